"""Pace write-behind so that it does not slow decode down.

Decode on a CPU keeps every core busy (the engine thread plus OpenBLAS's
workers, which spin between matmuls); a writer that hashes and copies at full
speed preempts one of them and the whole matmul waits, so decode loses far
more than the writer's own CPU time (docs/benchmarks.md, write-behind).
Niceness does not help: any runnable thread steals slices from the spinning
workers.

So the writer works in slices and, while the engine is decoding, holds a byte
rate (``busy_rate``); when the engine is idle, or when durability is urgent (a
flush is waiting, or the dirty backlog has grown past its bound), it writes at
full speed. The pacer itself knows nothing about engines: it asks a
`WriteGovernor` before every slice.

While a request waits for its first token (its lookup, restore and prefill:
`prefilling`, set by the scheduler), write-behind holds still instead: no
slice is written and no checkpoint is staged to host memory (on CUDA a
device-to-host copy) until the first token, because the next turn of a
conversation arrives while the previous turn's checkpoint is still being
written (docs/benchmarks.md, issue 28). Urgency overrides the hold as it
overrides the rate: a flush never waits behind a prefill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Bytes per paced slice: each slice wakes the writer once, and every wake-up
# stalls decode's BLAS threads; large slices at a low rate cost the least
# (docs/benchmarks.md, write-behind: pacing).
PACE_SLICE = 16 << 20
# The longest a writer holds still in one go for prefills: under a steady stream of arrivals some
# request is always waiting for its first token, and write-behind must still make progress (one slice,
# at the paced rate, per hold at least).
MAX_HOLD_S = 2.0
# The longest a staged piece waits for the engine's next step while rows decode (a slow or stuck step
# must not stall write-behind).
STEP_WAIT_S = 0.1


class WriteInterrupted(Exception):
    """The write was asked to stop between two slices (shutdown)."""


class WriteGovernor:
    """What the writer's rate should be now; set from the event loop, read by the writer thread.

    `busy` is the engine's state (rows in the batch). Urgency has reasons, each
    owned by one actor: "flush" (a flush is waiting) and "backlog" (too many
    dirty bytes) by the durability coordinator, "ram" (the RAM tier is over its
    cap because its victims await their writes) by the cache owner. Each field
    is replaced whole, so the writer thread reads a consistent value; the event
    wakes a pacing wait early when anything changes. `prefilling` (requests
    waiting for their first token, the scheduler's) holds writers still (`held`).
    """

    def __init__(self, *, busy_rate_bytes_per_s: float | None, max_hold_s: float = MAX_HOLD_S,
                 hold_while_decoding: bool = False) -> None:
        self.busy_rate = busy_rate_bytes_per_s or None  # None (or 0): never pace
        self.max_hold_s = max_hold_s  # the longest one hold lasts
        # Hold still while rows decode too, as for a prefill (`--ssd-write-hold-decode`), even past the backlog
        # bound: only a flush, RAM over its cap, the end of a hold (`max_hold_s`) or an idle engine lets a piece go.
        self.hold_while_decoding = hold_while_decoding
        self._busy = False
        self._steps = 0  # engine steps so far (`stepped`, the MLX thread): staging goes a piece per step
        self._step_cond = threading.Condition(threading.Lock())
        self._prefilling = False
        self._urgent: frozenset[str] = frozenset()
        self.changed = threading.Event()
        self.bytes_out = 0  # bytes handed to the OS by paced writers, slice by slice (for /stats)
        self.holds = 0  # times a writer held still for a prefill (writer threads count; for /stats and tests)
        self.holds_expired = 0  # holds that reached max_hold_s (a piece went anyway)
        self.held_s = 0.0
        # Bytes handed to the OS by slices that ended while a request waited for its first token (urgency
        # overrides the hold: what write-behind did beside prefills anyway)
        self.prefill_bytes_out = 0
        self._counts = threading.Lock()  # the sums above: added to by every writing thread
        # Seconds each urgency reason has been on, summed (the event loop's; a reason on now counts up to now)
        self._urgent_s: dict[str, float] = {}
        self._urgent_since: dict[str, float] = {}

    def count(self, *, bytes_out: int = 0, holds: int = 0, holds_expired: int = 0, held_s: float = 0.0) -> None:
        """Add to the writers' sums (several threads: each addition is a read-modify-write)."""
        with self._counts:
            self.bytes_out += bytes_out
            if self._prefilling:
                self.prefill_bytes_out += bytes_out
            self.holds += holds
            self.holds_expired += holds_expired
            self.held_s += held_s

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self.changed.set()

    def stepped(self) -> None:
        """The engine finished a step (any thread; cheap: a counter and a notify)."""
        with self._step_cond:
            self._steps += 1
            self._step_cond.notify_all()

    @property
    def steps(self) -> int:
        return self._steps

    def wait_step(self, after: int, timeout: float) -> int:
        """Wait until the engine finished a step past `after` (at most `timeout` s); the step count then."""
        with self._step_cond:
            self._step_cond.wait_for(lambda: self._steps > after, timeout)
            return self._steps

    def set_prefilling(self, prefilling: bool) -> None:
        if prefilling != self._prefilling:
            self._prefilling = prefilling
            self.changed.set()

    def set_urgent(self, reason: str, on: bool) -> None:
        urgent = self._urgent | {reason} if on else self._urgent - {reason}
        if urgent != self._urgent:
            now = time.monotonic()
            if on:
                self._urgent_since[reason] = now
            else:
                self._urgent_s[reason] = self._urgent_s.get(reason, 0.0) + now - self._urgent_since.pop(reason)
            self._urgent = urgent
            self.changed.set()

    def urgent_s(self) -> dict[str, float]:
        """Seconds each urgency reason has been on so far (one on now counts up to now)."""
        now = time.monotonic()
        out = dict(self._urgent_s)
        for reason, since in self._urgent_since.items():
            out[reason] = out.get(reason, 0.0) + now - since
        return {reason: round(s, 3) for reason, s in sorted(out.items())}

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def urgent(self) -> frozenset[str]:
        return self._urgent

    @property
    def prefilling(self) -> bool:
        return self._prefilling

    def held(self) -> bool:
        """Should write-behind hold still now? While a request waits for its first token and nothing is
        urgent (pacing on: a rate of 0 means never pace, never hold)."""
        if self.busy_rate is None or self._urgent - {"backlog"}:
            return False  # never paced, or a flush / RAM over its cap: never held
        decoding = self.hold_while_decoding and self._busy
        if self._urgent:  # a backlog past its bound: held only beside decode, and only when asked to
            return decoding
        return self._prefilling or decoding

    def parallel(self) -> bool:
        """May write-behind run several writes, and a write several blocks, at once now? Not beside decode
        unless a flush waits or RAM is over its cap: a backlog past its bound alone is written at full
        speed but one write and one block at a time while rows decode (four writing threads beside decode
        stage, hash and write four blocks at once; issue 28)."""
        return not self._busy or bool(self._urgent - {"backlog"})

    def rate(self) -> float | None:
        """Bytes/s to hold now, or None for full speed."""
        if self.busy_rate is None or self._urgent or not self._busy:
            return None
        return self.busy_rate

    def as_dict(self) -> dict[str, object]:
        return {"busy_rate_bytes_per_s": self.busy_rate, "engine_busy": self._busy,
                "urgent": sorted(self._urgent), "urgent_s": self.urgent_s(), "pacing_now": self.rate() is not None,
                "bytes_out": self.bytes_out, "prefill_bytes_out": self.prefill_bytes_out,
                "prefilling": self._prefilling, "held_now": self.held(), "holds": self.holds,
                "holds_expired": self.holds_expired, "held_s": round(self.held_s, 3),
                "hold_while_decoding": self.hold_while_decoding, "engine_steps": self._steps}


class WriteTimes:
    """Where one write's seconds went, summed over the threads that wrote its pieces (several block
    writers at once during a flush: thread-seconds, which may add up to more than the write's wall time).

    `stage_s`: copies to host memory before writing (CUDA; holds and step waits between pieces included);
    `pwrite_s`: handing bytes to the OS; `sync_s`: waiting for the disk (write-back of slices, each file's
    fsync, the directories' fsyncs); `files_s`: files from open to rename (checksums and packing are the
    rest of it, less pwrite_s and sync_s)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stage_s = 0.0
        self.pwrite_s = 0.0
        self.sync_s = 0.0
        self.files_s = 0.0

    def add(self, *, stage_s: float = 0.0, pwrite_s: float = 0.0, sync_s: float = 0.0, files_s: float = 0.0) -> None:
        with self._lock:
            self.stage_s += stage_s
            self.pwrite_s += pwrite_s
            self.sync_s += sync_s
            self.files_s += files_s


class Pacer:
    """Called by a writer after every slice; sleeps as needed to hold the governor's rate.

    A token bucket without burst: when the writer falls behind (it was idle, or
    slower than the rate), the schedule restarts from now, so time spent idle or
    at full speed is never saved up and spent as a burst during decode.
    """

    def __init__(
        self,
        governor: WriteGovernor | None = None,
        *,
        rate_bytes_per_s: float | None = None,
        slice_bytes: int = 2 << 20,
        stop: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        release_gil: bool = False,
        direct_unless_flush: bool = False,
    ) -> None:
        """`release_gil`: the writer copies bytes into its write buffer with the GIL released (where decode
        waits on a device and its host step needs the GIL back at once: CUDA; on the CPU the copy would run
        beside decode's BLAS threads instead, which measured slower: file_format/write.py `_copy_note`).
        `direct_unless_flush`: slices bypass the page cache at full speed too, unless a flush waits (the SSD
        writer's write-behind, `MLXD_SSD_DIRECT`); otherwise only while pacing or held (`wants_direct`)."""
        if governor is None:
            governor = WriteGovernor(busy_rate_bytes_per_s=rate_bytes_per_s)
            governor.set_busy(rate_bytes_per_s is not None)
        self.governor = governor
        self.slice_bytes = max(4096, slice_bytes)
        self.release_gil = release_gil
        self.direct_unless_flush = direct_unless_flush
        self._stop = stop
        self._clock = clock
        self._due = 0.0  # when the bytes sent so far are paid for at the current rate
        self.paced_s = 0.0  # total time spent waiting for the rate
        self.held_s = 0.0  # total time held still for prefills
        self.step_waits = 0  # staged pieces that waited for the engine's next step
        self.times = WriteTimes()  # where the write's seconds went (the writer's threads add to it)
        self._piece_step: int | None = None  # the engine's step count when the last staged piece went
        self._watchers: tuple[Callable[[], None], ...] = ()  # called after every slice (`watching`)
        # The block store's writing threads share one write's pacer: its sums and schedule change under this.
        self._lock = threading.Lock()

    def pacing(self) -> bool:
        """Whether the writer is being held to a rate (or held still) right now."""
        return self.governor.rate() is not None or self.governor.held()

    def wants_direct(self) -> bool:
        """Should the next slice bypass the page cache (`O_DIRECT`)? While pacing or held always; at full
        speed only with `direct_unless_flush` and no flush waiting (a flush's slices stay in the page cache:
        its rate was measured that way, sync-bound, and a restart right after it reads memory)."""
        if self.direct_unless_flush:
            return "flush" not in self.governor.urgent
        return self.pacing()

    def serial(self) -> bool:
        """One block at a time now: paced, held, or a backlog written beside decode (`WriteGovernor.parallel`)."""
        return self.pacing() or not self.governor.parallel()

    def check(self) -> None:
        """Raise WriteInterrupted if asked to stop."""
        if self._stop():
            raise WriteInterrupted("write interrupted")

    def hold(self) -> None:
        """Wait while the governor holds write-behind still (a request waits for its first token), at
        most the governor's `max_hold_s` at a time; raise WriteInterrupted if asked to stop. Called before staging,
        between staged pieces and between slices."""
        self.check()
        g = self.governor
        if not g.held():
            return
        g.count(holds=1)
        t0 = self._clock()
        while (left := t0 + g.max_hold_s - self._clock()) > 0:
            g.changed.clear()
            if not g.held():  # checked after the clear: a change since cannot be missed
                break
            g.changed.wait(min(left, 0.05))
            self.check()
        else:
            g.count(holds_expired=1)  # held too long: this piece goes (the next one may hold again)
        waited = self._clock() - t0
        g.count(held_s=waited)
        now = self._clock()
        with self._lock:
            self.held_s += waited
            self._due = now  # the rate's schedule restarts after the hold (no burst)

    def piece_size(self, idle: int, decoding: int) -> int:
        """The staged copy's piece size now: small while rows decode and nothing is urgent."""
        return decoding if self.governor.rate() is not None else idle

    def between_pieces(self) -> None:
        """Between two staged pieces (on CUDA device-to-host copies): the hold, then, while rows decode
        and write-behind is paced, at most one piece per engine step (waiting at most `STEP_WAIT_S` for
        it), so a copy's runtime calls and the GIL hand-offs they make are spread out, never a burst."""
        self.hold()
        g = self.governor
        if g.rate() is None:
            self._piece_step = None
            return
        if self._piece_step is not None and g.steps <= self._piece_step:
            with self._lock:
                self.step_waits += 1
            g.wait_step(self._piece_step, STEP_WAIT_S)
            self.check()
        self._piece_step = g.steps

    @contextmanager
    def watching(self, fn: Callable[[], None]) -> Iterator[None]:
        """Call `fn` after every slice and tensor written with this pacer (by any of its threads) while in the block: the
        block store hands a write's unstarted blocks to its writing threads the moment a flush makes the write
        parallel, not when the block in flight ends."""
        with self._lock:
            self._watchers = (*self._watchers, fn)
        try:
            yield
        finally:
            with self._lock:
                self._watchers = tuple(w for w in self._watchers if w is not fn)

    def done(self, nbytes: int) -> None:
        """Account for `nbytes` just written; wait until the rate allows more; then the watchers."""
        self._pace(nbytes)
        self.poll()

    def poll(self) -> None:
        """Run the watchers (`watching`): after every slice, and between two tensors of a file (a block's
        slice can hold most of it: a flush's hand-off should not wait for the block's end)."""
        for fn in self._watchers:
            fn()

    def _pace(self, nbytes: int) -> None:
        self.governor.count(bytes_out=nbytes)
        self.hold()
        rate = self.governor.rate()
        if rate is None:
            return
        now = self._clock()
        with self._lock:
            self._due = max(self._due, now) + nbytes / rate
        while (wait := self._due - self._clock()) > 0:
            t0 = self._clock()
            self.governor.changed.clear()
            # Checked after the clear, and on every wake: the event is shared by every writer's pacer, and
            # another one's clear can swallow the set that a flush's urgency made, so a wake alone would miss it
            # (a paced write then slept out its whole schedule before the flush could use it).
            if self.governor.rate() != rate:
                now = self._clock()
                with self._lock:
                    self._due = now  # re-plan the next slice at the new rate
                return
            self.governor.changed.wait(min(wait, 0.05))
            waited = self._clock() - t0
            with self._lock:
                self.paced_s += waited
            self.check()
