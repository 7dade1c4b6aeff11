"""Managed-memory hints (runtime/device_memory.py): no-ops off CUDA, exact byte ranges everywhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

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
