"""The one OS thread that runs every native MLX call.

MLX streams are thread-local, so the engine pins all of its work (model load,
prefill, decode, lending, snapshot preparation) to this thread.  A trio task
hands it a function with ``await thread.run(fn, *args)`` and sleeps until the
result comes back through the trio token; no polling, no stop flags.

A long job (the engine's run of decode steps, engine/step_loop.py) keeps the
thread's other jobs moving: between its steps it calls `serve_until`, which runs
the jobs handed over meanwhile and sleeps until the job's own condition holds;
`notify` (from any thread) wakes it to look again.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

_STOP = object()


class MlxThread:
    """A dedicated worker thread with one job in flight at a time per caller."""

    def __init__(self, name: str = "mlxd-engine") -> None:
        # At most one job per awaiting task is ever queued (run() waits for its
        # result), so this queue is bounded by the number of callers.
        self._jobs: collections.deque[Any] = collections.deque()
        self._wake = threading.Condition()  # a job was queued, or a waiting job's condition may hold
        self.jobs_run = 0  # jobs handed over and run (each a trio round trip)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        _name_os_thread(self._thread.name)
        while True:
            with self._wake:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.popleft()
            if job is _STOP:
                _release_thread_streams()
                return
            self.jobs_run += 1
            job()

    def _put(self, job: Any) -> None:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify_all()

    def notify(self) -> None:
        """Wake a job waiting in `serve_until` to check its condition again (any thread; after the change)."""
        with self._wake:
            self._wake.notify_all()

    def serve_until(self, ready: Callable[[], bool]) -> None:
        """On this thread, inside a job: run the jobs queued meanwhile until `ready()` (checked under the
        wake lock, so a change followed by `notify` is never missed)."""
        while True:
            with self._wake:
                while not self._jobs:
                    if ready():
                        return
                    self._wake.wait()
                job = self._jobs.popleft()
                if job is _STOP:  # the owner is closing: it leaves once the running job returns
                    self._jobs.appendleft(job)
                    return
            self.jobs_run += 1
            job()

    async def run(self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None) -> T:
        """Run ``fn(*args)`` on the thread; cancellation waits for it to finish.

        ``on_cancel`` is called (on the trio thread) when the caller is
        cancelled, e.g. to ask a long job to stop early.
        """
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def job() -> None:
            result = outcome.capture(fn, *args)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:
                pass

        self._put(job)

        def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
            # Native work cannot be interrupted: the caller gets the result,
            # and the cancellation at its next checkpoint.
            if on_cancel is not None:
                on_cancel()
            return trio.lowlevel.Abort.FAILED

        # The outcome is unwrapped by trio: a value, or the job's exception raised here.
        return await trio.lowlevel.wait_task_rescheduled(abort)

    async def aclose(self) -> None:
        self._put(_STOP)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._thread.join)

    async def __aenter__(self) -> MlxThread:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# Write-behind must not take CPU from decode: background writer threads run at a
# lower scheduling priority (Linux nice values are per thread).
BACKGROUND_NICE = 10


def lower_priority() -> None:
    """Run the calling thread at a lower priority (a job for a background writer's thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass  # not Linux, or not permitted: run at normal priority


def _release_thread_streams() -> None:
    """Finish this thread's MLX work and destroy the streams it created, on this thread.

    MLX keeps streams (and, on CUDA, their worker threads and events) in
    thread-local state. Left alone, they are destroyed while the interpreter
    finalizes, after CUDA has begun tearing down, and the process aborts
    ("terminate called without an active exception") instead of exiting 0.
    """
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return  # this thread never touched MLX
    try:
        mx.synchronize()
        mx.clear_streams()
    except RuntimeError:
        pass  # nothing left to synchronize with; exiting anyway


def _name_os_thread(name: str) -> None:
    """Show the thread's name to the OS (top -H, /proc/PID/task/TID/comm): 15 bytes max on Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
