"""Where MLX's CUDA memory sits when the host reads it, and before the device does.

MLX's CUDA backend allocates every array with `cudaMallocManaged`: one address
for host and device, pages moved to whichever side touched them last. Two of
mlxd's paths touch KV on the host:

- the SSD writer reads a checkpoint's buffers while the same prefix stays in
  the RAM tier. Each page it reads moves to the host, and the next RAM hit on
  that prefix faults it back, which makes that hit several times slower.
  `read_mostly()` marks the buffers `cudaMemAdviseSetReadMostly` first: host
  reads then make a read-only copy of each page and the device keeps its own.
- a restore copies a file's bytes into MLX arrays on the host, so the first
  forward pass faults every page to the device. `to_device()` starts one bulk
  migration instead, which the first token no longer waits on page by page.

Both effects are measured in docs/benchmarks.md (H200: managed memory).

What MLX's kernels write comes from CUDA's stream-ordered memory pool instead:
`DevicePool` reads what the pool holds and trims it (an idle engine's,
engine/core.py `idle_trim`).

Both are hints: they change where pages are, never what they hold, so a
missing or failing call costs speed, not correctness. On the CPU and on
Apple's unified memory there is nothing to move and both are no-ops; on CUDA
they need the CUDA runtime library that MLX's CUDA build itself loaded.
Neither calls MLX, so the SSD writer's thread may use them.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mlxd.kv.tiers import PoolUsage
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.device_memory")

_ADVISE_READ_MOSTLY = 1  # cudaMemAdviseSetReadMostly
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost


class _Location(ctypes.Structure):  # cudaMemLocation (CUDA 12.2+ signatures, the only ones in CUDA 13)
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # numpy 2 moved it


def byte_range(buffer: Any) -> tuple[int, int]:
    """(address, length) of the memory a buffer spans (strided views included)."""
    arr = np.asarray(buffer)
    if arr.size == 0:
        return (0, 0)
    lo, hi = _byte_bounds(arr)
    return (int(lo), int(hi - lo))


class ManagedMemory:
    """The CUDA runtime's managed-memory hints for one device, through ctypes."""

    def __init__(self, lib: Any, *, device: int = 0) -> None:
        self._lib = lib
        self._device = device
        version = ctypes.c_int()
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        self.failures = 0
        self._warned = threading.Event()

    def read_mostly(self, buffers: Iterable[Any]) -> int:
        """Let the host read these buffers without taking them from the device. Returns bytes advised."""
        done = 0
        for address, length in map(byte_range, buffers):
            if length and self._call("cudaMemAdvise", address, length, _ADVISE_READ_MOSTLY,
                                     _Location(_LOCATION_DEVICE, self._device)):
                done += length
        return done

    @property
    def lib(self) -> Any:
        """The CUDA runtime library these calls go through (MLX's own)."""
        return self._lib

    def to_device(self, buffers: Iterable[Any]) -> int:
        """Start moving these buffers to the device (asynchronous). Returns bytes requested."""
        done = 0
        for address, length in map(byte_range, buffers):
            if length and self._call("cudaMemPrefetchAsync", address, length,
                                     _Location(_LOCATION_DEVICE, self._device), 0, None):
                done += length
        return done

    def _call(self, name: str, address: int, length: int, *args: Any) -> bool:
        fn = getattr(self._lib, name)
        err = int(fn(ctypes.c_void_p(address), ctypes.c_size_t(length), *args))
        if err == 0:
            return True
        self.failures += 1
        if not self._warned.is_set():
            self._warned.set()
            log.warning("device_memory.hint_failed", call=name, cuda_error=err)
        return False


_POOL_RESERVED = 5  # cudaMemPoolAttrReservedMemCurrent: device memory the pool holds
_POOL_USED = 7  # cudaMemPoolAttrUsedMemCurrent: of it, allocations not freed


