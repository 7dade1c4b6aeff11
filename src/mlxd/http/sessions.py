"""Sessions over HTTP (seed §5.12): the `X-Session-Id` header and `DELETE /v1/sessions/{id}`.

A request names its session with the `X-Session-Id` header; without the
header, the body's OpenAI `user` field is used. The header wins when both are
present. OpenAI's `prompt_cache_key` field names the session too (after the
header, before `user`), on every route. `prompt_cache_retention` is read
here as well: "in_memory" is the default; "24h" pins the session's latest
checkpoints in RAM for 24 hours (`request_session`; a request without a session
gets a made-up one for its pin). The cache then finds the session's latest
checkpoint without a candidate scan and evicts it after anonymous entries.
`DELETE /v1/sessions/{id}` drops the session's references and its pin (cached
state stays for anyone whose prompt matches it). Session metadata lives in
this process only.

A session's KV travels as a verified `.mlxkv` file (runtime/session_files.py):
`GET /admin/sessions/{id}/export` downloads its latest checkpoint, and
`POST /admin/sessions/{id}/import` adopts such a file (same model, tokenizer
and KV scheme, every checksum checked) as that session's checkpoint, in RAM
and on SSD. Both are admin routes: an import writes state other requests are
served from, and an export holds the session's prompt tokens.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio
from quart import Response, request

from mlxd.http.schemas import ApiError
from mlxd.kv.tiers import IMPLICIT_PIN_SESSION  # a made-up session, closed when its pin expires
from mlxd.runtime import session_files

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 256


# prompt_cache_retention values and how long each pins the request's checkpoints in RAM (seconds)
RETENTIONS = {"in_memory": 0.0, "24h": 24 * 3600.0}


def check_retention(body: Any) -> float:
    """`prompt_cache_retention`: seconds to pin (0 for "in_memory" or none), or a 400 naming the value."""
    value = body.get("prompt_cache_retention") if isinstance(body, dict) else None
    if value is None:
        return 0.0
    if isinstance(value, str) and value in RETENTIONS:
        return RETENTIONS[value]
    raise ApiError(400, f"prompt_cache_retention must be 'in_memory' or '24h', got {value!r}",
                   param="prompt_cache_retention")


async def request_session(rt: Any, headers: Any, body: Any, *, pin_s: float = 0.0) -> str | None:
    """`session_id`, and the pin the request asks for (24h retention, or `pin_s` from cache_control).

    A pinned request without a session gets a made-up one, so its own checkpoints are what is pinned.
    """
    session = session_id(headers, body)
    ttl = max(check_retention(body), pin_s)
    if ttl > 0:
        session = session or f"{IMPLICIT_PIN_SESSION}{uuid.uuid4().hex}"
        await rt.pin_session(session, ttl)
    return session


def session_id(headers: Any, body: Any) -> str | None:
    """The request's session: the header, else `prompt_cache_key`, else the body's `user`, else None.

    Also checks the body's `prompt_cache_retention` (every route reads its session here).
    """
    check_retention(body)
    raw = headers.get(SESSION_HEADER)
    where = SESSION_HEADER
    for name in ("prompt_cache_key", "user"):
        if raw is not None:
            break
        raw = body.get(name) if isinstance(body, dict) else None
        where = name
        if raw is not None and not isinstance(raw, str):
            raise ApiError(400, f"'{name}' must be a string", param=name)
    if raw is None:
        return None
    if not raw or len(raw) > MAX_SESSION_ID or not raw.isprintable():
        raise ApiError(400, f"{where} must be 1-{MAX_SESSION_ID} printable characters",
                       param=None if where == SESSION_HEADER else where)
    return raw


_IMPORT_PATH = re.compile(r"^/admin/sessions/.+/import$")
_CHUNK = 1 << 20  # export reads, upload writes


def _check_id(sid: str) -> None:
    if not sid or len(sid) > MAX_SESSION_ID or not sid.isprintable():
        raise ApiError(400, f"a session id must be 1-{MAX_SESSION_ID} printable characters", param="session_id")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the file exceeds {limit} bytes, the largest checkpoint this model can have",
                    type="invalid_request_error", code="request_too_large", headers={"Connection": "close"})


async def _receive(body: Any, path: Path, limit: int) -> int:
    """Write the request body to a new file (0600), refusing it past `limit` bytes; its size."""
    fd = await trio.to_thread.run_sync(lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    size, pending = 0, bytearray()
    try:
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            pending += chunk
            if len(pending) >= _CHUNK:
                data, pending = bytes(pending), bytearray()
                await trio.to_thread.run_sync(os.write, fd, data)
        if pending:
            await trio.to_thread.run_sync(os.write, fd, bytes(pending))
    finally:
        os.close(fd)
    return size


async def _stream_file(path: Path) -> AsyncIterator[bytes]:
    """The file's bytes, read on a worker thread; the file is removed once sent (or abandoned)."""
    try:
        with open(path, "rb") as f:  # noqa: ASYNC230 - opening is instant; reads go to a thread
            while chunk := await trio.to_thread.run_sync(f.read, _CHUNK):
                yield chunk
    finally:
        path.unlink(missing_ok=True)  # noqa: ASYNC240 - one unlink, also when the stream is abandoned


