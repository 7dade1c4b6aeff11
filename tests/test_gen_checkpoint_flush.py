"""Durability tells the truth: a flush is not durable while generation-checkpoint writes fail.

Every checkpoint write fails for real (`<ssd>/generations` is a file, so the
checkpoint directory cannot be created: ENOTDIR/EEXIST from the OS), while the
prompt cache's own files are written fine. A flush taken while a generation
runs, or right after a client dropped a generation whose checkpoints never
reached the disk, answers `durable: false` with the reason; once the failure
no longer matters (the generation completed, or the abandoned one was
reported) flushes are durable again, and over HTTP the same report is a 503.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.runtime.kernel.messages import TokenGenerated

from serving import ServerThread, config_for

NO_EOS = ((0, -100.0), (2, -100.0))


def _blocked_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "ssd"
    cache.mkdir()
    (cache / "generations").write_bytes(b"not a directory: every checkpoint write fails")
    return cache


async def _wait_for(predicate) -> None:
    with trio.fail_after(60):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_flush_during_failing_checkpoint_writes_is_not_durable(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=_blocked_cache(tmp_path), generation_checkpoint=8)
    sampling = SamplingParams(max_tokens=600, logit_bias=NO_EOS)
    async with open_runtime(config) as rt:
        ckpt = rt.cold.checkpointer
        prompt = rt.encode("A generation whose checkpoints cannot reach the disk. " * 2)
        reports: list[dict] = []

        async def generate() -> None:
            async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                await stream.tokens()

        async def flush_while_running() -> None:
            await _wait_for(lambda: ckpt.stats["write_failures"] >= 2)
            reports.append(await rt.flush())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            nursery.start_soon(flush_while_running)
        (during,) = reports
        assert ckpt.stats["written"] == 0 and not list(tmp_path.rglob("*.mlxgen"))
        assert during["durable"] is False, during
        assert "generation checkpoint" in during["reason"] and during["generation_checkpoints_unwritten"] == 1
        assert "File exists" in during["reason"], "the OS's words"

        # Completed: its checkpoints were never needed, and the prompt cache's files are fine.
        await _wait_for(lambda: not ckpt.snapshot_stats()["owned"])
        after = await rt.flush()
        assert after["durable"] is True and after["generation_checkpoints_unwritten"] == 0, after

        # A dropped client: its checkpoint (what a retry would resume) is not on disk.
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated) and ckpt.snapshot_stats()["unwritten"]:
                    break
        await _wait_for(lambda: not ckpt.snapshot_stats()["owned"] and not ckpt.snapshot_stats()["pending"])
        dropped = await rt.flush()
        assert dropped["durable"] is False and "generation checkpoint" in dropped["reason"], dropped
        # Reported once: the snapshot is gone from RAM, nothing can write it any more.
        again = await rt.flush()
        assert again["durable"] is True, again


def test_the_http_flush_answers_503_with_the_reason(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, ssd_cache_dir=_blocked_cache(tmp_path), generation_checkpoint=8)
    body = {"model": "tiny", "prompt": "Checkpoints that fail, and a flush that says so. " * 2,
            "max_tokens": 2000, "logit_bias": {"0": -100, "2": -100}, "stream": True}
    with ServerThread(config) as server:
        root = server.base_url.removesuffix("/v1")
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{server.base_url}/completions", json=body) as r:
            for _ in r.iter_lines():
                if http.get(f"{root}/stats").json()["generation_checkpoints"]["write_failures"] >= 2:
                    flushed = http.post(f"{root}/admin/cache/flush")
                    break
        assert flushed.status_code == 503, flushed.text
        assert flushed.json()["durable"] is False and "generation checkpoint" in flushed.json()["reason"]
