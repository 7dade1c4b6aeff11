"""The SSD-writer actor: packs, hashes, writes, fsyncs and renames on a worker thread.

It decides nothing about what to keep: it writes what the durability
coordinator sends, on `workers` threads (the coordinator sends one job at a
time while write-behind may be paced, several during a flush), and reports each outcome back as a
message (`Stored(record)` or `Failed(error)`, with the OS's errno text) along
with a frozen snapshot of its counters. The thread never calls MLX; it reads
evaluated host buffers (memoryviews). A paced write stops between two slices
when the runtime shuts down (its cancellation sets the pacer's stop flag).
While a request waits for its first token, a write neither starts staging nor
writes a slice (the governor's hold, kv/pacing.py) unless durability is urgent.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import attrs
import trio

from mlxd.kv.file_format import SnapshotPlan
from mlxd.kv.pacing import PACE_SLICE, Pacer, WriteGovernor, WriteInterrupted
from mlxd.kv.ssd_store import Failed, SsdStore, Stored, WriteOutcome
from mlxd.runtime import device_memory, host_memory
from mlxd.runtime.config import env_switch
from mlxd.runtime.kernel.messages import (
    DurabilityMessage,
    SnapshotWritten,
    WriterStats,
    WriteSnapshot,
)
from mlxd.runtime.kernel.mlx_thread import MlxThread, lower_priority
from mlxd.runtime.logging import get_logger
from mlxd.vision.tensor_store import TensorPlan

log = get_logger("mlxd.ssd_writer")

# MLXD_SSD_COPY_GIL=1: staged writes copy into the write buffer holding the GIL, as before issue 28's fix (an arm
# for the H200: the same run with and without it says what the GIL-held copy cost decode beside write-behind).
def _copy_holds_gil() -> bool:
    """`MLXD_SSD_COPY_GIL`: off by default; another value than 0/off/false or 1/on/true is a ValueError
    (`runtime.config.env_switch`; docs/operations.md, the environment's arms)."""
    return env_switch("MLXD_SSD_COPY_GIL", default=False)


_COPY_HOLDS_GIL = _copy_holds_gil()


# MLXD_SSD_DIRECT (on by default): write-behind's slices bypass the page cache (O_DIRECT) at full speed too, not
# only while paced beside decode; a flush's stay buffered. A buffered slice costs the kernel a copy and its
# write-back CPU right after the write, when the next request often arrives; the page-cache copy it left did not
# make restarts faster (docs/benchmarks.md, "the SSD server's later start, reproduced on the CPU"). 0: buffered at
# full speed, as before.
def _direct_write_behind() -> bool:
    """`MLXD_SSD_DIRECT`: on by default (`runtime.config.env_switch`; docs/operations.md)."""
    return env_switch("MLXD_SSD_DIRECT", default=True)


_DIRECT_WRITE_BEHIND = _direct_write_behind()


def _write(
    store: SsdStore, plan: SnapshotPlan | TensorPlan, pacer: Pacer, staging: host_memory.Staging | None
) -> WriteOutcome:
    if isinstance(plan, TensorPlan):  # a vision encoder output: small, already in host memory
        return store.write(plan)
    # On CUDA the plan's buffers are the RAM tier's own KV (managed memory):
    # copy them to host memory in bulk first, so the write never reads device
    # pages beside decode (runtime/host_memory.py); without a side stream, read
    # them without moving their pages off the device (runtime/device_memory.py).
    # Staging copies only what the store writes (its new blocks, or the whole file),
    # each piece just before it is written. Neither starts while a request waits for
    # its first token (the pacer's hold).
    pacer.hold()
    if staging is None and plan.on_device:  # (device addresses: only a copy by address may read them)
        staging = _FALLBACK_STAGING
    if staging is None:
        device_memory.read_mostly(plan.buffers)
        return store.write(plan, pacer)
    return store.write(plan, pacer, prepare=partial(_stage, staging, pacer))


# Staging for a writer built not to stage that is handed a plan of device addresses anyway (allocates at first use).
_FALLBACK_STAGING = host_memory.Staging()


def _stage(staging: host_memory.Staging, pacer: Pacer, piece: SnapshotPlan) -> SnapshotPlan:
    # While rows decode: pieces of STAGE_PIECE_DECODING bytes, at most one per engine step (the pacer).
    pacer.between_pieces()
    t0 = time.perf_counter()
    size = pacer.piece_size(host_memory.STAGE_PIECE, host_memory.STAGE_PIECE_DECODING)
    staged: SnapshotPlan = staging.stage(piece, between=pacer.between_pieces, piece=size)
    pacer.times.add(stage_s=time.perf_counter() - t0)
    return staged


class SsdWriterActor:
    def __init__(
        self,
        store: SsdStore,
        *,
        inbox: trio.MemoryReceiveChannel[WriteSnapshot],
        outbox: trio.MemorySendChannel[DurabilityMessage],
        governor: WriteGovernor | None = None,
        workers: int = 1,
        staging: bool | None = None,
    ) -> None:
        """`staging`: copy each piece written (new blocks, whole files) to a host buffer first; None decides
        by the device (only where host memory is not the device's: CUDA), True stages anyway (tests)."""
        self._store = store
        self._staging = staging
        self._workers = max(1, workers)
        self._governor = governor
        self._inbox = inbox
        self._outbox = outbox
        # Set when the runtime shuts down: a paced write in flight stops at its next slice.
        self.stopping = threading.Event()
        self._stats = WriterStats()
        # One for every worker: a page-locked buffer per writing thread (workers and block-write threads).
        self._stager = host_memory.Staging()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with self._inbox, self._outbox, trio.open_nursery() as nursery:
                for i in range(self._workers):
                    await nursery.start(self._worker, i)
                task_status.started()
        finally:
            self.stopping.set()

    async def _worker(self, i: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """One writing thread (no MLX calls on it, despite the helper's name), taking jobs from the shared inbox."""
        thread = MlxThread(f"mlxd-ssd-writer-{i}")
        try:
            await thread.run(lower_priority)
            # On CUDA, staged through host buffers, allocated at their first use.
            stage = self._staging if self._staging is not None else await thread.run(host_memory.separate_host_memory)
            staging = self._stager if stage else None
            task_status.started()
            async for job in self._inbox:
                await self._outbox.send(await self._write(job, thread, staging))
        finally:
            self.stopping.set()
            await thread.aclose()

    async def _write(self, job: WriteSnapshot, thread: MlxThread, staging: host_memory.Staging | None) -> SnapshotWritten:
        t0 = time.perf_counter()
        plan = job.job.record.plan
        pacer = None
        try:
            assert plan is not None
            # Staged (CUDA): the bytes are copied on without the GIL, which decode's host-bound steps need.
            pacer = Pacer(self._governor, slice_bytes=PACE_SLICE, stop=self.stopping.is_set,
                          release_gil=staging is not None and not _COPY_HOLDS_GIL, direct_unless_flush=_DIRECT_WRITE_BEHIND)
            # Shutdown cancels us: the paced write stops at its next slice.
            outcome: WriteOutcome = await thread.run(
                _write, self._store, plan, pacer, staging, on_cancel=self.stopping.set
            )
        except WriteInterrupted as exc:
            outcome = Failed(f"write interrupted: {exc}")
        except Exception as exc:  # every storage failure degrades to "not stored"
            log.warning("ssd.write_error", error=repr(exc))
            outcome = Failed(repr(exc))
        seconds = time.perf_counter() - t0
        self._stats = self._count(outcome, seconds, pacer)
        if staging is not None:
            c = staging.copied
            self._stats = attrs.evolve(self._stats, staged=staging.staged, staged_bytes=staging.staged_bytes,
                                       staged_pieces=c.pieces, staged_calls=c.calls,
                                       step_waits=self._stats.step_waits + (pacer.step_waits if pacer else 0))
        return SnapshotWritten(job.job, outcome, seconds, self._stats)

    def _count(self, outcome: WriteOutcome, seconds: float, pacer: Pacer | None) -> WriterStats:
        s = self._stats
        paced = round(s.paced_s + (pacer.paced_s if pacer is not None else 0.0), 3)
        s = attrs.evolve(s, held_s=round(s.held_s + (pacer.held_s if pacer is not None else 0.0), 3))
        if pacer is not None:
            t = pacer.times
            s = attrs.evolve(s, stage_s=round(s.stage_s + t.stage_s, 4), pwrite_s=round(s.pwrite_s + t.pwrite_s, 4),
                             sync_s=round(s.sync_s + t.sync_s, 4), files_s=round(s.files_s + t.files_s, 4))
        if isinstance(outcome, Stored):
            return attrs.evolve(s, writes=s.writes + 1, bytes_written=s.bytes_written + outcome.written,
                                write_s_last=round(seconds, 4), paced_s=paced)
        if outcome.error.startswith("write interrupted"):
            log.info("ssd.write_interrupted", reason="shutdown")
        elif outcome.disk_full and not s.disk_full:
            log.warning("ssd_disk_full", dir=str(self._store.directory), error=outcome.error)
        elif not outcome.disk_full:
            log.warning("ssd_write_failed", dir=str(self._store.directory), error=outcome.error)
        return attrs.evolve(s, failures=s.failures + 1, paced_s=paced, disk_full=s.disk_full or outcome.disk_full)