def install_sessions(app: Any, rt: Any, json_response: Any) -> None:
    """DELETE /v1/sessions/{id}: 200 when the session was known, 404 otherwise.

    GET /admin/sessions/{id}/export and POST /admin/sessions/{id}/import: a session's KV as a file.
    """
    limit = session_files.import_limit(max_context=rt.info.max_context, kv_bytes_per_token=rt.info.kv_bytes_per_token,
                                       slack=rt.config.max_body_bytes)
    base = app.request_class

    class SessionUploadRequest(base):  # type: ignore[misc, valid-type]
        """An import's body may be larger than --max-body-bytes, up to the largest checkpoint."""

        def __init__(self, method: str, scheme: str, path: str, *args: Any, **kwargs: Any) -> None:
            if method == "POST" and _IMPORT_PATH.match(path):
                kwargs["max_content_length"] = limit
            super().__init__(method, scheme, path, *args, **kwargs)

    app.request_class = SessionUploadRequest
    adapters = {a.name: a.namespace for a in rt.info.adapters}

    def _namespace(model: str | None) -> str:
        """`?model=`: the base model (the default) or an `--adapter`, whose cache namespace is its own."""
        if model is None or model == rt.info.model_name:
            return ""
        if model not in adapters:
            raise ApiError(404, f"the model '{model}' does not exist on this server", param="model",
                           code="model_not_found")
        return adapters[model]

    @app.delete("/v1/sessions/<path:sid>")
    async def delete_session(sid: str) -> Response:
        _check_id(sid)
        if not await rt.close_session(sid):
            raise ApiError(404, f"no session '{sid}' is known to this server", type="not_found_error",
                           param="session_id", code="session_not_found")
        return json_response({"id": sid, "object": "session", "deleted": True})

    @app.get("/admin/sessions/<path:sid>/export")
    async def export_session(sid: str) -> Response:
        _check_id(sid)
        path = await rt.export_session(sid, _namespace(request.args.get("model")))
        if path is None:
            raise ApiError(404, f"no checkpoint of session '{sid}' is cached on this server", type="not_found_error",
                           param="session_id", code="session_not_found")
        size = (await trio.Path(path).stat()).st_size
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", sid)[:64]
        headers = {"Content-Length": str(size), "Content-Disposition": f'attachment; filename="{safe}.mlxkv"'}
        return Response(_stream_file(path), content_type="application/octet-stream", headers=headers)

    @app.post("/admin/sessions/<path:sid>/import")
    async def import_session(sid: str) -> Response:
        _check_id(sid)
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(limit)
        path = session_files.new_upload_path(rt.transfer_dir)
        try:
            await _receive(request.body, path, limit)
            done = await rt.import_session(sid, path)
        except session_files.ImportRefused as exc:
            raise ApiError(exc.status, str(exc), type="invalid_request_error", code=exc.code) from None
        finally:
            await trio.Path(path).unlink(missing_ok=True)
        return json_response({"id": sid, "object": "session.import", "tokens": done.tokens,
                              "nbytes": done.nbytes, "ram": done.ram, "ssd": done.ssd})
