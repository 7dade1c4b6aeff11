"""The generation checkpointer: in-flight generation checkpoints on the SSD (seed §5.7).

The engine sends a running row's snapshot every `--generation-checkpoint N`
tokens; this actor keeps only the newest per request key (a queued older
snapshot is replaced, never written), writes one file at a time on its own
low-priority thread, paced beside decode like write-behind, and removes a
request's file when it completes normally. A cancelled or failed request keeps
its last checkpoint: an identical retry resumes from it.

Files live in `<ssd dir>/generations/<fingerprint>/<request key>.mlxgen`: the
`.mlxkv` format, whose hashed header carries the generation record. One
fixed name per key, written as tmp + fsync + rename, so the previous
checkpoint stays valid until the new one is durable. At most `keep` files are
kept (oldest removed first). Every failure degrades to "no checkpoint".

A resume reads every byte it continues from, verified (each tensor's CRC-32
and the padding, as the prompt cache's restores): a damaged checkpoint is
removed and the request runs without it, never from wrong numbers. A write
that fails is remembered until the key's next write succeeds or its request
completes, and the next flush reports it (`unwritten()`), so a flush never
calls a generation durable whose newest checkpoint is not on disk. The scan
never follows a symbolic link (the directory or a file): it is logged and
left alone.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import trio

from mlxd.kv import file_format as ff
from mlxd.kv import gen_checkpoint as gc
from mlxd.kv.pacing import PACE_SLICE, Pacer, WriteGovernor, WriteInterrupted
from mlxd.runtime import device_memory, host_memory
from mlxd.runtime.kernel.messages import (
    CheckpointGeneration,
    FindGenerationCheckpoint,
    GenCheckpointMessage,
    GenerationAbandoned,
    GenerationCompleted,
    ResumeGeneration,
    SettleCheckpoints,
)
from mlxd.runtime.kernel.mlx_thread import MlxThread, lower_priority
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.gen_checkpoints")

Message = GenCheckpointMessage


def checkpoint_dir(ssd_root: Path, fingerprint: str) -> Path:
    return Path(ssd_root) / "generations" / fingerprint


class GenerationCheckpointer:
    def __init__(
        self,
        directory: Path,
        identity: Any,  # kv.ssd_store.StoreIdentity
        *,
        inbox: trio.MemoryReceiveChannel[Message],
        governor: WriteGovernor | None = None,
        keep: int = 64,
        verify: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self._identity = identity
        self._inbox = inbox
        self._governor = governor
        self._keep = keep
        self._verify = verify
        # Keys whose newest snapshot failed to write (-> the error); a flush reports them.
        self._unwritten: dict[str, str] = {}
        self._queue = gc.CheckpointQueue()
        self._entries: dict[str, gc.CheckpointEntry] = {}
        self._wake = trio.Event()
        self._writing = False  # a write or removal is on the thread
        self._settle: list[SettleCheckpoints] = []  # flushes waiting for the queue to empty
        self._thread: MlxThread | None = None
        self.stats = {
            "written": 0, "resumed": 0, "removed": 0, "write_failures": 0, "read_failures": 0,
            "superseded": 0, "bytes_written": 0, "write_s_last": 0.0,
        }

    def snapshot_stats(self) -> dict[str, Any]:
        return {
            **self.stats,
            "superseded": self._queue.superseded,
            "entries": len(self._entries),
            "pending": len(self._queue),
            "owned": self._queue.owners,
            "unwritten": len(self._unwritten),
            "pending_bytes": self._queue.pending_bytes(),
            "writing": self._writing,
        }

    def unwritten(self) -> gc.UnwrittenCheckpoints:
        """The checkpoints whose newest snapshot is not on disk (a flush reports them, then settles).

        A live request's failed key stays until its next write succeeds or it
        completes; an abandoned request's is reported once and then forgotten
        (its snapshot is gone: nothing can write it any more).
        """
        report = gc.UnwrittenCheckpoints.of(self._unwritten)
        for key in [k for k in self._unwritten if not self._queue.owned(k)]:
            del self._unwritten[key]
        return report

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._thread = MlxThread("mlxd-gen-ckpt")  # no MLX calls on it, despite the helper's name
        try:
            await self._thread.run(lower_priority)
            await self._thread.run(self._scan)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_forever)
                task_status.started()
                async with self._inbox:
                    async for msg in self._inbox:
                        self._handle(nursery, msg)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._thread.aclose()

    def _handle(self, nursery: trio.Nursery, msg: Message) -> None:
        if isinstance(msg, CheckpointGeneration):
            self._queue.write(gc.WriteJob(msg.key, msg.request_id, msg.plan, msg.emitted))
            self._wake.set()
        elif isinstance(msg, GenerationCompleted):
            if self._queue.remove(msg.key, msg.request_id):
                self._entries.pop(msg.key, None)  # no longer resumable; the file goes next
                self._unwritten.pop(msg.key, None)  # nothing left to make durable
                self._wake.set()
        elif isinstance(msg, GenerationAbandoned):
            self._queue.release(msg.key, msg.request_id)
        elif isinstance(msg, SettleCheckpoints):
            self._settle.append(msg)
            if self._governor is not None:
                self._governor.set_urgent("generation_checkpoints", True)  # full speed while a flush waits
            self._wake.set()
        elif isinstance(msg, FindGenerationCheckpoint):
            entry = self._entries.get(msg.key)
            if entry is None or self._queue.owned(msg.key):
                # A live identical request (e.g. one of n samples) keeps its own state:
                # only an abandoned or pre-restart checkpoint is resumed.
                msg.reply.send(None)
            else:
                self._queue.adopt(msg.key, msg.request_id)
                nursery.start_soon(self._read, entry, msg)

    # --- reads (worker threads, not the writer's: a paced write must not delay a resume) ---

    async def _read(self, entry: gc.CheckpointEntry, msg: FindGenerationCheckpoint) -> None:
        try:
            loaded = await trio.to_thread.run_sync(_read_file, entry.path, self._verify)
            record = self._check(loaded.header, msg)
        except (ff.StorageError, ValueError) as exc:
            self.stats["read_failures"] += 1
            log.warning("gen_checkpoint.unusable", path=str(entry.path), error=str(exc))
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                await trio.to_thread.run_sync(_unlink, entry.path)
            msg.reply.send(None)
            return
        self.stats["resumed"] += 1
        log.info("gen_checkpoint.resume", key=msg.key, emitted=len(record.emitted))
        msg.reply.send(ResumeGeneration(record, loaded))

    def _check(self, header: ff.FileHeader, msg: FindGenerationCheckpoint) -> gc.GenerationRecord:
        meta = header.meta
        if meta.config_fingerprint != self._identity.fingerprint or meta.model_id != self._identity.model_id:
            raise ValueError("checkpoint of another model")
        record = gc.GenerationRecord.from_header(meta.generation, meta.tokens)
        if record.key != msg.key or meta.namespace != msg.namespace:
            raise ValueError("checkpoint of another request")
        if meta.tokens[: record.prompt_tokens] != msg.prompt or record.prompt_tokens != len(msg.prompt):
            raise ValueError("checkpoint prompt differs from the request")
        return record

    # --- writes and removals (the checkpointer's thread, one at a time) ---------------

    async def _write_forever(self) -> None:
        while True:
            job = self._queue.take()
            if job is None:
                self._answer_settle()
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._writing = True
            try:
                if isinstance(job, gc.WriteJob):
                    await self._write(job)
                else:
                    await self._remove(job.key)
            finally:
                self._writing = False

    def _answer_settle(self) -> None:
        """Everything queued is done: answer the waiting flushes."""
        for msg in self._settle:
            msg.reply.send(len(self._queue))
        self._settle.clear()
        if self._governor is not None:
            self._governor.set_urgent("generation_checkpoints", False)

    async def _write(self, job: gc.WriteJob) -> None:
        assert self._thread is not None
        path = self.directory / gc.file_name(job.key)
        t0 = time.perf_counter()
        pacer = pacer_for(self._governor)
        try:
            written = await self._thread.run(_write_file, job.plan, path, pacer)
        except (ff.StorageError, WriteInterrupted) as exc:
            self.stats["write_failures"] += 1
            log.warning("gen_checkpoint.write_failed", error=str(exc))
            if not self._queue.removing(job.key):  # unless its request completed meanwhile
                self._unwritten[job.key] = str(exc) or type(exc).__name__
            return
        self._unwritten.pop(job.key, None)
        self.stats["written"] += 1
        self.stats["bytes_written"] += written.nbytes
        self.stats["write_s_last"] = round(time.perf_counter() - t0, 4)
        if not self._queue.removing(job.key):  # completed while this write was in flight
            self._entries[job.key] = gc.CheckpointEntry(job.key, path, job.emitted, written.nbytes, time.time())
        await self._enforce_keep()

    async def _remove(self, key: str) -> None:
        assert self._thread is not None
        self._entries.pop(key, None)
        await self._thread.run(_unlink, self.directory / gc.file_name(key))
        self.stats["removed"] += 1

    async def _enforce_keep(self) -> None:
        while len(self._entries) > self._keep:
            oldest = min(self._entries.values(), key=lambda e: e.mtime)
            await self._remove(oldest.key)

    # --- startup ----------------------------------------------------------------------

    def _scan(self) -> None:
        """(I/O) Index the checkpoints a previous process left; reap tmp files and bad ones.

        Symbolic links are never followed: a linked directory is not scanned, a linked
        file is neither read nor removed (both logged).
        """
        if _linked(self.directory):
            log.warning("gen_checkpoint.symlink_ignored", path=str(self.directory))
            return
        try:
            with os.scandir(self.directory) as it:
                found = sorted((e.name, e.is_symlink()) for e in it)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("gen_checkpoint.scan_failed", dir=str(self.directory), error=str(exc))
            return
        for name, is_link in found:
            path = self.directory / name
            if is_link:
                log.warning("gen_checkpoint.symlink_ignored", path=str(path))
                continue
            if name.endswith(".tmp"):
                _unlink(path)
                continue
            if not name.endswith(gc.EXTENSION):
                continue
            try:
                header = ff.read_header(path)
                record = gc.GenerationRecord.from_header(header.meta.generation, header.meta.tokens)
                if record.key + gc.EXTENSION != name or header.meta.config_fingerprint != self._identity.fingerprint:
                    raise ValueError("name or fingerprint mismatch")
                st = path.stat()
            except (ff.StorageError, ValueError, OSError) as exc:
                log.warning("gen_checkpoint.removed_unreadable", path=str(path), error=str(exc))
                _unlink(path)
                continue
            self._entries[record.key] = gc.CheckpointEntry(
                record.key, path, len(record.emitted), st.st_size, st.st_mtime
            )
        if self._entries:
            log.info("gen_checkpoint.scan", entries=len(self._entries))


def pacer_for(governor: WriteGovernor | None) -> Pacer | None:
    """The pacer of one checkpoint's write; on CUDA its copies release the GIL, which the engine thread's
    host-bound decode steps need back at once (the rows being checkpointed are decoding; issue 28)."""
    if governor is None:
        return None
    return Pacer(governor, slice_bytes=PACE_SLICE, release_gil=host_memory.separate_host_memory())


def _write_file(plan: ff.SnapshotPlan, path: Path, pacer: Pacer | None) -> ff.WrittenFile:
    """(I/O) The directory (0700), then tmp + fsync + rename onto the key's fixed name."""
    try:
        if _linked(path.parent):
            raise OSError(errno.ELOOP, "a symbolic link in the cache directory (never followed)")
        for d in (path.parent.parent.parent, path.parent.parent, path.parent):
            if not d.is_dir():
                d.mkdir(mode=0o700, exist_ok=True)
                os.chmod(d, 0o700)
    except OSError as exc:
        raise ff.storage_error(exc, f"creating {path.parent}") from exc
    _unlink(path.with_name(path.name + ".tmp"))  # a tmp left by a failed attempt
    if plan.on_device:  # (CUDA, MLXD_PLAN_DEVICE: device addresses, copied to host memory by DMA first)
        plan = _STAGING.stage(plan)
    else:
        device_memory.read_mostly(plan.buffers)  # a decoding row's KV: leave its pages on the device
    return ff.write_snapshot(plan, path, pacer=pacer)


# The checkpointer's thread's page-locked buffer for plans of device addresses (kept: pinning synchronizes the device).
_STAGING = host_memory.Staging()


def _read_file(path: Path, verify: bool) -> ff.LoadedSnapshot:
    return ff.read_snapshot(path, verify=verify)


def _linked(directory: Path) -> bool:
    """Is the checkpoint directory, or `generations/` above it, a symbolic link?
    (The cache root may be one: the operator chose it.)"""
    return directory.is_symlink() or directory.parent.is_symlink()


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("gen_checkpoint.unlink_failed", path=str(path), error=str(exc))
