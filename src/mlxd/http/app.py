"""The OpenAI-compatible HTTP API: a Quart app (quart-trio) over a running `Runtime`."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxd.http.openapi import openapi_document
from mlxd.http.schemas import ApiError, ParsedRequest, parse_common, parse_messages, parse_prompt
from mlxd.http.security import AccessPolicy, is_loopback
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import GenerationFinished, PromptAccepted, TokenGenerated
from mlxd.runtime.supervisor import (
    GenerationError,
    GenerationStream,
    InvalidRequest,
    QueueFull,
    Runtime,
    ShuttingDown,
)
from mlxd.runtime.text import TextAssembler

log = get_logger("mlxd.http")

MAX_BODY_BYTES = 16 * 1024 * 1024


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data), status=status, headers=headers, content_type="application/json")


def _error(err: ApiError) -> Response:
    return _json(err.body(), err.status, err.headers)


class _Completion:
    """Runs one generation and shapes its events into OpenAI chunks or a body."""

    def __init__(
        self, rt: Runtime, stream: GenerationStream, parsed: ParsedRequest, *, chat: bool,
        deadline: float = math.inf,
    ) -> None:
        self.rt = rt
        self.deadline = deadline  # trio clock; past it the generation ends with "length"
        self.timed_out = False
        self.stream = stream
        self.parsed = parsed
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text = TextAssembler(rt.tokenizer, stop=parsed.stop, eos_ids=rt.info.eos_token_ids)
        self.accepted: PromptAccepted | None = None
        self.finished: GenerationFinished | None = None
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []

    async def deltas(self) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
        """Yield (text delta, logprob entries) until the generation ends or a stop string hits."""
        async with self.stream:
            events = aiter(self.stream)
            while (event := await self._next_event(events)) is not None:
                if isinstance(event, PromptAccepted):
                    self.accepted = event
                elif isinstance(event, TokenGenerated):
                    self.completion_tokens += 1
                    self.token_ids.append(event.token)
                    delta = self.text.add(event.token)
                    entries = self._logprob_entries(event)
                    self.logprobs.extend(entries)
                    if delta or entries:
                        yield delta, entries
                    if self.text.stopped_by_string:
                        break  # leaving the stream cancels the generation
                elif isinstance(event, GenerationFinished):
                    self.finished = event
        tail = self.text.finish()
        if tail:
            yield tail, []
        if self.chat and not self.text.stopped_by_string:
            self.rt.remember_reply(self.text.text, self.token_ids)

    async def _next_event(self, events: AsyncIterator[Any]) -> Any:
        """The next event; None at the end or past the deadline (leaving cancels the generation)."""
        with trio.move_on_at(self.deadline):
            try:
                return await anext(events)
            except StopAsyncIteration:
                return None
        self.timed_out = True
        log.info("http.request_timeout", request_id=self.stream.request.request_id,
                 completion_tokens=self.completion_tokens)
        return None

    def finish_reason(self) -> str:
        if self.text.stopped_by_string:
            return "stop"
        if self.timed_out:
            return "length"  # cut by --request-timeout, like a max_tokens cut
        if self.finished is not None and self.finished.reason in ("stop", "length"):
            return self.finished.reason
        return "stop"

    def usage(self) -> dict[str, Any]:
        prompt = len(self.stream.request.prompt)
        cached = self.accepted.cached_tokens if self.accepted else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _logprob_entries(self, event: TokenGenerated) -> list[dict[str, Any]]:
        if event.logprob is None:
            return []
        tok = self.rt.tokenizer
        text = tok.decode([event.token])
        top = [{"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()), "id": t}
               for t, lp in event.top_logprobs]
        return [{"token": text, "logprob": event.logprob, "bytes": list(text.encode()), "id": event.token,
                 "top_logprobs": top}]

    # --- chat shapes ------------------------------------------------------------

    def chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.rt.info.model_name,
            "choices": [choice] if choice else [],
        }
        if usage is not None or self.parsed.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def choice(self, delta: str, entries: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": delta} if delta or finish is None else {},
                                      "finish_reason": finish}
            if self.parsed.sampling.logprobs:
                choice["logprobs"] = {"content": entries} if entries else None
            return choice
        choice = {"index": 0, "text": delta, "finish_reason": finish}
        choice["logprobs"] = self._completion_logprobs(entries) if self.parsed.sampling.logprobs else None
        return choice

    def _completion_logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": [],
        }

    async def sse(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield self.chunk(first)
            async for delta, entries in self.deltas():
                yield self.chunk(self.choice(delta, entries, None))
            yield self.chunk(self.choice("", [], self.finish_reason()))
            if self.parsed.include_usage:
                yield self.chunk({}, self.usage())
        except GenerationError as exc:
            yield f"data: {json.dumps(ApiError(500, str(exc), type='server_error').body())}\n\n"
        except Exception as exc:
            log.exception("http.stream_failed", request_id=self.stream.request.request_id)
            yield f"data: {json.dumps(ApiError(500, f'internal error: {type(exc).__name__}', type='server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    async def body(self) -> dict[str, Any]:
        text = "".join([d async for d, _ in self.deltas()])
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": self.finish_reason(),
                "logprobs": {"content": self.logprobs} if self.parsed.sampling.logprobs else None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": self.finish_reason(),
                "logprobs": self._completion_logprobs(self.logprobs) if self.parsed.sampling.logprobs else None,
            }
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.rt.info.model_name,
            "choices": [choice],
            "usage": self.usage(),
        }


def create_app(
    rt: Runtime, *, extra_stats: Callable[[], dict[str, Any]] | None = None, host: str = "127.0.0.1"
) -> QuartTrio:
    """Build the Quart app serving `rt` (the caller runs it under hypercorn bound to `host`)."""
    app = QuartTrio("mlxd")
    app.config["MAX_CONTENT_LENGTH"] = rt.config.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    access = AccessPolicy(api_key=rt.config.api_key, admin_key=rt.config.admin_key, loopback=is_loopback(host))
    timeout_s = rt.config.request_timeout_s

    @app.before_request
    async def _check_access() -> None:
        g.deadline = trio.current_time() + timeout_s if timeout_s > 0 else math.inf
        access.check(request.path, request.headers.get("Authorization"))

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
        return _error(ApiError(err.code or 400, message, type=kind))

    @app.errorhandler(Exception)
    async def _unexpected(err: Exception) -> Response:
        log.exception("http.unhandled", path=request.path)
        return _error(ApiError(500, f"internal error: {type(err).__name__}", type="server_error"))

    async def read_json() -> Any:
        raw = await request.get_data(cache=False)
        try:
            return json.loads(raw)
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not valid UTF-8") from None
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def check_model(name: str | None) -> None:
        if name is not None and name not in (rt.info.model_name, "default"):
            raise ApiError(
                404, f"the model '{name}' does not exist; this server serves '{rt.info.model_name}'",
                param="model", code="model_not_found",
            )


    async def run(parsed: ParsedRequest, prompt: tuple[int, ...], *, chat: bool) -> Response:
        check_model(parsed.model)
        try:
            req = rt.request(prompt, sampling=parsed.sampling)
            stream = rt.submit(req)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except QueueFull as exc:
            raise ApiError(503, str(exc), type="server_overloaded", headers={"Retry-After": "1"}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), type="server_shutting_down", headers={"Retry-After": "5"}) from None
        completion = _Completion(rt, stream, parsed, chat=chat, deadline=g.deadline)
        if parsed.stream:
            response = Response(completion.sse(), content_type="text/event-stream")
            response.headers["Cache-Control"] = "no-cache"
            response.timeout = None
            return response
        try:
            return _json(await completion.body())
        except GenerationError as exc:
            raise ApiError(500, str(exc), type="server_error") from None

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await read_json()
        parsed = parse_common(
            body, default_max_tokens=min(rt.config.default_max_tokens, rt.config.max_tokens_limit),
            max_tokens_limit=rt.config.max_tokens_limit, chat=True,
        )
        messages = parse_messages(body)
        try:
            prompt = await rt.render_chat(messages)
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return await run(parsed, prompt, chat=True)

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
        ids = rt.encode(prompt) if isinstance(prompt, str) else tuple(prompt)
        return await run(parsed, ids, chat=False)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": rt.info.model_name, "object": "model", "created": int(rt.started_at), "owned_by": "mlxd"}
        return _json({"object": "list", "data": [card]})

    @app.get("/v1/models/<path:name>")
    async def model(name: str) -> Response:
        check_model(name)
        return _json({"id": rt.info.model_name, "object": "model", "created": int(rt.started_at), "owned_by": "mlxd"})

    @app.get("/health")
    async def health() -> Response:
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
        data = await rt.stats()
        if extra_stats is not None:
            data.update(extra_stats())
        return _json(data)

    from mlxd.http.loads import install_loads
    from mlxd.http.metrics import install_metrics
    from mlxd.http.status import install_status_page

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
    """Serve the API with hypercorn on trio until `shutdown_trigger` returns."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = 5.0
    config.accesslog = None
    config.errorlog = None
    app = create_app(rt, host=host)
    await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
