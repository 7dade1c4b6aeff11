"""Anthropic's Messages API (`POST /v1/messages`) over the chat completions path.

A Messages body is translated into a chat request (system, content blocks,
tools, tool_choice) and runs through the same rendering, admission and prompt
cache as `/v1/chat/completions`; the reply is shaped as a Message (content
blocks `thinking`, `text`, `tool_use`) or streamed as Anthropic's SSE events.
Errors have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

`cache_control` breakpoints pin: every prompt's prefix is checkpointed by the
cache anyway, and a request with a breakpoint pins its conversation's latest
checkpoints (prompt boundary, then the end of the reply) in RAM for the
longest TTL among its breakpoints (5m by default, or 1h), through the session
(one is made up when the request names none). Each breakpoint also pins its
own prefix, for its own TTL: the prompt's tokens up to the end of the block
carrying `cache_control` (found by rendering the conversation up to that block
and comparing tokens), held by whichever RAM entry covers them, so a later
request that shares the prefix and diverges after it still finds it in RAM.
Where no entry covers it yet (or the model's caches cannot be cut back), the
request's prefill keeps a checkpoint that ends exactly there.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
from quart import Response, request
from werkzeug.exceptions import HTTPException

from mlxd.http.replies import ReplyDelta
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

log = get_logger("mlxd.http.anthropic")

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks per request
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return Response(json.dumps(body), status=status, headers=headers, content_type="application/json")


def _bad(message: str) -> ApiError:
    return ApiError(400, message)


# --- the request ----------------------------------------------------------------------


@attrs.frozen
class MessagesRequest:
    """A Messages body as a chat request: what the chat route needs, and the prefill to append."""

    parsed: ParsedRequest
    messages: list[dict[str, Any]]
    options: ChatOptions
    prefill: str  # text of a final assistant turn the reply continues ("" when none)
    model: str | None
    breakpoints: int  # cache_control blocks (each pins the conversation for its TTL)
    body: dict[str, Any]
    # Each breakpoint's prefix as chat messages (the conversation up to its block) and its TTL
    cuts: tuple[tuple[tuple[dict[str, Any], ...], float], ...] = ()


_TTL_S = {None: 300.0, "5m": 300.0, "1h": 3600.0}
_NOT_BLOCKS = ("input", "input_schema", "metadata")  # free-form JSON: a key named cache_control there is data


def _pin_seconds(node: Any) -> float:
    """The longest `cache_control` TTL in a (validated) body, in seconds; 0 without a breakpoint."""
    if isinstance(node, list):
        return max((_pin_seconds(v) for v in node), default=0.0)
    if not isinstance(node, dict):
        return 0.0
    cc = node.get("cache_control")
    ttl = _TTL_S.get(cc.get("ttl"), 0.0) if isinstance(cc, dict) else 0.0
    inner = (_pin_seconds(v) for k, v in node.items() if k not in _NOT_BLOCKS and isinstance(v, list | dict))
    return max([ttl, *inner])


def _ttl(node: Any) -> float:
    """The TTL of a node's own `cache_control` (0 when it has none)."""
    cc = node.get("cache_control") if isinstance(node, dict) else None
    return _TTL_S.get(cc.get("ttl"), 0.0) if isinstance(cc, dict) else 0.0


def _block_ttl(block: Any) -> float:
    """A content block's breakpoint TTL: its own, or (a tool result) its content blocks'."""
    inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
    return max([_ttl(block), *(_ttl(b) for b in inner if isinstance(b, dict))] if isinstance(inner, list)
               else [_ttl(block)])


def _cuts(body: dict[str, Any]) -> list[tuple[list[dict[str, Any]], float]]:
    """Each breakpoint's prefix (the chat messages up to the end of its block) and TTL, in prompt order.

    Called on a validated body. Tools render into the system turn, so a breakpoint on a tool cuts after
    the system prompt with the tools; the top-level `cache_control` cuts after the whole conversation.
    """
    cuts: list[tuple[list[dict[str, Any]], float]] = []
    system = body.get("system")
    done: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": _text_of(system, "system")[0]}]
    if isinstance(system, list):
        for i, block in enumerate(system):
            if _ttl(block):
                cuts.append(([{"role": "system", "content": _text_of(system[: i + 1], "system")[0]}], _ttl(block)))
    tools_ttl = max((_ttl(t) for t in body.get("tools") or []), default=0.0)
    if tools_ttl:
        cuts.append((list(done), tools_ttl))
    turns = body["messages"]
    for i, turn in enumerate(turns):
        content, user = turn.get("content"), turn["role"] == "user"
        if isinstance(content, list):
            for j, block in enumerate(content):
                ttl = _block_ttl(block)
                if ttl:
                    upto = content[: j + 1]
                    partial = _user_turn(upto, "")[0] if user else [_assistant_turn(upto, "")[0]]
                    cuts.append((done + partial, ttl))
        if user:
            done += _user_turn(content, "")[0]
        elif i < len(turns) - 1:  # a final assistant turn is a prefill, no message
            done.append(_assistant_turn(content, "")[0])
    if _ttl(body):
        cuts.append((done, _ttl(body)))
    return cuts


