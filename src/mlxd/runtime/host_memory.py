"""Host copies of KV buffers: bulk copies between MLX memory and host buffers.

The host tier (`--host-cache-gb`, kv/host_tier.py) and the SSD writer's
staging both need a checkpoint's bytes in host memory without the host
reading device memory page by page. On MLX's CUDA backend an array is
device memory until the host first touches it, which converts its buffer to
managed memory (MLX 0.32); a host thread that reads managed memory moves its
pages off the device (docs/benchmarks.md, "managed memory"). A write plan may
instead hold device addresses (`runtime/device_pointers.py`, `MLXD_PLAN_DEVICE`),
which only these copies read. Here a copy is one DMA per
contiguous block, issued with `cudaMemcpyAsync` on a stream of our own
(non-blocking, so it never waits behind the engine's kernels), into
page-locked host memory (`cudaHostAlloc`), and back.

Elsewhere (the CPU backend, Apple's unified memory) host and MLX memory are
the same memory: the copies are numpy copies, used by tests and by the
writer's staging; serving there keeps no separate host tier.

No MLX calls: the buffers are memoryviews of arrays evaluated on the engine
thread (as `SnapshotPlan` holds them), so any thread may copy.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from mlxd.runtime import device_memory
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.host_memory")

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1
# A staged copy goes in pieces of about this many bytes, so a writer held still for a prefill stops
# within one piece (~1 ms at the H200's 50 GB/s).
STAGE_PIECE = 64 << 20
# While rows decode (write-behind paced), pieces of at most this many bytes, one per engine step
# (kv/pacing.py): ~0.16 ms of the copy engine, a few runtime calls.
STAGE_PIECE_DECODING = 8 << 20
# A staging buffer is allocated this much larger than the checkpoint that needed it: a conversation's
# next checkpoint is a little longer, and re-pinning ~2 GB takes 0.6-1 s and synchronizes the device.
STAGE_HEADROOM = 1.25


class HostBuffer:
    """One host allocation of `nbytes`: page-locked on CUDA, plain numpy elsewhere. Freed with the object."""

    def __init__(self, nbytes: int, *, cuda: _Cuda | None) -> None:
        self.nbytes = nbytes
        self.pinned = False
        self._cuda = cuda
        self._ptr = ctypes.c_void_p()
        if cuda is not None and nbytes > 0 and cuda.host_alloc(self._ptr, nbytes):
            self.pinned = True
            raw = (ctypes.c_uint8 * nbytes).from_address(self._ptr.value or 0)
            self.array = np.frombuffer(raw, dtype=np.uint8)
        else:
            self.array = np.empty(nbytes, dtype=np.uint8)

    def __del__(self) -> None:
        if self.pinned and self._cuda is not None:
            self.pinned = False
            self._cuda.host_free(self._ptr)


class _Lane:
    """One side stream and the lock its callers take turns on."""

    def __init__(self, lib: Any, name: str) -> None:
        self.name = name
        self.stream = ctypes.c_void_p()
        self.lock = threading.RLock()
        if int(lib.cudaStreamCreateWithFlags(ctypes.byref(self.stream), _STREAM_NON_BLOCKING)) != 0:
            raise OSError("cudaStreamCreateWithFlags failed")


class _Cuda:
    """The CUDA runtime calls the copies need (the library MLX's CUDA build loaded).

    Three side streams (lanes), each with its own lock, so no kind of traffic queues behind another:
    `copy` (the SSD writer's staging and restores' pinned copies), `promote` (host-tier entries back to
    the device: a request waits for these) and `demote` (host-tier entries to host memory, in pieces).
    A migration to the host runs in the calling thread (the driver moves the pages there: issuing
    1.88 GB took 0.23-0.28 s on an H200), so with one shared stream and lock a promotion issued on the
    trio thread waited behind it (the H200's lookups of 435-508 ms, 14:02 UTC; docs/benchmarks.md)."""

    def __init__(self, lib: Any, version: int) -> None:
        self._lib = lib
        self.version = version
        self.copies = _Lane(lib, "copy")
        self.promotions = _Lane(lib, "promote")
        self.demotions = _Lane(lib, "demote")
        self._stream, self._lock = self.copies.stream, self.copies.lock  # the copy lane (older callers)
        self.failures = 0
        self.copy_calls = 0  # runtime calls the copy lane made (each a GIL release and re-take)
        self._copy_2d = getattr(lib, "cudaMemcpy2DAsync", None)

    def host_alloc(self, ptr: ctypes.c_void_p, nbytes: int) -> bool:
        ok = int(self._lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0)) == 0
        if not ok:
            self.failures += 1
            log.warning("host_memory.pinned_alloc_failed", nbytes=nbytes, fallback="pageable")
        return ok

    def host_free(self, ptr: ctypes.c_void_p) -> None:
        self._lib.cudaFreeHost(ptr)

    def prefetch(self, ranges: Sequence[tuple[int, int]], *, to_host: bool, lane: _Lane | None = None) -> int:
        """Start migrating managed ranges to the host or the device on a lane's stream (default: promote
        to the device, demote to the host); returns the bytes asked. Never waits for another lane."""
        lane = lane or (self.demotions if to_host else self.promotions)
        done = 0
        with lane.lock:
            for address, n in ranges:
                if self.version >= 13000:
                    where = device_memory._Location(device_memory._LOCATION_HOST if to_host else
                                                    device_memory._LOCATION_DEVICE, 0)
                    err = self._lib.cudaMemPrefetchAsync(ctypes.c_void_p(address), ctypes.c_size_t(n), where, 0,
                                                         lane.stream)
                else:
                    err = self._lib.cudaMemPrefetchAsync(ctypes.c_void_p(address), ctypes.c_size_t(n),
                                                         -1 if to_host else 0, lane.stream)
                if int(err) == 0:
                    done += n
                else:
                    self.failures += 1
        return done

    def sync(self, lane: _Lane) -> None:
        """Wait for what this lane's stream was given (no lock: other callers keep issuing)."""
        self._lib.cudaStreamSynchronize(lane.stream)

    def mark(self, lane: _Lane) -> ctypes.c_void_p | None:
        """A CUDA event recorded on the lane's stream now (after what it was given); None if it failed."""
        event = ctypes.c_void_p()
        if int(self._lib.cudaEventCreate(ctypes.byref(event))) != 0:
            return None
        if int(self._lib.cudaEventRecord(event, lane.stream)) != 0:
            self._lib.cudaEventDestroy(event)
            return None
        return event

    def elapsed_s(self, start: ctypes.c_void_p, end: ctypes.c_void_p) -> float | None:
        """Device time between two completed events (seconds), and both freed."""
        ms = ctypes.c_float()
        ok = int(self._lib.cudaEventElapsedTime(ctypes.byref(ms), start, end)) == 0
        self._lib.cudaEventDestroy(start)
        self._lib.cudaEventDestroy(end)
        return ms.value / 1000 if ok else None

    def busy(self, lane: _Lane) -> bool:
        """Is work still queued on this lane's stream (a non-blocking query)?"""
        return int(self._lib.cudaStreamQuery(lane.stream)) != 0

    def copy(self, copies: Sequence[Copy]) -> int:
        """Copies in order on the copy lane, each one runtime call (a strided one `cudaMemcpy2DAsync`);
        returns when all landed, with the number of calls made. Every call is a ctypes call: the GIL is
        released inside it and taken back after, so fewer calls mean fewer hand-offs with the engine thread."""
        calls = 0
        stream = self.copies.stream
        with self.copies.lock:
            for c in copies:
                if c.height == 1 or c.pitch == c.width:
                    err = int(self._lib.cudaMemcpyAsync(ctypes.c_void_p(c.dst), ctypes.c_void_p(c.src),
                                                        ctypes.c_size_t(c.nbytes), _MEMCPY_DEFAULT, stream))
                    calls += 1
                else:
                    err = -1
                    if self._copy_2d is not None:
                        err = int(self._copy_2d(ctypes.c_void_p(c.dst), ctypes.c_size_t(c.width),
                                                ctypes.c_void_p(c.src), ctypes.c_size_t(c.pitch),
                                                ctypes.c_size_t(c.width), ctypes.c_size_t(c.height),
                                                _MEMCPY_DEFAULT, stream))
                        calls += 1
                        if err != 0:  # refused (a pitch past the device's limit?): rows from now on
                            log.warning("host_memory.copy_2d_refused", error=err, pitch=c.pitch, width=c.width)
                            self._copy_2d = None
                    if err == 0:
                        continue
                    # A runtime without the 2D copy (or one that refused it): one call per row.
                    err = 0
                    for row in range(c.height):
                        err = err or int(self._lib.cudaMemcpyAsync(
                            ctypes.c_void_p(c.dst + row * c.width), ctypes.c_void_p(c.src + row * c.pitch),
                            ctypes.c_size_t(c.width), _MEMCPY_DEFAULT, stream))
                        calls += 1
                if err != 0:
                    raise OSError(f"cudaMemcpyAsync failed: CUDA error {err}")
            err = int(self._lib.cudaStreamSynchronize(stream))
            if err != 0:
                raise OSError(f"cudaStreamSynchronize failed: CUDA error {err}")
        self.copy_calls += calls
        return calls


_cuda: _Cuda | None = None
_resolved = False
_lock = threading.Lock()


def _runtime() -> _Cuda | None:
    global _cuda, _resolved
    with _lock:
        if _resolved:
            return _cuda
        _resolved = True
        m = device_memory.managed()  # None off CUDA, or without a runtime library
        if m is None:
            return None
        try:
            _cuda = _Cuda(m._lib, m.version)
        except (OSError, AttributeError) as exc:
            log.warning("host_memory.no_side_stream", error=repr(exc))
        return _cuda


def separate_host_memory() -> bool:
    """Is host memory distinct from MLX's (CUDA)? On the CPU and Apple GPUs it is the same memory."""
    return _runtime() is not None


def alloc(nbytes: int) -> HostBuffer:
    """A host buffer of `nbytes` (page-locked where the device has its own memory)."""
    return HostBuffer(nbytes, cuda=_runtime())


@attrs.frozen
class Copy:
    """One copy into packed host memory: `height` rows of `width` bytes, `pitch` bytes apart at the source
    (a cache sliced to its offset: one row per head), one after another at `dst`."""

    dst: int
    src: int
    width: int
    height: int = 1
    pitch: int = 0

    @property
    def nbytes(self) -> int:
        return self.width * self.height


def _strided(arr: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(address, width, height, pitch) runs covering a (possibly strided) array in C order: the longest
    contiguous trailing block is a row, the leading axes (size-1 axes dropped, collapsible ones merged)
    give the rows; one run per index of any axes left outside the last one."""
    if arr.size == 0:
        return []
    base = arr.ctypes.data
    if arr.flags.c_contiguous:
        return [(base, arr.nbytes, 1, arr.nbytes)]
    inner, k = arr.itemsize, arr.ndim
    while k > 0 and (arr.shape[k - 1] == 1 or arr.strides[k - 1] == inner):
        inner *= arr.shape[k - 1]
        k -= 1
    lead: list[tuple[int, int]] = []  # (extent, stride), outermost first
    for n, st in zip(arr.shape[:k], arr.strides[:k], strict=True):
        if n == 1:
            continue
        if lead and lead[-1][1] == st * n:
            lead[-1] = (lead[-1][0] * n, st)
        else:
            lead.append((n, st))
    if not lead:
        return [(base, inner, 1, inner)]
    height, pitch = lead[-1]
    if pitch < inner:  # overlapping or reversed rows: one run per row
        return [(base + sum(i * s for i, (_, s) in zip(idx, lead, strict=True)), inner, 1, inner)
                for idx in np.ndindex(*[n for n, _ in lead])]
    outer = lead[:-1]
    return [(base + sum(i * s for i, (_, s) in zip(idx, outer, strict=True)), inner, height, pitch)
            for idx in np.ndindex(*[n for n, _ in outer])]


def _blocks(arr: np.ndarray) -> list[tuple[int, int]]:
    """(address, nbytes) of the C-order contiguous runs of a (possibly strided) array."""
    return [(at + row * pitch, width) for at, width, height, pitch in _strided(arr) for row in range(height)]


def nbytes_of(buffers: Sequence[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


@attrs.define
class Copied:
    """What one or more staged copies did: pieces (each waited, then `between`), runtime calls, bytes."""

    pieces: int = 0
    calls: int = 0
    nbytes: int = 0
    largest_piece: int = 0

    def add(self, other: Copied) -> None:
        """Count `other`'s copies in too."""
        self.pieces += other.pieces
        self.calls += other.calls
        self.nbytes += other.nbytes
        self.largest_piece = max(self.largest_piece, other.largest_piece)


def to_host(
    buffers: Sequence[Any], dest: HostBuffer | None = None, *, between: Callable[[], None] | None = None,
    piece: int | None = None, counts: Copied | None = None,
) -> tuple[HostBuffer, tuple[np.ndarray, ...]]:
    """Copy buffers (file order) into one host buffer, compacted: the buffer and one array per tensor.

    Each array has its source's shape and dtype, C-contiguous: the bytes the
    file format writes for that tensor, so a `SnapshotPlan` (as memoryviews)
    or a `LoadedSnapshot` can take them as its buffers. The copy goes in pieces
    of at most `piece` bytes (default `STAGE_PIECE`; a strided tensor larger
    than what is left of a piece is split by rows), each issued on the copy
    lane's stream (one `cudaMemcpy2DAsync` per tensor's rows) and waited with
    the GIL released; `between`: called between pieces (the writer's hold and
    pacing; it may raise to stop the copy). `counts`: added to.
    """
    srcs = [np.asarray(b) for b in buffers]
    total = sum(a.nbytes for a in srcs)
    host = dest if dest is not None else alloc(total)
    limit = max(1, piece or STAGE_PIECE)
    counts = counts if counts is not None else Copied()
    views: list[np.ndarray] = []
    pos = 0
    cuda = _runtime()
    pending: list[Copy] = []
    size = 0  # bytes in the piece being gathered

    def flush() -> None:
        nonlocal pending, size
        if cuda is not None and pending:
            counts.calls += cuda.copy(pending)
        counts.pieces += 1
        counts.nbytes += size
        counts.largest_piece = max(counts.largest_piece, size)
        pending, size = [], 0

    for a in srcs:
        out = host.array[pos : pos + a.nbytes].view(a.dtype).reshape(a.shape)
        if cuda is None:  # unified memory: a numpy copy, a tensor at a time
            if size and size + a.nbytes > limit:
                flush()
                if between is not None:
                    between()
            np.copyto(out, a)
            size += a.nbytes
        else:
            at = out.ctypes.data
            runs = _strided(a)
            if len(runs) == 1 and runs[0][2] == 1 and runs[0][1] > limit:  # contiguous: split by bytes
                runs = [(runs[0][0] + o, min(limit, runs[0][1] - o), 1, 0) for o in range(0, runs[0][1], limit)]
            for src, width, height, pitch in runs:
                row = 0
                while row < height:
                    if size and size + width > limit:  # this piece is full: copy it, then the hold
                        flush()
                        if between is not None:
                            between()
                    rows = min(height - row, max(1, (limit - size) // width))
                    pending.append(Copy(at, src + row * pitch, width, rows, pitch))
                    at += rows * width
                    size += rows * width
                    row += rows
        views.append(out)
        pos += a.nbytes
    if size:
        flush()
    return host, tuple(views)


def from_host(dests: Sequence[memoryview], sources: Sequence[Any]) -> int:
    """Copy host byte views into (contiguous) MLX memory views, e.g. a `Landing`'s; returns bytes copied."""
    cuda = _runtime()
    copies = []
    done = 0
    for d, s in zip(dests, sources, strict=True):
        dst = np.frombuffer(d, dtype=np.uint8)
        src = np.frombuffer(memoryview(s).cast("B"), dtype=np.uint8)
        if dst.nbytes != src.nbytes:
            raise ValueError(f"{src.nbytes} bytes into a {dst.nbytes}-byte buffer")
        if cuda is not None:
            copies.append(Copy(dst.ctypes.data, src.ctypes.data, dst.nbytes))
        else:
            np.copyto(dst, src)
        done += dst.nbytes
    if cuda is not None:
        cuda.copy(copies)
    return done


def arrays_of(payload: Any) -> list[Any]:
    """The MLX arrays a cache payload (a list of mlx-lm caches) holds, found by walking its attributes."""
    import mlx.core as mx

    found: list[Any] = []
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> None:
        if depth > 4 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, mx.array):
            found.append(x)
        elif isinstance(x, list | tuple):
            for y in x:
                walk(y, depth + 1)
        elif hasattr(x, "__dict__"):
            for y in vars(x).values():
                walk(y, depth + 1)

    walk(payload, 0)
    return found


def _range_of(array: Any) -> tuple[int, int] | None:
    """(address, nbytes) of one array's whole (contiguous) buffer; None for a strided view (its owner is
    walked too) or an empty one. On MLX's CUDA backend (0.31+) the first host read of an array computed on
    the GPU converts it from device memory to managed memory (`Buffer::raw_ptr`: an allocation and a
    synchronous copy, with the GIL held: every thread waits); after that it costs nothing."""
    try:
        b = np.frombuffer(array, dtype=np.uint8)
    except (ValueError, TypeError, BufferError):
        return None
    return (b.ctypes.data, b.nbytes) if b.nbytes else None


def _ranges(payload: Any) -> list[tuple[int, int]]:
    """(address, nbytes) of a payload's arrays, in the order the forward pass reads them (layer by layer);
    ranges that follow each other in memory are one range (one call). Converts every array not yet
    converted (`_range_of`): serving calls it only for a payload whose demotion already converted it."""
    out: list[tuple[int, int]] = []
    for a in arrays_of(payload):
        span = _range_of(a)
        if span is None:
            continue
        address, n = span
        if out and out[-1][0] + out[-1][1] == address:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append(span)
    return out


def _pieces(ranges: Sequence[tuple[int, int]], piece: int) -> list[tuple[int, int]]:
    out = []
    for address, n in ranges:
        for at in range(0, n, piece):
            out.append((address + at, min(piece, n - at)))
    return out


# A demotion moves an entry's pages in pieces of this many bytes (~9 ms each at the H200's 7.5 GB/s to the
# host) and looks between pieces whether to hold still or stop.
DEMOTE_PIECE = 64 << 20
# A held demotion waits at most this long in all (then goes on: the budget wants the room).
DEMOTE_HOLD_S = 2.0


@attrs.define(eq=False)
class _Demoting:
    lock: threading.Lock = attrs.Factory(threading.Lock)  # held while an array converts or a piece moves
    cancelled: bool = False
    decided: float = attrs.Factory(time.perf_counter)  # a queued demotion's hold counts from here
    # The arrays converted so far (their ranges, under `lock`): only these can have left the device, so a
    # promotion that stops this demotion moves back these and converts none of the rest.
    moved: list[tuple[int, int]] = attrs.Factory(list)


_demoting: dict[int, _Demoting] = {}  # id(payload) -> its demotion in progress
_demoting_lock = threading.Lock()


@attrs.define(eq=False)
class Promotion:
    """A host-tier entry's pages on their way back to the device (what serving issues, what the probe times).

    `issue_s`: the caller's time to issue it (waiting for a piece of the same entry's demotion included);
    `landed_s`: from issue until the promote lane had moved everything (set by `wait`; None until then)."""

    nbytes: int = 0
    calls: int = 0
    issue_s: float = 0.0
    issued_at: float = 0.0  # time.perf_counter()
    landed_s: float | None = None
    cancelled_demotion: bool = False  # its own demotion was still moving pieces, and stopped
    # CUDA events around its prefetches on the promote stream: `landed_s` is then the device's own time
    # from the first to the last page (exact, whatever thread waits and however late it wakes)
    events: tuple[Any, Any] | None = None

    def wait(self) -> float:
        """Wait until the promote lane drained (any thread; not the engine's); returns `landed_s`."""
        cuda = _runtime()
        if cuda is not None and self.nbytes:
            cuda.sync(cuda.promotions)
        wall = time.perf_counter() - self.issued_at
        device = cuda.elapsed_s(*self.events) if cuda is not None and self.events is not None else None
        self.events = None
        self.landed_s = device if device is not None else wall
        return self.landed_s

    @property
    def bytes_per_s(self) -> float | None:
        return self.nbytes / self.landed_s if self.landed_s and self.nbytes else None


@attrs.define(eq=False)
class Demotion:
    nbytes: int = 0  # moved
    pieces: int = 0
    held_s: float = 0.0  # waited for `hold` (a request waiting for its first token, a promotion landing)
    holds: int = 0
    cancelled: bool = False  # a lookup took the entry back before its last piece
    seconds: float = 0.0
    # Taking the arrays' addresses (the first host read: on CUDA an array computed on the device is converted
    # to managed memory then, an allocation and a synchronous copy with the GIL held: every thread waits).
    ranges_s: float = 0.0  # all of its arrays
    convert_max_s: float = 0.0  # the longest one array's (one array at a time: the longest the GIL is held)


def promote(payload: Any) -> Promotion:
    """Start a host-tier entry's pages back to the device: one prefetch per contiguous range, in layer order,
    on the promote lane (never behind a demotion or a staging copy), and return at once. Serving issues it
    in the lookup, before the reply lets the engine read the prefix; the first forward pass then runs while
    the pages arrive. A demotion of the same entry still under way stops first (after at most the array
    converting or the piece in flight), and only the arrays it converted come back: the rest never left the
    device, and converting them here, on the event loop with the GIL held, took 111-132 ms of a returning
    turn's lookup on an H100 (docs/benchmarks.md). A no-op on unified memory (nbytes 0)."""
    t0 = time.perf_counter()
    cuda = _runtime()
    if cuda is None or payload is None:
        return Promotion(issued_at=t0)
    with _demoting_lock:
        job = _demoting.get(id(payload))
    if job is not None:
        job.cancelled = True
        with job.lock:  # the array converting or the piece in flight lands first
            ranges = list(job.moved)  # what it converted (the rest never left the device): no conversion here
    else:
        ranges = _ranges(payload)  # demoted whole: converted already, addresses only
    t1 = time.perf_counter()
    if not ranges:  # its demotion had converted nothing yet: every page is still on the device
        return Promotion(issue_s=t1 - t0, issued_at=t1, cancelled_demotion=job is not None)
    with cuda.promotions.lock:  # (the events bracket this promotion's prefetches only)
        start = cuda.mark(cuda.promotions)
        nbytes = cuda.prefetch(ranges, to_host=False, lane=cuda.promotions)
        end = cuda.mark(cuda.promotions) if start is not None else None
    t2 = time.perf_counter()
    events = (start, end) if start is not None and end is not None and nbytes else None
    if events is None:  # nothing to time (every prefetch failed): no one waits to free them
        for event in (start, end):
            if event is not None:
                cuda._lib.cudaEventDestroy(event)
    return Promotion(nbytes=nbytes, calls=len(ranges), issue_s=t2 - t0, issued_at=t1,
                     cancelled_demotion=job is not None, events=events)


def promotion_pending() -> bool:
    """Is a promotion still moving pages to the device?"""
    cuda = _runtime()
    return cuda is not None and cuda.busy(cuda.promotions)


def begin_demotion(payload: Any) -> _Demoting | None:
    """Register a demotion about to start (on the thread that decided it, before its worker runs), so a
    promotion of the same entry in between stops it rather than racing it. None off CUDA."""
    if _runtime() is None or payload is None:
        return None
    job = _Demoting()
    with _demoting_lock:
        _demoting[id(payload)] = job
    return job


def end_demotion(payload: Any, job: _Demoting | None) -> None:
    """Unregister a demotion (done, or its worker never ran: its actor stopped); another since registered
    for the same payload stays."""
    if job is None:
        return
    with _demoting_lock:
        if _demoting.get(id(payload)) is job:
            del _demoting[id(payload)]


def demote(payload: Any, *, hold: Callable[[], bool] | None = None, hold_max_s: float | None = None,
           piece: int | None = None, ticket: _Demoting | None = None) -> Demotion:
    """Move a host-tier entry's pages to host memory (a worker thread: each piece runs in this thread).

    Array by array, in layer order: its address taken (on CUDA its conversion to managed memory), then its
    pages in pieces of `piece` bytes, each waited, on the demote lane. Before each array and each piece the
    demotion holds still while `hold()` says so or a promotion is landing (at most `hold_max_s` in all): a
    migration beside a request's prefill or a promotion competes with them for the same link and driver
    (None: no hold, device memory is needed now). A promotion of the same entry stops it between arrays or
    pieces (`cancelled`; it then moves back only the arrays converted so far); `ticket`:
    from `begin_demotion`, when the demotion was decided on another thread. A no-op on unified memory."""
    out = Demotion()
    cuda = _runtime()
    if cuda is None or payload is None:
        return out
    t0 = time.perf_counter()
    job = ticket if ticket is not None else begin_demotion(payload)
    assert job is not None
    # A demotion decided earlier (`ticket`) waited for its worker meanwhile (one at a time, the cache owner):
    # that wait counts against its hold, so demotions queued together hold still about as long as one.
    # (None: `DEMOTE_HOLD_S` as it is now, not as it was when this module was loaded)
    limit = (DEMOTE_HOLD_S if hold_max_s is None else hold_max_s) - (
        max(0.0, t0 - job.decided) if ticket is not None else 0.0)

    def hold_still() -> None:
        if hold is None or job.cancelled:
            return
        h0, waited = time.perf_counter(), False
        while (out.held_s + time.perf_counter() - h0 < limit and not job.cancelled
               and (hold() or cuda.busy(cuda.promotions))):
            waited = True
            time.sleep(0.002)
        if waited:
            out.holds += 1
            out.held_s += time.perf_counter() - h0

    try:
        # One array at a time, holding still before each: its first host read converts it (`_range_of`, the
        # GIL held), so converting a whole 16k-token entry of the 1.7B shape at once held every thread for
        # 157-200 ms (an H100, 2026-12-05), the event loop too, right when the next request came.
        for array in arrays_of(payload):
            hold_still()
            with job.lock:
                if job.cancelled:
                    break
                r0 = time.perf_counter()
                span = _range_of(array)
                took = time.perf_counter() - r0
                out.ranges_s += took
                out.convert_max_s = max(out.convert_max_s, took)
                if span is None:
                    continue
                job.moved.append(span)
            for address, n in _pieces([span], piece or DEMOTE_PIECE):
                hold_still()
                # One piece at a time across demotions (the lane), and only then this entry's lock: a promotion
                # of this entry waits for at most the piece in flight, never for other entries' pieces.
                with cuda.demotions.lock, job.lock:
                    if job.cancelled:
                        break
                    out.nbytes += cuda.prefetch([(address, n)], to_host=True, lane=cuda.demotions)
                    cuda.sync(cuda.demotions)
                    out.pieces += 1
        out.cancelled = job.cancelled
    finally:
        end_demotion(payload, job)
        out.seconds = time.perf_counter() - t0 - out.held_s
    return out


def move_pages(payload: Any, *, to_host: bool) -> int:
    """Move a cached entry's memory to the host (`demote`, no hold) or back to the device (`promote`).

    On CUDA the arrays stay MLX arrays: only their managed pages migrate, in
    bulk (`cudaMemPrefetchAsync` on side streams). A no-op (0) on unified
    memory. Returns the bytes asked to move.
    """
    return demote(payload).nbytes if to_host else promote(payload).nbytes


def wait_moves() -> None:
    """Wait for the page moves started so far (benchmarks; serving never waits on them)."""
    cuda = _runtime()
    if cuda is not None:
        for lane in (cuda.promotions, cuda.demotions, cuda.copies):
            cuda.sync(lane)


class Staging:
    """Reusable host buffers the SSD writer copies each piece it writes into first (a new block, or a
    whole file), one buffer per thread that writes.

    On CUDA the writer then reads host memory only: one bulk DMA per
    contiguous block instead of the host faulting the RAM tier's managed
    pages one by one beside decode; and only the bytes it writes are copied
    (a conversation's next checkpoint shares all but its last blocks with the
    one before). A buffer grows to the largest piece its thread saw, with
    headroom, and is kept (allocating and freeing page-locked memory
    synchronizes the device).
    """

    def __init__(self) -> None:
        self._local = threading.local()  # .buffer: this thread's HostBuffer
        self._count_lock = threading.Lock()
        self.allocations = 0
        self.staged = 0
        self.staged_bytes = 0
        self.copied = Copied()  # every stage's pieces and runtime calls

    def stage(self, plan: Any, *, between: Callable[[], None] | None = None, piece: int | None = None) -> Any:
        """The plan with its buffers replaced by host copies (a `SnapshotPlan`; descriptors unchanged).
        `between`: called between pieces of the copy (the writer's hold and pacing); `piece`: their size."""
        import attrs

        need = nbytes_of(plan.buffers)
        buffer: HostBuffer | None = getattr(self._local, "buffer", None)
        if buffer is None or buffer.nbytes < need:
            self._local.buffer = buffer = None  # the old one goes first: never both at once
            self._local.buffer = buffer = alloc(int(need * STAGE_HEADROOM))
            with self._count_lock:
                self.allocations += 1
        counts = Copied()
        _, arrays = to_host(plan.buffers, buffer, between=between, piece=piece, counts=counts)
        with self._count_lock:
            self.staged += 1
            self.staged_bytes += need
            self.copied.add(counts)
        # (host copies now: a plan of device addresses becomes an ordinary one, its arrays no longer held)
        return attrs.evolve(plan, buffers=tuple(memoryview(a) for a in arrays), on_device=False,  # type: ignore[arg-type]
                            keep=())
