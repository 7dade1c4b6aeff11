"""The OpenAPI document covers every route the app registers, and the agent routes answer as it says.

`docs/openapi.json` is the generated document; each (path, method) of the live app is in it and
each documented operation is served. The Messages, Responses, count_tokens and session export /
import replies of a real server over loopback conform to their documented schemas.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import schemathesis

from mlxd.http.openapi import openapi_document

from serving import ServerThread, config_for

DOC = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
SCHEMA = schemathesis.openapi.from_dict(openapi_document())
QUART_OWN = {"/static/{filename}"}  # Quart's static-folder rule (no static folder is served)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as s:
        yield s


def test_the_committed_document_is_the_generated_one():
    assert json.loads(DOC.read_text()) == openapi_document(), "run: python -m mlxd.http.openapi > docs/openapi.json"


def test_every_route_the_app_registers_is_documented_and_back(server):
    from mlxd.http.app import create_app

    async def rules():
        app = create_app(server.runtime)
        return [(r.rule, set(r.methods or ())) for r in app.url_map.iter_rules()]

    served = set()
    for rule, methods in server.call(rules):
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)
        if path in QUART_OWN:
            continue
        served |= {(path, m.lower()) for m in methods - {"HEAD", "OPTIONS"}}
    paths = openapi_document()["paths"]
    documented = {(re.sub(r"\{[a-z_]+\}", "{}", p), m) for p, ops in paths.items() for m in ops}
    served_shapes = {(re.sub(r"\{[a-z_]+\}", "{}", p), m) for p, m in served}
    assert served_shapes - documented == set(), "served but not in the OpenAPI document"
    assert documented - served_shapes == set(), "documented but not served"
    for route in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{}",
                  "/admin/sessions/{}/export", "/admin/sessions/{}/import"):
        assert any(p == route for p, _ in documented), route


def conforms(path: str, method: str, response: httpx.Response) -> None:
    """The reply's status is documented, and its body is as the document says (schemathesis' check)."""
    assert str(response.status_code) in openapi_document()["paths"][path][method.lower()]["responses"]
    SCHEMA[path][method].validate_response(response)


def test_messages_and_count_tokens_conform(server):
    base = server.base_url.removesuffix("/v1")
    tool = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}
    body = {"model": "tiny", "max_tokens": 4, "system": "Be brief.", "tools": [tool],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there",
                                                       "cache_control": {"type": "ephemeral"}}]}]}
    r = httpx.post(f"{base}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    conforms("/v1/messages", "POST", r)
    assert {"cache_read_input_tokens", "cache_creation_input_tokens"} <= r.json()["usage"].keys()
    bad = httpx.post(f"{base}/v1/messages", json={"messages": []}, timeout=60)
    assert bad.status_code == 400
    conforms("/v1/messages", "POST", bad)
    assert bad.json()["type"] == "error"
    n = httpx.post(f"{base}/v1/messages/count_tokens", json={k: body[k] for k in ("model", "system", "messages")},
                   timeout=60)
    assert n.status_code == 200, n.text
    conforms("/v1/messages/count_tokens", "POST", n)


def test_responses_get_and_delete_conform(server):
    base = server.base_url.removesuffix("/v1")
    r = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "Hello", "max_output_tokens": 4},
                   timeout=60)
    assert r.status_code == 200, r.text
    conforms("/v1/responses", "POST", r)
    rid = r.json()["id"]
    follow = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "And?", "max_output_tokens": 4,
                                                      "previous_response_id": rid}, timeout=60)
    conforms("/v1/responses", "POST", follow)
    assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    got = httpx.get(f"{base}/v1/responses/{rid}", timeout=60)
    conforms("/v1/responses/{response_id}", "GET", got)
    items = httpx.get(f"{base}/v1/responses/{rid}/input_items", params={"limit": 5}, timeout=60)
    conforms("/v1/responses/{response_id}/input_items", "GET", items)
    gone = httpx.delete(f"{base}/v1/responses/{rid}", timeout=60)
    conforms("/v1/responses/{response_id}", "DELETE", gone)
    missing = httpx.get(f"{base}/v1/responses/{rid}", timeout=60)
    assert missing.status_code == 404
    conforms("/v1/responses/{response_id}", "GET", missing)


def test_session_export_and_import_conform(server):
    base = server.base_url.removesuffix("/v1")
    chat = {"model": "tiny", "max_tokens": 2, "prompt_cache_key": "doc-session",
            "messages": [{"role": "user", "content": "A session worth moving. " * 8}]}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    exported = httpx.get(f"{base}/admin/sessions/doc-session/export", timeout=60)
    assert exported.status_code == 200, exported.text
    conforms("/admin/sessions/{session_id}/export", "GET", exported)
    imported = httpx.post(f"{base}/admin/sessions/doc-copy/import", content=exported.content,
                          headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert imported.status_code == 200, imported.text
    conforms("/admin/sessions/{session_id}/import", "POST", imported)
    refused = httpx.post(f"{base}/admin/sessions/doc-bad/import", content=b"not a file",
                         headers={"Content-Type": "application/octet-stream"}, timeout=60)
    assert refused.status_code == 400, refused.text
    conforms("/admin/sessions/{session_id}/import", "POST", refused)
    unknown = httpx.get(f"{base}/admin/sessions/nobody/export", timeout=60)
    assert unknown.status_code == 404
    conforms("/admin/sessions/{session_id}/export", "GET", unknown)
