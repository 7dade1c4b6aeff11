"""Fuzz a live server against its own OpenAPI document (schemathesis).

Valid and invalid inputs for every operation: no 5xx, every response
conforms to the document, every error has the OpenAI shape, and the server
is healthy afterwards. The server's max_tokens limit is small, so the schema
keeps generations short and the fuzz fast.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from mlxd.http.openapi import openapi_document

from serving import ServerThread, config_for

LIMIT = 8
schema = schemathesis.openapi.from_dict(openapi_document(max_tokens_limit=LIMIT))
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@schemathesis.check
def openai_style_errors(ctx, response, case) -> None:
    """A 4xx/5xx body is JSON {"error": {"message", "type", "param", "code"}} (Anthropic's shape on /v1/messages)."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    error = body["error"]
    if case.path.startswith("/v1/messages") and response.status_code != 401:
        assert body["type"] == "error" and isinstance(error["type"], str)
        assert isinstance(error["message"], str) and error["message"]
        return
    assert isinstance(error["message"], str) and error["message"]
    assert {"message", "type", "param", "code"} <= error.keys()


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          openai_style_errors]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_tokens_limit=LIMIT, max_context=512)) as s:
        yield s


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case, server):
    base = server.base_url.removesuffix("/v1")
    case.call_and_validate(base_url=base, checks=CHECKS, timeout=60)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        ({"logit_bias": {"99999999": 1}}, 400),  # an id past the vocabulary once reached MLX (UB, a segfault)
        ({"logit_bias": {"-1": 5}}, 400),  # a negative id silently biased the last token
        ({"top_k": 10**12}, 200),  # top_k >= vocab was a 500 from mlx-lm; it means "no top_k"
        ({"top_k": 10**30}, 200),
        ({"seed": 2**70}, 400),
        ({"stop": [""]}, 200),
    ],
)
def test_sampling_edge_cases_are_clean(server, extra, status):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    if status >= 400:
        assert r.json()["error"]["param"] in extra
