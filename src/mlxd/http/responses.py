"""OpenAI's Responses API (`/v1/responses`) over the chat completions path.

`input` (a string or items: messages, `function_call`, `function_call_output`,
`reasoning`) and `instructions` become chat messages, appended to the stored
conversation of `previous_response_id`; the request then runs through the same
rendering, admission and prompt cache as `/v1/chat/completions`. The reply is
shaped as output items (`reasoning`, `message`, `function_call`) or streamed as
Responses events. Stored responses (`store`, true by default) are kept by
`ResponseStore` (with the SSD tier, as files that survive a restart); a
continued conversation keeps the cache session of the response it continues.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import trio
from quart import Response, request

from mlxd.http.replies import ReplyDelta
from mlxd.http.response_store import ResponseStore
from mlxd.http.routekit import RouteKit, event_stream
from mlxd.http.schemas import (
    ApiError,
    ChatOptions,
    ParsedRequest,
    parse_chat_options,
    parse_common,
    parse_messages,
)
from mlxd.http.sessions import request_session
from mlxd.runtime.logging import get_logger
from mlxd.runtime.supervisor import GenerationError

log = get_logger("mlxd.http.responses")


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the request ----------------------------------------------------------------------


@attrs.frozen
class ResponsesRequest:
    parsed: ParsedRequest
    options: ChatOptions
    instructions: str | None
    input: list[dict[str, Any]]  # the request's own items as chat messages
    previous: str | None
    store: bool
    echo: dict[str, Any]  # request fields the response object repeats
    items: list[dict[str, Any]] = attrs.Factory(list)  # the input as items with ids (GET .../input_items)
    origins: list[str] = attrs.Factory(list)  # each of `input`'s messages: the item it came from (`input[i]`)


def input_items(raw: Any) -> list[dict[str, Any]]:
    """The request's input as Responses items, each with an id (a string is one user message)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    out = []
    for item in raw:
        kind = item.get("type", "message")
        item = {"type": kind, **item}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", _new_id(prefixes.get(kind, "item")))
        out.append(item)
    return out


def _part_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}[{i}]: {kind} parts are not supported here", "input")
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _bad(f"{where}[{i}] must be an input_text or output_text part", "input")
    return "".join(texts)


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user or system message's content: its text, or parts when it has images (input_image)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _part_text(content, where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{where}[{i}]: an input_image needs an 'image_url' (file_id is not supported)", "input")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _part_text([part], f"{where}[{i}]")})
    return parts


