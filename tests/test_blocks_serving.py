"""Shared-prefix conversations through real `mlxd serve` processes with `--ssd-layout blocks`."""

from __future__ import annotations

import signal

import pytest

from mlxd.kv.block_store import BLOCK_EXT, MANIFEST_EXT

from procs import ServeProcess

SYSTEM = "You are the agent. Tools: search, read, write, run. Rules: be brief, cite files, never guess. " * 8
TOPICS = ["caches", "rivers", "trains"]


def chat(http, messages):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(response) -> list[float]:
    return [c["logprob"] for c in response["choices"][0]["logprobs"]["content"]]


def serve(tmp_path, model_dir, cache_dir, name: str, *extra: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache_dir),
                        *extra, log_path=tmp_path / f"{name}.log")


def flush(http) -> dict:
    r = http.post("/admin/cache/flush")
    assert r.status_code == 200, r.text
    assert r.json()["durable"] is True
    return r.json()


def test_shared_prefix_is_stored_once_and_survives_restarts(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {t}."}]
                     for t in TOPICS]
    warm = {}
    with serve(tmp_path, tiny_model_dir, cache, "first", "--ssd-layout", "blocks", "--ssd-block-tokens", "32") as p:
        with p.client() as http:
            for turn in range(2):
                for i, conv in enumerate(conversations):
                    reply = chat(http, conv)
                    if turn == 1:
                        warm[i] = (list(conv), reply)
                    conv += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "And then?"}]
                    flush(http)
            stats = http.get("/stats").json()["ssd_cache"]
            assert stats["layout"] == "blocks" and stats["block_tokens"] == 32
            # Every conversation's checkpoints name the system prompt's blocks: stored once.
            assert stats["entries"] >= len(TOPICS)
            assert stats["bytes"] < 0.6 * stats["checkpoint_bytes"]
            assert stats["writer"]["bytes_written"] < stats["checkpoint_bytes"]
        p.signal(signal.SIGTERM)
        assert p.wait() == 0
    manifests = list(cache.rglob("*" + MANIFEST_EXT))
    assert len(manifests) == stats["entries"]
    assert list(cache.rglob("*" + BLOCK_EXT)) and not list(cache.rglob("*.mlxkv"))

    # A restart restores each conversation from its blocks and continues as the RAM tier did
    # (read straight into MLX arrays here; the whole-file server below reads into host memory).
    with serve(tmp_path, tiny_model_dir, cache, "second", "--ssd-layout", "blocks", "--ssd-block-tokens", "32",
               "--restore-landing", "mlx") as p:
        with p.client() as http:
            messages, before = warm[0]
            again = chat(http, messages)
            usage = again["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            assert again["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
            assert logprobs(again) == pytest.approx(logprobs(before), abs=1e-4)
            stats = http.get("/stats").json()["ssd_cache"]
            assert stats["restores"] == 1 and stats["prefetch"]["reads_into_mlx"] == 1
        p.signal(signal.SIGTERM)
        assert p.wait() == 0
    assert "ssd_block_scan" in p.log()

    # Back to whole files: the blocks written before still serve.
    with serve(tmp_path, tiny_model_dir, cache, "third", "--ssd-layout", "whole", "--restore-landing", "host") as p, \
            p.client() as http:
        messages, before = warm[1]
        again = chat(http, messages)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
        assert logprobs(again) == pytest.approx(logprobs(before), abs=1e-4)
        stats = http.get("/stats").json()["ssd_cache"]
        assert stats["layout"] == "whole" and stats["restores"] == 1 and stats["prefetch"]["reads_into_mlx"] == 0


def test_a_whole_file_directory_restores_under_the_block_layout(tmp_path, tiny_model_dir):
    """A directory of whole files (the layout before blocks) keeps serving after a restart with blocks: its
    checkpoints are read and new ones are written as blocks (no migration: a whole file goes only when a
    longer checkpoint of its conversation supersedes it, as in either layout)."""
    cache = tmp_path / "ssd"
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about caches."}]
    with serve(tmp_path, tiny_model_dir, cache, "whole", "--ssd-layout", "whole") as p, p.client() as http:
        before = chat(http, conv)
        flush(http)
        assert http.get("/stats").json()["ssd_cache"]["layout"] == "whole"
    old = sorted(cache.rglob("*.mlxkv"))
    assert old and not list(cache.rglob("*" + MANIFEST_EXT))

    with serve(tmp_path, tiny_model_dir, cache, "blocks", "--ssd-layout", "blocks", "--ssd-block-tokens", "32") as p:
        with p.client() as http:
            again = chat(http, conv)
            usage = again["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            assert again["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
            assert logprobs(again) == pytest.approx(logprobs(before), abs=1e-4)
            stats = http.get("/stats").json()["ssd_cache"]
            assert stats["layout"] == "blocks" and stats["restores"] == 1
            conv += [{"role": "assistant", "content": again["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And then?"}]
            chat(http, conv)
            flush(http)
        p.signal(signal.SIGTERM)
        assert p.wait() == 0
    assert "ssd_whole_files_kept" in p.log()
    assert list(cache.rglob("*" + MANIFEST_EXT)) and list(cache.rglob("*" + BLOCK_EXT))
