"""Managed-memory hints (runtime/device_memory.py): no-ops off CUDA, exact byte ranges everywhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxd.kv import file_format, kinds
from mlxd.runtime import device_memory


def test_byte_range_spans_exactly_the_buffer_memory():
    base = np.arange(4 * 6 * 8, dtype=np.uint16).reshape(4, 6, 8)
    assert device_memory.byte_range(memoryview(base)) == (base.ctypes.data, base.nbytes)
    strided = base[:, 2:5, :]  # a view into the middle of each leading row
    address, length = device_memory.byte_range(memoryview(strided))
    assert address == base.ctypes.data + 2 * 8 * 2
    assert address + length == base.ctypes.data + (3 * 6 + 5) * 8 * 2
    assert device_memory.byte_range(memoryview(np.zeros(0, np.uint8))) == (0, 0)
    # An MLX array's memoryview (what the SSD writer reads) spans its own nbytes.
    a = mx.arange(1000, dtype=mx.float32)
    mx.eval(a)
    assert device_memory.byte_range(memoryview(a))[1] == a.nbytes


def test_off_cuda_the_hints_do_nothing_and_adopt_reports_what_landed(tmp_path):
    assert mx.default_device() == mx.cpu  # CI and this machine: nothing to move
    assert device_memory.managed() is None
    assert device_memory.read_mostly([memoryview(np.ones(16))]) == 0
    assert device_memory.to_device([memoryview(np.ones(16))]) == 0
    # kinds.adopt hands the landing hook the memory of every array it made, after the copy.
    from mlx_lm.models.cache import KVCache

    caches = []
    for layer in range(2):
        c = KVCache()
        k = mx.random.normal((1, 2, 5, 4)).astype(mx.bfloat16)
        c.update_and_fetch(k, k + layer)
        caches.append(c)
    meta = file_format.SnapshotMeta(model_id="m", config_fingerprint="f", namespace="", tokenizer_hash="t",
                                    tokens=range(5))
    path = tmp_path / f"x{file_format.EXTENSION}"
    file_format.write_snapshot(kinds.plan_snapshot(caches, meta=meta), path, direct=False)
    seen: list[memoryview] = []
    adopted = kinds.adopt(file_format.read_snapshot(path, verify=True), landed=seen.extend)
    assert len(seen) == 4 and sum(v.nbytes for v in seen) == sum(c.keys[..., :5, :].nbytes * 2 for c in caches)
    for a, b in zip(adopted, caches, strict=True):
        assert a.keys.dtype == mx.bfloat16
        assert mx.array_equal(a.keys[..., :5, :], b.keys[..., :5, :]) and mx.array_equal(a.values[..., :5, :], b.values[..., :5, :])


class _Runtime:
    """The CUDA runtime's ABI as ctypes sees it (this machine has no GPU): records each call."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def cudaRuntimeGetVersion(self, out):  # noqa: N802
        out._obj.value = 13000
        return 0

    def cudaMemAdvise(self, ptr, size, advice, location):  # noqa: N802
        self.calls.append(("advise", ptr.value, size.value, advice, location.type, location.id))
        return 700 if self.fail else 0

    def cudaMemPrefetchAsync(self, ptr, size, location, flags, stream):  # noqa: N802
        self.calls.append(("prefetch", ptr.value, size.value, location.type, location.id, flags, stream))
        return 0


def test_managed_memory_passes_each_buffer_range_to_the_cuda_runtime():
    rt = _Runtime()
    m = device_memory.ManagedMemory(rt)
    assert m.version == 13000
    a, b = np.ones(1024, np.uint16), np.ones((3, 4), np.float32)
    assert m.read_mostly([memoryview(a), memoryview(b)]) == a.nbytes + b.nbytes
    assert rt.calls == [("advise", a.ctypes.data, a.nbytes, 1, 1, 0), ("advise", b.ctypes.data, b.nbytes, 1, 1, 0)]
    rt.calls.clear()
    assert m.to_device([memoryview(a)]) == a.nbytes
    assert rt.calls == [("prefetch", a.ctypes.data, a.nbytes, 1, 0, 0, None)]
    # A refused hint costs speed, never correctness: counted, logged once, nothing raised.
    failing = device_memory.ManagedMemory(_Runtime(fail=True))
    assert failing.read_mostly([memoryview(a), memoryview(b)]) == 0 and failing.failures == 2


class _Pool:
    """CUDA's default memory pool as ctypes sees it: what it reserves and what of it is allocated; a trim gives
    the device back the free part past `keep` (never what is allocated)."""

    def __init__(self, reserved: int, used: int, *, fail_trim: bool = False) -> None:
        self.reserved, self.used, self.fail_trim = reserved, used, fail_trim
        self.trims: list[int] = []

    def cudaDeviceGetDefaultMemPool(self, out, device):  # noqa: N802
        out._obj.value = 0xBEEF
        return 0

    def cudaMemPoolGetAttribute(self, pool, attr, out):  # noqa: N802
        assert pool.value == 0xBEEF
        out._obj.value = {5: self.reserved, 7: self.used}[attr]  # ReservedMemCurrent, UsedMemCurrent
        return 0

    def cudaMemPoolTrimTo(self, pool, keep):  # noqa: N802
        self.trims.append(keep.value)
        if self.fail_trim:
            return 1
        self.reserved = max(self.used, min(self.reserved, keep.value))
        return 0


def test_the_device_pool_reports_and_trims_what_cuda_reserves():
    from mlxd.kv.tiers import PoolUsage

    MiB = 1 << 20
    rt = _Pool(reserved=900 * MiB, used=100 * MiB)
    pool = device_memory.DevicePool(rt)
    assert pool.usage() == PoolUsage(900 * MiB, 100 * MiB, trims=0, trimmed_bytes=0)
    assert pool.trim(108 * MiB) == 792 * MiB  # down to what is kept past the allocations
    assert rt.trims == [108 * MiB] and pool.usage() == PoolUsage(108 * MiB, 100 * MiB, 1, 792 * MiB)
    assert pool.trim(0) == 8 * MiB and rt.reserved == 100 * MiB  # never below what is allocated
    assert pool.trim(0) == 0 and pool.trims == 3 and pool.trimmed_bytes == 800 * MiB
    failing = device_memory.DevicePool(_Pool(reserved=900 * MiB, used=100 * MiB, fail_trim=True))
    assert failing.trim(0) == 0 and failing.trims == 0  # refused: nothing counted, nothing raised

    class NoPools(_Pool):
        def cudaDeviceGetDefaultMemPool(self, out, device):  # noqa: N802
            return 801  # cudaErrorNotSupported: a device without memory pools

    with pytest.raises(OSError, match="cudaDeviceGetDefaultMemPool"):
        device_memory.DevicePool(NoPools(0, 0))
    assert device_memory.device_pool() is None  # the CPU: no pool
