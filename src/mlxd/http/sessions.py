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
"""

from __future__ import annotations

import uuid
from typing import Any

from quart import Response

from mlxd.http.schemas import ApiError
from mlxd.kv.tiers import IMPLICIT_PIN_SESSION  # a made-up session, closed when its pin expires

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


def install_sessions(app: Any, rt: Any, json_response: Any) -> None:
    """DELETE /v1/sessions/{id}: 200 when the session was known, 404 otherwise."""

    @app.delete("/v1/sessions/<path:sid>")
    async def delete_session(sid: str) -> Response:
        if not await rt.close_session(sid):
            raise ApiError(404, f"no session '{sid}' is known to this server", type="not_found_error",
                           param="session_id", code="session_not_found")
        return json_response({"id": sid, "object": "session", "deleted": True})
