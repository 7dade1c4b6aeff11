# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Can a write plan get a fresh array's bytes to the host without the host read that converts it (issue 28)?

On the H200 (2026-12-06, `final_plan-h200-ssd-20261206-063924.json`) a step that only left 4 finished rows of
8k tokens took ~290 ms: each row's final write plan takes a `memoryview` of every array, and on MLX's CUDA backend
that first host access converts the array's buffer to managed memory (an allocation and a synchronous copy with
the GIL held: ~75 ms per 940 MB row; `time_plan_snapshot.py`'s round 0). Every other row waits for it.

The way around it, if MLX gives one: the array's data pointer from DLPack (`__dlpack__`, no host access) and one
DMA per contiguous run into pinned host memory on a stream of our own (`runtime/host_memory.py`'s copy lane:
`cudaMemcpyAsync` / `cudaMemcpy2DAsync`, the GIL released in each call). Here, on fresh KV caches of the 1.7B
shape sliced to their length as a plan slices them, per round and size: (a) DLPack: the device it reports, the
export's time, the copy's time (and the longest gap of a 1 ms ticker thread: the GIL held that long), (b) the
plan's path on the same arrays (`memoryview`, first access), and whether (a)'s bytes equal (b)'s; then (c) the
`memoryview` path alone on fresh arrays, for the cost (a) would replace. Off CUDA the copy is a host memmove
(the same bytes, no device); the script then only checks the DLPack reading. No model, no server.

    python3 benchmarks/gpu/probe_dlpack_copy.py --tokens 8192 --rounds 3 --json OUT.json
    wave3.sh dlpackcopy
"""

from __future__ import annotations

import mlxd  # noqa: F401

import ctypes
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_plan_snapshot import Ticker, caches_of, probe_main, probe_meta, timed  # noqa: E402


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def exported(array: Any) -> tuple[Any, Any, int]:
    """(the DLPack capsule, kept alive while its memory is used; a numpy array describing that memory without
    reading it; the device type DLPack reports: 1 CPU, 2 CUDA, 13 CUDA managed)."""
    import numpy as np

    capsule = array.__dlpack__()
    t = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor
    itemsize = t.dtype.bits // 8
    shape = [t.shape[i] for i in range(t.ndim)]
    strides = [t.strides[i] * itemsize for i in range(t.ndim)] if t.strides else None
    extent = itemsize + sum((n - 1) * s for n, s in zip(shape, strides or [], strict=False)) if strides else \
        itemsize * int(np.prod(shape))
    raw = (ctypes.c_uint8 * (int(t.byte_offset) + extent)).from_address(t.data)  # an address, not a read
    view = np.ndarray(shape, dtype=np.dtype(f"u{itemsize}"), buffer=raw, offset=int(t.byte_offset), strides=strides)
    return capsule, view, int(t.device.device_type)


def copy_out(views: list[Any]) -> tuple[Any, int]:
    """The views' bytes, in C order one after another, in one pinned host buffer (plain off CUDA); the calls made."""
    import numpy as np

    from mlxd.runtime import host_memory

    total = sum(v.nbytes for v in views)
    buf = host_memory.alloc(total)
    cuda = host_memory._runtime()
    if cuda is None:  # unified memory: a memmove per run
        at = 0
        for v in views:
            flat = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
            buf.array[at : at + flat.nbytes] = flat
            at += flat.nbytes
        return buf, 0
    copies, at = [], buf.array.ctypes.data
    for v in views:
        for address, width, height, pitch in host_memory._strided(v):
            copies.append(host_memory.Copy(dst=at, src=address, width=width, height=height, pitch=pitch))
            at += width * height
    return buf, cuda.copy(copies)


def one_round(tokens: int, ticker: Ticker) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from mlxd.kv import kinds

    row: dict[str, Any] = {"tokens": tokens}
    caches = caches_of(tokens, mx.bfloat16)
    arrays: list[Any] = []
    for c in caches:
        kinds.kind_of(c).plan(c, arrays)
    arrays = [a.view(mx.uint16) for a in arrays]
    mx.eval(arrays)
    try:
        exports, row["dlpack_ms"], row["dlpack_gap_ms"] = timed(ticker, lambda: [exported(a) for a in arrays])
    except Exception as exc:  # (an MLX that cannot export these)
        row["dlpack_error"] = f"{type(exc).__name__}: {exc}"
        return row
    row["dlpack_device_type"] = sorted({d for _, _, d in exports})
    views_out = [v for _, v, _ in exports]
    try:
        (buf, calls), row["copy_ms"], row["copy_gap_ms"] = timed(ticker, lambda: copy_out(views_out))
    except Exception as exc:  # (a pointer the runtime refuses to copy from)
        row["copy_error"] = f"{type(exc).__name__}: {exc}"
        return row
    row["copy_calls"], row["copy_mb"] = calls, round(buf.nbytes / 1e6, 1)
    views, row["memoryview_ms"], row["memoryview_gap_ms"] = timed(ticker, lambda: [memoryview(a) for a in arrays])
    plain = np.concatenate([np.asarray(v).reshape(-1).view(np.uint8) for v in views])
    row["equal"] = bool(np.array_equal(plain, buf.array[: plain.nbytes]))
    del views, buf  # (the exports go with the round)
    fresh = caches_of(tokens, mx.bfloat16)  # (c) the plan's path alone on arrays no one touched
    row["plan_fresh_ms"] = timed(ticker, lambda: kinds.plan_snapshot(fresh, meta=probe_meta(tokens)))[1]
    return row


def main() -> int:
    return probe_main(one_round, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
