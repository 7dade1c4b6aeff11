"""The OpenAI-compatible HTTP API: a Quart app (quart-trio) over a running `Runtime`."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxd.http.connections import ShieldedSendConnection
from mlxd.http.openapi import openapi_document
from mlxd.http.replies import ReplyDelta, ReplyReader, initial_state
from mlxd.http.request_body import ChunkedBody, ChunkedBodyRequest
from mlxd.http.routekit import event_stream
from mlxd.http.schemas import (
    ApiError,
    ChatOptions,
    ParsedRequest,
    parse_chat_options,
    parse_common,
    parse_messages,
    parse_prompt,
)
from mlxd.http.security import AccessPolicy, is_loopback
from mlxd.http.sessions import install_sessions, request_session
from mlxd.http.stages import Stages
from mlxd.runtime import gc_pauses
from mlxd.runtime.chat.prompt_bound import PromptBound, chat_chars, encode_off_loop
from mlxd.runtime.chat.text import TextAssembler
from mlxd.runtime.kernel.messages import (
    GenerationFinished,
    PromptAccepted,
    SamplingParams,
    TokenGenerated,
)
from mlxd.runtime.logging import get_logger
from mlxd.runtime.stall_watch import StallWatch
from mlxd.runtime.supervisor import (
    GenerationError,
    GenerationStream,
    InvalidRequest,
    QueueFull,
    Runtime,
    ShuttingDown,
)
from mlxd.structured.spec import TOOL_CALL_END, TOOL_CALL_START, Constraint
from mlxd.vision.chat import chat_prompt, preparer_for
from mlxd.vision.prepare import restore_lifted

log = get_logger("mlxd.http")

MAX_BODY_BYTES = 16 * 1024 * 1024
# Request bodies larger than this are parsed on a worker thread. json.loads holds the GIL
# throughout, so a worker thread frees the event loop only between its decode and its scan,
# while the hop costs a GIL hand-off each way (5-10 ms on a loaded host): a chat that re-sends
# ten inline images (2 MB, ~2 ms to parse) is parsed on the loop.
PARSE_OFF_LOOP_BYTES = 4 * 1024 * 1024
# Names that mean "the served model": ours, and mlx_lm.server's (its clients send it).
MODEL_ALIASES = ("default", "default_model")


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data), status=status, headers=headers, content_type="application/json")


def _error(err: ApiError) -> Response:
    if request.path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's error shape
        from mlxd.http.anthropic import error_response

        return error_response(err.status, err.message, err.headers)
    return _json(err.body(), err.status, err.headers)


async def _close(choices: list[_Choice]) -> None:
    with trio.CancelScope(shield=True):
        for c in choices:
            await c.stream.aclose()


class _Choice:
    """One generation of a request: its events as text, reasoning and tool calls."""

    def __init__(
        self, rt: Runtime, stream: GenerationStream, parsed: ParsedRequest, *, index: int, chat: bool,
        options: ChatOptions, deadline: float = math.inf,
    ) -> None:
        self.rt = rt
        self.deadline = deadline  # trio clock; past it the generation ends with "length"
        self.timed_out = False
        self.stream = stream
        self.parsed = parsed
        self.index = index
        self.chat = chat
        self.text = TextAssembler(rt.tokenizer, stop=parsed.stop, eos_ids=rt.info.eos_token_ids)
        parse_tools = chat and bool(options.tools) and options.tool_choice != "none"
        self.reader = ReplyReader(
            rt.tokenizer, tools=options.tools, parse_tools=parse_tools,
            initial=initial_state(rt.tokenizer, stream.request.prompt),
        ) if chat else None
        self.accepted: PromptAccepted | None = None
        self.finished: GenerationFinished | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.text_offsets: list[int] = []  # each logprob entry's character offset in the completion text
        self._text_end = 0
        self._events: AsyncIterator[Any] | None = None
        self._primed: list[Any] = []
        self.first_token_at: float | None = None  # perf_counter, as this handler read it (http/stages.py)

    async def reached(self, kind: type | tuple[type, ...], deadline: float) -> bool:
        """Read events until one of `kind` (or the end); False if `deadline` (trio clock) came first."""
        if self._events is None:
            self._events = aiter(self.stream)
        if any(isinstance(e, kind | GenerationFinished) for e in self._primed):
            return True
        with trio.move_on_at(deadline):
            while (event := await self._next_event()) is not None:
                self._primed.append(event)
                if isinstance(event, kind | GenerationFinished):
                    return True
            return True  # ended or failed: the reply says so
        return False

    async def prime(self) -> None:
        """Read events up to the first generated token: the prompt's KV is published by then."""
        if self._events is None:
            self._events = aiter(self.stream)
        while (event := await self._next_event()) is not None:
            self._primed.append(event)
            if isinstance(event, PromptAccepted):
                self.accepted = event  # known before the first token (Anthropic's message_start)
            if isinstance(event, TokenGenerated | GenerationFinished):
                return

    async def deltas(self) -> AsyncIterator[tuple[ReplyDelta, list[dict[str, Any]]]]:
        """Yield (reply delta, logprob entries) until the generation ends or a stop string hits."""
        async with self.stream:
            if self._events is None:
                self._events = aiter(self.stream)
            while (event := await self._take()) is not None:
                if isinstance(event, PromptAccepted):
                    self.accepted = event
                elif isinstance(event, TokenGenerated):
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    if self.text.done:
                        continue  # decoded past a stop string before the engine ended the row
                    self.completion_tokens += 1
                    self.token_ids.append(event.token)
                    delta = self._read(self.text.add(event.token))
                    entries = self._logprob_entries(event)
                    self.logprobs.extend(entries)
                    for e in entries:
                        self.text_offsets.append(self._text_end)
                        self._text_end += len(e["token"])
                    if delta or entries:
                        yield delta, entries
                    if self.text.stopped_by_string:
                        # The engine ends the row as a normal stop and publishes its
                        # checkpoint (the next turn reuses it); wait for that end.
                        await self.rt.stop_generation(self.stream.request.request_id)
                elif isinstance(event, GenerationFinished):
                    self.finished = event
        tail = self._read(self.text.finish(), final=True)
        if tail:
            yield tail, []
        if self.chat:
            self._remember()

    def _read(self, text: str, *, final: bool = False) -> ReplyDelta:
        if self.reader is None:
            return ReplyDelta(content=text)
        delta = self.reader.feed(text)
        if final:
            rest = self.reader.finish()
            delta = ReplyDelta(delta.content + rest.content, delta.reasoning + rest.reasoning,
                               delta.tool_calls + rest.tool_calls)
        return delta

    def _remember(self) -> None:
        """Keep the reply's exact ids (cut to the shown text after a stop string)."""
        shown, ids = self.text.text, self.token_ids
        if self.text.stopped_by_string:
            tok = self.rt.tokenizer
            k = len(ids)
            while k > 0 and len(text := tok.decode(ids[:k])) >= len(shown) and text != shown:
                k -= 1
            ids = ids[:k]
        self.rt.remember_reply(shown, ids)

    async def _take(self) -> Any:
        if self._primed:
            return self._primed.pop(0)
        return await self._next_event()

    async def _next_event(self) -> Any:
        """The next event; None at the end or past the deadline (leaving cancels the generation)."""
        assert self._events is not None
        with trio.move_on_at(self.deadline):
            try:
                return await anext(self._events)
            except StopAsyncIteration:
                return None
        self.timed_out = True
        log.info("http.request_timeout", request_id=self.stream.request.request_id,
                 completion_tokens=self.completion_tokens)
        return None

    def finish_reason(self) -> str:
        if self.reader is not None and self.reader.calls and not self.timed_out and (
            self.finished is None or self.finished.reason != "length"
        ):
            return "tool_calls"
        if self.text.stopped_by_string:
            return "stop"
        if self.timed_out:
            return "length"  # cut by --request-timeout, like a max_tokens cut
        if self.finished is not None and self.finished.reason in ("stop", "length"):
            return self.finished.reason
        return "stop"

    def _logprob_entries(self, event: TokenGenerated) -> list[dict[str, Any]]:
        if event.logprob is None:
            return []
        tok = self.rt.tokenizer
        text = tok.decode([event.token])
        top = [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()), "id": t}
               for t, lp in event.top_logprobs]
        return [{"token": text, "logprob": event.logprob, "bytes": list(text.encode()), "id": event.token,
                 "top_logprobs": top}]


