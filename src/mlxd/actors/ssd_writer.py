"""The SSD-writer actor: packs, hashes, writes, fsyncs and renames on a worker thread.

It decides nothing about what to keep: it writes what the durability
coordinator sends, one file at a time, and reports each outcome back. The
thread never calls MLX; it reads evaluated host buffers (memoryviews).
"""

from __future__ import annotations

import os
import time

import trio

from mlxd.kv.pacing import Pacer, WriteGovernor
from mlxd.kv.ssd_store import SsdStore
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import SnapshotWritten, WriteSnapshot
from mlxd.runtime.mlx_thread import MlxThread

# Write-behind must not take CPU from decode: the writer thread runs at a lower
# scheduling priority (Linux nice values are per thread).
WRITER_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)
    except (AttributeError, OSError):
        pass  # not Linux, or not permitted: run at normal priority

log = get_logger("mlxd.ssd_writer")

# Bytes per paced slice: each slice wakes the writer once, and every wake-up
# stalls decode's BLAS threads; large slices at a low rate cost the least
# (bench_writer_interference.py: 16 MB slices at 50 MB/s 0.97x decode, 0.25 MB 0.88x).
PACE_SLICE = 16 << 20


class SsdWriterActor:
    def __init__(
        self,
        store: SsdStore,
        *,
        inbox: trio.MemoryReceiveChannel[WriteSnapshot],
        outbox: trio.MemorySendChannel[SnapshotWritten],
        governor: WriteGovernor | None = None,
    ) -> None:
        self._store = store
        self._governor = governor
        self._inbox = inbox
        self._outbox = outbox
        self._thread: MlxThread | None = None
        self.stats = {"writes": 0, "failures": 0, "bytes_written": 0, "write_s_last": 0.0, "paced_s": 0.0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # A dedicated thread (no MLX calls on it, despite the helper's name).
        self._thread = MlxThread("mlxd-ssd-writer")
        try:
            await self._thread.run(_lower_priority)
            task_status.started()
            async with self._inbox, self._outbox:
                async for job in self._inbox:
                    await self._outbox.send(await self._write(job))
        finally:
            await self._thread.aclose()

    async def _write(self, job: WriteSnapshot) -> SnapshotWritten:
        t0 = time.perf_counter()
        try:
            # A cancelled caller still lets the file finish: a half-written tmp is
            # reaped at startup anyway, but a finished write is worth keeping.
            assert self._thread is not None
            pacer = Pacer(self._governor, slice_bytes=PACE_SLICE) if self._governor is not None else None
            outcome = await self._thread.run(self._store.write, job.plan, pacer)
            if pacer is not None:
                self.stats["paced_s"] = round(self.stats["paced_s"] + pacer.paced_s, 3)
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
