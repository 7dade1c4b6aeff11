"""A run of engine steps on the MLX thread, without a trio round trip between them.

The engine actor hands the MLX thread one `StepLoop.run(ops)` while rows decode.
It steps on by itself: after each step it hands the `StepResult` over (`hand`,
which must not block: the actor's trio side delivers it) and takes what arrived
meanwhile from its thread-safe inbox (`put`: new rows, cancels, stops, drops),
merged into the next step's `StepOps`. It runs at most `window` steps ahead of
delivery (1: step n + 1 runs while step n's tokens are delivered), so a stop or
cancel sent in answer to a token takes effect within a step or two, as with one
round trip per step. It returns once no row is left and nothing is queued, or
when asked to `stop`; a failing step raises out of `run` (the actor resets).

No trio here: `wait(ready)` blocks until `ready()` holds, running the thread's
other jobs meanwhile (`MlxThread.serve_until`), and `notify` wakes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import attrs

from mlxd.engine.ops import StepOps, StepResult
from mlxd.runtime.distributed import MAX_DROPS_PER_STEP

NO_OPS = StepOps()  # a step with nothing to do but decode (a value: shared)


def merge(queued: list[StepOps]) -> tuple[StepOps, list[StepOps]]:
    """One step's ops from what was queued, in order; drops past `MAX_DROPS_PER_STEP` stay queued."""
    starts = tuple(s for o in queued for s in o.starts)
    cancels = tuple(dict.fromkeys(c for o in queued for c in o.cancels))
    stops = tuple(dict.fromkeys(s for o in queued for s in o.stops if s not in cancels))
    drops = [d for o in queued for d in o.drops]
    ops = StepOps(starts=starts, cancels=cancels, stops=stops, drops=tuple(drops[:MAX_DROPS_PER_STEP]))
    rest = [StepOps(drops=tuple(drops[MAX_DROPS_PER_STEP:]))] if len(drops) > MAX_DROPS_PER_STEP else []
    return ops, rest


@attrs.define
class StepLoop:
    """Steps `step` until no row is left; thread-safe `put` / `delivered` / `stop` from the trio side."""

    step: Callable[[StepOps], StepResult]
    hand: Callable[[StepResult], None]  # give a result to the delivering side; never blocks
    wait: Callable[[Callable[[], bool]], None]  # block until the condition holds (other jobs run meanwhile)
    notify: Callable[[], None]  # wake `wait` to look again (called after every change below)
    window: int = 1  # steps run ahead of delivery: step n + window + 1 waits until step n is delivered
    steps: int = 0  # steps this loop ran
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _queued: list[StepOps] = attrs.Factory(list)
    _handed: int = 0
    _delivered: int = 0
    _open: bool = True
    _stopping: bool = False

    # --- the trio side ---------------------------------------------------------------

    def put(self, ops: StepOps) -> bool:
        """Queue ops for the next step; False once the loop has ended (the caller runs them itself)."""
        with self._lock:
            if not self._open:
                return False
            self._queued.append(ops)
        self.notify()
        return True

    def delivered(self) -> None:
        """One more result was delivered."""
        with self._lock:
            self._delivered += 1
        self.notify()

    def stop(self) -> None:
        """End the run after the step in progress (shutdown)."""
        with self._lock:
            self._stopping = True
        self.notify()

    def leftover(self) -> list[StepOps]:
        """What was queued and never run (after a failed step); empty after a normal end."""
        with self._lock:
            left, self._queued = self._queued, []
            return left

    # --- the MLX thread ----------------------------------------------------------------

    def run(self, ops: StepOps) -> int:
        """Step from `ops` until no row is left and nothing is queued; the number of steps run."""
        try:
            while True:
                result = self.step(ops)
                self.steps += 1
                with self._lock:
                    self._handed += 1
                self.hand(result)
                with self._lock:
                    if self._stopping or (not result.stats.batch_rows and not self._queued):
                        self._open = False  # with the check: a later `put` is refused, never lost
                        return self.steps
                self.wait(self._may_step)
                with self._lock:
                    if self._stopping:
                        self._open = False
                        return self.steps
                    ops, self._queued = merge(self._queued) if self._queued else (NO_OPS, [])
        finally:
            with self._lock:
                self._open = False

    def _may_step(self) -> bool:
        return self._stopping or self._handed - self._delivered <= self.window
