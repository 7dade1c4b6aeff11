"""The durability coordinator: write-behind order and `flush()`.

The dirty-record state machine is `mlxd.kv.write_queue.WriteQueue` (shared
with the simulator): records are written one at a time through the SSD
writer, so decode never waits, and up to `writers` at once while a flush waits
or the backlog is urgent (nothing paces them then: a SIGTERM flush runs at the
disk's bandwidth, not one file's write-then-fsync at a time), and a failed write leaves its record failed
and retryable. This actor feeds the writer, reports each outcome to the cache
owner as a message (`EntryDurable`, `EntryNotPersisted`) and answers flushes:
a flush retries failures once, waits for everything that was dirty when it
was called, and reports durable only when nothing is pending, failed, dropped
or unstorable. A failed write's report carries its cause (errno text). A
failure in a handler answers every waiting flush at once, not durable, with
that failure as its reason (never a flush left waiting: SIGTERM would wait out
its whole timeout), and a write whose outcome was lost counts as failed. So
does every write once the SSD writer actor is gone (its inbox closed): the
writes it had taken and each one after, reported as failed writes are (the
entries stay in RAM), logged once; flushes are answered at once, not durable.
Outcomes reach the cache owner in the order the writes were started, however
the writers finish: the tier core indexes each file as the most recently used
and enforces the SSD cap as it goes, so the order is what it keeps, and the
simulator (one writer) replays the same sequence.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import attrs
import trio

from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.ssd_store import Stored
from mlxd.kv.tiers import Key
from mlxd.kv.write_queue import WriteJob, WriteQueue
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    CacheStatsSnapshot,
    DurabilityMessage,
    DurabilitySnapshot,
    DurabilityStats,
    EntryDurable,
    EntryNotPersisted,
    FlushReport,
    FlushRequest,
    ForgetDirty,
    MarkDirty,
    MarkNotStored,
    QueryCacheStats,
    SnapshotWritten,
    WriterStats,
    WriteSnapshot,
)
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.durability")

__all__ = ["DurabilityCoordinator", "FlushReport"]


@attrs.define
class _FlushWaiter:
    targets: set[Key]
    reply: Reply[FlushReport]
    started: float
    writer: WriterStats  # the writer's counters when the flush came (its report gives what they gained)


class DurabilityCoordinator:
    def __init__(
        self,
        *,
        inbox: trio.MemoryReceiveChannel[DurabilityMessage],
        writer: trio.MemorySendChannel[WriteSnapshot],
        cache: trio.MemorySendChannel[CacheOwnerMessage],
        governor: WriteGovernor | None = None,
        backlog_bytes: int = 0,
        writers: int = 1,
        shared_prefixes: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Writing is urgent (full speed, even during decode) while a flush waits
        # or the backlog exceeds backlog_bytes (0 = never by size).
        self._governor = governor
        self._backlog_bytes = backlog_bytes
        self._writers = max(1, writers)  # writes at once while urgent (the writer's worker threads)
        self._inbox = inbox
        self._writer = writer
        self._cache = cache
        self._clock = clock
        self._queue = WriteQueue(shared_prefixes=shared_prefixes)  # the backlog's bytes: WriteQueue.pending_bytes
        self._waiters: list[_FlushWaiter] = []
        self._not_stored: list[str] = []  # reasons since the last flush report
        self._not_stored_total = 0
        self._flushes = 0
        self._writer_stats = WriterStats()
        # Writes in the order they were started, each with its report to the cache owner once it is known.
        self._started: deque[tuple[WriteJob, list[CacheOwnerMessage | None]]] = deque()
        self._writer_gone: str | None = None  # why no write can reach the writer any more

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            async for msg in self._inbox:
                try:
                    await self._handle(msg)
                    await self._pump()
                    await self._answer_flushes()
                except Exception as exc:  # one bad message fails its own reply, not the runtime
                    log.exception("durability.handler_failed", message=type(msg).__name__)
                    reply = getattr(msg, "reply", None)
                    # A waiting flush is answered now (not durable) rather than never: SIGTERM must not wait
                    # out its timeout for a write whose outcome was lost.
                    answered = self._abandon_flushes(exc)
                    if reply is not None and reply not in answered:
                        reply.fail(exc)
                    if isinstance(msg, SnapshotWritten):  # a failure here ends the actor, loudly
                        await self._release(msg.job, f"durability handler failed: {exc!r}")
                self._set_urgency()

    async def _handle(self, msg: DurabilityMessage) -> None:
        queue = self._queue
        if isinstance(msg, MarkDirty):
            queue.mark(msg.namespace, msg.tokens, plan=msg.plan, trimmable=msg.trimmable, nbytes=msg.nbytes,
                       first=msg.first)
        elif isinstance(msg, SnapshotWritten):
            await self._written(msg)
        elif isinstance(msg, ForgetDirty):
            queue.forget(msg.namespace, msg.tokens)
        elif isinstance(msg, MarkNotStored):
            self._not_stored.append(msg.reason)
            self._not_stored_total += 1
        elif isinstance(msg, FlushRequest):
            self._flushes += 1
            self._waiters.append(_FlushWaiter(queue.open_flush(), msg.reply, self._clock(), self._writer_stats))
        elif isinstance(msg, DurabilityStats):
            msg.reply.send(self.snapshot_stats())

    async def _written(self, msg: SnapshotWritten) -> None:
        self._writer_stats = msg.stats
        job, outcome = msg.job, msg.outcome
        report: CacheOwnerMessage | None = None
        if isinstance(outcome, Stored):
            self._queue.written(job.key, job.version, stored=True)
            report = EntryDurable(outcome.record)
        elif self._queue.written(job.key, job.version, stored=False, error=outcome.error):
            record = job.record
            report = EntryNotPersisted(record.namespace, tuple(record.tokens), outcome.error)
        slot = next((s for j, s in self._started if j is job), None)
        if slot is None:  # sent before the writer went, and counted failed then: the cache owner learns it now
            if report is not None:
                await self._cache.send(report)
            return
        slot.append(report)
        await self._report_in_order()

    async def _report_in_order(self) -> None:
        """Report in start order: an earlier write still in flight holds the later ones back."""
        while self._started and self._started[0][1]:
            _, (ready,) = self._started.popleft()
            if ready is not None:
                await self._cache.send(ready)

    async def _release(self, job: WriteJob, error: str, *, tell_cache: bool = False) -> None:
        """A write whose outcome could not be handled, or will never come: count it failed, so the next flush
        retries it and the writes started after it still reach the cache owner (unless its handler got that far).
        `tell_cache`: reported as a failed write is (the cache owner is not what failed)."""
        slot = next((s for j, s in self._started if j is job), None)
        if slot is None or slot:
            return
        report: CacheOwnerMessage | None = None
        if self._queue.written(job.key, job.version, stored=False, error=error) and tell_cache:
            report = EntryNotPersisted(job.record.namespace, tuple(job.record.tokens), error)
        slot.append(report)
        await self._report_in_order()

    async def _lose_writer(self, exc: BaseException | None) -> None:
        """The SSD writer is gone (its inbox closed): no outcome comes for the writes it had taken, and none
        can reach it. Each write in flight counts failed now, each later one at once (`_pump`); logged once."""
        self._writer_gone = f"the SSD writer is gone ({type(exc).__name__ if exc else 'its inbox closed'})"
        log.error("durability.writer_gone", in_flight=sum(1 for _, slot in self._started if not slot),
                  error=repr(exc) if exc else None)
        for job, slot in list(self._started):
            if not slot:
                await self._release(job, self._writer_gone, tell_cache=True)

    def _abandon_flushes(self, exc: Exception) -> list[Reply[FlushReport]]:
        """Answer every waiting flush: not durable, with the handler's failure as the reason. What the SSD
        holds is not asked of the cache owner (that may be what failed): its figures read 0."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._queue.close_flush(waiter.targets)
            report = self._report(waiter, 0, 0, 0)
            waiter.reply.send(attrs.evolve(report, durable=False, reason=f"durability handler failed: {exc!r}"))
        if waiters:
            log.error("durability.flushes_abandoned", flushes=len(waiters), error=repr(exc))
        return [w.reply for w in waiters]

    async def _pump(self) -> None:
        """Start queued writes while fewer than the allowed number are in flight."""
        if self._writer_gone is None and self._writer.statistics().open_receive_channels == 0:
            await self._lose_writer(None)
        while (job := self._queue.next_job(limit=self._parallel_writes())) is not None:
            self._started.append((job, []))
            if self._writer_gone is None:
                try:
                    await self._writer.send(WriteSnapshot(job))
                    continue
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    await self._lose_writer(exc)
            assert self._writer_gone is not None
            await self._release(job, self._writer_gone, tell_cache=True)

    def _parallel_writes(self) -> int:
        """Several writers only while durability is urgent (a flush waits, the backlog or RAM is over its
        bound): then nothing paces them; otherwise one paced write at a time, beside decode. A backlog alone
        while rows decode: one write at a time, at full speed (`WriteGovernor.parallel`)."""
        g = self._governor
        urgent = bool(self._waiters) or (g is not None and bool(g.urgent) and g.parallel())
        return self._writers if urgent else 1

    async def _answer_flushes(self) -> None:
        if any(slot for _, slot in self._started):
            return  # a finished write's report waits for an earlier one: the cache owner has not indexed it
        done = [w for w in self._waiters if not self._queue.busy(w.targets)]
        if not done:
            return
        # What the SSD tier holds now, from the cache owner (it owns the index).
        reply: Reply[CacheStatsSnapshot] = Reply()
        await self._cache.send(QueryCacheStats(reply))
        snapshot = await reply.wait()
        tiers = snapshot.tiers
        for waiter in done:
            self._queue.close_flush(waiter.targets)
            report = self._report(waiter, tiers.ssd_entries, tiers.ssd_bytes, tiers.longest_durable_prefix_tokens)
            # Vision encoder outputs are written through this queue too (vision/tensor_store.py).
            waiter.reply.send(attrs.evolve(report, encoder_outputs=snapshot.encoder_files,
                                           encoder_output_bytes=snapshot.encoder_bytes))
        self._waiters = [w for w in self._waiters if w not in done]
        self._queue.dropped_since_flush = 0
        self._not_stored = []

    def _report(self, waiter: _FlushWaiter, entries: int, nbytes: int, longest: int) -> FlushReport:
        failed = self._queue.failed()
        pending = len(self._queue.pending())
        dropped = self._queue.dropped_since_flush + len(self._not_stored)
        reason = None
        if failed:
            reason = failed[0].error or "write failed"
            if self._writer_stats.disk_full:
                reason = f"disk full ({reason})"
        elif self._not_stored:
            reason = f"{len(self._not_stored)} checkpoints were not stored: {self._not_stored[0]}"
        elif dropped:
            reason = f"{dropped} checkpoints were dropped before they could be written"
        now, then = self._writer_stats, waiter.writer
        return FlushReport(
            writes=now.writes + now.failures - then.writes - then.failures,
            written_bytes=now.bytes_written - then.bytes_written,
            stage_s=round(now.stage_s - then.stage_s, 4),
            pwrite_s=round(now.pwrite_s - then.pwrite_s, 4),
            sync_s=round(now.sync_s - then.sync_s, 4),
            files_s=round(now.files_s - then.files_s, 4),
            durable=not failed and pending == 0 and dropped == 0,
            pending=pending,
            failed=len(failed),
            dropped=dropped,
            entries=entries,
            bytes=nbytes,
            longest_durable_prefix_tokens=longest,
            seconds=round(self._clock() - waiter.started, 4),
            reason=reason,
        )

    def _set_urgency(self) -> None:
        if self._governor is None:
            return
        backlog = self._backlog_bytes > 0 and self._queue.pending_bytes() >= self._backlog_bytes
        self._governor.set_urgent("flush", bool(self._waiters))
        self._governor.set_urgent("backlog", backlog)

    def snapshot_stats(self) -> DurabilitySnapshot:
        q = self._queue
        return DurabilitySnapshot(
            spills=q.spills,
            failed_spills=q.failed_spills,
            dropped_spills=q.dropped_spills,
            superseded=q.superseded,
            flushes=self._flushes,
            not_stored=self._not_stored_total,
            pending_snapshots=len(q),
            pending_spills=len(q.pending()),
            pending_spill_bytes=q.pending_bytes(),
            writer=self._writer_stats,
        )
