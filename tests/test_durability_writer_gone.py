"""The durability coordinator when the SSD writer actor has gone: its writes fail, its flushes are answered."""

from __future__ import annotations

import math

import trio
import trio.testing

from mlxd.actors.durability import DurabilityCoordinator
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ssd_store import Stored
from mlxd.kv.tiers import CacheTiers, SsdRecord
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    CacheStatsSnapshot,
    DurabilityMessage,
    DurabilityStats,
    EntryDurable,
    EntryNotPersisted,
    FlushReport,
    FlushRequest,
    MarkDirty,
    QueryCacheStats,
    SnapshotWritten,
    WriterStats,
    WriteSnapshot,
)
from test_cache_actors import plan_for

A, B, C = tuple(range(10)), tuple(range(20, 30)), tuple(range(40, 50))


async def start(nursery, writers: int = 1):
    inbox_send, inbox = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer_send, writer = trio.open_memory_channel[WriteSnapshot](1)
    cache_send, cache = trio.open_memory_channel[CacheOwnerMessage](64)
    await nursery.start(DurabilityCoordinator(inbox=inbox, writer=writer_send, cache=cache_send, writers=writers).run)
    return inbox_send, writer, cache


async def flush(inbox, cache) -> tuple[FlushReport, list[tuple[int, ...]]]:
    """A flush, answered; and the writes it retried, each reported failed again to the cache owner."""
    reply: Reply[FlushReport] = Reply()
    await inbox.send(FlushRequest(reply))
    retried = []
    while isinstance(msg := await cache.receive(), EntryNotPersisted):
        retried.append(msg.tokens)
    assert isinstance(msg, QueryCacheStats)  # the cache owner is alive: it says what the SSD holds
    msg.reply.send(CacheStatsSnapshot(CacheTiers(PromptCache(max_bytes=1), ssd=True).stats(), {}, 0, None, 0))
    return await reply.wait(), retried


async def test_a_write_the_gone_writer_cannot_take_fails_and_every_flush_is_answered_at_once(autojump_clock, caplog):
    """The writer's inbox closed (the actor died): the write it had taken, or one whose send raised, stayed in
    flight for ever: every later outcome was held back and every flush waited out its whole timeout (SIGTERM's). Now the
    write counts failed (a cache miss: the entry stays in RAM), each flush is answered at once, not durable, with
    the cause, and the coordinator serves on."""
    with trio.fail_after(60):  # on the mock clock: a hang fails the test rather than the run
        async with trio.open_nursery() as nursery:
            inbox, writer, cache = await start(nursery)
            await inbox.send(MarkDirty("", A, plan_for(A), True, 320))
            job_a = await writer.receive()
            writer.close()  # the writer actor is gone: its inbox is closed
            await inbox.send(MarkDirty("", B, plan_for(B), True, 320))
            # A's write had been taken and is never answered; B cannot be sent. Both count failed, in start order.
            reports = [await cache.receive(), await cache.receive()]
            assert all(isinstance(r, EntryNotPersisted) for r in reports)
            assert [r.tokens for r in reports] == [A, B]  # type: ignore[union-attr]
            first, retried = await flush(inbox, cache)
            assert retried == [A, B]  # a flush tries failed writes once more: they fail at once
            assert not first.durable and first.failed == 2 and first.pending == 0
            assert "writer" in (first.reason or "") and "gone" in (first.reason or "")
            # A later checkpoint and a later flush: answered at once too, with the same cause.
            await inbox.send(MarkDirty("", C, plan_for(C), True, 320))
            assert isinstance(await cache.receive(), EntryNotPersisted)
            second, retried = await flush(inbox, cache)
            assert retried == [A, B, C]
            assert not second.durable and second.failed == 3 and "gone" in (second.reason or "")
            # An outcome the writer had sent before it went still reaches the cache owner (it is on disk).
            stored = SsdRecord("", A, 320, 0.0)
            await inbox.send(SnapshotWritten(job_a.job, Stored(stored, 0.0), 0.0, WriterStats(writes=1)))
            assert isinstance(await cache.receive(), EntryDurable)
            stats: Reply = Reply()
            await inbox.send(DurabilityStats(stats))
            assert (await stats.wait()).pending_snapshots == 2  # B and C, failed (kept for a retry); A is durable
            nursery.cancel_scope.cancel()
    gone = [r for r in caplog.records if "writer_gone" in r.getMessage()]
    assert len(gone) == 1  # logged once, not for every write


async def test_a_send_the_writer_s_closing_inbox_breaks_counts_that_write_failed(autojump_clock):
    """A flush sends two writes at once (two writers): the first waits in the writer's inbox, the second's send
    blocks; the writer goes without taking either, and the blocked send raises BrokenResourceError. Both writes
    count failed; this flush and the next are answered at once (the next waited out its timeout before)."""
    with trio.fail_after(60):  # on the mock clock
        async with trio.open_nursery() as nursery:
            inbox, writer, cache = await start(nursery, writers=2)
            await inbox.send(MarkDirty("", A, plan_for(A), True, 320))
            await inbox.send(MarkDirty("", B, plan_for(B), True, 320))
            await trio.testing.wait_all_tasks_blocked()  # A is in the writer's inbox, unread
            reply: Reply[FlushReport] = Reply()
            await inbox.send(FlushRequest(reply))
            await trio.testing.wait_all_tasks_blocked()  # B's send waits for room
            assert writer.statistics().tasks_waiting_send == 1
            await writer.aclose()
            failed = [await cache.receive(), await cache.receive()]
            assert [type(m) for m in failed] == [EntryNotPersisted] * 2
            assert [m.tokens for m in failed] == [A, B]  # type: ignore[union-attr]
            msg = await cache.receive()
            assert isinstance(msg, QueryCacheStats)
            msg.reply.send(CacheStatsSnapshot(CacheTiers(PromptCache(max_bytes=1), ssd=True).stats(), {}, 0, None, 0))
            report = await reply.wait()
            assert not report.durable and report.failed == 2 and "BrokenResourceError" in (report.reason or "")
            again, retried = await flush(inbox, cache)
            assert retried == [A, B] and not again.durable and again.failed == 2
            nursery.cancel_scope.cancel()
