"""Device addresses of evaluated MLX arrays, read without a host access (CUDA), for DMA copies.

On MLX's CUDA backend an array lives in device memory until the host first touches it: a `memoryview`, numpy or
DLPack access converts its whole buffer to managed memory (an allocation and a synchronous copy, with the GIL
held). A finished 8k-token row's write plan paid ~85 ms for that on an H100 and ~75 ms on an H200, and every
other row waited (docs/benchmarks.md, "H100, 2026-12-06 09:01"). DLPack gives no way around it: MLX exports
the converted host pointer (device type CPU).

A custom CUDA kernel receives each input's device address (its buffer's plus its offset) and, when its source
names them, its strides. `addresses()` runs one that writes those into a small output on the given stream, so
the SSD writer's copy lane (`runtime/host_memory.py`) can DMA the bytes into page-locked memory while the arrays
stay device memory. `device_views()` wraps each address in a numpy array of the array's shape, dtype and strides
over that address, which no host code may read: only `host_memory.to_host` (copies by address) takes them.

Off CUDA (the CPU backend, Apple's unified memory) there is nothing to convert: both return None and callers keep
their memoryviews.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.device_pointers")

CHUNK = 16  # inputs per kernel (one compiled kernel per input count and rank, at most CHUNK of them)

_kernels: dict[tuple[int, ...], Any] = {}
_lock = threading.Lock()
_broken: list[str] = []  # the first failure: later calls return None at once


def kernel_source(ranks: Sequence[int]) -> str:
    """The kernel's body for inputs `a0..` of these ranks: input i's address, then its strides (elements),
    at its own offset in `out` (`1 + rank` words each, in input order). One thread does it all."""
    lines = ["if (blockIdx.x != 0 || threadIdx.x != 0) return;"]
    at = 0
    for i, rank in enumerate(ranks):
        lines.append(f"out[{at}] = (uint64_t)(a{i});")
        lines.extend(f"out[{at + 1 + d}] = (uint64_t)(a{i}_strides[{d}]);" for d in range(rank))
        at += 1 + rank
    return "\n".join(lines)


def _kernel(ranks: tuple[int, ...]) -> Any:
    import mlx.core as mx

    with _lock:
        k = _kernels.get(ranks)
        if k is None:
            k = _kernels[ranks] = mx.fast.cuda_kernel(
                name="mlxd_addresses_" + "_".join(map(str, ranks)),
                input_names=[f"a{i}" for i in range(len(ranks))],
                output_names=["out"],
                source=kernel_source(ranks),
                ensure_row_contiguous=False,  # a copy would hand us a temporary's address
            )
        return k


def available() -> bool:
    """Can addresses be read here and copied from (MLX on a CUDA device, the CUDA runtime's copies that
    `host_memory` makes, no earlier failure)? Without those copies nothing could take a plan of addresses."""
    import mlx.core as mx

    from mlxd.runtime import host_memory

    if _broken:
        return False
    try:
        on_cuda = bool(mx.default_device() == mx.gpu and mx.cuda.is_available())
    except AttributeError:  # an MLX without `mx.cuda`
        return False
    return on_cuda and host_memory.separate_host_memory()


def addresses(arrays: Sequence[Any], *, stream: Any = None) -> list[tuple[int, tuple[int, ...]]] | None:
    """(device address, strides in elements) of each evaluated array, in order; None off CUDA, for an array of
    rank 0 or of no elements, or if the kernel fails (logged once; later calls return None). `stream`: where the kernels run
    (default: MLX's default stream); the call waits for them (a few µs of the device, one small read back)."""
    import mlx.core as mx

    if not arrays or not available() or any(a.ndim == 0 or a.size == 0 for a in arrays):
        return None  # (rank 0 has no strides to name; an empty array may have no memory at all)
    try:
        outs, layouts = [], []
        for lo in range(0, len(arrays), CHUNK):
            part = arrays[lo : lo + CHUNK]
            ranks = tuple(a.ndim for a in part)
            (out,) = _kernel(ranks)(
                inputs=list(part), output_shapes=[(sum(1 + r for r in ranks),)], output_dtypes=[mx.uint64],
                grid=(1, 1, 1), threadgroup=(1, 1, 1), stream=stream)
            outs.append(out)
            layouts.append(ranks)
        mx.eval(outs)
        found: list[tuple[int, tuple[int, ...]]] = []
        for out, ranks in zip(outs, layouts, strict=True):
            words = [int(w) for w in np.array(out, copy=False)]  # (a small output: its own conversion only)
            at = 0
            for rank in ranks:
                strides = tuple(int(np.int64(np.uint64(w))) for w in words[at + 1 : at + 1 + rank])
                found.append((words[at], strides))
                at += 1 + rank
        return found
    except Exception as exc:  # an MLX or driver that cannot: callers keep the host read
        if not _broken:
            _broken.append(repr(exc))
            log.warning("device_pointers.unavailable", error=repr(exc))
        return None


def view_at(address: int, shape: Sequence[int], dtype: np.dtype[Any], strides: Sequence[int]) -> np.ndarray:
    """A numpy array of `shape`/`dtype`/`strides` (elements) over memory at `address`, made without reading it.
    Device memory: never read it on the host; only copy it by address (`host_memory.to_host`)."""
    itemsize = dtype.itemsize
    byte_strides = tuple(int(s) * itemsize for s in strides)
    if any(n == 0 for n in shape):
        return np.empty(tuple(shape), dtype=dtype)
    if any(s < 0 for s in byte_strides):
        raise ValueError("negative strides")
    extent = itemsize + sum((n - 1) * s for n, s in zip(shape, byte_strides, strict=True))
    raw = (ctypes.c_uint8 * extent).from_address(address)  # an address, not a read
    return np.ndarray(tuple(shape), dtype=dtype, buffer=raw, strides=byte_strides)


def device_views(arrays: Sequence[Any], *, stream: Any = None) -> list[np.ndarray] | None:
    """`view_at` for each evaluated array (its address and strides from `addresses`); None where that is."""
    from mlxd.kv.kinds import numpy_dtype

    found = addresses(arrays, stream=stream)
    if found is None:
        return None
    return [view_at(address, a.shape, numpy_dtype(a), strides)
            for a, (address, strides) in zip(arrays, found, strict=True)]