class DevicePool:
    """The device's default stream-ordered memory pool: where MLX's CUDA build takes the memory of the arrays
    its kernels write (`cudaMallocAsync`), and where it gives back what it frees past its own buffer cache
    (`cudaFreeAsync`).

    What the pool holds (`reserved_bytes`) and what of it is allocated (`used_bytes`) tell how much of a
    process's share of the device (what nvidia-smi shows) is this pool's, and how much of that it keeps free.
    CUDA gives free pool memory back at synchronizations down to the pool's release threshold (0 by default,
    which MLX leaves); `trim` gives it back now, down to `keep` bytes. Memory a kernel still uses, or whose free
    the host has not seen complete, stays (the caller synchronizes its streams first). No MLX calls: any thread
    may call it."""

    def __init__(self, lib: Any, *, device: int = 0) -> None:
        self._lib = lib
        self._handle = ctypes.c_void_p()
        err = int(lib.cudaDeviceGetDefaultMemPool(ctypes.byref(self._handle), device))
        if err != 0:
            raise OSError(f"cudaDeviceGetDefaultMemPool failed (CUDA error {err})")
        self.trims = 0  # trims that ran
        self.trimmed_bytes = 0  # reserved bytes they gave back to the device

    def usage(self) -> PoolUsage | None:
        """What the pool reserves and what of it is allocated; None if the runtime would not say."""
        reserved, used = ctypes.c_uint64(), ctypes.c_uint64()
        for attr, out in ((_POOL_RESERVED, reserved), (_POOL_USED, used)):
            if int(self._lib.cudaMemPoolGetAttribute(self._handle, attr, ctypes.byref(out))) != 0:
                return None
        return PoolUsage(reserved.value, used.value, self.trims, self.trimmed_bytes)

    def trim(self, keep: int) -> int:
        """Give the device back what the pool reserves past `keep` bytes (at least); the bytes given back."""
        before = self.usage()
        err = int(self._lib.cudaMemPoolTrimTo(self._handle, ctypes.c_size_t(max(0, keep))))
        if err != 0:
            log.warning("device_memory.trim_failed", cuda_error=err)
            return 0
        after = self.usage()
        freed = max(0, before.reserved_bytes - after.reserved_bytes) if before and after else 0
        self.trims += 1
        self.trimmed_bytes += freed
        return freed


def _cudart_candidates() -> list[str]:
    """The CUDA runtime this process already mapped (MLX's), then the usual install places."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    for root in [p for p in sys.path if p and os.path.isdir(p)] + ["/usr/local/cuda/lib64"]:
        for pattern in ("nvidia/*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*", "libcudart.so*"):
            found += sorted(p for p in glob.glob(os.path.join(root, pattern)) if p not in found)
    return found


def _is_cuda() -> bool:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def is_metal() -> bool:
    """Does MLX run on an Apple GPU (unified memory; the restore landing there is not measured yet)?"""
    import mlx.core as mx

    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available() and mx.default_device() == mx.gpu)


_managed: ManagedMemory | None = None
_resolved = False
_lock = threading.Lock()


def managed() -> ManagedMemory | None:
    """The hints for MLX's CUDA device, or None where memory is not managed (CPU, Metal) or no runtime loads."""
    global _managed, _resolved
    with _lock:
        if _resolved:
            return _managed
        _resolved = True
        if not _is_cuda():
            return None
        for path in _cudart_candidates():
            try:
                _managed = ManagedMemory(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
            log.info("device_memory.managed", cudart=path, version=_managed.version)
            return _managed
        log.warning("device_memory.no_cudart",
                    consequence="SSD writes and restores will move KV pages between host and device on demand")
        return None


def read_mostly(buffers: Sequence[Any]) -> int:
    """`ManagedMemory.read_mostly` where memory is managed; else 0."""
    m = managed()
    return m.read_mostly(buffers) if m is not None else 0


def to_device(buffers: Sequence[Any]) -> int:
    """`ManagedMemory.to_device` where memory is managed; else 0."""
    m = managed()
    return m.to_device(buffers) if m is not None else 0


_pool: DevicePool | None = None
_pool_resolved = False


def device_pool() -> DevicePool | None:
    """MLX's CUDA device's memory pool, or None off CUDA, without a runtime, or on a device without pools."""
    global _pool, _pool_resolved
    m = managed()
    with _lock:
        if _pool_resolved:
            return _pool
        _pool_resolved = True
        if m is None:
            return None
        try:
            _pool = DevicePool(m.lib)
        except (OSError, AttributeError) as exc:
            log.info("device_memory.no_pool", reason=str(exc))
        return _pool
