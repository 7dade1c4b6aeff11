"""Where a request's time goes outside the engine: `time.perf_counter` stamps at each stage.

A few stamps a request (well under a microsecond each), logged as one `request.stages`
line at debug level (`--log-level debug`), and, once the first token's chunk is written (or the
reply is), as one `request.http` line at info level: each stage in ms after arrival, beside the
scheduler's `request.done` (its `first_token_ms`: the engine's part). The stamps are the process's monotonic clock,
which on Linux and macOS a client on the same host shares, so a benchmark lines its own
stamps up with the server's (benchmarks/bench_vision.py prints the breakdown).
"""

from __future__ import annotations

import time
from typing import Any

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.http")


class Stages:
    """A request's stage stamps, in the order they were taken (name, perf_counter seconds)."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("arrived", time.perf_counter())]

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks.append((name, time.perf_counter() if at is None else at))

    def report(self, **fields: Any) -> None:
        """One info line (`request.http`): each stage in ms after arrival, for the request log."""
        start = self.marks[0][1]
        log.info("request.http", arrived=round(start, 6),
                 ms={name: round((t - start) * 1000, 2) for name, t in self.marks[1:]}, **fields)

    def log(self, **fields: Any) -> None:
        """One debug line: each stage's stamp in seconds (absolute, to line up with a client's)."""
        log.debug("request.stages", stamps={name: round(t, 6) for name, t in self.marks}, **fields)
