"""Event-loop stalls, caught while they last: a diagnostic (`MLXD_STALL_WATCH_MS=20 mlxd serve ...`).

Everything the server does between a request's bytes and the engine runs on the trio thread; when
that thread does not run (its own work blocks it, or another thread holds the GIL) a request that
arrives waits before the server has read it, and no server-side clock sees the wait (the H200, 04:55
UTC 2026-12-05: a returning turn's request waited 80.7 ms before its body was read, right after the
turn before it ended). A trio task beats every `period_s`; a watcher thread that finds the beat
late by `threshold_s` takes every thread's top frames then, and the trio task, once it runs again,
records the stall with them (`stats()`, under `/stats` `event_loop`). If the trio thread's own frame
is in the server's code, it was busy; if it is in trio's wait, another thread held the GIL (the
watcher waits for the GIL too, so it sees the holder between two of its bytecodes, or just after).
A garbage collection holds the GIL without a bytecode between: each stall also says how many of its
ms were collections (`gc_ms`, runtime/gc_pauses.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import attrs
import trio

from mlxd.runtime.gc_pauses import GcPauses
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.stall_watch")

FRAMES = 4  # innermost frames kept per thread


def _frames(skip: int) -> dict[str, list[str]]:
    """Every thread's innermost `FRAMES` frames as `file:line function`, by thread name (not `skip`'s)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        stack = traceback.extract_stack(frame)[-FRAMES:]
        out[names.get(ident, str(ident))] = [f"{_short(s.filename)}:{s.lineno} {s.name}" for s in reversed(stack)]
    return out


def _short(path: str) -> str:
    """A frame's file: under mlxd/ from there, else its last two parts (`trio/_core/_run.py` -> `_core/_run.py`)."""
    if "/mlxd/" in path:
        return "mlxd/" + path.split("/mlxd/")[-1]
    return "/".join(path.split("/")[-2:])


@attrs.define
class StallWatch:
    """Counts the trio thread's stalls of `threshold_s` or more, the last `keep` with the threads' frames."""

    threshold_s: float
    period_s: float = 0.005
    keep: int = 8
    stalls: int = 0
    stalled_s: float = 0.0
    max_s: float = 0.0
    recent: list[dict[str, Any]] = attrs.Factory(list)
    _beat: float = 0.0
    _seen: dict[float, dict[str, list[str]]] = attrs.Factory(dict)  # frames taken during the stall after a beat
    _started: float = attrs.Factory(time.monotonic)
    _stop: threading.Event = attrs.Factory(threading.Event)
    gc: GcPauses | None = None  # where given: each stall says how much of it was garbage collection

    @classmethod
    def from_env(cls, *, gc: GcPauses | None = None) -> StallWatch | None:
        """`MLXD_STALL_WATCH_MS=N`: a watch of stalls of N ms or more; unset: none; not a positive number:
        none, with a warning. `gc`: the process's collections, to tell each stall how much was theirs."""
        given = os.environ.get("MLXD_STALL_WATCH_MS", "").strip()
        if not given:
            return None
        try:
            ms = float(given)
        except ValueError:
            ms = 0.0
        if not ms > 0:
            log.warning("stall_watch.off", reason=f"MLXD_STALL_WATCH_MS={given!r} is not a positive number of ms")
            return None
        return cls(ms / 1e3, gc=gc)

    async def run(self) -> None:
        """The beat (a trio task, until cancelled), with the watcher thread beside it."""
        watcher = threading.Thread(target=self._watch, name="mlxd-stall-watch", daemon=True)
        self._beat = time.monotonic()
        watcher.start()
        try:
            while True:
                beat = self._beat = time.monotonic()
                await trio.sleep(self.period_s)
                now = time.monotonic()
                late = now - beat - self.period_s
                if late >= self.threshold_s:
                    gc_s = self.gc.paused_between(beat, now) if self.gc is not None else None
                    self._record(late, self._seen.get(beat), gc_s)
                if self._seen:  # this beat's frames, and any the watcher took just after an earlier stall ended
                    for k in [k for k in list(self._seen) if k <= beat]:
                        self._seen.pop(k, None)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.period_s):
            beat = self._beat
            if time.monotonic() - beat - self.period_s >= self.threshold_s and beat not in self._seen:
                self._seen[beat] = _frames(skip=me)

    def _record(self, late: float, frames: dict[str, list[str]] | None, gc_s: float | None = None) -> None:
        self.stalls += 1
        self.stalled_s += late
        self.max_s = max(self.max_s, late)
        stall = {"ms": round(late * 1e3, 1), "at_s": round(time.monotonic() - self._started, 3), "frames": frames or {}}
        if gc_s is not None:  # a collection stops the watcher too: its frames cannot show one, this can
            stall["gc_ms"] = round(gc_s * 1e3, 1)
        self.recent.append(stall)
        del self.recent[: -self.keep]

    def stats(self) -> dict[str, Any]:
        return {"event_loop": {"watch_ms": round(self.threshold_s * 1e3, 1), "stalls": self.stalls,
                               "stalled_s": round(self.stalled_s, 4), "max_ms": round(self.max_s * 1e3, 1),
                               "recent": list(self.recent)}}