def _chat_delta(delta: ReplyDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = list(delta.tool_calls)
    return out


def reply_model(rt: Runtime, requested: str | None) -> str:
    """The model a reply names: the adapter the request chose (--adapter), else the served model."""
    return requested if requested in {a.name for a in rt.info.adapters} else rt.info.model_name


class _Completion:
    """Runs a request's generations (its choices) and shapes them into OpenAI chunks or a body."""

    def __init__(
        self, rt: Runtime, choices: list[_Choice], parsed: ParsedRequest, *, chat: bool, stages: Stages | None = None
    ) -> None:
        self.rt = rt
        self.stages = stages  # reported (request.http) once the first token's chunk is written
        self.choices = choices
        self.parsed = parsed
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = reply_model(rt, parsed.model)

    def usage(self) -> dict[str, Any]:
        first = self.choices[0]
        prompt = len(first.stream.request.prompt)
        cached = first.accepted.cached_tokens if first.accepted else 0
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # --- shapes ------------------------------------------------------------------

    def chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage is not None or self.parsed.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice_chunk(
        self, c: _Choice, delta: ReplyDelta, entries: list[dict[str, Any]], finish: str | None
    ) -> dict[str, Any]:
        if self.chat:
            fields = _chat_delta(delta)
            if finish is None and not fields:
                fields = {"content": ""}
            choice: dict[str, Any] = {"index": c.index, "delta": fields, "finish_reason": finish}
            if self.parsed.sampling.logprobs:
                choice["logprobs"] = {"content": entries} if entries else None
            return choice
        choice = {"index": c.index, "text": delta.content, "finish_reason": finish}
        offsets = c.text_offsets[len(c.text_offsets) - len(entries):]
        choice["logprobs"] = self._completion_logprobs(entries, offsets) if self.parsed.sampling.logprobs else None
        return choice

    def _completion_logprobs(self, entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    # --- streaming ---------------------------------------------------------------

    async def _choice_sse(self, c: _Choice) -> AsyncIterator[str]:
        """One choice's chunks (an error becomes an error event)."""
        try:
            if self.chat:
                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield self.chunk(first)
            async for delta, entries in c.deltas():
                yield self.chunk(self.choice_chunk(c, delta, entries, None))
                if self.stages is not None and c.index == 0:  # the first token's chunk is written
                    self._report_stages(c, self.stages)
            yield self.chunk(self.choice_chunk(c, ReplyDelta(), [], c.finish_reason()))
        except GenerationError as exc:
            yield f"data: {json.dumps(ApiError(500, str(exc), type='server_error').body())}\n\n"
        except Exception as exc:
            log.exception("http.stream_failed", request_id=c.stream.request.request_id)
            error = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
            yield f"data: {json.dumps(error.body())}\n\n"

    def _report_stages(self, c: _Choice, stages: Stages) -> None:
        self.stages = None  # once
        if c.first_token_at is not None:
            stages.mark("first_token", c.first_token_at)
        stages.mark("first_chunk_sent")
        stages.report(request_id=c.stream.request.request_id, stream=True)

    async def _pump(self, c: _Choice, send: trio.MemorySendChannel[str]) -> None:
        async with send:
            try:
                async for chunk in self._choice_sse(c):
                    await send.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client left
            finally:
                await c.stream.aclose()

    async def sse(self, spawn: Callable[..., Any]) -> AsyncIterator[str]:
        """The event stream; several choices run as tasks of `spawn` and interleave."""
        if len(self.choices) == 1:
            async for chunk in self._choice_sse(self.choices[0]):
                yield chunk
        else:
            send, receive = trio.open_memory_channel[str](0)
            for c in self.choices:
                spawn(self._pump, c, send.clone())
            send.close()
            try:
                async for chunk in receive:
                    yield chunk
            finally:
                receive.close()
        if self.parsed.include_usage:
            yield self.chunk({}, self.usage())
        yield "data: [DONE]\n\n"

    # --- one body ---------------------------------------------------------------

    async def _choice_body(self, c: _Choice) -> dict[str, Any]:
        parts = [d async for d, _ in c.deltas()]
        content = "".join(d.content for d in parts)
        if not self.chat:
            return {
                "index": c.index,
                "text": content,
                "finish_reason": c.finish_reason(),
                "logprobs": (self._completion_logprobs(c.logprobs, c.text_offsets)
                             if self.parsed.sampling.logprobs else None),
            }
        calls = [{k: v for k, v in call.items() if k != "index"} for d in parts for call in d.tool_calls]
        reasoning = "".join(d.reasoning for d in parts)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "index": c.index,
            "message": message,
            "finish_reason": c.finish_reason(),
            "logprobs": {"content": c.logprobs} if self.parsed.sampling.logprobs else None,
        }

    async def body(self) -> dict[str, Any]:
        bodies: list[dict[str, Any]] = [{} for _ in self.choices]

        async def one(c: _Choice) -> None:
            bodies[c.index] = await self._choice_body(c)

        try:
            async with trio.open_nursery() as nursery:
                for c in self.choices:
                    nursery.start_soon(one, c)
        except BaseExceptionGroup as group:
            # A failed generation answers as itself (a 500 with its message), not as a group.
            failed = group.subgroup(GenerationError)
            if failed is None:
                raise
            raise _first_leaf(failed) from None
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": bodies,
            "usage": self.usage(),
        }