def _cache_control(block: dict[str, Any], where: str) -> int:
    cc = block.get("cache_control")
    if cc is None:
        return 0
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise _bad(f"{where}.cache_control must be {{'type': 'ephemeral'}}")
    if cc.get("ttl") not in (None, "5m", "1h"):
        raise _bad(f"{where}.cache_control.ttl must be '5m' or '1h', got {cc.get('ttl')!r}")
    return 1


def _text_of(content: Any, where: str) -> tuple[str, int]:
    """A string, or text blocks joined; (text, cache_control breakpoints)."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    parts, marks = [], 0
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}[{i}]: only text blocks are supported here, got {kind!r}")
        marks += _cache_control(block, f"{where}[{i}]")
        parts.append(block["text"])
    return "".join(parts), marks


def _user_turn(content: Any, where: str) -> tuple[list[dict[str, Any]], int]:
    """A user turn: tool results become tool messages, text blocks a user message, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}], 0
    if not isinstance(content, list) or not content:
        raise _bad(f"{where}.content must be a string or a non-empty list of content blocks")
    out: list[dict[str, Any]] = []
    marks = 0

    def user_parts() -> list[dict[str, Any]]:
        if not out or out[-1]["role"] != "user":
            out.append({"role": "user", "content": []})
        parts: list[dict[str, Any]] = out[-1]["content"]
        return parts

    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        if not isinstance(block, dict):
            raise _bad(f"{at} must be a content block object")
        marks += _cache_control(block, at)
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{at}.text must be a string")
            user_parts().append({"type": "text", "text": block["text"]})
        elif kind == "image":
            user_parts().append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id must be a string")
            text, more = _text_of(block.get("content", ""), f"{at}.content")
            marks += more
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "document":
            raise _bad(f"{at}: document blocks are not supported by this server")
        else:
            raise _bad(f"{at}: unsupported content block type {kind!r} in a user turn")
    for m in out:  # text only: one string, as the chat route renders it
        if m["role"] == "user" and all(p["type"] == "text" for p in m["content"]):
            m["content"] = "".join(p["text"] for p in m["content"])
    return out, marks


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the chat route's image_url: a data URL, or the URL as given."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if media not in ("image/jpeg", "image/png", "image/gif", "image/webp"):
            raise _bad(f"{where}.source.media_type must be image/jpeg, image/png, image/gif or image/webp")
        return f"data:{media};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise _bad(f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or {{'type': 'url', 'url'}}")


def _assistant_turn(content: Any, where: str) -> tuple[dict[str, Any], int]:
    """An assistant turn: text, tool_use blocks (tool calls) and thinking (reasoning)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}, 0
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content blocks")
    text, reasoning, calls, marks = [], [], [], 0
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        if not isinstance(block, dict):
            raise _bad(f"{at} must be a content block object")
        marks += _cache_control(block, at)
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # nothing readable to render
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise _bad(f"{at}: a tool_use block needs a 'name' and an object 'input'")
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        else:
            raise _bad(f"{at}: unsupported content block type {kind!r} in an assistant turn")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message, marks


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    tools = body.get("tools")
    if tools is None:
        return [], 0
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list")
    out, marks = [], 0
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools[{i}] must be an object with a non-empty 'name'")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]: server tool type {tool['type']!r} is not supported; give client tools "
                       "with 'name', 'description' and 'input_schema'")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _bad(f"tools[{i}].input_schema must be an object")
        marks += _cache_control(tool, f"tools[{i}]")
        fn: dict[str, Any] = {"name": tool["name"]}  # OpenAI's key order: the template renders it as JSON
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out, marks


def _tool_choice(body: dict[str, Any]) -> tuple[Any, bool]:
    """Anthropic's tool_choice as the chat route's, and whether parallel calls are allowed."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, True
    if not isinstance(choice, dict):
        raise _bad("'tool_choice' must be an object such as {'type': 'auto'}")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice {'type': 'tool'} needs a 'name'")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad(f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


