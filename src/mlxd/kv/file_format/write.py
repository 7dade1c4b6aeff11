"""Writing `.mlxkv` files (writer worker thread; no MLX calls).

`plan` (built on the engine thread by `kinds.plan_snapshot`) carries the
descriptors and one zero-copy buffer per tensor; `write_snapshot` lays them
out page-aligned, checksums them as they stream out, and commits atomically.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import numpy as np

from mlxd.kv.file_format.header import (
    PAGE,
    PREAMBLE,
    ZERO_CRC,
    CacheDesc,
    FileHeader,
    SnapshotMeta,
    StorageError,
    TensorDesc,
    align,
    encode_header,
    header_json,
    storage_error,
)
from mlxd.kv.pacing import Pacer, WriteInterrupted

_CHUNK = 16 << 20  # write granularity: one bounce buffer, one paced slice


@attrs.frozen
class SnapshotPlan:
    """What the writer needs: descriptors plus one buffer per tensor, in file order.

    Buffers are memoryviews of evaluated MLX arrays (zero-copy, possibly
    strided); each keeps its array alive. Nothing here needs MLX any more.

    `on_device` (CUDA, `MLXD_PLAN_DEVICE`): the buffers describe device memory by address
    (`runtime/device_pointers.py`) and must never be read on the host: only the SSD writer's staging copies
    them (`host_memory.Staging.stage`, by DMA), which hands back a plan of host buffers. Writing such a plan
    is refused (`StorageError`), never attempted. `keep`: the MLX arrays that memory belongs to, held until then.
    """

    meta: SnapshotMeta
    caches: tuple[CacheDesc, ...]
    buffers: tuple[memoryview, ...]
    packed: bool = False  # the buffers view one packed copy of the tensors (`kinds.plan_snapshot`), not the caches
    on_device: bool = False
    keep: tuple[object, ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def trimmable(self) -> bool:
        return all(c.trimmable for c in self.caches)



@attrs.frozen
class WrittenFile:
    """A snapshot that is durably on disk under its final name."""

    path: Path
    nbytes: int  # file size
    header: FileHeader
    seconds: float

    @property
    def digest(self) -> str:
        return self.header.digest


def _layout(plan: SnapshotPlan) -> FileHeader:
    """Assign page-aligned offsets; hashes stay placeholders of their final width."""
    caches, data_offset = plan.caches, PAGE
    for _ in range(8):  # offsets change the header length, which can move the data start
        caches, end = _place(plan.caches, data_offset)
        size = max(end, data_offset)  # a file without tensors ends at the data offset
        draft = FileHeader(meta=plan.meta, caches=caches, data_offset=data_offset, file_size=size)
        header_end = PREAMBLE.size + len(header_json(draft))
        if header_end <= data_offset:
            return draft
        data_offset = align(header_end)
    raise AssertionError("header layout did not converge")


def _place(caches: Sequence[CacheDesc], start: int) -> tuple[tuple[CacheDesc, ...], int]:
    """Offsets for every tensor from `start`; returns the placed caches and the data end."""
    pos, end = start, 0

    def place(c: CacheDesc) -> CacheDesc:
        nonlocal pos, end
        tensors = []
        for t in c.tensors:
            if t is not None:
                t = attrs.evolve(t, offset=align(pos), crc32=ZERO_CRC)
                pos = end = t.offset + t.nbytes
            tensors.append(t)
        children = tuple(place(x) for x in c.children)
        return attrs.evolve(c, tensors=tuple(tensors), children=children)

    placed = tuple(place(c) for c in caches)
    return placed, end



def _with_digests(caches: Sequence[CacheDesc], digests: Iterator[str]) -> tuple[CacheDesc, ...]:
    def fill(c: CacheDesc) -> CacheDesc:
        tensors = tuple(
            None if t is None else attrs.evolve(t, crc32=next(digests)) for t in c.tensors
        )
        return attrs.evolve(c, tensors=tensors, children=tuple(fill(x) for x in c.children))

    return tuple(fill(c) for c in caches)

def write_snapshot(
    plan: SnapshotPlan,
    path: str | os.PathLike[str],
    *,
    pacer: Pacer | None = None,
    direct: bool | None = None,
    sync_dir: bool = True,
) -> WrittenFile:
    """Write `<path>.tmp`, checksumming as it goes; fsync; rename onto `path`; fsync the dir
    (`sync_dir=False`: the caller fsyncs it once after several files, as the block store does).

    No MLX calls. With a `pacer`, bytes go out in its slices at its rate.
    `direct` chooses O_DIRECT (True), the page cache (False), or (None) O_DIRECT
    exactly while the pacer is pacing (see `_Sink`). Raises DiskFull or
    StorageError (or the pacer's WriteInterrupted); the tmp file is removed on
    any failure after this call created it (an existing tmp is another writer's).
    """
    t0 = time.perf_counter()
    path = Path(path)
    refuse_device(plan, path)
    tmp = path.with_name(path.name + ".tmp")
    layout = _layout(plan)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # EEXIST: another writer's tmp, which is not ours to remove
        raise storage_error(exc, f"writing {path}") from exc
    try:
        header = _write_tmp(plan, layout, fd, pacer, direct)
        os.replace(tmp, path)
        if sync_dir:
            t1 = time.perf_counter()
            fsync_dir(path.parent)
            if pacer is not None:
                pacer.times.add(sync_s=time.perf_counter() - t1)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise storage_error(exc, f"writing {path}") from exc
    except WriteInterrupted:
        _unlink_quietly(tmp)
        raise
    seconds = time.perf_counter() - t0
    if pacer is not None:
        pacer.times.add(files_s=seconds)
    return WrittenFile(path, header.file_size, header, seconds)


def _write_tmp(
    plan: SnapshotPlan, layout: FileHeader, fd: int, pacer: Pacer | None, direct: bool | None
) -> FileHeader:
    """Fill the tmp file open at `fd` (and close it)."""
    try:
        descs = [desc for _, desc in layout.tensors()]
        digests = _write_range(fd, layout.data_offset, descs, plan.buffers, pacer, direct)
        return _finish_tmp(layout, digests, fd, pacer)
    finally:
        os.close(fd)


def _write_range(
    fd: int, start: int, descs: Sequence[TensorDesc], buffers: Sequence[memoryview], pacer: Pacer | None,
    direct: bool | None,
) -> list[str]:
    """Write `descs`' tensors (with the zero padding before each) from file offset `start` (page-aligned) on,
    the last page zero-padded; their CRC-32s."""
    if direct is not None:
        want_direct: Callable[[], bool] = lambda: direct  # noqa: E731
    else:
        want_direct = pacer.wants_direct if pacer is not None else (lambda: False)
    size = pacer.slice_bytes if pacer is not None else _CHUNK
    sink = _Sink(fd, start=start, size=size, want_direct=want_direct,
                 release_gil=pacer is not None and pacer.release_gil)
    digests = []
    for desc, buf in zip(descs, buffers, strict=True):
        sink.zeros(desc.offset - sink.position)  # padding up to the tensor's page
        crc = 0
        for piece in _byte_pieces(buf, _CHUNK):
            crc = zlib.crc32(piece, crc)
            sink.write(piece, pacer)
        digests.append(f"{crc:08x}")
        if pacer is not None:
            pacer.poll()  # between tensors: a flush's hand-off (block_store) need not wait for the slice's end
    sink.finish(pacer)
    return digests


def _finish_tmp(layout: FileHeader, digests: Sequence[str], fd: int, pacer: Pacer | None) -> FileHeader:
    """The header (with the tensors' CRC-32s) at the file's start, the size, the fsync: the tmp file is durable."""
    caches = _with_digests(layout.caches, iter(digests))
    header = attrs.evolve(layout, caches=caches)
    blob, digest = encode_header(header)
    head = _Sink(fd, start=0, size=header.data_offset, want_direct=lambda: False)
    head.write(memoryview(blob), None)
    head.finish(None)  # zero-pads the header block up to data_offset
    os.ftruncate(fd, header.file_size)  # the last block was padded to the page
    t0 = time.perf_counter()
    os.fsync(fd)
    if pacer is not None:
        pacer.times.add(sync_s=time.perf_counter() - t0)
    return attrs.evolve(header, digest=digest)


def split_points(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """`sizes` (tensors, in file order) cut into at most `parts` contiguous non-empty runs of about equal bytes:
    (start, end) index pairs covering them all (one run when there is at most one tensor)."""
    n = len(sizes)
    parts = max(1, min(parts, n))
    total = sum(sizes)
    runs: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        left_parts = parts - len(runs) - 1  # runs still to start after this one
        if left_parts and n - (i + 1) >= left_parts and acc * parts >= total * (len(runs) + 1):
            runs.append((lo, i + 1))
            lo = i + 1
    runs.append((lo, n))
    return [r for r in runs if r[1] > r[0]] or [(0, n)]


def refuse_device(plan: SnapshotPlan, path: Path) -> None:
    """A plan whose buffers are device addresses is never read here: StorageError (a cache miss), not a crash."""
    if plan.on_device:
        raise StorageError(f"writing {path}: the plan's buffers are device memory; stage them to the host first")


class SplitWrite:
    """One file written by several threads at once: its tensors cut into parts (contiguous runs of whole
    tensors, about equal bytes, each a page-aligned byte range of the file), each part written by whichever
    thread takes it (`write_part`: its own descriptor, its own write-back window, a CRC-32 per tensor as
    `write_snapshot` computes them). The thread that finishes the last part writes the header, fsyncs the
    file and renames it (then fsyncs the directory, `sync_dir`): the file is durable under its name exactly
    as `write_snapshot` leaves it, byte for byte the same. A failed part fails the file: the last part to end
    removes the tmp file and raises the first failure; `abort()` removes it when parts were never run.

    The block store splits the last blocks of an unpaced write this way, so that no writing thread idles
    while one finishes a block alone (issue 28: a flush's tail)."""

    def __init__(self, plan: SnapshotPlan, path: str | os.PathLike[str], parts: int, *, pacer: Pacer | None = None,
                 sync_dir: bool = True) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._plan = plan
        self._pacer = pacer
        self._sync_dir = sync_dir
        self._t0 = time.perf_counter()
        self._layout = _layout(plan)
        self._descs = [desc for _, desc in self._layout.tensors()]
        self.runs = split_points([d.nbytes for d in self._descs], parts)
        self._digests: list[str] = [""] * len(self._descs)
        self._lock = threading.Lock()
        self._left = len(self.runs)
        self._error: BaseException | None = None
        self.written: WrittenFile | None = None
        try:  # the header's descriptor: the last part writes the header and fsyncs through it
            self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # EEXIST: another writer's tmp, which is not ours to remove
            raise storage_error(exc, f"writing {self.path}") from exc

    @property
    def parts(self) -> int:
        return len(self.runs)

    def part_plan(self, i: int) -> SnapshotPlan:
        """Part i's tensors as a plan (its buffers only): what the SSD writer stages before writing them."""
        lo, hi = self.runs[i]
        return attrs.evolve(self._plan, buffers=self._plan.buffers[lo:hi])

    def write_part(
        self, i: int, prepare: Callable[[SnapshotPlan], SnapshotPlan] | None = None
    ) -> WrittenFile | None:
        """Write part i (`prepare`: applied to its plan first, e.g. the SSD writer's staging to host memory).
        The `WrittenFile` when it was the last part to end (the file is durable under its name), else None.
        Raises this part's failure; the last part raises the first failure of any (after removing the tmp file)."""
        lo, hi = self.runs[i]
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            if self._error is None:  # after a failure the other parts write nothing more
                plan = self.part_plan(i)
                if prepare is not None:
                    plan = prepare(plan)
                refuse_device(plan, self.path)
                fd = os.open(self._tmp, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    self._digests[lo:hi] = _write_range(fd, self._descs[lo].offset, self._descs[lo:hi],
                                                        plan.buffers, self._pacer, None)
                finally:
                    os.close(fd)
        except BaseException as exc:
            failure = exc
        if self._pacer is not None:
            self._pacer.times.add(files_s=time.perf_counter() - t0)
        with self._lock:
            if failure is not None and self._error is None:
                self._error = failure
            self._left -= 1
            last = self._left == 0
        if last:
            return self._finish()
        if failure is not None:
            raise self._raised(failure)
        return None

    def _raised(self, exc: BaseException) -> BaseException:
        if isinstance(exc, OSError):
            err = storage_error(exc, f"writing {self.path}")
            err.__cause__ = exc
            return err
        return exc

    def _finish(self) -> WrittenFile:
        fd, self._fd = self._fd, None
        assert fd is not None
        t0 = time.perf_counter()
        try:
            if self._error is not None:  # a part failed: no rename, no tmp file left
                os.close(fd)
                _unlink_quietly(self._tmp)
                raise self._raised(self._error)
            try:
                try:
                    header = _finish_tmp(self._layout, self._digests, fd, self._pacer)
                finally:
                    os.close(fd)
                os.replace(self._tmp, self.path)
                if self._sync_dir:
                    t1 = time.perf_counter()
                    fsync_dir(self.path.parent)
                    if self._pacer is not None:
                        self._pacer.times.add(sync_s=time.perf_counter() - t1)
            except OSError as exc:
                _unlink_quietly(self._tmp)
                raise self._raised(exc) from exc
        finally:
            if self._pacer is not None:
                self._pacer.times.add(files_s=time.perf_counter() - t0)
        self.written = WrittenFile(self.path, header.file_size, header, time.perf_counter() - self._t0)
        return self.written

    def abort(self) -> None:
        """Parts that will never run (their writers gave up after another failure): remove the tmp file. Call
        only when no part is running."""
        with self._lock:
            fd, self._fd = self._fd, None
            self._left = 0
        if fd is not None:
            os.close(fd)
            _unlink_quietly(self._tmp)


class _Sink:
    """Streams bytes to a file from `start` on, through a page-aligned buffer.

    Each full buffer is one slice (one paced step). Before each slice the sink
    asks `want_direct()` whether to bypass the page cache:

    - O_DIRECT while write-behind is being paced beside a decoding engine, and
      (the SSD writer's default, `Pacer.wants_direct`) at full speed too:
      buffered writes cost several times more kernel CPU per MB (writeback)
      than O_DIRECT plus the copy into the aligned buffer, and every
      millisecond is taken from decode (docs/benchmarks.md, write-behind), or
      from the next request, which arrives while an idle engine's write is
      written back;
    - buffered while a flush is waiting (or with the writer's `MLXD_SSD_DIRECT=0`,
      whenever the engine is idle): the pages stay in the page cache, so a
      restart right after a flush reads memory. A buffered slice is written back
      at once (sync_file_range, one slice in flight behind the one being filled),
      so no writeback burst is left for a decoding moment later.

    Falls back to buffered writes where the filesystem refuses O_DIRECT
    (tmpfs, some FUSE and network filesystems).
    """

    def __init__(self, fd: int, *, start: int, size: int, want_direct: Callable[[], bool],
                 release_gil: bool = False) -> None:
        self.fd = fd
        self.position = start  # file offset of the next byte
        self._flushed = start  # file offset of the buffer's first byte
        self._size = align(max(size, PAGE))
        self._buf = _bounce(self._size)
        self._fill = 0
        self._want_direct = want_direct
        self._release_gil = release_gil  # copy into the buffer without the GIL (see _copy_note)
        self._refused = False  # the filesystem said no to O_DIRECT: stop asking
        self.direct = False
        self.direct_bytes = 0  # bytes written with O_DIRECT (for tests and stats)
        self._behind: tuple[int, int] | None = None  # (offset, bytes) of the slice being written back

    def write(self, data: memoryview, pacer: Pacer | None) -> None:
        while data.nbytes:
            n = min(data.nbytes, self._size - self._fill)
            if self._release_gil:  # numpy copies without the GIL
                np.copyto(np.frombuffer(self._buf[self._fill : self._fill + n], dtype=np.uint8),
                          np.frombuffer(data[:n], dtype=np.uint8))
            else:
                self._buf[self._fill : self._fill + n] = data[:n]  # holds the GIL: see _copy_note
            self._fill += n
            self.position += n
            data = data[n:]
            if self._fill == self._size:
                self._flush(pacer)

    def _write_back(self, offset: int, nbytes: int) -> None:
        """Write this slice back now, while the CPU is free; wait only for the slice before it.

        The disk then always has a slice queued while the next one is copied and checksummed (an
        fdatasync per slice left it idle meanwhile: a flush at 0.44x the disk, issue 28), and no
        more than two slices a file are ever dirty. The file's fsync at the end makes it durable."""
        previous, self._behind = self._behind, (offset, nbytes)
        if not _sync_range(self.fd, offset, nbytes, _SYNC_RANGE_WRITE):
            os.fdatasync(self.fd)  # no sync_file_range here (not Linux, or the filesystem refuses)
            self._behind = None
        elif previous is not None:
            _sync_range(self.fd, *previous, _SYNC_RANGE_WAIT)

    def zeros(self, n: int) -> None:
        if n < 0:
            raise AssertionError("tensors out of file order")
        while n:
            k = min(n, self._size - self._fill)
            self._buf[self._fill : self._fill + k] = bytes(k)
            self._fill += k
            self.position += k
            n -= k
            if self._fill == self._size:
                self._flush(None)

    def finish(self, pacer: Pacer | None) -> None:
        """Flush the rest, zero-padded to a whole page (the caller truncates the file)."""
        if self._fill:
            pad = align(self._fill) - self._fill
            self._buf[self._fill : self._fill + pad] = bytes(pad)
            self._fill += pad
            self._flush(pacer)

    def _flush(self, pacer: Pacer | None) -> None:
        want = self._want_direct() and not self._refused
        if want != self.direct:
            self.direct = _set_direct(self.fd, want)
            self._refused = want and not self.direct
        data = self._buf[: self._fill]
        offset = self._flushed
        t0 = time.perf_counter()
        while data.nbytes:
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self.direct = _set_direct(self.fd, False)  # accepted by fcntl, refused on write
                self._refused = True
                continue
            data = data[n:]
            offset += n
        t1 = time.perf_counter()
        if self.direct:
            self.direct_bytes += self._fill
        elif self._fill >= _SYNC_SLICE:
            self._write_back(self._flushed, self._fill)
        if pacer is not None:
            pacer.times.add(pwrite_s=t1 - t0, sync_s=time.perf_counter() - t1)
        self._flushed += self._fill
        written, self._fill = self._fill, 0
        if pacer is not None:
            pacer.done(written)


_SYNC_SLICE = 1 << 20  # buffered slices this large are written back at once

# sync_file_range(2) flags: start writing a range back; or wait for what is in flight in it, write the
# rest and wait for that too (neither makes metadata durable: the file's fsync does).
_SYNC_RANGE_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_SYNC_RANGE_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


def _libc_sync_range() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # a ctypes call: the GIL is released
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_range() if sys.platform.startswith("linux") else None


def _sync_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """sync_file_range(fd, offset, nbytes, flags); False where it is missing or refused (the caller
    falls back to fdatasync). A write error surfaces as OSError here, or at the file's fsync."""
    if _sync_file_range is None:
        return False
    while _sync_file_range(fd, offset, nbytes, flags) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:  # a signal: again, as os.fdatasync does (PEP 475)
            break
    else:
        return True
    if err in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


# _copy_note: the slice assignment in `write` holds the GIL for each 16 MiB copy; np.copyto
# releases it. On the CPU decode beside write-behind measured slower with np.copyto (its BLAS
# threads need every core; docs/benchmarks.md, H200 run 9), so the CPU keeps the slice
# assignment. On CUDA (`Pacer.release_gil`, set where the writer stages to host memory) the
# engine thread's step is host-bound Python that needs the GIL back whenever the device
# answers, and a GIL-held copy beside it made every step wait (issue 28, wbgaps).


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is now on."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        return False
    return on


_bounces = threading.local()


def _bounce(size: int) -> memoryview:
    """A page-aligned buffer of at least `size` bytes, reused per thread (an anonymous mapping)."""
    cached = getattr(_bounces, "buf", None)
    if cached is None or len(cached) < size:
        cached = mmap.mmap(-1, size)
        _bounces.buf = cached
    return memoryview(cached)[:size]


def _byte_pieces(buf: memoryview, size: int) -> Iterator[memoryview]:
    """A tensor's bytes in C order: direct slices (at most `size`) if contiguous, else packed rows."""
    if buf.c_contiguous:
        raw = buf.cast("B") if buf.ndim else memoryview(buf.tobytes())
        for start in range(0, raw.nbytes, size):
            yield raw[start : start + size]
        return
    arr = np.asarray(buf)  # strided view; pack one leading index at a time
    for idx in np.ndindex(arr.shape[:-2] if arr.ndim > 2 else ()):
        yield memoryview(np.ascontiguousarray(arr[idx])).cast("B")  # type: ignore[arg-type]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass

