"""SIGTERM with requests that outlast --shutdown-timeout: the flush keeps its share and the checkpoints land."""

from __future__ import annotations

import json
import threading
import time

import httpx

from procs import ServeProcess
from ssd_files import checkpoint_files


def test_a_drain_that_never_ends_leaves_the_flush_its_reserved_share(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    with ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                      "--shutdown-timeout", "4", log_path=tmp_path / "serve.log") as proc:
        with proc.client() as http:
            # A finished conversation whose checkpoint must be durable after the exit.
            done = http.post("/v1/completions", json={"model": "tiny", "prompt": "Remember this. " * 8,
                                                      "max_tokens": 4})
            assert done.status_code == 200

        def endless() -> None:  # end tokens banned: it outlasts the whole shutdown budget
            body = {"model": "tiny", "prompt": "Talk forever. " * 4, "max_tokens": 8000, "stream": True,
                    "logit_bias": {"0": -100, "2": -100}}
            try:
                with httpx.Client(base_url=proc.url, timeout=60) as h, h.stream("POST", "/v1/completions",
                                                                                 json=body) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        worker = threading.Thread(target=endless)
        worker.start()
        with proc.client() as http:  # the endless request runs (a fixed sleep could signal before it did)
            deadline = time.monotonic() + 60
            while http.get("/stats").json()["scheduler"]["running"] == 0:
                assert time.monotonic() < deadline, "the endless request never started"
                time.sleep(0.02)
        t0 = time.monotonic()
        proc.signal()
        assert proc.wait(timeout=60) == 0
        took = time.monotonic() - t0
        worker.join(timeout=60)
    events = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    drained = next(e for e in events if e.get("event") == "serve.drained")
    flushed = next(e for e in events if e.get("event") == "serve.flushed")
    assert drained["complete"] is False and drained["seconds"] < 3.5  # stopped at 3 s: 1 s kept for the flush
    assert flushed["durable"] is True and flushed["entries"] >= 1
    assert not any(e.get("event") == "serve.flush_incomplete" for e in events)
    assert took < 15
    assert checkpoint_files(cache), "the finished conversation's checkpoint is on disk"