def _thinking(body: dict[str, Any]) -> dict[str, Any]:
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise _bad("'thinking' must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}")
    return {"enable_thinking": thinking["type"] != "disabled"}


def parse_request(body: Any, *, max_tokens_limit: int) -> MessagesRequest:
    """Validate a Messages body; every problem is an ApiError (shaped by the route)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop_sequences' must be a list of strings")
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise _bad(f"'temperature' must be between 0 and 1, got {temperature}")
    chat_body = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")
                 if k in body}
    parsed = attrs.evolve(parse_common(chat_body, default_max_tokens=1, max_tokens_limit=max_tokens_limit,
                                       chat=True), stop=tuple(stops))
    marks = _cache_control(body, "request")  # automatic caching: one breakpoint at the last block
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text, more = _text_of(system, "system")
        marks += more
        messages.append({"role": "system", "content": text})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad("'messages' must be a non-empty list")
    prefill = ""
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must be an object with role 'user' or 'assistant'")
        if turn["role"] == "user":
            out, more = _user_turn(turn.get("content"), where)
            messages.extend(out)
        else:
            message, more = _assistant_turn(turn.get("content"), where)
            if i == len(turns) - 1:  # a prefill: the reply continues this text
                if message.get("tool_calls") or message.get("reasoning_content"):
                    raise _bad(f"{where}: a final assistant turn (prefill) may hold text only")
                prefill = message["content"]
            else:
                messages.append(message)
        marks += more
    if not any(m["role"] != "system" for m in messages):  # a prefill alone: no turn to reply to
        raise _bad("'messages' needs a user turn: a final assistant turn (a prefill) continues the reply to one")
    if marks > MAX_BREAKPOINTS:
        raise _bad(f"a request may have at most {MAX_BREAKPOINTS} blocks with cache_control, got {marks}")
    tools, more = _tools(body)
    marks += more
    choice, parallel = _tool_choice(body)
    options = parse_chat_options({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
                                  "chat_template_kwargs": _thinking(body)})
    cuts = tuple((tuple(parse_messages({"messages": m})), ttl) for m, ttl in _cuts(body) if m) if marks else ()
    return MessagesRequest(
        parsed=parsed, messages=parse_messages({"messages": messages}), options=options, prefill=prefill,
        model=body.get("model"), breakpoints=marks, body=body, cuts=cuts,
    )


# --- the reply ------------------------------------------------------------------------


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class BlockWriter:
    """Reply deltas as content blocks: the finished list, and the stream events that build it."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "thinking" | "text" while a block is open

    def feed(self, delta: ReplyDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._append("thinking", delta.reasoning)
        if delta.content:
            events += self._append("text", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            fn = call["function"]
            try:
                args = json.loads(fn["arguments"] or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):  # not an object: shown as text, never a bad tool_use
                events += self._append("text", fn["arguments"])
                continue
            block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args}
            index = len(self.blocks)
            self.blocks.append(block)
            events.append(_sse("content_block_start", {"type": "content_block_start", "index": index,
                                                       "content_block": {**block, "input": {}}}))
            events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}}))
            events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    def _append(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self._open != kind:
            events += self._close()
            block: dict[str, Any] = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""}
            self.blocks.append(block)
            self._open = kind
            events.append(_sse("content_block_start", {"type": "content_block_start",
                                                       "index": len(self.blocks) - 1, "content_block": block.copy()}))
        self.blocks[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {
            "type": "thinking_delta", "thinking": text}
        events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                   "delta": delta}))
        return events

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def close(self) -> list[str]:
        return self._close()


