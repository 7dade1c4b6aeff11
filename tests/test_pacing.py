"""Write-behind pacing (kv/pacing.py): the governor's rules, real paced writes, and a live flush."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import mlx.core as mx
import pytest
import trio
from mlx_lm.models import cache as mlc

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.kv import file_format, kinds
from mlxd.kv.pacing import Pacer, WriteGovernor, WriteInterrupted

MB = 1 << 20


def test_governor_paces_only_a_busy_engine_without_urgency():
    g = WriteGovernor(busy_rate_bytes_per_s=8 * MB)
    assert g.rate() is None  # idle engine: full speed
    g.set_busy(True)
    assert g.rate() == 8 * MB
    g.set_urgent("flush", True)
    g.set_urgent("ram", True)
    assert g.rate() is None and g.urgent == {"flush", "ram"}
    g.set_urgent("flush", False)
    assert g.rate() is None  # "ram" still urgent
    g.set_urgent("ram", False)
    assert g.rate() == 8 * MB
    assert WriteGovernor(busy_rate_bytes_per_s=0).rate() is None  # 0 = never pace


def _plan(tokens: int = 256) -> file_format.SnapshotPlan:
    caches = []
    for _ in range(2):
        c = mlc.KVCache()
        c.update_and_fetch(mx.random.normal((1, 4, tokens, 64)), mx.random.normal((1, 4, tokens, 64)))
        caches.append(c)
    meta = file_format.SnapshotMeta(model_id="m", config_fingerprint="f", namespace="", tokenizer_hash="t",
                                    tokens=tuple(range(tokens)))
    return kinds.plan_snapshot(caches, meta=meta)


def test_paced_write_holds_the_rate_and_reads_back_equal(tmp_path):
    plan = _plan()  # 4 tensors x 256 KiB = 1 MiB
    governor = WriteGovernor(busy_rate_bytes_per_s=4 * MB)
    governor.set_busy(True)
    pacer = Pacer(governor, slice_bytes=64 * 1024)
    t0 = time.monotonic()
    written = file_format.write_snapshot(plan, tmp_path / "a.mlxkv", pacer=pacer)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.2  # 1 MiB at 4 MiB/s: ~0.25 s (the first slice is free)
    assert pacer.paced_s > 0.1
    unpaced = file_format.write_snapshot(plan, tmp_path / "b.mlxkv")
    assert written.header.caches == unpaced.header.caches  # same tensor hashes: same bytes
    loaded = file_format.read_snapshot(written.path, verify=True)
    assert loaded.header.tokens == plan.meta.tokens


def test_urgency_ends_the_pacing_of_a_write_in_progress(tmp_path):
    plan = _plan()
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)  # 1 MiB would take 1,000 s
    governor.set_busy(True)
    pacer = Pacer(governor, slice_bytes=64 * 1024)
    writing = threading.Thread(target=file_format.write_snapshot, args=(plan, tmp_path / "a.mlxkv"),
                               kwargs={"pacer": pacer}, daemon=True)
    writing.start()
    while governor.bytes_out == 0 and writing.is_alive():  # the first slice is out: the write is paced now
        time.sleep(0.01)
    governor.set_urgent("flush", True)
    writing.join(timeout=60)  # generous for a loaded host, and far below the paced 1,000 s
    assert not writing.is_alive(), "the flush's urgency did not end the pacing"
    assert pacer.paced_s > 0 and (tmp_path / "a.mlxkv").exists()


def test_a_flush_reaches_a_paced_writer_whose_wake_was_swallowed():
    """Writers share the governor's `changed` event and each clears it before it waits, so a flush's set that
    lands just before a clear is lost to every waiter (another writer's clear, or this one's between two
    waits). The paced writer still stops pacing: it looks at the rate after each clear, instead of sleeping
    out its schedule (1,000 s here) for want of a wake."""
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)
    governor.set_busy(True)

    class Swallowing(threading.Event):
        clears = 0

        def clear(self) -> None:
            Swallowing.clears += 1
            if Swallowing.clears == 2:  # the flush comes just before the writer's second clear
                governor.set_urgent("flush", True)
            super().clear()

    governor.changed = Swallowing()
    pacer = Pacer(governor, slice_bytes=4096)
    waiting = threading.Thread(target=pacer.done, args=(1024 * 1000,), daemon=True)
    waiting.start()
    waiting.join(timeout=30)
    assert Swallowing.clears >= 2 and governor.urgent == {"flush"}
    assert not waiting.is_alive(), "the paced writer missed the flush"


def test_an_interrupted_write_leaves_no_file(tmp_path):
    plan = _plan()
    governor = WriteGovernor(busy_rate_bytes_per_s=1024)  # 1,000 s: no stalled host lets it finish before the stop
    governor.set_busy(True)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(WriteInterrupted):
        file_format.write_snapshot(plan, tmp_path / "a.mlxkv", pacer=Pacer(governor, slice_bytes=64 * 1024,
                                                                           stop=stop.is_set))
    assert list(tmp_path.iterdir()) == []


async def test_flush_is_urgent_while_the_engine_decodes(tiny_model_dir, tmp_path):
    """A crawl-paced writer (1 KiB/s while decoding) holds its write back; a flush still completes promptly."""
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", snapshot_min_tokens=16,
                           ssd_write_rate_bytes=1024, max_batch=4)
    async with open_runtime(config) as rt, trio.open_nursery() as nursery:
        governor = rt.cold.governor
        long_prompt = await rt.render_chat([{"role": "user", "content": "Count slowly."}])
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        decoding = rt.submit(rt.request(long_prompt, sampling=SamplingParams(max_tokens=8000, logit_bias=no_eos)))

        first_token = trio.Event()

        async def drain() -> None:
            async with decoding:
                async for _ in decoding:
                    first_token.set()

        nursery.start_soon(drain)
        await first_token.wait()
        assert governor.busy
        # A checkpoint published while the engine decodes: its write is paced.
        prompt = await rt.render_chat([{"role": "user", "content": "Tell me about prefix caches. " * 20}])
        async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=2))) as stream:
            await stream.tokens()
        with trio.fail_after(60):  # the first slice went out (its writer thread may start late when loaded)...
            while (stats := await rt.ssd_stats()).pacing["bytes_out"] == 0:  # noqa: ASYNC110 - polling an actor from a test
                await trio.sleep(0.05)
        await trio.sleep(1.0)  # ...and the write has been paced since, a while (writer.paced_s below)
        stats = await rt.ssd_stats()
        assert stats.pending_spills >= 1, "the paced write is still in flight"
        pacing = stats.pacing
        skip = ("bytes_out", "holds", "holds_expired", "held_s", "engine_steps", "prefill_bytes_out")
        assert {k: v for k, v in pacing.items() if k not in skip} == {
            "busy_rate_bytes_per_s": 1024, "engine_busy": True, "urgent": [], "urgent_s": {}, "pacing_now": True,
            "prefilling": False, "held_now": False, "hold_while_decoding": False}
        assert pacing["engine_steps"] > 0  # the engine ticks the governor every step
        with trio.fail_after(60):
            report = await rt.flush()
        assert report["durable"] and report["entries"] >= 1, report
        assert governor.busy, "the decode was still running during the flush"
        assert governor.urgent == frozenset()  # urgency ends with the flush
        assert (await rt.ssd_stats()).pacing["urgent_s"]["flush"] > 0  # and was counted while it lasted
        assert (await rt.ssd_stats()).writer.paced_s > 0.5
        nursery.cancel_scope.cancel()


def test_the_governor_counts_urgent_seconds_and_bytes_written_beside_prefills():
    """`/stats` tells what write-behind did beside a decode's start: seconds each urgency reason was on (urgency
    lifts the hold for prefills) and the bytes handed to the OS while a request waited for its first token."""
    governor = WriteGovernor(busy_rate_bytes_per_s=1 << 20)
    governor.set_busy(True)
    governor.count(bytes_out=100)
    governor.set_prefilling(True)
    assert governor.held()
    governor.set_urgent("backlog", True)
    assert not governor.held()  # a backlog past its bound is not held for a prefill
    governor.count(bytes_out=7)
    time.sleep(0.05)
    on = governor.urgent_s()["backlog"]
    assert on >= 0.05
    governor.set_urgent("backlog", False)
    governor.set_prefilling(False)
    governor.count(bytes_out=11)
    done = governor.urgent_s()
    time.sleep(0.02)
    assert governor.urgent_s() == done and done["backlog"] >= on  # off: it no longer counts
    assert (governor.bytes_out, governor.prefill_bytes_out) == (118, 7)
    assert governor.as_dict()["urgent_s"] == done and governor.as_dict()["prefill_bytes_out"] == 7


def _hammer(threads: int, calls: int, call: Callable[[], object]) -> None:
    """`threads` threads each making `call()` `calls` times, all at once; every one ends."""

    def run() -> None:
        for _ in range(calls):
            call()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers)


def test_one_pacer_shared_by_several_block_writing_threads_keeps_exact_totals():
    """The block store's writing threads share one write's pacer (and every writer the governor): its sums
    are read-modify-writes, and a thread switch inside one lost the other threads' additions. Each thread's
    clock here ticks 2**-20 s per call and yields at every call, so every paced wait adds exactly one tick
    (its start and end are that thread's two consecutive readings) and switches land mid-update."""
    tick = 2.0**-20
    local = threading.local()

    def clock() -> float:
        local.k = getattr(local, "k", 0) + 1
        time.sleep(0)  # another thread runs now
        return local.k * tick

    governor = WriteGovernor(busy_rate_bytes_per_s=1 / tick)  # a byte: one tick of schedule
    governor.set_busy(True)
    stops = []  # check() runs once per done() (its hold) and once per paced wait

    def stop() -> bool:
        stops.append(None)  # list.append is atomic
        return False

    pacer = Pacer(governor, slice_bytes=4096, stop=stop, clock=clock)
    threads, calls = 4, 400
    _hammer(threads, calls, lambda: pacer.done(1))
    waits = len(stops) - threads * calls
    assert waits > 0
    assert governor.bytes_out == threads * calls
    assert pacer.paced_s == waits * tick  # exact: sums of whole ticks


def test_holds_of_several_threads_keep_exact_totals():
    """The hold's sums too (the pacer's and the governor's): each hold here expires at once and lasts exactly
    two ticks of its thread's clock."""
    tick = 2.0**-20
    local = threading.local()

    def clock() -> float:
        local.k = getattr(local, "k", 0) + 1
        time.sleep(0)
        return local.k * tick

    governor = WriteGovernor(busy_rate_bytes_per_s=MB, max_hold_s=0.0)
    governor.set_prefilling(True)
    pacer = Pacer(governor, clock=clock)
    threads, calls = 4, 400
    _hammer(threads, calls, pacer.hold)
    n = threads * calls
    assert governor.holds == n and governor.holds_expired == n
    assert pacer.held_s == governor.held_s == 2 * n * tick
