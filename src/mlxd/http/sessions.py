"""Sessions over HTTP (seed §5.12): the `X-Session-Id` header and `DELETE /v1/sessions/{id}`.

A request names its session with the `X-Session-Id` header; without the
header, the body's OpenAI `user` field is used. The header wins when both are
present. The cache then finds the session's latest checkpoint without a
candidate scan and evicts it after anonymous entries. `DELETE
/v1/sessions/{id}` drops the session's references (cached state stays for
anyone whose prompt matches it). Session metadata lives in this process only.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from mlxd.http.schemas import ApiError

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID = 256


def session_id(headers: Any, body: Any) -> str | None:
    """The request's session: the header, else the body's `user` field, else None."""
    raw = headers.get(SESSION_HEADER)
    where = SESSION_HEADER
    if raw is None:
        raw = body.get("user") if isinstance(body, dict) else None
        where = "user"
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise ApiError(400, "'user' must be a string", param="user")
    if not raw or len(raw) > MAX_SESSION_ID or not raw.isprintable():
        raise ApiError(400, f"{where} must be 1-{MAX_SESSION_ID} printable characters",
                       param="user" if where == "user" else None)
    return raw


def install_sessions(app: Any, rt: Any, json_response: Any) -> None:
    """DELETE /v1/sessions/{id}: 200 when the session was known, 404 otherwise."""

    @app.delete("/v1/sessions/<path:sid>")
    async def delete_session(sid: str) -> Response:
        if not await rt.close_session(sid):
            raise ApiError(404, f"no session '{sid}' is known to this server", type="not_found_error",
                           param="session_id", code="session_not_found")
        return json_response({"id": sid, "object": "session", "deleted": True})
