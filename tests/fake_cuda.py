"""A stand-in for the CUDA runtime calls `runtime/host_memory.py` makes, for CPU tests and traces.

It answers `cudaStreamCreateWithFlags`, `cudaMemPrefetchAsync`, `cudaMemcpyAsync`, `cudaMemcpy2DAsync`,
`cudaStreamSynchronize`, `cudaStreamQuery`, `cudaEvent*`, `cudaHostAlloc` as ctypes would, keeps
one timeline per stream, and records every call (thread, stream, direction, bytes,
when it was issued and when the stream reached it). Time is simulated from an
H200's measured rates (docs/benchmarks.md, "Host-memory tier on the H200"): a
migration to the host runs synchronously in the calling thread at `to_host_Bps`
(the driver does it there: issuing 1.88 GB took 0.23-0.28 s "not waited"), a
migration to the device is queued on its stream at `to_device_Bps`, a pinned copy
at `copy_Bps`. `scale` multiplies every byte count (a tiny model's KV stands for a
16k-token prefix of the 1.7B shape). Nothing here touches memory.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import attrs
import pytest

NOT_READY = 600  # cudaErrorNotReady


@attrs.define
class Call:
    op: str  # prefetch_host | prefetch_device | copy | sync | query
    thread: str
    stream: int
    nbytes: int  # scaled
    issued: float  # seconds since the fake started
    starts: float  # when its stream reaches it (after the work queued before it)
    ends: float


class FakeCudaLib:
    def __init__(self, *, scale: float = 1.0, to_host_Bps: float = 7.5e9, to_device_Bps: float = 40e9,
                 copy_Bps: float = 50e9) -> None:
        self.scale = scale
        self.to_host_Bps, self.to_device_Bps, self.copy_Bps = to_host_Bps, to_device_Bps, copy_Bps
        self.calls: list[Call] = []
        # Tests: while `gate` is clear, a migration to the host waits inside the call (`entered` set), as
        # one in flight would; `entered` says a thread is in it.
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        # While `device_gate` is clear, a migration to the device waits inside the call too, as one issued
        # while the driver finishes another thread's migration does (an H100: 299 ms).
        self.device_gate: threading.Event | None = None
        self.entered_device = threading.Event()  # a thread is in a migration to the device
        self._busy: dict[int, float] = {}  # stream -> when its queued work ends (perf_counter)
        self._events: dict[int, float] = {}  # event -> when its stream reaches it
        self._next = 1
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # --- the runtime's calls ----------------------------------------------------------------

    def cudaStreamCreateWithFlags(self, ref: Any, flags: int) -> int:
        with self._lock:
            sid, self._next = self._next, self._next + 1
            self._busy[sid] = 0.0
        ref._obj.value = sid
        return 0

    def cudaMemPrefetchAsync(self, address: Any, n: Any, where: Any, *rest: Any) -> int:
        stream = _int(rest[-1])
        to_host = _int(where) == -1 if not hasattr(where, "type") else where.type == 2
        nbytes = int(_int(n) * self.scale)
        if to_host:  # synchronous in the calling thread, after the stream's queued work
            self.entered.set()
            if self.gate is not None:
                self.gate.wait()
            start, end = self._queue(stream, nbytes / self.to_host_Bps)
            _sleep_until(end)
            self._record("prefetch_host", stream, nbytes, start, end)
        else:
            self.entered_device.set()
            if self.device_gate is not None:
                self.device_gate.wait()
            start, end = self._queue(stream, nbytes / self.to_device_Bps)
            self._record("prefetch_device", stream, nbytes, start, end)
        return 0

    def cudaMemcpyAsync(self, dst: Any, src: Any, n: Any, kind: int, stream: Any) -> int:
        ctypes.memmove(_int(dst), _int(src), _int(n))  # pinned copies are real (the SSD writer's staging)
        nbytes = int(_int(n) * self.scale)
        start, end = self._queue(_int(stream), nbytes / self.copy_Bps)
        self._record("copy", _int(stream), nbytes, start, end)
        return 0

    def cudaMemcpy2DAsync(self, dst: Any, dpitch: Any, src: Any, spitch: Any, width: Any, height: Any, kind: int,
                          stream: Any) -> int:
        d, s, w = _int(dst), _int(src), _int(width)
        for row in range(_int(height)):  # real, as the 1D copy's
            ctypes.memmove(d + row * _int(dpitch), s + row * _int(spitch), w)
        nbytes = int(w * _int(height) * self.scale)
        start, end = self._queue(_int(stream), nbytes / self.copy_Bps)
        self._record("copy", _int(stream), nbytes, start, end)
        return 0

    def cudaStreamSynchronize(self, stream: Any) -> int:
        sid = _int(stream)
        with self._lock:
            end = self._busy.get(sid, 0.0)
        t = time.perf_counter()
        _sleep_until(end)
        self._record("sync", sid, 0, t, max(t, end))
        return 0

    def cudaStreamQuery(self, stream: Any) -> int:
        with self._lock:
            end = self._busy.get(_int(stream), 0.0)
        return 0 if time.perf_counter() >= end else NOT_READY

    def cudaEventCreate(self, ref: Any) -> int:
        with self._lock:
            eid, self._next = self._next, self._next + 1
        ref._obj.value = eid
        return 0

    def cudaEventRecord(self, event: Any, stream: Any) -> int:
        with self._lock:  # it fires when the stream gets there
            self._events[_int(event)] = max(time.perf_counter(), self._busy.get(_int(stream), 0.0))
        return 0

    def cudaEventElapsedTime(self, ref: Any, start: Any, end: Any) -> int:
        with self._lock:
            a, b = self._events.get(_int(start)), self._events.get(_int(end))
        if a is None or b is None or time.perf_counter() < b:
            return NOT_READY
        ref._obj.value = (b - a) * 1000
        return 0

    def cudaEventDestroy(self, event: Any) -> int:
        with self._lock:
            self._events.pop(_int(event), None)
        return 0

    def cudaHostAlloc(self, ref: Any, n: Any, flags: int) -> int:
        return 2  # cudaErrorMemoryAllocation: the caller falls back to pageable memory

    def cudaFreeHost(self, ptr: Any) -> int:
        return 0

    # --- internals ------------------------------------------------------------------------

    def _queue(self, stream: int, seconds: float) -> tuple[float, float]:
        with self._lock:
            start = max(time.perf_counter(), self._busy.get(stream, 0.0))
            end = start + seconds
            self._busy[stream] = end
        return start, end

    def _record(self, op: str, stream: int, nbytes: int, start: float, end: float) -> None:
        with self._lock:
            self.calls.append(Call(op, threading.current_thread().name, stream, nbytes, self.now(),
                                   start - self.t0, end - self.t0))


def _int(x: Any) -> int:
    if isinstance(x, int):
        return x
    v = getattr(x, "value", x)
    return int(v or 0)


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def install(monkeypatch: Any, lib: FakeCudaLib, *, version: int = 12000) -> Any:
    """Make `host_memory` run on the fake (pytest's monkeypatch, or any object with setattr)."""
    from mlxd.runtime import host_memory

    cuda = host_memory._Cuda(lib, version)
    monkeypatch.setattr(host_memory, "_cuda", cuda)
    monkeypatch.setattr(host_memory, "_resolved", True)
    return cuda


class Patch:
    """A minimal monkeypatch for scripts: `setattr` now, `undo()` later."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()


__all__ = ["Call", "FakeCudaLib", "Patch", "install", "ctypes"]


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> FakeCudaLib:
    """The fake runtime installed for one test, copies as fast as they come (import it into a test module)."""
    fake = FakeCudaLib(copy_Bps=1e12)
    install(monkeypatch, fake)
    return fake
