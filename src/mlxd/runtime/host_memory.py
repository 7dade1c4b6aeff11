"""Host copies of KV buffers: bulk copies between MLX memory and host buffers.

The host tier (`--host-cache-gb`, kv/host_tier.py) and the SSD writer's
staging both need a checkpoint's bytes in host memory without the host
reading device memory page by page. On MLX's CUDA backend every array is
managed memory: a host thread that reads it moves its pages off the device
(docs/benchmarks.md, "managed memory"). Here a copy is one DMA per
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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mlxd.runtime import device_memory
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.host_memory")

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1
# A staged copy goes in pieces of about this many bytes, so a writer held still for a prefill stops
# within one piece (~1 ms at the H200's 50 GB/s).
STAGE_PIECE = 64 << 20
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


class _Cuda:
    """The CUDA runtime calls the copies need (the library MLX's CUDA build loaded)."""

    def __init__(self, lib: Any, version: int) -> None:
        self._lib = lib
        self.version = version
        self._stream = ctypes.c_void_p()
        self._lock = threading.Lock()  # one side stream; copies from several threads take turns
        if int(lib.cudaStreamCreateWithFlags(ctypes.byref(self._stream), _STREAM_NON_BLOCKING)) != 0:
            raise OSError("cudaStreamCreateWithFlags failed")
        self.failures = 0

    def host_alloc(self, ptr: ctypes.c_void_p, nbytes: int) -> bool:
        ok = int(self._lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0)) == 0
        if not ok:
            self.failures += 1
            log.warning("host_memory.pinned_alloc_failed", nbytes=nbytes, fallback="pageable")
        return ok

    def host_free(self, ptr: ctypes.c_void_p) -> None:
        self._lib.cudaFreeHost(ptr)

    def prefetch(self, ranges: Sequence[tuple[int, int]], *, to_host: bool) -> int:
        """Start migrating managed ranges to the host or the device, on the side stream (no wait)."""
        done = 0
        with self._lock:
            for address, n in ranges:
                if self.version >= 13000:
                    where = device_memory._Location(device_memory._LOCATION_HOST if to_host else
                                                    device_memory._LOCATION_DEVICE, 0)
                    err = self._lib.cudaMemPrefetchAsync(ctypes.c_void_p(address), ctypes.c_size_t(n), where, 0,
                                                         self._stream)
                else:
                    err = self._lib.cudaMemPrefetchAsync(ctypes.c_void_p(address), ctypes.c_size_t(n),
                                                         -1 if to_host else 0, self._stream)
                if int(err) == 0:
                    done += n
                else:
                    self.failures += 1
        return done

    def copy(self, pairs: Sequence[tuple[int, int, int]]) -> None:
        """(dst, src, nbytes) blocks, copied in order on the side stream; returns when all landed."""
        with self._lock:
            for dst, src, n in pairs:
                err = int(self._lib.cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n),
                                                    _MEMCPY_DEFAULT, self._stream))
                if err != 0:
                    raise OSError(f"cudaMemcpyAsync failed: CUDA error {err}")
            err = int(self._lib.cudaStreamSynchronize(self._stream))
            if err != 0:
                raise OSError(f"cudaStreamSynchronize failed: CUDA error {err}")


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


def _blocks(arr: np.ndarray) -> list[tuple[int, int]]:
    """(address, nbytes) of the C-order contiguous runs of a (possibly strided) array."""
    if arr.size == 0:
        return []
    if arr.flags.c_contiguous:
        return [(arr.ctypes.data, arr.nbytes)]
    # The longest contiguous trailing block, then one run per index of the leading axes.
    inner, k = arr.itemsize, arr.ndim
    while k > 0 and arr.strides[k - 1] == inner:
        inner *= arr.shape[k - 1]
        k -= 1
    base = arr.ctypes.data
    runs = []
    for idx in np.ndindex(*arr.shape[:k]):
        runs.append((base + sum(i * s for i, s in zip(idx, arr.strides[:k], strict=True)), inner))
    return runs


def nbytes_of(buffers: Sequence[Any]) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


