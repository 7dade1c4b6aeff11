"""Access control and request limits: bearer tokens, the loopback rule, timeouts, body size."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from mlxd.http.schemas import ApiError
from mlxd.http.security import AccessPolicy, bearer_token, is_loopback

from procs import ServeProcess
from serving import ServerThread, config_for

NO_EOS = {"0": -100, "2": -100}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def status(policy: AccessPolicy, path: str, auth: str | None = None) -> int:
    try:
        policy.check(path, auth)
    except ApiError as err:
        assert {"message", "type", "param", "code"} <= err.body()["error"].keys()
        return err.status
    return 200


def test_loopback_and_bearer_parsing():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com"))
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_policy_without_keys_on_loopback_is_open():
    policy = AccessPolicy()
    assert status(policy, "/v1/chat/completions") == 200
    assert status(policy, "/admin/cache/flush") == 200


def test_policy_api_key_guards_everything_but_public_routes():
    policy = AccessPolicy(api_key="s3cret")
    for path in ("/v1/chat/completions", "/v1/models", "/stats", "/metrics", "/anything"):
        assert status(policy, path) == 401
        assert status(policy, path, "Bearer wrong") == 401
        assert status(policy, path, "Bearer s3cret") == 200
    assert status(policy, "/health") == 200
    assert status(policy, "/openapi.json") == 200
    assert "s3cret" not in repr(policy)


def test_policy_admin_routes():
    # Loopback without an admin key: open (the local operator); a non-loopback bind: refused.
    assert status(AccessPolicy(api_key="k"), "/admin/cache/flush") == 200
    assert status(AccessPolicy(api_key="k", loopback=False), "/admin/cache/flush") == 403
    assert status(AccessPolicy(loopback=False), "/admin/cache/flush", "Bearer k") == 403
    # With an admin key it is required everywhere; the API key is not an admin key.
    for loopback in (True, False):
        policy = AccessPolicy(api_key="k", admin_key="adm", loopback=loopback)
        assert status(policy, "/admin/cache/flush") == 401
        assert status(policy, "/admin/cache/flush", "Bearer k") == 401
        assert status(policy, "/admin/cache/flush", "Bearer adm") == 200
        assert status(policy, "/v1/models", "Bearer adm") == 401


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    config = config_for(tiny_model_dir, api_key="k-123", admin_key="adm-456", max_body_bytes=4096,
                        max_tokens_limit=64)
    with ServerThread(config) as s:
        yield s


def test_live_server_requires_the_api_key(keyed):
    base = keyed.base_url.removesuffix("/v1")
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{base}/stats").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/openapi.json").json()["openapi"].startswith("3.")
    good = openai.OpenAI(base_url=keyed.base_url, api_key="k-123", max_retries=0, timeout=60)
    reply = good.chat.completions.create(**CHAT)
    assert reply.choices[0].finish_reason in ("stop", "length")
    bad = openai.OpenAI(base_url=keyed.base_url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(**CHAT)


def test_live_server_admin_key(keyed):
    url = keyed.base_url.removesuffix("/v1") + "/admin/cache/flush"
    assert httpx.post(url).status_code == 401
    assert httpx.post(url, headers={"Authorization": "Bearer k-123"}).status_code == 401
    # Authorized; this server has no SSD tier, so the flush itself is a 400.
    r = httpx.post(url, headers={"Authorization": "Bearer adm-456"})
    assert r.status_code == 400 and "SSD" in r.json()["error"]["message"]


def test_body_limit_and_max_tokens_cap(keyed):
    auth = {"Authorization": "Bearer k-123"}
    r = httpx.post(f"{keyed.base_url}/chat/completions", content=b"x" * 5000, headers=auth)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    r = httpx.post(f"{keyed.base_url}/chat/completions", json={**CHAT, "max_tokens": 65}, headers=auth)
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    # Without max_tokens, the default is capped at the server's limit instead of refused.
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    r = httpx.post(f"{keyed.base_url}/chat/completions", json={**body, "logit_bias": NO_EOS}, headers=auth,
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64


def test_request_timeout_cuts_generations_cleanly(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, request_timeout_s=1.0, max_batch=1)) as s:
        long = {**CHAT, "max_tokens": 3000, "logit_bias": NO_EOS}
        t0 = time.monotonic()
        r = httpx.post(f"{s.base_url}/chat/completions", json=long, timeout=60)
        assert time.monotonic() - t0 < 10
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
        assert 0 < body["usage"]["completion_tokens"] < 3000
        # Streaming: the stream ends with a "length" chunk and [DONE].
        with httpx.stream("POST", f"{s.base_url}/chat/completions", json={**long, "stream": True},
                          timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in lines[-2]
        # The only slot was freed: a short request still works.
        r = httpx.post(f"{s.base_url}/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200


def test_cli_non_loopback_bind_refuses_admin_without_admin_key(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MLXD_API_KEY", "env-key")
    monkeypatch.delenv("MLXD_ADMIN_KEY", raising=False)
    proc = ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--host", "0.0.0.0",
                        log_path=tmp_path / "serve.log")
    with proc:
        base = proc.url.replace("0.0.0.0", "127.0.0.1")
        auth = {"Authorization": "Bearer env-key"}
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200
        r = httpx.post(f"{base}/admin/cache/flush", headers=auth)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
    assert "env-key" not in proc.log()
