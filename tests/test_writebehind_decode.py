"""Write-behind beside decode (issue 28): the SSD writer's device-to-host staging in bounded pieces.

On CUDA the writer copies each block it writes to host memory first (`host_memory.to_host`, on the copy
lane's side stream, each piece waited with the GIL released). Here the CUDA runtime is `tests/fake_cuda.py`
(real copies, recorded): a cache sliced to a block is one `cudaMemcpy2DAsync` per tensor (one GIL hand-off,
where it was one call per head), pieces are bounded, while rows decode at most one piece goes per engine
step, the bytes on disk are the unstaged write's, and a flush is never held.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models import cache as mlc
from tests import fake_cuda
from tests.test_file_format import _o_direct_works

from mlxd.actors import ssd_writer
from mlxd.actors.ssd_writer import SsdWriterActor
from mlxd.kv import kinds, pacing
from mlxd.kv.pacing import Pacer, WriteGovernor
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity, resident_pages
from mlxd.kv.write_queue import WriteQueue
from mlxd.runtime import host_memory
from mlxd.runtime.kernel.messages import DurabilityMessage, SnapshotWritten, WriteSnapshot

MB = 1 << 20
IDENTITY = StoreIdentity(model_id="m", fingerprint="f" * 32, tokenizer_hash="t")
lib = fake_cuda.lib  # the fake runtime, as a fixture


def _kv(tokens: int, heads: int = 4, dim: int = 16) -> list[mlc.KVCache]:
    c = mlc.KVCache()
    pos = mx.arange(tokens, dtype=mx.float32)[None, None, :, None]
    k = pos * 1000 + mx.arange(heads, dtype=mx.float32)[None, :, None, None] * 16 + mx.arange(dim, dtype=mx.float32)
    c.update_and_fetch(k, -k)
    return [c]


def _plan(tokens: tuple[int, ...]):
    return kinds.plan_snapshot(_kv(len(tokens)), meta=IDENTITY.meta(tokens, ""))


def test_a_block_of_a_sliced_cache_is_one_2d_copy_per_tensor_with_the_same_bytes(lib):
    whole = np.arange(1 * 4 * 64 * 16, dtype=np.float32).reshape(1, 4, 64, 16)
    spans = [whole[..., 16:48, :], (whole + 0.5)[..., 16:48, :]]  # one block's span of K and V: 4 rows each
    counts = host_memory.Copied()
    _, arrays = host_memory.to_host(spans, counts=counts)
    assert all(np.array_equal(a, s) and a.flags.c_contiguous for a, s in zip(arrays, spans, strict=True))
    copies = [c for c in lib.calls if c.op == "copy"]
    assert counts.calls == len(copies) == 2 and counts.pieces == 1  # was one call per head: 8
    assert host_memory._blocks(spans[0]) == [
        (spans[0].ctypes.data + h * 64 * 16 * 4, 32 * 16 * 4) for h in range(4)]  # the rows it stands for


def test_pieces_are_bounded_split_by_rows_and_yield_between(lib):
    whole = np.arange(2 * 8 * 64 * 16, dtype=np.float32).reshape(2, 8, 64, 16)
    spans = [whole[..., 0:32, :], whole[..., 32:64, :], np.arange(5000, dtype=np.float32)]  # 2 strided, 1 flat
    total = sum(s.nbytes for s in spans)
    limit = 5000  # bytes: rows are 2 KiB, the flat tensor 20 kB
    between = []
    counts = host_memory.Copied()
    _, arrays = host_memory.to_host(spans, between=lambda: between.append(counts.pieces), piece=limit,
                                    counts=counts)
    assert all(np.array_equal(a, s) for a, s in zip(arrays, spans, strict=True))
    assert counts.nbytes == total and counts.largest_piece <= limit
    assert counts.pieces == 8 + 8 + 4  # 2 rows (4 KiB) a piece for each span, the flat one in 5000-byte parts
    assert between == list(range(1, counts.pieces))  # between every two pieces, never after the last
    assert all(c.nbytes <= limit for c in lib.calls if c.op == "copy")
    assert sum(c.nbytes for c in lib.calls if c.op == "copy") == total


def test_while_rows_decode_a_staged_copy_goes_one_piece_per_engine_step(lib, monkeypatch):
    monkeypatch.setattr(pacing, "STEP_WAIT_S", 600.0)  # only a step lets the next piece go
    g = WriteGovernor(busy_rate_bytes_per_s=64 * MB)
    g.set_busy(True)  # rows decode: write-behind is paced
    pacer = Pacer(g)
    src = [np.arange(4096, dtype=np.float32) for _ in range(3)]  # 16 KiB each: 3 pieces of 16 KiB
    counts = host_memory.Copied()
    done = threading.Event()
    result: list[tuple[np.ndarray, ...]] = []

    def stage() -> None:
        pacer.between_pieces()  # as the writer does before its first piece
        result.append(host_memory.to_host(src, between=pacer.between_pieces, piece=16 << 10, counts=counts)[1])
        done.set()

    t = threading.Thread(target=stage)
    t.start()
    try:
        for pieces in (1, 2):
            _until(lambda p=pieces: counts.pieces == p and pacer.step_waits == p)  # parked after a piece
            threading.Event().wait(0.05)
            assert counts.pieces == pieces and not done.is_set()  # no step, no piece
            g.stepped()
        assert done.wait(60)
    finally:
        for _ in range(3):
            g.stepped()
        t.join(timeout=60)
    assert counts.pieces == 3 and all(np.array_equal(a, s) for a, s in zip(result[0], src, strict=True))
    idle = Pacer(g)
    g.set_busy(False)  # an idle engine: pieces go at once, large
    idle.between_pieces()
    idle.between_pieces()
    assert idle.step_waits == 0 and idle.piece_size(64, 8) == 64 and pacer.piece_size(64, 8) == 64
    g.set_busy(True)
    assert pacer.piece_size(64, 8) == 8
    g.set_urgent("flush", True)  # a flush: full speed, no step waits
    assert pacer.piece_size(64, 8) == 64
    before = pacer.step_waits
    pacer.between_pieces()
    pacer.between_pieces()
    assert pacer.step_waits == before


async def test_the_writer_stages_in_pieces_while_decoding_and_writes_the_same_bytes(lib, tmp_path: Path):
    """The real SSD writer, blocks layout, rows decoding (its steps ticked): every block staged in bounded
    2D pieces, the loaded bytes equal the plan's and an unstaged store's."""
    store = SsdStore(tmp_path / "staged", IDENTITY, layout="blocks", block_tokens=16)
    plain = SsdStore(tmp_path / "plain", IDENTITY, layout="blocks", block_tokens=16)
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    g.set_busy(True)
    plan = _plan(tuple(range(70)))
    written = await _write_one(store, g, plan, ticking=True)
    assert isinstance(written.outcome, Stored)
    s = written.stats
    assert s.staged == 5 and s.staged_bytes == plan.nbytes  # 4 full blocks and one of 6 tokens
    assert s.staged_calls == 2 * 5  # one 2D copy per tensor (K, V) per block: the blocks' rows were 4 per tensor
    expect = plain.write(plan)
    assert isinstance(expect, Stored)
    loaded, reference = store.load(written.outcome.record), plain.load(expect.record)
    assert loaded is not None and reference is not None
    assert all(bytes(a) == bytes(b) == bytes(c)
               for a, b, c in zip(loaded.buffers, reference.buffers, plan.buffers, strict=True))


async def test_the_staged_writer_copies_without_the_gil_and_writes_the_same_bytes(lib, tmp_path: Path, monkeypatch):
    """Staged (CUDA), the writer copies every byte it writes into its write buffer with numpy, which releases
    the GIL (a GIL-held copy beside decode made every host-bound step wait, issue 28); unstaged (the CPU), it
    keeps the slice assignment. The files hold the same bytes either way."""
    copied = []
    copyto = np.copyto

    def counting(dst, src, *a, **k):
        copied.append(np.asarray(src).nbytes)
        return copyto(dst, src, *a, **k)

    monkeypatch.setattr(np, "copyto", counting)
    store = SsdStore(tmp_path / "staged", IDENTITY, layout="blocks", block_tokens=16)
    plain = SsdStore(tmp_path / "plain", IDENTITY, layout="blocks", block_tokens=16)
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    g.set_urgent("backlog", True)  # full speed beside decode
    g.set_busy(True)
    plan = _plan(tuple(range(70)))
    written = await _write_one(store, g, plan, ticking=True)
    assert isinstance(written.outcome, Stored)
    assert sum(copied) == plan.nbytes  # every tensor byte, through numpy (host_memory's fake staging copies none)
    copied.clear()
    expect = await trio.to_thread.run_sync(lambda: plain.write(plan, Pacer(g)))  # unstaged: GIL-held copies
    assert isinstance(expect, Stored) and not copied
    loaded, reference = store.load(written.outcome.record), plain.load(expect.record)
    assert loaded is not None and reference is not None
    assert all(bytes(a) == bytes(b) == bytes(c)
               for a, b, c in zip(loaded.buffers, reference.buffers, plan.buffers, strict=True))
    assert sorted(p.read_bytes() for p in (tmp_path / "staged").rglob("*.mlxblk")) == sorted(
        p.read_bytes() for p in (tmp_path / "plain").rglob("*.mlxblk"))


async def test_mlxd_ssd_copy_gil_brings_back_the_gil_held_copy_for_an_h200_arm(lib, tmp_path: Path, monkeypatch):
    """`MLXD_SSD_COPY_GIL=1` (read at import): staged writes copy holding the GIL again, the same bytes."""
    copied = []
    copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, *a, **k: (copied.append(1), copyto(dst, src, *a, **k)))
    monkeypatch.setattr(ssd_writer, "_COPY_HOLDS_GIL", True)
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    plan = _plan(tuple(range(40)))
    written = await _write_one(store, g, plan, ticking=False)
    assert isinstance(written.outcome, Stored) and written.stats.staged == 3 and not copied
    loaded = store.load(written.outcome.record)
    assert loaded is not None and all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))


def test_generation_checkpoints_copy_without_the_gil_on_cuda(monkeypatch):
    """A generation checkpoint is written while its row decodes: on CUDA its copies release the GIL too."""
    from mlxd.actors.gen_checkpointer import pacer_for

    g = WriteGovernor(busy_rate_bytes_per_s=MB)
    assert pacer_for(None) is None
    plain = pacer_for(g)
    assert plain is not None and not plain.release_gil  # the CPU: host and MLX memory are one
    fake_cuda.install(monkeypatch, fake_cuda.FakeCudaLib())
    cuda = pacer_for(g)
    assert cuda is not None and cuda.release_gil and cuda.governor is g


async def test_holding_write_behind_while_decoding_never_holds_a_flush(lib, tmp_path: Path):
    """`--ssd-write-hold-decode`: a checkpoint written behind waits while rows decode; a flush (urgent) is
    never held, and everything it covers is on disk."""
    store = SsdStore(tmp_path, IDENTITY)
    g = WriteGovernor(busy_rate_bytes_per_s=64 * MB, max_hold_s=600, hold_while_decoding=True)
    g.set_busy(True)
    assert g.held() and g.as_dict()["hold_while_decoding"] is True
    plan = _plan(tuple(range(40)))
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, governor=g, staging=True)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await write_send.send(WriteSnapshot(_job(plan)))
            await _wait_for(lambda: g.holds >= 1)
            await trio.sleep(0.05)
            files = await trio.to_thread.run_sync(lambda: list(tmp_path.rglob("*.mlxkv")))
            assert out.statistics().current_buffer_used == 0 and files == []  # held: nothing staged or written
            g.set_urgent("flush", True)  # the SIGTERM flush: full speed
            written = await out.receive()
            nursery.cancel_scope.cancel()
    assert isinstance(written, SnapshotWritten) and isinstance(written.outcome, Stored)
    loaded = store.load(written.outcome.record)
    assert loaded is not None and all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))
    g.set_urgent("flush", False)
    g.set_urgent("backlog", True)
    assert g.held()  # past the backlog bound beside decode: still held (a piece every max_hold_s)
    g.set_urgent("ram", True)
    assert not g.held()  # RAM over its cap: never
    g.set_urgent("ram", False)
    g.set_busy(False)
    assert not g.held()  # an idle engine: write-behind goes
    g.set_urgent("backlog", False)
    g.set_prefilling(True)
    assert g.held()
    g.set_urgent("backlog", True)
    assert not g.held()  # a backlog is never held for a prefill (as before)


def _job(plan):
    queue = WriteQueue()
    queue.mark("", tuple(plan.meta.tokens), plan=plan, trimmable=True, nbytes=0)
    job = queue.next_job()
    assert job is not None
    return job


async def _write_one(store: SsdStore, g: WriteGovernor, plan, *, ticking: bool) -> SnapshotWritten:
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, governor=g, staging=True)

    async def tick() -> None:  # the engine's steps
        while True:
            g.stepped()
            await trio.sleep(0.001)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            if ticking:
                nursery.start_soon(tick)
            await write_send.send(WriteSnapshot(_job(plan)))
            written = await out.receive()
            nursery.cancel_scope.cancel()
    assert isinstance(written, SnapshotWritten)
    return written


def _until(predicate) -> None:
    for _ in range(12_000):  # up to a minute on a loaded host
        if predicate():
            return
        threading.Event().wait(0.005)
    raise AssertionError("timed out")


async def _wait_for(predicate) -> None:
    for _ in range(6000):
        if predicate():
            return
        await trio.sleep(0.01)
    raise AssertionError("timed out")


def test_an_unpaced_block_write_goes_one_block_at_a_time_once_rows_decode(tmp_path: Path, monkeypatch):
    """A checkpoint's write that began while the engine was idle commits its blocks four at a time; once rows
    decode, every block it starts is written alone (the four threads no longer stage, hash and write beside
    decode at once), and every block is on disk."""
    from mlxd.kv import file_format as ff

    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)  # the engine idle: unpaced
    pacer = Pacer(g)
    first = threading.Barrier(4, timeout=60)  # the first four blocks start together, unpaced
    lock = threading.Lock()
    state = {"prepared": 0, "paced_now": 0, "paced_most": 0}
    local = threading.local()

    def prepare(plan):
        with lock:
            index = state["prepared"]
            state["prepared"] += 1
        if index < 4:
            first.wait()
            g.set_busy(True)  # rows start decoding while the first blocks are written
        local.paced = index >= 4
        return plan

    real = ff.write_snapshot

    def write(plan, path, **kw):
        paced = getattr(local, "paced", False)
        if paced:
            with lock:
                state["paced_now"] += 1
                state["paced_most"] = max(state["paced_most"], state["paced_now"])
        try:
            threading.Event().wait(0.01)
            return real(plan, path, **kw)
        finally:
            if paced:
                with lock:
                    state["paced_now"] -= 1

    monkeypatch.setattr(ff, "write_snapshot", write)
    plan = _plan(tuple(range(16 * 12)))
    stored = store.write(plan, pacer, prepare=prepare)
    assert isinstance(stored, Stored) and state["prepared"] == 12
    assert state["paced_most"] == 1  # the 8 blocks begun while rows decode: one at a time
    loaded = store.load(stored.record)
    assert loaded is not None and all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))


def test_a_runtime_that_refuses_the_2d_copy_gets_rows_and_the_same_bytes(monkeypatch):
    class Refusing(fake_cuda.FakeCudaLib):
        def cudaMemcpy2DAsync(self, *args):  # e.g. a pitch past the device's limit
            return 1

    lib = Refusing(copy_Bps=1e12)
    cuda = fake_cuda.install(monkeypatch, lib)
    whole = np.arange(1 * 4 * 64 * 16, dtype=np.float32).reshape(1, 4, 64, 16)
    spans = [whole[..., 16:48, :], whole[..., 0:16, :]]
    counts = host_memory.Copied()
    _, arrays = host_memory.to_host(spans, counts=counts)
    assert all(np.array_equal(a, s) for a, s in zip(arrays, spans, strict=True))
    assert counts.calls == 1 + 4 + 4 and cuda._copy_2d is None  # refused once, then one call per row


def test_a_backlog_beside_decode_is_written_at_full_speed_one_block_at_a_time(tmp_path: Path, monkeypatch):
    """Past the backlog bound write-behind goes at full speed; beside decode one block (and one write) at a
    time, while an idle engine, a flush or RAM pressure still gets the four writers."""
    from mlxd.kv import file_format as ff

    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    g.set_busy(True)
    g.set_urgent("backlog", True)
    pacer = Pacer(g)
    assert g.rate() is None and not pacer.pacing() and not g.parallel() and pacer.serial()
    g.set_urgent("ram", True)
    assert g.parallel() and not pacer.serial()  # RAM over its cap: every writer
    g.set_urgent("ram", False)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    together = threading.Barrier(2, timeout=60)
    real = ff.write_snapshot

    def write(plan, path, **kw):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            index = state.setdefault("calls", 0)
            state["calls"] = index + 1
        try:
            if not g.busy and index < 2:
                together.wait()  # idle: two blocks are being written at once (or this times out)
            threading.Event().wait(0.005)
            return real(plan, path, **kw)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(ff, "write_snapshot", write)
    plan = _plan(tuple(range(16 * 8)))
    stored = SsdStore(tmp_path / "decoding", IDENTITY, layout="blocks", block_tokens=16).write(plan, pacer)
    assert isinstance(stored, Stored) and state["most"] == 1 and state["calls"] == 8
    g.set_busy(False)  # the engine idle: the backlog goes four blocks at a time again
    state.update(now=0, most=0, calls=0)
    stored = SsdStore(tmp_path / "idle", IDENTITY, layout="blocks", block_tokens=16).write(plan, pacer)
    assert isinstance(stored, Stored) and state["most"] >= 2


async def test_a_live_flush_while_rows_decode_writes_what_the_decode_hold_kept_back(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """A live runtime with `--ssd-write-hold-decode`, staging on (the fake CUDA runtime): a checkpoint published
    while a row decodes is held back; a flush during the decode writes it (staged through the copy lane) and
    reports everything durable, the row still decoding."""
    from mlxd import RuntimeConfig, SamplingParams, open_runtime

    fake_cuda.install(monkeypatch, fake_cuda.FakeCudaLib(copy_Bps=1e12))
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", snapshot_min_tokens=16,
                           max_batch=4, ssd_write_hold_decode=True)
    async with open_runtime(config) as rt, trio.open_nursery() as nursery:
        governor = rt.cold.governor
        assert governor.hold_while_decoding
        governor.max_hold_s = 600.0  # held until the flush (by default a piece goes after 2 s)
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
        prompt = await rt.render_chat([{"role": "user", "content": "Tell me about prefix caches. " * 20}])
        async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=2))) as stream:
            await stream.tokens()
        await _wait_for(lambda: governor.holds >= 1)
        await trio.sleep(0.3)
        stats = await rt.ssd_stats()
        assert stats.pending_spills >= 1 and stats.pacing["held_now"] and governor.busy  # held beside decode
        with trio.fail_after(60):
            report = await rt.flush()
        assert report["durable"] and report["entries"] >= 1, report
        assert governor.busy, "the decode was still running during the flush"
        writer = (await rt.ssd_stats()).writer
        assert writer.staged >= 1 and writer.staged_calls >= 1 and writer.failures == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("value", "holds"), [("", False), ("0", False), ("off", False), ("1", True), ("True", True)])
def test_mlxd_ssd_copy_gil_reads_its_values(monkeypatch, value, holds):
    monkeypatch.setenv("MLXD_SSD_COPY_GIL", value)
    assert ssd_writer._copy_holds_gil() is holds


def test_mlxd_ssd_copy_gil_refuses_a_value_it_does_not_know(monkeypatch):
    monkeypatch.setenv("MLXD_SSD_COPY_GIL", "yes")
    with pytest.raises(ValueError, match="MLXD_SSD_COPY_GIL"):
        ssd_writer._copy_holds_gil()


async def _write_idle(store: SsdStore, plan, *, flush: bool = False) -> SnapshotWritten:
    """One write by the SSD writer actor (the CPU: no staging), the engine idle: full speed (`flush`: a flush
    waits, the governor's urgency)."""
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    governor = WriteGovernor(busy_rate_bytes_per_s=MB)
    governor.set_urgent("flush", flush)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, governor=governor)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await write_send.send(WriteSnapshot(_job(plan)))
            written = await out.receive()
            nursery.cancel_scope.cancel()
    assert isinstance(written, SnapshotWritten)
    return written


