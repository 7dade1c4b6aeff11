"""OpenAI's cache knobs on every route: `prompt_cache_key` names the cache session,
`prompt_cache_retention` is honoured ("in_memory", the default; "24h" pins the
request's checkpoints in RAM, tests/test_pins.py) or refused with a 400 naming an
unknown value, never silently ignored."""

from __future__ import annotations

import httpx
import openai
import pytest

from serving import ServerThread, config_for

ROUTES = {
    "/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/completions": {"prompt": "hi", "max_tokens": 1},
    "/responses": {"input": "hi", "max_output_tokens": 1},
    "/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as s:
        yield s


def post(server, route: str, **fields) -> httpx.Response:
    return httpx.post(server.base_url + route, json={"model": "tiny", **ROUTES[route], **fields}, timeout=60)


def message_of(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


@pytest.mark.parametrize("route", list(ROUTES))
def test_prompt_cache_key_is_the_session(server, route):
    key = f"agent-{route.strip('/').replace('/', '-')}"
    # Unknown before: deleting it is a 404.
    assert httpx.delete(f"{server.base_url}/sessions/{key}", timeout=30).status_code == 404
    r = post(server, route, prompt_cache_key=key, prompt_cache_retention="in_memory")
    assert r.status_code == 200, r.text
    # The request ran in that session: the cache knows it now.
    assert httpx.delete(f"{server.base_url}/sessions/{key}", timeout=30).status_code == 200


@pytest.mark.parametrize("route", list(ROUTES))
def test_24h_retention_pins_and_unknown_values_are_refused(server, route):
    stats_url = server.base_url.removesuffix("/v1") + "/stats"
    before = httpx.get(stats_url, timeout=30).json()["cache"]["pins"]["pinned"]
    r = post(server, route, prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    assert httpx.get(stats_url, timeout=30).json()["cache"]["pins"]["pinned"] == before + 1
    other = post(server, route, prompt_cache_retention="forever")
    assert other.status_code == 400 and "'forever'" in message_of(other)


def test_the_openai_client_sends_the_knobs(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour. " * 8}]
    c.chat.completions.create(model="tiny", messages=messages, max_tokens=1, prompt_cache_key="colours")
    again = c.chat.completions.create(model="tiny", messages=messages, max_tokens=1, prompt_cache_key="colours")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    c.responses.create(model="tiny", input="hi", max_output_tokens=1, prompt_cache_retention="24h")
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model="tiny", input="hi", extra_body={"prompt_cache_retention": "forever"})
    assert refused.value.body["param"] == "prompt_cache_retention"


def test_a_bad_key_is_a_400(server):
    r = post(server, "/chat/completions", prompt_cache_key=7)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key"
    r = post(server, "/messages", prompt_cache_key="")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