def _check_unicode(body: Any) -> None:
    """A lone surrogate escape (e.g. "\\ud800") parses as JSON but is no text the tokenizer can read."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end].encode("utf-8", "backslashreplace").decode()
        raise ApiError(400, f"the request body has a string with a lone surrogate ({bad}); "
                       "strings must be valid Unicode") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


# A lone surrogate reaches a parsed string only from a \\uD800-\\uDFFF escape or (json.loads
# decodes bytes with "surrogatepass") from UTF-8 bytes ED A0-BF: a UTF-8 body with neither
# (a body of inline images, say) skips re-encoding the whole body in `_check_unicode`.
def _may_hold_surrogates(raw: str | bytes) -> bool:
    if not isinstance(raw, bytes) or b"\x00" in raw[:4] or raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return True  # text, or UTF-16/32: check the parsed body
    if b"\xed" in raw:
        return True
    at = raw.find(b"\\")  # each backslash starts an escape: look at each one's letter (single-byte finds are fast)
    while at != -1:
        if raw[at + 1 : at + 3] in (b"ud", b"uD"):
            return True
        at = raw.find(b"\\", at + 2)
    return False


def _parse_json(raw: str | bytes) -> Any:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8") from None
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if _may_hold_surrogates(raw):
        _check_unicode(body)
    return body


def _first_leaf(group: BaseExceptionGroup[Any]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def create_app(
    rt: Runtime, *, extra_stats: Callable[[], dict[str, Any]] | None = None, host: str = "127.0.0.1"
) -> QuartTrio:
    """Build the Quart app serving `rt` (the caller runs it under hypercorn bound to `host`)."""
    app = QuartTrio("mlxd")
    app.request_class = ChunkedBodyRequest  # a large body is joined once, not regrown per chunk
    app.asgi_http_class = ShieldedSendConnection  # keep-alive and Connection: close really close
    app.config["MAX_CONTENT_LENGTH"] = rt.config.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    access = AccessPolicy(api_key=rt.config.api_key, admin_key=rt.config.admin_key, loopback=is_loopback(host))
    prompt_bound = PromptBound.of(rt.tokenizer)  # a prompt's fewest tokens from its characters
    media_preparer = preparer_for(rt)  # None: a text-only model (docs/vision.md)
    timeout_s = rt.config.request_timeout_s
    queue_timeout_s = rt.config.queue_timeout_s
    ttft_timeout_s = rt.config.ttft_timeout_s

    @app.before_request
    async def _check_access() -> None:
        g.arrived = trio.current_time()
        g.stages = Stages()
        g.deadline = g.arrived + timeout_s if timeout_s > 0 else math.inf
        authorization = request.headers.get("Authorization")
        if authorization is None and request.headers.get("x-api-key"):  # Anthropic clients' header
            authorization = "Bearer " + request.headers["x-api-key"]
        access.check(request.path, authorization)

    @app.after_request
    async def _log_stages(response: Response) -> Response:
        stages = g.get("stages")
        if stages is not None:
            stages.mark("response")
            stages.log(path=request.path, status=response.status_code)
        return response

    @app.errorhandler(ApiError)
    async def _api_error(err: ApiError) -> Response:
        return _error(err)

    @app.errorhandler(HTTPException)
    async def _http_error(err: HTTPException) -> Response:
        kind = "not_found_error" if err.code == 404 else "invalid_request_error"
        message = {
            404: f"unknown route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
            413: f"the request body exceeds {rt.config.max_body_bytes} bytes",
        }.get(err.code or 0, err.description or "bad request")
        # The unread rest of a too-large body cannot start the next request: close the connection.
        headers = {"Connection": "close"} if err.code == 413 else None
        return _error(ApiError(err.code or 400, message, type=kind, headers=headers))

    @app.errorhandler(Exception)
    async def _unexpected(err: Exception) -> Response:
        log.exception("http.unhandled", path=request.path)
        return _error(ApiError(500, f"internal error: {type(err).__name__}", type="server_error"))

    async def read_json() -> Any:
        raw = await request.get_data(cache=False)
        stages = g.stages
        body = request.body
        if isinstance(body, ChunkedBody) and body.first_chunk_at is not None and body.complete_at is not None:
            stages.mark("body_first_chunk", body.first_chunk_at)
            stages.mark("body_complete", body.complete_at)
        stages.mark("body")
        tokens: dict[str, str] = {}
        if media_preparer is not None and isinstance(raw, bytes):  # known images skip the parse (vision/prepare.py)
            raw, tokens = media_preparer.lift(raw)
            stages.mark("lifted")
        if len(raw) > PARSE_OFF_LOOP_BYTES:  # megabytes of JSON take a while: off the event loop
            parsed = await trio.to_thread.run_sync(_parse_json, raw)
        else:
            parsed = _parse_json(raw)
        if tokens:
            parsed = restore_lifted(parsed, tokens)
        stages.mark("parsed")
        return parsed

    def refuse_early(parsed: ParsedRequest, chars: int, param: str) -> None:
        """Refuse before tokenizing: a prompt whose characters alone cannot fit, or a full queue."""
        fewest, limit = prompt_bound.fewest_tokens(chars), rt.info.max_context
        if fewest + parsed.sampling.max_tokens > limit:
            raise ApiError(400, f"the prompt ({chars} characters, so at least {fewest} tokens) + max_tokens "
                           f"({parsed.sampling.max_tokens}) exceeds the model's context length of {limit} tokens",
                           param=param, code="context_length_exceeded")
        try:
            rt.check_admission(fewest)
        except QueueFull as exc:
            raise ApiError(503, str(exc), type="server_overloaded", headers={"Retry-After": "1"}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), type="server_shutting_down", headers={"Retry-After": "5"}) from None

    adapter_namespaces = {a.name: a.namespace for a in rt.info.adapters}  # --adapter (docs/adapters.md)

    def check_model(name: str | None) -> None:
        if name is not None and name not in (rt.info.model_name, *MODEL_ALIASES, *adapter_namespaces):
            served = ", ".join(f"'{n}'" for n in (rt.info.model_name, *adapter_namespaces))
            raise ApiError(
                404, f"the model '{name}' does not exist; this server serves {served}",
                param="model", code="model_not_found",
            )

    def namespace_of(name: str | None) -> str:
        """The cache namespace a request's `model` selects: an adapter's own, or the base model's ("")."""
        return adapter_namespaces.get(name or "", "")


    def forced_call(sampling: SamplingParams, options: ChatOptions) -> Constraint | None:
        """A forced tool call's grammar, for a model whose tool calls the grammar spells."""
        if sampling.constraint is not None:
            raise ApiError(400, "a forced tool call (tool_choice) cannot be combined with another output "
                           "constraint (response_format, regex, grammar)", param="tool_choice")
        if rt.tokenizer.tool_call_start != TOOL_CALL_START or rt.tokenizer.tool_call_end != TOOL_CALL_END:
            raise ApiError(400, f"tool_choice 'required' or a named function needs the {TOOL_CALL_START} call "
                           "format; this model's chat template has another (use 'auto')", param="tool_choice",
                           code="unsupported_parameter")
        return options.forced

    def submit(
        prompt: tuple[int, ...], sampling: SamplingParams, session: str | None, media: tuple[Any, ...] = (),
        namespace: str = "", *, follows: bool = False, leads: bool = False, checkpoint_at: tuple[int, ...] = (),
    ) -> GenerationStream:
        try:
            request = rt.request(prompt, sampling=sampling, session=session, media=media, namespace=namespace,
                                 checkpoint_at=checkpoint_at)
            if leads:  # the others borrow its prompt's checkpoint once its first token is out
                request = attrs.evolve(request, prompt_shared=True)
            return rt.submit(request, follows=follows, within_queue_timeout=True)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
        except QueueFull as exc:
            raise ApiError(503, str(exc), type="server_overloaded", headers={"Retry-After": "1"}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), type="server_shutting_down", headers={"Retry-After": "5"}) from None

    async def start_choices(
        parsed: ParsedRequest, prompt: tuple[int, ...], options: ChatOptions, *, chat: bool, session: str | None,
        media: tuple[Any, ...] = (), checkpoint_at: tuple[int, ...] = (),
    ) -> list[_Choice]:
        """Submit the request's generations: the first alone, then (n > 1) the rest.

        The rest start once the first has a token, when its prompt's checkpoint is
        in the cache: they share that prefill (the cache lends it to each row).
        Each samples with its own seed (seed, seed + 1, ... when one is given). `checkpoint_at`: where
        the chat template's rendering stops being stable (`Runtime.render_chat_cut`).
        """
        sampling = parsed.sampling
        if options.forced is not None:
            sampling = attrs.evolve(sampling, constraint=forced_call(sampling, options))
        if chat and options.tools and options.tool_choice == "none":
            start = rt.tokenizer.tool_call_start_tokens if rt.tokenizer.has_tool_calling else None
            if start and len(start) == 1:  # the model cannot open a call
                sampling = attrs.evolve(sampling, logit_bias=(*sampling.logit_bias, (start[0], -100.0)))
        choices: list[_Choice] = []
        arrived = g.get("arrived", trio.current_time())
        try:
            for i in range(parsed.n):
                seed = None if sampling.seed is None else (sampling.seed + i) % 2**32
                stream = submit(prompt, attrs.evolve(sampling, seed=seed), session, media, namespace_of(parsed.model),
                                follows=i > 0, leads=i == 0 and parsed.n > 1,
                                checkpoint_at=checkpoint_at)  # the first choice has its first token: its prompt is cached
                if i == 0:
                    g.stages.mark("submitted")
                choices.append(_Choice(rt, stream, parsed, index=i, chat=chat, options=options, deadline=g.deadline))
                if i == 0 and queue_timeout_s > 0 and not await choices[0].reached(PromptAccepted, arrived + queue_timeout_s):
                    raise ApiError(503, f"no batch slot came free within {queue_timeout_s:g} s (--queue-timeout); "
                                   "retry later", type="server_overloaded", headers={"Retry-After": "5"})
                if i == 0 and ttft_timeout_s > 0 and not await choices[0].reached(TokenGenerated, arrived + ttft_timeout_s):
                    raise ApiError(503, f"no first token within {ttft_timeout_s:g} s (--ttft-timeout); the server is "
                                   "overloaded, retry later", type="server_overloaded", headers={"Retry-After": "5"})
                if i == 0 and parsed.n > 1:
                    await choices[0].prime()
        except GenerationError as exc:
            await _close(choices)
            raise ApiError(500, str(exc), type="server_error") from None
        except BaseException:
            await _close(choices)
            raise
        return choices

    async def run(
        parsed: ParsedRequest,
        prompt: tuple[int, ...],
        *,
        chat: bool,
        options: ChatOptions | None = None,
        session: str | None = None,
        media: tuple[Any, ...] = (),
        checkpoint_at: tuple[int, ...] = (),
    ) -> Response:
        check_model(parsed.model)
        choices = await start_choices(parsed, prompt, options or ChatOptions(), chat=chat, session=session,
                                      media=media, checkpoint_at=checkpoint_at)
        completion = _Completion(rt, choices, parsed, chat=chat, stages=g.stages)
        if parsed.stream:
            return event_stream(completion.sse(app.nursery.start_soon))
        try:
            reply = await completion.body()
            if choices[0].first_token_at is not None:
                g.stages.mark("first_token", choices[0].first_token_at)
            g.stages.mark("replied")
            g.stages.report(request_id=choices[0].stream.request.request_id, stream=False)
            return _json(reply)
        except GenerationError as exc:
            raise ApiError(500, str(exc), type="server_error") from None
        finally:
            await _close(choices)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await read_json()
        parsed = parse_common(
            body, default_max_tokens=min(rt.config.default_max_tokens, rt.config.max_tokens_limit),
            max_tokens_limit=rt.config.max_tokens_limit, chat=True,
        )
        messages = parse_messages(body)
        options = parse_chat_options(body)
        refuse_early(parsed, chat_chars(messages), "messages")

        async def render(realign: bool) -> tuple[tuple[int, ...], int | None]:
            g.stages.mark("images")  # the images are prepared (or there are none): rendering starts
            try:
                return await rt.render_chat_cut(messages, tools=options.tools,
                                                template_kwargs=options.template_kwargs, realign=realign,
                                                namespace=namespace_of(parsed.model))
            except InvalidRequest as exc:
                raise ApiError(400, str(exc), param="messages") from None
            finally:
                g.stages.mark("rendered")

        g.stages.mark("checked")
        prompt, media, cuts = await chat_prompt(rt, media_preparer, messages, parsed.sampling, render)  # vision/
        g.stages.mark("keyed")
        return await run(parsed, prompt, chat=True, options=options,
                         session=await request_session(rt, request.headers, body), media=media, checkpoint_at=cuts)

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await read_json()
        parsed = parse_common(
            body, default_max_tokens=min(16, rt.config.max_tokens_limit),
            max_tokens_limit=rt.config.max_tokens_limit, chat=False,
        )
        if body.get("echo"):
            raise ApiError(400, "'echo' is not supported", param="echo")
        prompt = parse_prompt(body)
        refuse_early(parsed, len(prompt) if isinstance(prompt, str) else 0, "prompt")
        ids = await encode_off_loop(rt.encode, prompt) if isinstance(prompt, str) else tuple(prompt)
        return await run(parsed, ids, chat=False, session=await request_session(rt, request.headers, body))

    def model_card(name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": int(rt.started_at), "owned_by": "mlxd"}
        if name in adapter_namespaces:  # an adapter: the model it adapts
            card["parent"] = rt.info.model_name
        return card

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card(n) for n in (rt.info.model_name, *adapter_namespaces)]})

    @app.get("/v1/models/<path:name>")
    async def model(name: str) -> Response:
        check_model(name)
        return _json(model_card(name if name in adapter_namespaces else rt.info.model_name))

    @app.get("/health")
    async def health() -> Response:
        if rt.engine.device_lost is not None:
            return _json({"status": "failed", "error": rt.engine.device_lost}, 503)
        if not rt.admitting:
            return _json({"status": "draining"}, 503)
        return _json({"status": "ok", "model": rt.info.model_name})

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return _json(openapi_document(max_tokens_limit=rt.config.max_tokens_limit))

    @app.post("/admin/cache/flush")
    async def flush() -> Response:
        if rt.cold is None:
            raise ApiError(400, "this server has no SSD tier (start it with --ssd-cache DIR)")
        report = await rt.flush()
        return _json(report, 200 if report["durable"] else 503)

    @app.get("/stats")
    async def stats() -> Response:
        data = (await rt.stats()).as_dict()
        if media_preparer is not None:
            data["media"] = media_preparer.stats()  # images decoded, known, lifted (docs/vision.md)
        if extra_stats is not None:
            data.update(extra_stats())
        return _json(data)

    from mlxd.http.anthropic import install_anthropic
    from mlxd.http.loads import install_loads
    from mlxd.http.metrics import install_metrics
    from mlxd.http.responses import install_responses
    from mlxd.http.routekit import RouteKit
    from mlxd.http.status import install_status_page

    async def kit_prompt(
        parsed: ParsedRequest, messages: list[dict[str, Any]], options: ChatOptions, param: str,
        names: list[str] | None = None,
    ) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]:
        """The chat route's prompt steps for another protocol's messages: (prompt, media, checkpoint cuts);
        `names`: each message's field in that protocol's body, for an image's error (default `messages[i]`)."""
        refuse_early(parsed, chat_chars(messages), param)

        async def render(realign: bool) -> tuple[tuple[int, ...], int | None]:
            try:
                return await rt.render_chat_cut(messages, tools=options.tools,
                                                template_kwargs=options.template_kwargs, realign=realign,
                                                namespace=namespace_of(parsed.model))
            except InvalidRequest as exc:
                raise ApiError(400, str(exc), param=param) from None

        try:
            return await chat_prompt(rt, media_preparer, messages, parsed.sampling, render, names=names)
        except ApiError as err:
            err.param = param if err.param == "messages" else err.param  # the protocol's own field
            raise

    kit = RouteKit(read_json=read_json, check_model=check_model, chat_prompt=kit_prompt,
                   start_choices=start_choices, close=_close, reply_model=lambda name: reply_model(rt, name))
    install_anthropic(app, rt, kit)  # POST /v1/messages, /v1/messages/count_tokens
    install_responses(app, rt, kit)  # POST /v1/responses, GET/DELETE /v1/responses/{id}
    install_sessions(app, rt, _json)  # DELETE /v1/sessions/{id}
    install_metrics(app, rt)  # GET /metrics
    install_status_page(app, rt)  # GET /
    install_loads(app, rt)  # GET /v1/loads (gateways' load polling)
    return app


async def serve_http(
    rt: Runtime,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Any],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API with hypercorn on trio until `shutdown_trigger` returns.

    Connections past `--max-connections` get a 503 and are closed; an idle
    keep-alive connection closes after `--keep-alive-timeout` (http/connections.py).
    """
    from hypercorn.config import Config

    from mlxd.http.connections import ConnectionGate, default_max_connections, serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = rt.config.keep_alive_timeout_s
    config.accesslog = None
    config.errorlog = None
    gate = ConnectionGate(limit=rt.config.max_connections or default_max_connections())
    pauses = gc_pauses.process_pauses()
    watch = StallWatch.from_env(gc=pauses)
    app = create_app(rt, host=host, extra_stats=lambda: {
        **gate.stats(), **pauses.stats(), **(watch.stats() if watch is not None else {})})
    async with trio.open_nursery() as nursery:
        if watch is not None:
            nursery.start_soon(watch.run)
        await serve(app, config, gate=gate, shutdown_trigger=shutdown_trigger, task_status=task_status)
        nursery.cancel_scope.cancel()
