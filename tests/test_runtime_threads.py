"""Threads are owned by the runtime's nursery: none of mlxd's is left once `open_runtime` returns."""

from __future__ import annotations

import threading

from mlxd import SamplingParams, open_runtime

from serving import config_for


def mlxd_threads() -> set[str]:
    # The block store's reader pool is process-wide (shared by every store), not a runtime's.
    return {t.name for t in threading.enumerate() if t.name.startswith("mlxd-") and "block-read" not in t.name}


async def test_no_thread_outlives_the_runtime(tiny_model_dir, tmp_path):
    before = mlxd_threads()
    config = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=4)
    async with open_runtime(config) as rt:
        prompt = await rt.render_chat([{"role": "user", "content": "hello there"}])
        async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=6))) as stream:
            assert len(await stream.tokens()) == 6
        await rt.flush()
        running = mlxd_threads() - before
        assert {"mlxd-engine", "mlxd-ssd-writer-0", "mlxd-gen-ckpt"} <= running, running
    assert mlxd_threads() - before == set()
