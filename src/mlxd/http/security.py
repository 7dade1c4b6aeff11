"""Access control for the HTTP API: bearer tokens and the loopback rule.

Every route needs the API key (when one is set) except a short allowlist of
public routes; `/admin/*` needs the admin key instead. Without an admin key,
admin routes are open only on a loopback bind and refused (403) otherwise.
Tokens are compared in constant time. See SECURITY.md for the threat model.
"""

from __future__ import annotations

import hmac
import ipaddress

import attrs

from mlxd.http.schemas import ApiError

# Routes anyone may call: liveness probes and the API description.
PUBLIC_PATHS = frozenset({"/health", "/openapi.json"})
ADMIN_PREFIX = "/admin/"


def is_loopback(host: str) -> bool:
    """Is `host` (a bind address or name) reachable only from this machine?"""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name other than localhost: assume it is reachable


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def same_token(given: str | None, expected: str) -> bool:
    """Constant-time comparison (the time does not depend on where they differ)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401, message, type="invalid_request_error", code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="mlxd"'},
    )


@attrs.frozen
class AccessPolicy:
    """Who may call what; `check` raises an ApiError (401/403) or returns None."""

    api_key: str | None = attrs.field(default=None, repr=False)
    admin_key: str | None = attrs.field(default=None, repr=False)
    loopback: bool = True  # the server is bound to a loopback address only

    def check(self, path: str, authorization: str | None) -> None:
        if path in PUBLIC_PATHS:
            return
        token = bearer_token(authorization)
        if path.startswith(ADMIN_PREFIX):
            self._check_admin(token)
        elif self.api_key is not None and not same_token(token, self.api_key):
            what = "is missing" if token is None else "is not valid"
            raise _unauthorized(f"the API key {what}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")

    def _check_admin(self, token: str | None) -> None:
        if self.admin_key is None:
            if self.loopback:
                return
            raise ApiError(
                403,
                "admin routes are disabled on a non-loopback bind without an admin key "
                "(start the server with --admin-key or MLXD_ADMIN_KEY)",
                type="permission_error", code="admin_disabled",
            )
        if not same_token(token, self.admin_key):
            what = "is missing" if token is None else "is not valid"
            raise _unauthorized(f"the admin key {what}: send 'Authorization: Bearer <admin key>'")
