"""The SSD-writer actor: packs, hashes, writes, fsyncs and renames on a worker thread.

It decides nothing about what to keep: it writes what the durability
coordinator sends, one file at a time, and reports each outcome back. The
thread never calls MLX; it reads evaluated host buffers (memoryviews).
"""

from __future__ import annotations

import time

import trio

from mlxd.kv.ssd_store import SsdStore
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import SnapshotWritten, WriteSnapshot

log = get_logger("mlxd.ssd_writer")


class SsdWriterActor:
    def __init__(
        self,
        store: SsdStore,
        *,
        inbox: trio.MemoryReceiveChannel[WriteSnapshot],
        outbox: trio.MemorySendChannel[SnapshotWritten],
    ) -> None:
        self._store = store
        self._inbox = inbox
        self._outbox = outbox
        self._thread = trio.CapacityLimiter(1)  # one writer thread at a time
        self.stats = {"writes": 0, "failures": 0, "bytes_written": 0, "write_s_last": 0.0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox, self._outbox:
            async for job in self._inbox:
                await self._outbox.send(await self._write(job))

    async def _write(self, job: WriteSnapshot) -> SnapshotWritten:
        t0 = time.perf_counter()
        try:
            # A cancelled caller still lets the file finish: a half-written tmp is
            # reaped at startup anyway, but a finished write is worth keeping.
            outcome = await trio.to_thread.run_sync(self._store.write, job.plan, limiter=self._thread)
        except Exception as exc:  # every storage failure degrades to "not stored"
            log.warning("ssd.write_error", error=repr(exc))
            outcome = None
            error = repr(exc)
        else:
            error = None if outcome is not None else "write failed (see ssd_write_failed / ssd_disk_full)"
        seconds = time.perf_counter() - t0
        if outcome is None:
            self.stats["failures"] += 1
        else:
            self.stats["writes"] += 1
            self.stats["bytes_written"] += outcome.entry.nbytes
            self.stats["write_s_last"] = round(seconds, 4)
        return SnapshotWritten(job.key, job.version, outcome is not None, seconds, error)
