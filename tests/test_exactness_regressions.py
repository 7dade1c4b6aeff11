"""Defects the exactness harness (tests/exactness.py, benchmarks/exactness.py) found, one test each."""

from __future__ import annotations

import gc
from pathlib import Path

import trio

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.kv.shared_dir import DirWatch

SYSTEM = "You answer briefly and keep every cached prefix. " * 6
GREEDY = SamplingParams(max_tokens=6, logprobs=True, logit_bias=((0, -100.0), (2, -100.0)))


def _config(model_dir: Path, ssd: Path, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model_dir), model_name="tiny", snapshot_min_tokens=16, device_probe="off",
                         ssd_cache_dir=ssd, **kw)


async def _serve(rt, prompt) -> tuple[list[tuple[int, float]], str]:
    async with rt.submit(rt.request(prompt, sampling=GREEDY)) as stream:
        got = [(e.token, e.logprob) async for e in stream if hasattr(e, "logprob")]
    return got, stream.accepted.cache_tier


def test_a_shared_dir_watch_never_reports_files_it_does_not_list(tmp_path: Path) -> None:
    """The startup scan also indexes block manifests (.mlxmf); the watch listed only .mlxkv files,
    so it took every known manifest for a file another replica deleted."""
    ns = tmp_path / "ns"
    ns.mkdir()
    whole, manifest = ns / "a.mlxkv", ns / "b.mlxmf"
    whole.write_bytes(b"x")
    manifest.write_bytes(b"y")
    watch = DirWatch(tmp_path, read=lambda path: path)
    watch.know([whole, manifest])
    assert watch.poll().gone == frozenset()  # both are still there
    whole.unlink()
    assert watch.poll().gone == {whole}  # a deleted file still counts


async def test_a_sharing_replica_keeps_the_block_manifests_it_restores(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A directory written with --ssd-layout blocks, then served by --ssd-shared replicas (which read both
    layouts): a replica's first rescan dropped every manifest from its index ("vanished"), so what it
    restored from them was reported "its file left SSD during the restore" and its flushes were never
    durable (the harness's replica scenario, gemma3 and mamba2 cells)."""
    ssd = tmp_path / "ssd"
    async def first() -> tuple[tuple[int, ...], list[tuple[int, float]]]:  # its frame lets the runtime go
        async with open_runtime(_config(tiny_model_dir, ssd, ssd_layout="blocks")) as rt:
            prompt = await rt.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
            cold, _ = await _serve(rt, prompt)
            assert (await rt.flush())["durable"]
            return prompt, cold

    prompt, cold = await first()
    gc.collect()  # a closed runtime's directory lock goes with its store (the sharers lock it shared)
    assert list(ssd.rglob("*.mlxmf"))

    shared = _config(tiny_model_dir, ssd, ssd_shared=True, ssd_rescan_s=0.05)
    async with open_runtime(shared) as replica, open_runtime(shared) as other:
        # The other replica publishes a file of its own; once the replica has found it, its watch
        # has listed the namespace directory (the manifests' too) at least once.
        other_prompt = await other.render_chat([{"role": "user", "content": "Another conversation. " * 8}])
        await _serve(other, other_prompt)
        assert (await other.flush())["durable"]
        with trio.fail_after(60):
            while (await replica.ssd_stats()).shared["discovered"] < 1:  # noqa: ASYNC110
                await trio.sleep(0.02)
        assert (await replica.ssd_stats()).shared["vanished"] == 0
        again, tier = await _serve(replica, prompt)
        assert tier == "ssd" and [t for t, _ in again] == [t for t, _ in cold]
        report = await replica.flush()
        assert report["durable"], report


async def test_a_closed_runtime_lets_its_ssd_directory_go(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Leaving `open_runtime` kept the SSD directory locked until the runtime was garbage-collected, so
    a server started next on it in the other mode (here: sharing it) was refused while the embedder
    still held the old `Runtime` (the harness's restart-then-replica step)."""
    ssd = tmp_path / "ssd"
    async with open_runtime(_config(tiny_model_dir, ssd)) as rt:
        prompt = rt.encode("A conversation that outlives its server. " * 4)
        before, _ = await _serve(rt, prompt)
    async with open_runtime(_config(tiny_model_dir, ssd, ssd_shared=True)) as replica:
        again, tier = await _serve(replica, prompt)
    assert tier == "ssd" and [t for t, _ in again] == [t for t, _ in before]
    assert rt.cold is not None  # the old runtime is still referenced
