"""`--ssd-shared` with `--ssd-layout blocks`: two real `mlxd serve` processes on one block directory."""

from __future__ import annotations

import signal
import time

import pytest

from mlxd.kv import block_store as bs

from procs import ServeProcess

SYSTEM = "You are the fleet's agent. Tools: search, read, write, run. Rules: be brief, never guess. " * 8


def chat(http, messages):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "logit_bias": {"0": -100, "2": -100}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(response) -> list[float]:
    return [c["logprob"] for c in response["choices"][0]["logprobs"]["content"]]


def flush(http) -> None:
    r = http.post("/admin/cache/flush")
    assert r.status_code == 200 and r.json()["durable"] is True, r.text


def consistent(cache) -> set:
    """Every manifest on disk names only blocks on disk; returns the block names."""
    blocks = {p.stem for p in cache.rglob("*" + bs.BLOCK_EXT)}
    for path in cache.rglob("*" + bs.MANIFEST_EXT):
        assert {b.name for b in bs.read_manifest(path).blocks} <= blocks, f"{path} names a missing block"
    return blocks


def test_replicas_share_one_block_directory(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    common = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
              "--ssd-layout", "blocks", "--ssd-block-tokens", "32", "--ssd-shared", "--ssd-rescan", "0.2")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What did we decide?"}]
    with ServeProcess(*common, log_path=tmp_path / "a.log") as a, ServeProcess(*common, log_path=tmp_path / "b.log") as b:
        with a.client() as http:
            r1 = chat(http, first)
            turn2 = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "And after that?"}]
            warm = chat(http, turn2)
            flush(http)
        a.signal(signal.SIGTERM)
        assert a.wait() == 0
        manifests = set(cache.rglob("*" + bs.MANIFEST_EXT))
        blocks = consistent(cache)
        assert manifests and blocks
        with b.client() as http:
            deadline = time.monotonic() + 60
            while (shared := http.get("/stats").json()["ssd_cache"]["shared"])["discovered"] < len(manifests):
                assert time.monotonic() < deadline, shared
                time.sleep(0.1)
            # B never saw the conversation: it restores A's manifest from A's blocks, exactly.
            again = chat(http, turn2)
            usage = again["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            assert logprobs(again) == pytest.approx(logprobs(warm), abs=1e-4)
            # A new conversation over the same system prompt reuses A's blocks of it.
            before = http.get("/stats").json()["ssd_cache"]
            chat(http, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something else."}])
            flush(http)
            after = http.get("/stats").json()["ssd_cache"]
            assert after["restores"] == 1 and after["shared"]["vanished"] == 0
            written = after["writer"]["bytes_written"] - before["writer"]["bytes_written"]
            stored = after["checkpoint_bytes"] - before["checkpoint_bytes"]
            assert 0 < written < 0.5 * stored  # only its own tokens' blocks are new
    # Neither replica deleted what the other's manifests name (all too fresh for the collector).
    assert manifests <= set(cache.rglob("*" + bs.MANIFEST_EXT))
    assert blocks <= consistent(cache)
