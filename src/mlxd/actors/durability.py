"""The durability coordinator: the dirty-key state machine and `flush()`.

Every RAM checkpoint that is not on SSD is a dirty record keyed by its
namespace and *exact* tokens (two same-length conversations never cancel each
other). Records are written one at a time through the SSD writer (write-behind:
decode never waits). A failed write leaves its record dirty and retryable.
`flush()` retries failures once, waits for everything that was dirty when it
was called, and reports durable only when nothing is pending, failed or
dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import attrs
import trio

from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.ssd_store import SsdStore
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import (
    DurabilityStats,
    EntryDurable,
    EntryNotPersisted,
    FlushRequest,
    ForgetDirty,
    MarkDirty,
    SnapshotWritten,
    WriteSnapshot,
)

log = get_logger("mlxd.durability")

Key = tuple[str, tuple[int, ...]]


@attrs.define
class _Record:
    plan: Any
    trimmable: bool
    nbytes: int
    version: int
    state: str = "queued"  # queued | writing | failed
    error: str | None = None


@attrs.define
class _FlushWaiter:
    targets: set[Key]
    reply: Any
    started: float
    failed_at_start: int


@attrs.frozen
class FlushReport:
    durable: bool
    pending: int
    failed: int
    dropped: int
    entries: int
    bytes: int
    longest_durable_prefix_tokens: int
    seconds: float
    reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _is_strict_prefix(short: tuple[int, ...], long: tuple[int, ...]) -> bool:
    return len(short) < len(long) and long[: len(short)] == short


class DurabilityCoordinator:
    def __init__(
        self,
        store: SsdStore,
        *,
        inbox: trio.MemoryReceiveChannel[Any],
        writer: trio.MemorySendChannel[WriteSnapshot],
        cache: trio.MemorySendChannel[Any],
        governor: WriteGovernor | None = None,
        backlog_bytes: int = 0,
    ) -> None:
        self._store = store
        # Writing is urgent (full speed, even during decode) while a flush waits
        # or the backlog exceeds backlog_bytes (0 = never by size).
        self._governor = governor
        self._backlog_bytes = backlog_bytes
        self._inbox = inbox
        self._writer = writer
        self._cache = cache
        self._records: OrderedDict[Key, _Record] = OrderedDict()
        self._writing: Key | None = None
        self._versions = 0
        self._waiters: list[_FlushWaiter] = []
        self._dropped_since_flush = 0
        self.stats = {"spills": 0, "failed_spills": 0, "dropped_spills": 0, "superseded": 0, "flushes": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            async for msg in self._inbox:
                await self._handle(msg)
                await self._pump()
                self._answer_flushes()
                self._set_urgency()

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, MarkDirty):
            self._mark(msg)
        elif isinstance(msg, SnapshotWritten):
            await self._written(msg)
        elif isinstance(msg, ForgetDirty):
            self._forget((msg.namespace, msg.tokens))
        elif isinstance(msg, FlushRequest):
            self._flush(msg)
        elif isinstance(msg, DurabilityStats):
            msg.reply.send(self.snapshot_stats())

    def _mark(self, msg: MarkDirty) -> None:
        key = (msg.namespace, msg.tokens)
        self._versions += 1
        old = self._records.pop(key, None)
        if old is not None and old.state == "writing":
            # The older version is being written; the new one gets its own attempt.
            pass
        self._records[key] = _Record(msg.plan, msg.trimmable, msg.plan.nbytes, self._versions)
        if msg.trimmable:
            # A trimmable descendant covers its queued ancestors: don't write them.
            for other in [k for k, r in self._records.items() if r.state != "writing"]:
                if other[0] == msg.namespace and _is_strict_prefix(other[1], msg.tokens):
                    del self._records[other]
                    self.stats["superseded"] += 1

    def _forget(self, key: Key) -> None:
        record = self._records.get(key)
        if record is not None and record.state != "writing":
            del self._records[key]
            self.stats["dropped_spills"] += 1
            self._dropped_since_flush += 1

    async def _written(self, msg: SnapshotWritten) -> None:
        self._writing = None
        record = self._records.get(msg.key)
        current = record is not None and record.version == msg.version
        if msg.stored:
            self.stats["spills"] += 1
            if record is not None:
                # Same exact tokens: a newer queued version holds the same state.
                del self._records[msg.key]
            await self._cache.send(EntryDurable(*msg.key))
            return
        self.stats["failed_spills"] += 1
        if current:
            record.state = "failed"
            record.error = msg.error
            await self._cache.send(EntryNotPersisted(msg.key[0], msg.key[1], msg.error or "write failed"))

    async def _pump(self) -> None:
        """Start the next queued write when the writer is idle."""
        if self._writing is not None:
            return
        for key, record in self._records.items():
            if record.state == "queued":
                record.state = "writing"
                self._writing = key
                await self._writer.send(WriteSnapshot(key, record.version, record.plan))
                return

    def _flush(self, msg: FlushRequest) -> None:
        self.stats["flushes"] += 1
        for record in self._records.values():
            if record.state == "failed":
                record.state = "queued"  # one more try for each failed record
        targets = set(self._records)
        self._waiters.append(
            _FlushWaiter(targets, msg.reply, time.monotonic(), self.stats["failed_spills"])
        )

    def _answer_flushes(self) -> None:
        still = []
        for waiter in self._waiters:
            busy = [k for k in waiter.targets if k in self._records and self._records[k].state in ("queued", "writing")]
            if busy:
                still.append(waiter)
                continue
            waiter.reply.send(self._report(waiter))
        if len(still) < len(self._waiters):
            self._dropped_since_flush = 0
        self._waiters = still

    def _report(self, waiter: _FlushWaiter) -> FlushReport:
        failed = [r for k, r in self._records.items() if r.state == "failed"]
        pending = len(self._pending())
        dropped = self._dropped_since_flush
        s = self._store.stats
        reason = None
        if failed:
            reason = "disk full" if s.disk_full else (failed[0].error or "write failed")
        elif dropped:
            reason = f"{dropped} checkpoints were dropped before they could be written"
        return FlushReport(
            durable=not failed and pending == 0 and dropped == 0,
            pending=pending,
            failed=len(failed),
            dropped=dropped,
            entries=s.entries,
            bytes=s.bytes,
            longest_durable_prefix_tokens=s.longest_durable_prefix_tokens,
            seconds=round(time.monotonic() - waiter.started, 4),
            reason=reason,
        )

    def _set_urgency(self) -> None:
        if self._governor is None:
            return
        flushing = bool(self._waiters)
        backlog = self._backlog_bytes > 0 and self._pending_bytes() >= self._backlog_bytes
        self._governor.set_urgent("flush", flushing)
        self._governor.set_urgent("backlog", backlog)

    def _pending(self) -> list[_Record]:
        return [r for r in self._records.values() if r.state in ("queued", "writing")]

    def _pending_bytes(self) -> int:
        return sum(r.nbytes for r in self._pending())

    def snapshot_stats(self) -> dict[str, Any]:
        return {
            **self.stats,
            "pending_snapshots": len(self._records),
            "pending_spills": len(self._pending()),
            "pending_spill_bytes": self._pending_bytes(),
        }