def stop_reason(choice: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    reason = choice.finish_reason()
    if reason == "tool_calls":
        return "tool_use", None
    if choice.text.stopped_by_string:
        return "stop_sequence", choice.text.stop_string
    if reason == "length":
        return "max_tokens", None
    return "end_turn", None


def usage(choice: Any) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache."""
    prompt = len(choice.stream.request.prompt)
    cached = choice.accepted.cached_tokens if choice.accepted else 0
    return {
        "input_tokens": prompt - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": choice.completion_tokens,
    }


@attrs.define
class _Reply:
    rt: Any
    choice: Any
    kit: RouteKit
    model: str  # the name the reply gives (an --adapter's, or the served model's)
    id: str = attrs.Factory(lambda: "msg_" + uuid.uuid4().hex[:24])

    def message(self, blocks: list[dict[str, Any]], *, final: bool) -> dict[str, Any]:
        reason, sequence = stop_reason(self.choice) if final else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(self.choice)}

    async def body(self) -> dict[str, Any]:
        writer = BlockWriter()
        async for delta, _ in self.choice.deltas():
            writer.feed(delta)
        return self.message(writer.blocks, final=True)

    async def sse(self) -> AsyncIterator[str]:
        writer = BlockWriter()
        try:
            await self.choice.prime()  # the prompt's cached tokens are known: message_start can tell them
            yield _sse("message_start", {"type": "message_start", "message": self.message([], final=False)})
            yield _sse("ping", {"type": "ping"})
            async for delta, _ in self.choice.deltas():
                for event in writer.feed(delta):
                    yield event
            for event in writer.close():
                yield event
            reason, sequence = stop_reason(self.choice)
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage(self.choice)})
            yield _sse("message_stop", {"type": "message_stop"})
        except GenerationError as exc:
            yield _sse("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}})
        except Exception as exc:
            log.exception("anthropic.stream_failed", request_id=self.choice.stream.request.request_id)
            yield _sse("error", {"type": "error", "error": {"type": "api_error",
                                                            "message": f"internal error: {type(exc).__name__}"}})
        finally:
            await self.kit.close([self.choice])


def install_anthropic(app: Any, rt: Any, kit: RouteKit) -> None:
    """POST /v1/messages and /v1/messages/count_tokens, answering errors in Anthropic's shape."""

    async def prompt_of(req: MessagesRequest) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]:
        kit.check_model(req.model)
        ids, media, cuts = await kit.chat_prompt(req.parsed, req.messages, req.options, "messages")
        return (ids + rt.encode(req.prefill) if req.prefill else ids), media, cuts

    async def pin_breakpoints(req: MessagesRequest, prompt: tuple[int, ...], session: str) -> None:
        """Pin each breakpoint's prefix: the prompt's tokens that the conversation up to its block renders to."""
        namespace = {a.name: a.namespace for a in rt.info.adapters}.get(req.model or "", "")
        for messages, ttl in req.cuts:
            try:  # realigned as the prompt was (replies keep their cached ids), so the two agree up to the cut
                ids = await rt.render_chat(list(messages), namespace=namespace, tools=req.options.tools,
                                           template_kwargs=req.options.template_kwargs)
            except Exception as exc:  # a template that cannot render the prefix: the session pin still holds
                log.info("anthropic.breakpoint_unrendered", error=str(exc))
                continue
            offset = _common_prefix(prompt, ids)
            if offset > 0:
                await rt.pin_prefix(session, namespace, prompt[:offset], ttl)

    async def read(with_max_tokens: bool) -> tuple[MessagesRequest, Any]:
        body = await kit.read_json()
        if not with_max_tokens and isinstance(body, dict):
            body = {**body, "max_tokens": 1}
        return parse_request(body, max_tokens_limit=rt.config.max_tokens_limit), body

    async def answer(route: Any) -> Response:
        try:
            return await route()
        except ApiError as err:
            return error_response(err.status, err.message, err.headers)
        except HTTPException as err:
            message = {413: f"the request body exceeds {rt.config.max_body_bytes} bytes"}.get(
                err.code or 0, err.description or "bad request")
            return error_response(err.code or 400, message)
        except GenerationError as exc:
            return error_response(500, str(exc))

    @app.post("/v1/messages")
    async def messages() -> Response:
        async def route() -> Response:
            req, body = await read(True)
            pin_s = _pin_seconds(body) if req.breakpoints else 0.0
            session = await request_session(rt, request.headers, _session_body(body), pin_s=pin_s)
            prompt, media, cuts = await prompt_of(req)
            if req.cuts and session is not None and not media:
                await pin_breakpoints(req, prompt, session)
            (choice,) = await kit.start_choices(req.parsed, prompt, req.options, chat=True, session=session,
                                                media=media, checkpoint_at=cuts)
            reply = _Reply(rt, choice, kit, kit.reply_model(req.parsed.model))
            if req.parsed.stream:
                return event_stream(reply.sse())
            try:
                return Response(json.dumps(await reply.body()), content_type="application/json")
            finally:
                await kit.close([choice])

        return await answer(route)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        async def route() -> Response:
            req, _ = await read(False)
            prompt, _, _ = await prompt_of(req)
            return Response(json.dumps({"input_tokens": len(prompt)}), content_type="application/json")

        return await answer(route)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _session_body(body: dict[str, Any]) -> dict[str, Any]:
    """The session fields: `prompt_cache_key` (mlxd's), else Anthropic's `metadata.user_id`."""
    meta = body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, dict) else None
    out: dict[str, Any] = {k: body[k] for k in ("prompt_cache_key", "prompt_cache_retention") if k in body}
    if user is not None:
        out["user"] = user
    return out