@pytest.mark.parametrize(("direct", "flush", "cached"), [(True, False, False), (True, True, True),
                                                         (False, False, True), (False, True, True)])
async def test_write_behind_bypasses_the_page_cache_unless_a_flush_waits(tmp_path: Path, monkeypatch, direct, flush,
                                                                         cached):
    """`MLXD_SSD_DIRECT` (on by default, read at import): a write at full speed (the engine idle) bypasses the
    page cache as a paced one does, unless a flush waits (a restart right after it reads memory); off, every
    full-speed write stays cached, as before. The same bytes either way."""
    if not _o_direct_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT; every write takes the buffered path")
    monkeypatch.setattr(ssd_writer, "_DIRECT_WRITE_BEHIND", direct)
    store = SsdStore(tmp_path / "ssd", IDENTITY, layout="whole")
    plan = _plan(tuple(range(6000)))  # 3 MB of KV
    written = await _write_idle(store, plan, flush=flush)
    assert isinstance(written.outcome, Stored)
    resident, total = resident_pages(written.outcome.record.path)
    assert (resident == total) if cached else (resident <= 2)  # (direct: the header page only)
    loaded = store.load(written.outcome.record)
    assert loaded is not None and all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))


@pytest.mark.parametrize(("value", "on"), [("", True), ("0", False), ("off", False), ("1", True)])
def test_mlxd_ssd_direct_reads_its_values(monkeypatch, value, on):
    monkeypatch.setenv("MLXD_SSD_DIRECT", value)
    assert ssd_writer._direct_write_behind() is on
    monkeypatch.setenv("MLXD_SSD_DIRECT", "always")
    with pytest.raises(ValueError, match="MLXD_SSD_DIRECT"):
        ssd_writer._direct_write_behind()
