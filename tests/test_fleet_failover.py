"""Two replicas on one shared SSD directory behind SMG: stop one, its conversations restore on the other."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack

from mlxd.kv import block_store as bs

from gateway import Gateway
from procs import ServeProcess

SYSTEM = "NOTEBOOK. You keep careful notes of everything the user tells you, and recall them exactly. " * 6


def chat(http, messages):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6,
            "logit_bias": {"0": -100, "2": -100}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_stopping_a_replica_moves_its_conversations_with_their_cache(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    common = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
              "--ssd-shared", "--ssd-rescan", "0.2")
    with ExitStack() as stack:
        replicas = [stack.enter_context(ServeProcess(*common, log_path=tmp_path / f"replica{i}.log"))
                    for i in range(2)]
        by_url = {r.url: r for r in replicas}
        gw = stack.enter_context(Gateway(
            list(by_url), policy="cache_aware", log_path=tmp_path / "smg.log",
            extra=("--health-check-interval-secs", "1", "--health-failure-threshold", "1"),
        ))
        with gw.client() as http:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Remember: blue."}]
            r = chat(http, messages)
            home = r.headers["x-smg-routed-worker-id"]
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "What did I say?"}]
            r = chat(http, messages)
            assert r.headers["x-smg-routed-worker-id"] == home
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            # The conversation's replica stops: drain, flush to the shared directory, exit.
            stopped = by_url[home]
            stopped.signal(signal.SIGTERM)
            assert stopped.wait() == 0 and "serve.flushed" in stopped.log()
            [other] = [r for url, r in by_url.items() if url != home]
            # Every checkpoint the stopped replica left (the first turn's by write-behind, the second's by the
            # flush) indexed by the survivor: waiting for the first one alone raced the rescan for the second.
            left = max(1, len(list(cache.rglob("*" + bs.MANIFEST_EXT))))
            with other.client() as direct:
                deadline = time.monotonic() + 60
                while direct.get("/stats").json()["ssd_cache"]["shared"]["discovered"] < left:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            # The next turn goes through the gateway to the survivor, which restores it from SSD.
            deadline = time.monotonic() + 60
            while True:
                body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6,
                        "logit_bias": {"0": -100, "2": -100}}
                r = http.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    break
                assert time.monotonic() < deadline, r.text  # the gateway has not noticed yet
                time.sleep(0.5)
            assert r.headers["x-smg-routed-worker-id"] == other.url
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            with other.client() as direct:
                assert direct.get("/stats").json()["ssd_cache"]["restores"] == 1
