"""`GET /`: a static status page that polls `/stats` once a second.

Plain HTML and JavaScript shipped as package data: no build step, no external
URLs. The page reads nothing but `/stats`, so it shows what monitoring sees.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from quart import Response


def status_page_html() -> str:
    return (resources.files("mlxd.http") / "static" / "index.html").read_text(encoding="utf-8")


def install_status_page(app: Any, rt: Any) -> None:
    """Register `GET /` serving the status page (`rt` is unused: the page polls /stats)."""
    html = status_page_html()

    @app.get("/")
    async def status_page() -> Response:
        return Response(html, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})
