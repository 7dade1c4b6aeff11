"""The SSD cold tier across real process restarts and signals."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from procs import ServeProcess

SYSTEM = "You are a meticulous assistant. Always answer in full sentences. " * 10
NO_EOS = {"0": -100, "2": -100}


def chat(http, messages, **kw):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "logprobs": True,
            "top_logprobs": 3, **kw}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(response) -> list[float]:
    return [c["logprob"] for c in response["choices"][0]["logprobs"]["content"]]


def wait_until_running(http, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while http.get("/stats").json()["scheduler"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def serve(tmp_path, model_dir, cache_dir, name: str, *extra: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache_dir),
                        *extra, log_path=tmp_path / f"{name}.log")


def test_flush_sigterm_restart_restores_the_conversation(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a cache?"}]
    with serve(tmp_path, tiny_model_dir, cache, "first") as first:
        with first.client() as http:
            r1 = chat(http, turn1)
            turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "Tell me more."}]
            warm = chat(http, turn2)  # served from the RAM tier
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            flush = http.post("/admin/cache/flush")
            assert flush.status_code == 200, flush.text
            report = flush.json()
            assert report["durable"] is True and report["pending"] == 0 and report["failed"] == 0
            assert report["longest_durable_prefix_tokens"] >= warm["usage"]["prompt_tokens"]
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    assert "serve.flushed" in first.log()

    with serve(tmp_path, tiny_model_dir, cache, "second") as second, second.client() as http:
        # The next process has no RAM state: the same request restores from SSD...
        again = chat(http, turn2)
        usage = again["usage"]
        assert usage["prompt_tokens"] == warm["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
        # ...and continues exactly as the RAM tier did: same tokens, same logprobs.
        assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]
        assert logprobs(again) == pytest.approx(logprobs(warm), abs=1e-4)
        stats = http.get("/stats").json()["ssd_cache"]
        assert stats["restores"] == 1
        assert stats["entries"] >= 1
        # A new turn after the restart reuses the restored conversation too.
        turn3 = turn2 + [{"role": "assistant", "content": again["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Thanks."}]
        r3 = chat(http, turn3)
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
        second.signal(signal.SIGINT)
        assert second.wait() == 0
    # The restarted server read its newest files into the page cache in the background, and said so.
    warmed = [json.loads(line) for line in second.log().splitlines() if '"ssd.page_cache_warmed"' in line]
    assert len(warmed) == 1
    assert warmed[0]["bytes"] > 0 and warmed[0]["files"] + warmed[0]["skipped_resident"] >= 1


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    with serve(tmp_path, tiny_model_dir, cache, "drain") as proc:
        result: dict = {}

        def long_request() -> None:
            with proc.client() as http:
                result["r"] = chat(http, [{"role": "user", "content": "go on"}], max_tokens=600,
                                   logit_bias=NO_EOS, logprobs=False, top_logprobs=None)

        worker = threading.Thread(target=long_request)
        worker.start()
        with proc.client() as http:
            wait_until_running(http)
            proc.signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while http.get("/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = http.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["type"] == "server_shutting_down"
        worker.join(timeout=120)
        # The admitted request ran to its full length despite the signal.
        assert result["r"]["choices"][0]["finish_reason"] == "length"
        assert result["r"]["usage"]["completion_tokens"] == 600
        assert proc.wait(timeout=180) == 0
    log = proc.log()
    assert '"durable": true' in log.replace("'", '"') or "durable=True" in log or '"durable":true' in log


def test_second_signal_exits_at_once(tmp_path, tiny_model_dir):
    with serve(tmp_path, tiny_model_dir, tmp_path / "ssd", "twice") as proc:
        result: dict = {}

        def long_request() -> None:
            with proc.client() as http:
                try:
                    result["r"] = http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "x"}], "max_tokens": 8000,
                        "logit_bias": NO_EOS, "temperature": 0})
                except Exception as exc:  # the connection is cut
                    result["error"] = exc

        worker = threading.Thread(target=long_request)
        worker.start()
        with proc.client() as http:
            wait_until_running(http)
        proc.signal(signal.SIGTERM)
        # The first one taken (two that arrive before trio reads its signal receiver count as one).
        proc.wait_for_log('"serve.shutdown"')
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert time.monotonic() - started < 10
        assert code == 0
        worker.join(timeout=30)


def test_multi_turn_chat_with_branches_realigns_after_restart(tmp_path, tiny_model_dir):
    """Replies re-tokenize differently; after a restart the server finds their original ids on SSD."""
    cache = tmp_path / "ssd"
    conv = [{"role": "system", "content": SYSTEM}]
    with serve(tmp_path, tiny_model_dir, cache, "first") as first, first.client() as http:
        for i in range(3):
            conv.append({"role": "user", "content": f"Question number {i}?"})
            r = chat(http, conv, max_tokens=12, logprobs=False, top_logprobs=None)
            conv.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            if i == 1:  # a side branch off the same history
                chat(http, conv[:-2] + [{"role": "user", "content": "Something else entirely."}],
                     logprobs=False, top_logprobs=None)
        last = r["usage"]
        assert http.post("/admin/cache/flush").status_code == 200
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    with serve(tmp_path, tiny_model_dir, cache, "second") as second, second.client() as http:
        conv.append({"role": "user", "content": "And finally?"})
        r = chat(http, conv, logprobs=False, top_logprobs=None)
        # Everything up to the new question comes from the restored checkpoint.
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= last["prompt_tokens"] + last[
            "completion_tokens"] - 1
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