def to_host(
    buffers: Sequence[Any], dest: HostBuffer | None = None, *, between: Callable[[], None] | None = None
) -> tuple[HostBuffer, tuple[np.ndarray, ...]]:
    """Copy buffers (file order) into one host buffer, compacted: the buffer and one array per tensor.

    Each array has its source's shape and dtype, C-contiguous: the bytes the
    file format writes for that tensor, so a `SnapshotPlan` (as memoryviews)
    or a `LoadedSnapshot` can take them as its buffers. `between`: called
    between pieces of about `STAGE_PIECE` bytes (a writer's hold; it may raise
    to stop the copy).
    """
    srcs = [np.asarray(b) for b in buffers]
    total = sum(a.nbytes for a in srcs)
    host = dest if dest is not None else alloc(total)
    views: list[np.ndarray] = []
    pos = 0
    cuda = _runtime()
    pairs: list[tuple[int, int, int]] = []
    piece = 0  # bytes copied (or queued) since the last `between`
    for a in srcs:
        out = host.array[pos : pos + a.nbytes].view(a.dtype).reshape(a.shape)
        if cuda is not None:
            at = out.ctypes.data
            for src, n in _blocks(a):
                pairs.append((at, src, n))
                at += n
                piece += n
                if between is not None and piece >= STAGE_PIECE:
                    cuda.copy(pairs)
                    pairs, piece = [], 0
                    between()
        else:
            np.copyto(out, a)
            piece += a.nbytes
            if between is not None and piece >= STAGE_PIECE:
                piece = 0
                between()
        views.append(out)
        pos += a.nbytes
    if cuda is not None and pairs:
        cuda.copy(pairs)
    return host, tuple(views)


def from_host(dests: Sequence[memoryview], sources: Sequence[Any]) -> int:
    """Copy host byte views into (contiguous) MLX memory views, e.g. a `Landing`'s; returns bytes copied."""
    cuda = _runtime()
    pairs = []
    done = 0
    for d, s in zip(dests, sources, strict=True):
        dst = np.frombuffer(d, dtype=np.uint8)
        src = np.frombuffer(memoryview(s).cast("B"), dtype=np.uint8)
        if dst.nbytes != src.nbytes:
            raise ValueError(f"{src.nbytes} bytes into a {dst.nbytes}-byte buffer")
        if cuda is not None:
            pairs.append((dst.ctypes.data, src.ctypes.data, dst.nbytes))
        else:
            np.copyto(dst, src)
        done += dst.nbytes
    if cuda is not None:
        cuda.copy(pairs)
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


def _ranges(payload: Any) -> list[tuple[int, int]]:
    out = []
    for a in arrays_of(payload):
        try:
            b = np.frombuffer(a, dtype=np.uint8)  # the whole (contiguous) buffer; no host access
        except (ValueError, TypeError, BufferError):
            continue  # a strided view: its owner is walked too, or it is left where it is
        if b.nbytes:
            out.append((b.ctypes.data, b.nbytes))
    return out


def move_pages(payload: Any, *, to_host: bool) -> int:
    """Move a cached entry's memory to the host (a host-tier demotion) or back to the device (a promotion).

    On CUDA the arrays stay MLX arrays: only their managed pages migrate, in
    bulk and asynchronously (`cudaMemPrefetchAsync` on the side stream), so a
    promotion is under way before the engine's first forward pass reads it.
    A no-op (0) on unified memory. Returns the bytes asked to move.
    """
    cuda = _runtime()
    if cuda is None or payload is None:
        return 0
    return cuda.prefetch(_ranges(payload), to_host=to_host)


def wait_moves() -> None:
    """Wait for the page moves started so far (benchmarks; serving never waits on them)."""
    cuda = _runtime()
    if cuda is not None:
        with cuda._lock:
            cuda._lib.cudaStreamSynchronize(cuda._stream)


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

    def stage(self, plan: Any, *, between: Callable[[], None] | None = None) -> Any:
        """The plan with its buffers replaced by host copies (a `SnapshotPlan`; descriptors unchanged).
        `between`: called between pieces of the copy (the writer's hold)."""
        import attrs

        need = nbytes_of(plan.buffers)
        buffer: HostBuffer | None = getattr(self._local, "buffer", None)
        if buffer is None or buffer.nbytes < need:
            self._local.buffer = buffer = None  # the old one goes first: never both at once
            self._local.buffer = buffer = alloc(int(need * STAGE_HEADROOM))
            with self._count_lock:
                self.allocations += 1
        _, arrays = to_host(plan.buffers, buffer, between=between)
        with self._count_lock:
            self.staged += 1
            self.staged_bytes += need
        return attrs.evolve(plan, buffers=tuple(memoryview(a) for a in arrays))  # type: ignore[arg-type]
