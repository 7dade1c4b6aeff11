"""Python's garbage collector: the serving heap frozen after start-up, and every pause counted.

A full collection (generation 2) walks every container object the process holds, with the GIL held
all along: every thread stops, the engine between two steps and the event loop before it reads a
request. A started server holds about 133,000 of them, nearly all from start-up (mlx-lm, the
tokenizer, Quart, the model's modules); on this project's 2-core CPU machines one full collection
took 58-88 ms, and while serving one came after 570-640 requests (two runs), on whichever thread
allocated last (docs/benchmarks.md, "Garbage-collector pauses"). `freeze_heap` moves everything
alive after start-up into the permanent generation (`gc.freeze`), which collections skip: a full
collection then walks only what serving created since (3.5 ms against 73 ms in that run). vLLM
freezes its heap the same way at the end of its warm-up; SGLang offers it as an API beside a
warning for long collections.

A frozen object is never collected as part of a reference cycle: what start-up made and serving later
drops in a cycle would stay. What serving drops of start-up's making is freed by its reference count:
the engine's generator after a failed step (with the batch it held: mlx-lm's rows form cycles, but
they are made while serving, after the freeze) is gone at once, checked frozen (tests/test_gc_pauses.py).
`thaw` undoes the freeze (a server stopping in a process that goes on).

`GcPauses` times every collection (`gc.callbacks`) for `/stats` `gc` and `/metrics`, and tells the
stall watch how much of a stall was a collection (runtime/stall_watch.py): a collection stops the
watcher's thread too, so its frames cannot show one.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from typing import Any

import attrs

from mlxd.runtime.config import env_switch

LONG_S = 0.02  # a collection this long or longer is kept in `recent` (a stall the stall watch would see)
KEEP = 8  # long collections kept
WINDOW = 64  # the last collections kept for `paused_between`


def freeze_wanted() -> bool:
    """`MLXD_GC_FREEZE`: on unless set to 0/off/false (an arm for the same run with and without it)."""
    return env_switch("MLXD_GC_FREEZE", default=True)


def freeze_heap() -> dict[str, Any]:
    """Collect once, then move every object alive into the permanent generation (`gc.freeze`).

    Returns what it did, for the log: the objects frozen, how long the collection took, what it
    collected."""
    t0 = time.perf_counter()
    collected = gc.collect()
    collect_s = time.perf_counter() - t0
    gc.freeze()
    return {"frozen": gc.get_freeze_count(), "collected": collected, "collect_ms": round(collect_s * 1e3, 1)}


def thaw() -> None:
    """Undo `freeze_heap`: the frozen objects go back to the oldest generation, collected as before."""
    gc.unfreeze()


@attrs.define
class GcPauses:
    """Every collection's generation and length (process-wide: `gc.callbacks`); `install` adds the hook."""

    long_s: float = LONG_S
    collections: list[int] = attrs.Factory(lambda: [0, 0, 0])
    paused_s: list[float] = attrs.Factory(lambda: [0.0, 0.0, 0.0])
    max_s: list[float] = attrs.Factory(lambda: [0.0, 0.0, 0.0])
    long: int = 0
    recent: deque[dict[str, Any]] = attrs.Factory(lambda: deque(maxlen=KEEP))
    _window: deque[tuple[float, float]] = attrs.Factory(lambda: deque(maxlen=WINDOW))  # (start, end), monotonic
    _began: float | None = None
    _started: float = attrs.Factory(time.monotonic)

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # Runs in the thread that triggered the collection, with the GIL held: no other callback runs meanwhile.
        now = time.monotonic()
        if phase == "start":
            self._began = now
            return
        began, self._began = self._began, None
        if began is None:  # installed during a collection
            return
        gen = min(2, max(0, int(info.get("generation", 0))))
        took = now - began
        self.collections[gen] += 1
        self.paused_s[gen] += took
        self.max_s[gen] = max(self.max_s[gen], took)
        self._window.append((began, now))
        if took >= self.long_s:
            self.long += 1
            self.recent.append({"generation": gen, "ms": round(took * 1e3, 1), "thread": threading.current_thread().name,
                                "at_s": round(began - self._started, 3), "collected": info.get("collected")})

    def paused_between(self, start: float, end: float) -> float:
        """Seconds of collections within [start, end] (`time.monotonic`), of the last `WINDOW` ones."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in list(self._window))

    def stats(self) -> dict[str, Any]:
        return {"gc": {
            "frozen_objects": gc.get_freeze_count(), "collections": list(self.collections),
            "paused_s": [round(s, 4) for s in self.paused_s], "max_ms": [round(s * 1e3, 2) for s in self.max_s],
            "long_ms": round(self.long_s * 1e3, 1), "long": self.long, "recent": list(self.recent),
        }}


_process: GcPauses | None = None
_lock = threading.Lock()


def process_pauses() -> GcPauses:
    """The process's one `GcPauses`, installed on first use (several servers in a process share it)."""
    global _process
    with _lock:
        if _process is None:
            _process = GcPauses().install()
        return _process
