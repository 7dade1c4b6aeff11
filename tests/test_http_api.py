"""The OpenAI-compatible API over real HTTP on loopback, driven by the official client."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from serving import ServerThread, config_for

# The tiny model's end tokens (<|endoftext|>, <|im_end|>) banned, so a generation runs its length.
NO_EOS = {"0": -100, "2": -100}
SYSTEM = "You are a careful assistant who answers briefly. " * 12


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def cold_server(tiny_model_dir):
    """The same model with the prompt cache disabled: every prompt is a full prefill."""
    with ServerThread(config_for(tiny_model_dir, prompt_cache_bytes=0)) as s:
        yield s


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client(server).chat.completions.create(model="tiny", messages=messages, **kw)


def top_logprobs(response) -> list[dict[int, float]]:
    """Per generated token: {token text: logprob} of the top alternatives."""
    return [{t.token: t.logprob for t in c.top_logprobs} for c in response.choices[0].logprobs.content]


def test_second_turn_hits_cache_and_matches_cold_prefill(server, cold_server):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
    first = chat(server, turn1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reply = first.choices[0].message.content
    # The cold server sees the same first turn, so it renders turn 2 with the same
    # token ids (the reply keeps its generated ids); it just has no prompt cache.
    assert chat(cold_server, turn1).choices[0].message.content == reply
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]

    warm = chat(server, turn2, logprobs=True, top_logprobs=5)
    cold = chat(cold_server, turn2, logprobs=True, top_logprobs=5)

    cached = warm.usage.prompt_tokens_details.cached_tokens
    # The first prompt and the reply's generated tokens all come from the cache.
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # Logits, not just tokens: fp32 prefix reuse vs one full prefill differ only by
    # reduction order, so every reported logprob agrees to 1e-3.
    for w, c in zip(top_logprobs(warm), top_logprobs(cold), strict=True):
        assert w.keys() == c.keys()
        for token, lp in w.items():
            assert lp == pytest.approx(c[token], abs=1e-3)
    chosen_w = [c.logprob for c in warm.choices[0].logprobs.content]
    chosen_c = [c.logprob for c in cold.choices[0].logprobs.content]
    assert chosen_w == pytest.approx(chosen_c, abs=1e-3)


def test_streaming_reports_usage_with_cached_tokens(server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Stream please."}]
    chat(server, messages)  # warm the cache
    stream = client(server).chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = chat(server, messages, max_tokens=6)
    assert text == plain.choices[0].message.content


def test_completions_with_text_and_token_ids(server):
    c = client(server)
    by_text = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert by_text.choices[0].finish_reason in ("length", "stop")
    assert by_text.usage.completion_tokens <= 5
    ids = server.runtime.encode("The quick brown fox")
    by_ids = c.completions.create(model="tiny", prompt=list(ids), max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    with_lp = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=3, temperature=0,
                                   logprobs=2)
    assert len(with_lp.choices[0].logprobs.token_logprobs) == 3
    assert all(len(t) == 2 for t in with_lp.choices[0].logprobs.top_logprobs)


def test_stop_string_cuts_the_text(server):
    base = chat(server, [{"role": "user", "content": "count"}], max_tokens=12)
    text = base.choices[0].message.content
    if len(text) < 3:
        pytest.skip("the random model produced too little text to cut")
    stop = text[2:4]
    cut = chat(server, [{"role": "user", "content": "count"}], max_tokens=12, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server):
    kw = {"temperature": 1.0, "top_p": 0.9, "extra_body": {"top_k": 50}, "seed": 1234, "max_tokens": 12}
    messages = [{"role": "user", "content": "Say something random."}]
    a = chat(server, messages, **kw)
    b = chat(server, messages, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_concurrent_streams_decode_together_and_match_solo(server):
    prompts = [f"Conversation number {i}: tell me a story." for i in range(6)]
    solo = [chat(server, [{"role": "user", "content": p}], max_tokens=16).choices[0].message.content
            for p in prompts]

    def stream(p: str) -> str:
        s = client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], temperature=0, max_tokens=16, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)

    steps_before = server.call(server.runtime.stats).engine.steps
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(stream, prompts))
    steps = server.call(server.runtime.stats).engine.steps - steps_before
    assert together == solo
    # Six 16-token generations one after another need at least 96 decode steps;
    # batched together they need far fewer.
    assert steps < 6 * 16


def test_models_health_and_stats(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    base = server.base_url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    stats = httpx.get(f"{base}/stats").json()
    assert stats["cache"]["ram"]["max_bytes"] > 0
    assert {"queued", "running", "completed", "rejected"} <= stats["scheduler"].keys()


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", b"\xff\xfe\x00", 400, "UTF-8"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400,
         "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 10000000}',
         400, "limit"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400,
         "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}', 404,
         "does not exist"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', 400, "'n' must be"),
        ("/v1/completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": [999999999]}', 400, "token ids"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4096}', 400, "context"),
        ("/v1/nothing", b"{}", 404, "unknown route"),
    ],
)
def test_bad_input_gets_openai_style_errors(server, path, body, status, fragment):
    base = server.base_url.removesuffix("/v1")
    r = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment.lower() in err["message"].lower()
    assert {"message", "type", "param", "code"} <= err.keys()
    assert httpx.get(f"{base}/health").json()["status"] == "ok"  # unaffected


def test_oversized_body_and_wrong_method(server):
    base = server.base_url.removesuffix("/v1")
    r = httpx.post(f"{base}/v1/completions", content=b"x" * (17 * 1024 * 1024))
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]["message"]
    r = httpx.delete(f"{base}/v1/models")
    assert r.status_code == 405


def test_full_queue_gets_503_with_retry_after(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_batch=1, max_queue=1)) as s:
        base = s.base_url.removesuffix("/v1")
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "temperature": 0,
                "stream": True, "logit_bias": NO_EOS}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{base}/v1/chat/completions", json=body) as running:
                lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
                next(lines)  # it holds the only batch slot now
                queued = concurrent.futures.ThreadPoolExecutor(1).submit(
                    httpx.post, f"{base}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2},
                    timeout=120)
                deadline = time.monotonic() + 60
                while s.call(s.runtime.stats).scheduler.queued < 1:
                    assert time.monotonic() < deadline, s.call(s.runtime.stats)
                    time.sleep(0.05)
                refused = http.post(f"{base}/v1/chat/completions", json={**body, "stream": False})
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "server_overloaded"
            # Closing the running stream frees the slot; the queued request completes.
            assert queued.result(timeout=120).status_code == 200
        assert s.call(s.runtime.stats).scheduler.rejected == 1


def test_client_disconnect_cancels_generation_and_frees_slot(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_batch=1)) as s:
        c = client(s)
        stream = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "long"}], max_tokens=3000, temperature=0,
            stream=True, logit_bias=NO_EOS)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        deadline = time.monotonic() + 60
        while True:
            sched = s.call(s.runtime.stats).scheduler
            if sched.cancelled == 1 and sched.running == 0:
                break
            assert time.monotonic() < deadline, sched
            time.sleep(0.05)
        assert sched.generated_tokens < 3000
        # The only slot is free again.
        done = chat(s, [{"role": "user", "content": "next"}], max_tokens=2)
        assert done.choices[0].finish_reason in ("length", "stop")


def test_a_client_gone_during_prefill_cancels_it_before_its_first_token(tiny_model_dir):
    """A non-streamed request sends nothing while its prompt is prefilled, so no failed send tells the
    server its client left: closing the connection mid-prefill still cancels the row there."""
    # 8-token prefill steps: a ~3,000-token prompt takes hundreds of steps, so it is still prefilling.
    with ServerThread(config_for(tiny_model_dir, max_batch=1, prefill_step_size=8)) as s:
        url = urlsplit(s.base_url)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 1500}],
                           "max_tokens": 4, "temperature": 0}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 60
            while s.call(s.runtime.stats).engine.steps == 0:  # the row is in the engine, prefilling
                assert time.monotonic() < deadline, s.call(s.runtime.stats)
                time.sleep(0.01)
        deadline = time.monotonic() + 60
        while True:
            sched = s.call(s.runtime.stats).scheduler
            if sched.running == 0:
                break
            assert time.monotonic() < deadline, sched
            time.sleep(0.05)
        assert (sched.cancelled, sched.completed, sched.generated_tokens) == (1, 0, 0)


def test_a_tokenized_prompt_past_the_context_is_a_400_with_openai_s_code(server):
    """Token ids pass the characters' early bound (none to count); the runtime's check after tokenizing
    refuses with the code OpenAI clients look for (`context_length_exceeded`), and the server goes on."""
    base = server.base_url.removesuffix("/v1")
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5] * 4090, "max_tokens": 10})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", err
    assert "4090 tokens" in err["message"] and "4096" in err["message"], err
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
