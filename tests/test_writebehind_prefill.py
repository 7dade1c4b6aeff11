"""Write-behind holds still while a request waits for its first token (kv/pacing.py, issue 28).

The next turn of a conversation arrives while the previous turn's checkpoint is
still being staged and written: the scheduler tells the write governor, the
SSD writer neither stages (device -> host on CUDA) nor writes a slice until the
first token, and a flush is never held.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import trio
from mlx_lm.models import cache as mlc

from mlxd.actors.scheduler import SchedulerActor
from mlxd.actors.ssd_writer import SsdWriterActor
from mlxd.kv import kinds
from mlxd.kv.pacing import Pacer, WriteGovernor
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity
from mlxd.kv.tiers import PrefixLookup
from mlxd.kv.write_queue import WriteQueue
from mlxd.runtime import host_memory
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    DurabilityMessage,
    EngineInbox,
    GenerationEvent,
    GenerationFinished,
    GenerationRequest,
    LookupPrefix,
    PromptAccepted,
    SnapshotWritten,
    StartGeneration,
    SubmitGeneration,
    TokenGenerated,
    WriteSnapshot,
)

MB = 1 << 20
IDENTITY = StoreIdentity(model_id="m", fingerprint="f" * 32, tokenizer_hash="t")


def test_the_governor_holds_while_a_request_waits_for_its_first_token_unless_urgent():
    g = WriteGovernor(busy_rate_bytes_per_s=8 * MB)
    assert not g.held()
    g.set_prefilling(True)
    assert g.held() and Pacer(g).pacing()  # idle engine, but a prompt waits: hold still
    g.set_urgent("flush", True)
    assert not g.held() and g.rate() is None  # a flush goes at full speed whatever waits
    g.set_urgent("flush", False)
    g.set_prefilling(False)
    assert not g.held() and g.as_dict()["prefilling"] is False
    never = WriteGovernor(busy_rate_bytes_per_s=0)  # --ssd-write-rate 0: never pace, never hold
    never.set_prefilling(True)
    assert not never.held()


def test_a_held_pacer_waits_on_its_thread_until_the_first_token():
    g = WriteGovernor(busy_rate_bytes_per_s=8 * MB, max_hold_s=600)
    g.set_prefilling(True)
    pacer = Pacer(g, slice_bytes=4096)
    done = threading.Event()

    def write_a_slice() -> None:
        pacer.done(4096)
        done.set()

    t = threading.Thread(target=write_a_slice)
    t.start()
    try:
        for _ in range(12_000):  # until the writer is parked in its hold (up to a minute on a loaded host)
            if g.holds:
                break
            threading.Event().wait(0.005)
        assert g.holds == 1 and not done.is_set()
    finally:
        g.set_prefilling(False)  # the first token: it resumes
        t.join(timeout=30)
    assert done.is_set() and pacer.held_s > 0 and g.as_dict()["holds"] == 1


def test_a_hold_is_bounded_so_a_steady_stream_of_prompts_cannot_starve_write_behind():
    g = WriteGovernor(busy_rate_bytes_per_s=8 * MB, max_hold_s=0.05)
    g.set_prefilling(True)  # and it never ends
    pacer = Pacer(g, slice_bytes=4096)
    pacer.hold()  # returns: the piece goes anyway
    assert g.holds == 1 and g.holds_expired == 1 and g.held()


def test_a_staged_copy_yields_between_pieces(monkeypatch):
    monkeypatch.setattr(host_memory, "STAGE_PIECE", 1024)
    bufs = [np.arange(512, dtype=np.float32) for _ in range(6)]  # 2 KiB each
    calls = []
    _, arrays = host_memory.to_host(bufs, between=lambda: calls.append(1))
    assert len(calls) == 5 and all(np.array_equal(a, b) for a, b in zip(arrays, bufs, strict=True))  # between pieces
    staging = host_memory.Staging()
    plan = _plan(tuple(range(64)))
    staging.stage(plan)
    bigger = _plan(tuple(range(70)))
    staging.stage(bigger)  # a little longer: the buffer's headroom takes it, no new allocation
    assert staging.allocations == 1 and staging.staged == 2


def _plan(tokens: tuple[int, ...]):
    c = mlc.KVCache()
    # Each token's KV depends on its position only, as a shared prefix's does.
    pos = mx.arange(len(tokens), dtype=mx.float32)[None, None, :, None]
    k = pos * 1000 + mx.arange(4, dtype=mx.float32)[None, :, None, None] * 16 + mx.arange(16, dtype=mx.float32)
    c.update_and_fetch(k, k + 1)
    return kinds.plan_snapshot([c], meta=IDENTITY.meta(tokens, ""))


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


async def _wait_for(predicate) -> None:
    """Until a writer thread's state shows (it cannot set a trio.Event); the test's fail_after bounds it."""
    for _ in range(100_000):
        if predicate():
            return
        await trio.sleep(0.01)


async def test_a_prefill_holds_the_writers_staging_until_its_first_token_and_a_flush_is_never_held(
    tmp_path: Path,
):
    """Real scheduler and SSD writer (staging forced on this CPU), a scripted engine: the previous turn's
    checkpoint is handed to the writer while the next request waits for its first token."""
    store = SsdStore(tmp_path, IDENTITY)
    governor = WriteGovernor(busy_rate_bytes_per_s=64 * MB, max_hold_s=600)  # held until the token
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, governor=governor, staging=True)
    submit_send, submit_receive = trio.open_memory_channel[SubmitGeneration](4)
    engine_send, engine_receive = trio.open_memory_channel[EngineInbox](4)
    cache_send, cache_receive = trio.open_memory_channel[CacheOwnerMessage](4)
    scheduler = SchedulerActor(RuntimeConfig(max_batch=2), inbox=submit_receive, engine=engine_send,
                               cache=cache_send, governor=governor)
    seen: dict[str, object] = {}

    async def cache_owner() -> None:
        async for msg in cache_receive:
            assert isinstance(msg, LookupPrefix)
            assert governor.prefilling  # the hold starts before the lookup
            msg.reply.send(PrefixLookup(hit=None))

    async def write(tokens: tuple[int, ...]) -> None:
        queue = WriteQueue()
        queue.mark("", tokens, plan=_plan(tokens), trimmable=True, nbytes=0)
        job = queue.next_job()
        assert job is not None
        await write_send.send(WriteSnapshot(job))

    async def engine() -> None:
        async for msg in engine_receive:
            if not isinstance(msg, StartGeneration):
                continue
            n, rid = len(msg.request.prompt), msg.request.request_id
            if rid == "next-turn":
                before = _files(tmp_path)
                await write(tuple(range(100, 164)))  # the previous turn's checkpoint, written behind
                await _wait_for(lambda: governor.holds >= 1)  # the writer is parked before staging
                seen["files_during_prefill"] = _files(tmp_path) - before
                seen["outcome_during_prefill"] = out.statistics().current_buffer_used
                msg.events.send_nowait(PromptAccepted(n, 0, "none", 0.0))
                msg.events.send_nowait(TokenGenerated(1))
                seen["written"] = await out.receive()  # resumes after the first token
            else:  # a flush waits: the same hold must not stop it
                governor.set_urgent("flush", True)
                await write(tuple(range(200, 264)))
                seen["flushed"] = await out.receive()  # before this request's first token
                governor.set_urgent("flush", False)
                msg.events.send_nowait(PromptAccepted(n, 0, "none", 0.0))
                msg.events.send_nowait(TokenGenerated(1))
            msg.events.send_nowait(GenerationFinished("stop", n, 0, 1))
            msg.events.close()

    async def ask(rid: str) -> list[GenerationEvent]:
        send, receive = trio.open_memory_channel[GenerationEvent](math.inf)
        await submit_send.send(SubmitGeneration(GenerationRequest(request_id=rid, prompt=(1, 2, 3)), send, 0.0))
        return [e async for e in receive]

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            nursery.start_soon(cache_owner)
            nursery.start_soon(engine)
            await nursery.start(scheduler.run)
            assert isinstance((await ask("next-turn"))[-1], GenerationFinished)
            assert not governor.prefilling
            assert isinstance((await ask("flushed"))[-1], GenerationFinished)
            nursery.cancel_scope.cancel()
    assert seen["files_during_prefill"] == set() and seen["outcome_during_prefill"] == 0
    written, flushed = seen["written"], seen["flushed"]
    assert isinstance(written, SnapshotWritten) and isinstance(written.outcome, Stored)
    assert written.stats.staged == 1 and written.stats.held_s > 0  # staged once, after the hold
    assert isinstance(flushed, SnapshotWritten) and isinstance(flushed.outcome, Stored)
    assert flushed.stats.staged == 2 and governor.holds == 1  # the flush's write was never held


async def test_staging_copies_only_the_blocks_the_store_writes(tmp_path: Path):
    """A conversation's next checkpoint shares all but its last blocks with the one before: the writer
    stages (device -> host on CUDA; forced here) only the new blocks, each just before its write."""
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, staging=True)
    first, second = _plan(tuple(range(64))), _plan(tuple(range(70)))
    written = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            for plan in (first, second):
                queue = WriteQueue()
                queue.mark("", tuple(plan.meta.tokens), plan=plan, trimmable=True, nbytes=0)
                job = queue.next_job()
                assert job is not None
                await write_send.send(WriteSnapshot(job))
                written.append(await out.receive())
            nursery.cancel_scope.cancel()
    assert all(isinstance(w.outcome, Stored) for w in written)
    assert (written[0].stats.staged, written[0].stats.staged_bytes) == (4, first.nbytes)  # 4 new blocks
    # The second: 4 blocks already on disk, one new block of 6 tokens staged.
    assert written[1].stats.staged == 5
    assert written[1].stats.staged_bytes - first.nbytes == second.nbytes * 6 // 70
    loaded = store.load(written[1].outcome.record)
    assert loaded is not None and all(
        bytes(a) == bytes(b) for a, b in zip(loaded.buffers, second.buffers, strict=True))