def input_messages(items: Any, origins: list[str] | None = None) -> list[dict[str, Any]]:
    """Responses input items as chat messages (consecutive assistant items merge into one turn).

    A reasoning item belongs to the assistant turn it is in: the one its message or function call
    opens, or the one it ends; with neither (a reply cut off inside its thinking), it is a turn of
    its own with empty content, as the chat route replies and a chat client sends it back.
    `origins`, when given, gets each message's item (`input[i]`: the one that opened it), so an error
    found later in a message (an image that does not decode) names the request's own field.
    """
    if isinstance(items, str):
        if origins is not None:
            origins.append("input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    reasoning = ""

    def assistant(*, message: bool = False) -> dict[str, Any]:
        """The open assistant turn (a new one after another role, or for a message after text or calls)."""
        nonlocal reasoning
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant" or message and (last["content"] or last.get("tool_calls")):
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1]["reasoning_content"] = out[-1].get("reasoning_content", "") + reasoning
            reasoning = ""
        return out[-1]

    def other(message: dict[str, Any]) -> None:
        if reasoning:  # the reasoning ends the turn before this message
            assistant()
        out.append(message)

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
            if role == "assistant":
                assistant(message=True)["content"] = _part_text(item.get("content", ""), f"{where}.content")
            else:
                other({"role": "system" if role == "developer" else role,
                       "content": _user_content(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", "{}"), str):
                raise _bad(f"{where}: a function_call needs 'name' and 'arguments' (a JSON string)", "input")
            call_id = item.get("call_id") or item.get("id") or ""
            assistant().setdefault("tool_calls", []).append(
                {"id": str(call_id), "type": "function",
                 "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output needs a 'call_id'", "input")
            other({"role": "tool", "tool_call_id": item["call_id"],
                   "content": _part_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = [p for key in ("content", "summary") if isinstance(item.get(key), list) for p in item[key]]
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict)
                                 and isinstance(p.get("text"), str))
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported", "input")
        if origins is not None:
            origins.extend([where] * (len(out) - len(origins)))
    if reasoning:  # the last turn's, or a reply that is reasoning only
        assistant()
    if origins is not None and items:
        origins.extend([f"input[{len(items) - 1}]"] * (len(out) - len(origins)))
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict[str, Any]) -> Any:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
               "tool_choice")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format`."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object, e.g. {'format': {'type': 'json_object'}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'", "text")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt["type"]}


def parse_request(body: Any, *, default_max_tokens: int, max_tokens_limit: int) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name in ("background", "conversation"):
        if body.get(name):
            raise _bad(f"'{name}' is not supported by this server", name)
    chat_body: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream") if k in body}
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body)
    if response_format is not None:
        chat_body["response_format"] = response_format
    try:
        parsed = parse_common(chat_body, default_max_tokens=default_max_tokens, max_tokens_limit=max_tokens_limit,
                              chat=True)
    except ApiError as err:  # named as this route's body names them
        if err.param == "max_tokens":
            err.param, err.message = "max_output_tokens", err.message.replace("max_tokens", "max_output_tokens")
        elif err.param == "response_format":
            err.param = "text"
            err.message = err.message.replace("response_format.json_schema", "text.format").replace(
                "response_format", "text.format")
        raise
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    try:
        options = parse_chat_options({
            "tools": _tools(body), "tool_choice": _tool_choice(body),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            **({"reasoning_effort": effort} if effort is not None else {}),
        })
    except ApiError as err:
        if err.param == "reasoning_effort":  # named as this body names it
            err.param, err.message = "reasoning", err.message.replace("'reasoning_effort'", "'reasoning.effort'")
        raise
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("'previous_response_id' must be a string", "previous_response_id")
    store = True if body.get("store") is None else body["store"]
    if not isinstance(store, bool):
        raise _bad("'store' must be a boolean", "store")
    if "input" not in body:
        raise _bad("'input' is required", "input")
    origins: list[str] = []
    items = input_messages(body["input"], origins)
    if items:
        parse_messages({"messages": items})  # the chat route's checks on what we built
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    echo = {
        "instructions": instructions, "metadata": metadata,
        "max_output_tokens": body.get("max_output_tokens"), "parallel_tool_calls": options.forced is None
        and bool(body.get("parallel_tool_calls", True)), "previous_response_id": previous,
        "temperature": parsed.sampling.temperature, "top_p": parsed.sampling.top_p,
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": {"format": body.get("text", {}).get("format") or {"type": "text"}}
        if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
        "store": store, "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user"),
        "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None,
    }
    return ResponsesRequest(parsed, options, instructions, items, previous, store, echo, input_items(body["input"]),
                            origins)


# --- the reply ------------------------------------------------------------------------


class OutputWriter:
    """Reply deltas as output items, and the stream events that build them."""

    def __init__(self, emit: Any) -> None:
        self.items: list[dict[str, Any]] = []
        self._emit = emit  # (type, fields) -> an SSE event string
        self._open: str | None = None  # "reasoning" | "message" while an item streams

    def feed(self, delta: ReplyDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            fn = call["function"]
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": fn["name"],
                    "arguments": fn["arguments"], "status": "completed"}
            index = len(self.items)
            self.items.append(item)
            events.append(self._emit("response.output_item.added", output_index=index,
                                     item={**item, "arguments": "", "status": "in_progress"}))
            events.append(self._emit("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=fn["arguments"]))
            events.append(self._emit("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=fn["name"], arguments=fn["arguments"]))
            events.append(self._emit("response.output_item.done", output_index=index, item=item))
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self._open != kind:
            events += self._close()
            self._open = kind
            index = len(self.items)
            item: dict[str, Any]
            if kind == "message":
                item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
                events.append(self._emit("response.output_item.added", output_index=index,
                                         item={**item, "content": []}))
                events.append(self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                                         content_index=0, part=dict(item["content"][0])))
            else:
                item = {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                events.append(self._emit("response.output_item.added", output_index=index,
                                         item={**item, "content": []}))
            self.items.append(item)
        item = self.items[-1]
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._emit(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                 delta=text, **extra))
        return events

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = "completed"
        part = item["content"][0]
        if kind == "message":
            events = [self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], logprobs=[]),
                      self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part)]
        else:
            events = [self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"])]
        events.append(self._emit("response.output_item.done", output_index=index, item=item))
        return events

    def close(self) -> list[str]:
        return self._close()


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation renders."""
    return input_messages([{k: v for k, v in item.items() if k != "id" or item["type"] != "function_call"}
                           for item in items])


@attrs.define
class _Reply:
    rt: Any
    kit: RouteKit
    store: ResponseStore
    req: ResponsesRequest
    choice: Any
    conversation: list[dict[str, Any]]  # the chat messages before this reply (instructions left out)
    session: str
    id: str
    created_at: int = attrs.Factory(lambda: int(time.time()))
    _seq: int = 0

    def usage(self) -> dict[str, Any]:
        prompt = len(self.choice.stream.request.prompt)
        cached = self.choice.accepted.cached_tokens if self.choice.accepted else 0
        out = self.choice.completion_tokens
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + out}

    def response(self, output: list[dict[str, Any]], *, status: str) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "incomplete_details": incomplete, "model": self.kit.reply_model(self.req.parsed.model),
            "output": output, "usage": self.usage() if status != "in_progress" else None,
            **self.req.echo,
        }

    def final_status(self) -> str:
        return "incomplete" if self.choice.finish_reason() == "length" else "completed"

    def emit(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def finish(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.response(output, status=self.final_status())
        if self.req.store:
            record = {"response": body, "session": self.session, "input_items": self.req.items,
                      "conversation": self.conversation + output_messages(output)}
            await trio.to_thread.run_sync(self.store.put, self.id, record)
        return body

    async def body(self) -> dict[str, Any]:
        writer = OutputWriter(self.emit)
        async for delta, _ in self.choice.deltas():
            writer.feed(delta)
        writer.close()
        return await self.finish(writer.items)

    async def sse(self) -> AsyncIterator[str]:
        writer = OutputWriter(self.emit)
        try:
            yield self.emit("response.created", response=self.response([], status="in_progress"))
            yield self.emit("response.in_progress", response=self.response([], status="in_progress"))
            async for delta, _ in self.choice.deltas():
                for event in writer.feed(delta):
                    yield event
            for event in writer.close():
                yield event
            body = await self.finish(writer.items)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield self.emit(kind, response=body)
        except GenerationError as exc:
            yield self.emit("error", code="server_error", message=str(exc), param=None)
        except Exception as exc:
            log.exception("responses.stream_failed", request_id=self.choice.stream.request.request_id)
            yield self.emit("error", code="server_error", message=f"internal error: {type(exc).__name__}",
                            param=None)
        finally:
            await self.kit.close([self.choice])


def install_responses(app: Any, rt: Any, kit: RouteKit) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}."""
    root = rt.config.ssd_cache_dir
    store = ResponseStore(Path(root) / "responses" if root is not None else None)

    def json_response(data: Any, status: int = 200) -> Response:
        return Response(json.dumps(data), status=status, content_type="application/json")

    def missing(rid: str) -> ApiError:
        return ApiError(404, f"no stored response '{rid}' is known to this server", type="not_found_error",
                        param="response_id", code="response_not_found")

    @app.post("/v1/responses")
    async def create() -> Response:
        body = await kit.read_json()
        req = parse_request(body, default_max_tokens=min(rt.config.default_max_tokens, rt.config.max_tokens_limit),
                            max_tokens_limit=rt.config.max_tokens_limit)
        kit.check_model(req.parsed.model)
        session = await request_session(rt, request.headers, body)
        conversation: list[dict[str, Any]] = []
        if req.previous is not None:
            record = await trio.to_thread.run_sync(store.get, req.previous)
            if record is None:
                raise ApiError(404, f"previous_response_id '{req.previous}' is not a stored response",
                               type="not_found_error", param="previous_response_id", code="response_not_found")
            conversation = list(record.get("conversation") or [])
            if session is None and isinstance(record.get("session"), str):
                session = record["session"]
        stored = len(conversation)
        conversation += req.input
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        # each message's field in this body (or the stored conversation's), for an error found in it later
        names = (["instructions"] if req.instructions else []) + [
            f"the stored conversation's messages[{k}]" for k in range(stored)] + req.origins
        if not messages:
            raise _bad("'input' is empty and there is no previous response to continue", "input")
        prompt, media, cuts = await kit.chat_prompt(req.parsed, messages, req.options, "input", names=names)
        rid = _new_id("resp")
        if session is None and req.store:  # a stored conversation's first response names its cache session
            session = rid
        (choice,) = await kit.start_choices(req.parsed, prompt, req.options, chat=True, session=session,
                                            media=media, checkpoint_at=cuts)
        reply = _Reply(rt, kit, store, req, choice, conversation, session or "", id=rid)
        if req.parsed.stream:
            return event_stream(reply.sse())
        try:
            return json_response(await reply.body())
        except GenerationError as exc:
            raise ApiError(500, str(exc), type="server_error") from None
        finally:
            await kit.close([choice])

    @app.get("/v1/responses/<rid>")
    async def get(rid: str) -> Response:
        record = await trio.to_thread.run_sync(store.get, rid)
        if record is None:
            raise missing(rid)
        return json_response(record["response"])

    @app.get("/v1/responses/<rid>/input_items")
    async def get_input_items(rid: str) -> Response:
        record = await trio.to_thread.run_sync(store.get, rid)
        if record is None:
            raise missing(rid)
        items = list(record.get("input_items") or [])
        order = request.args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad("'order' must be 'asc' or 'desc'", "order")
        if order == "desc":
            items.reverse()
        after = request.args.get("after")
        if after is not None:
            ids = [i.get("id") for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        try:
            limit = int(request.args.get("limit", "20"))
        except ValueError:
            raise _bad("'limit' must be an integer between 1 and 100", "limit") from None
        if not 1 <= limit <= 100:
            raise _bad("'limit' must be an integer between 1 and 100", "limit")
        page = items[:limit]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    @app.delete("/v1/responses/<rid>")
    async def delete(rid: str) -> Response:
        if not await trio.to_thread.run_sync(store.delete, rid):
            raise missing(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})
