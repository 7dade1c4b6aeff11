"""Reading a restarted server's newest SSD files into the page cache, out of serving's way.

Files may be written with O_DIRECT, so after a restart they are on disk only, and the conversations
that return first are the ones used last. The warm-up reads the newest files (the LRU clock: mtime)
up to a budget, in pieces of `PIECE` bytes, and before each piece waits while serving has a read of
its own in flight (`ForegroundReads`). Asking the kernel for all of it at once (`posix_fadvise
WILLNEED`, what the server did before) queued every byte ahead of the first returning conversation's
read: on a disk slower than the recompute (the GPU's regime after a restart, reproduced on the CPU with
the disk capped) an overlapped split's tail could not come back while the head was recomputed, nor a
restore beat a recompute (docs/benchmarks.md). Here a read serving starts waits for one piece at
most (sized to what the disk reads in `PIECE_S`), and a file serving read already is skipped
(`mincore`: its pages are resident).

No trio: the warm-up runs on a worker thread (actors/page_cache_warmer.py) and serving's reads on
theirs; `stop` ends it between two pieces.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import attrs

# A piece is what this disk reads in about PIECE_S (measured piece by piece): a read serving starts waits
# about that long at most, on a slow disk and a fast one alike, and a fast disk is not read in tiny pieces.
PIECE_S = 0.02
MIN_PIECE, MAX_PIECE = 64 << 10, 8 << 20
FIRST_PIECE = 256 << 10
IDLE_POLL_S = 0.05  # how often a waiting warm-up looks at `stop` while serving reads


class PieceSize:
    """The next piece's bytes: what the last piece's rate reads in PIECE_S, at most twice the last piece
    (a piece the page cache held reads fast and says little about the disk), within MIN/MAX_PIECE."""

    def __init__(self) -> None:
        self.bytes = FIRST_PIECE

    def measured(self, nbytes: int, seconds: float) -> None:
        rate_fits = int(nbytes / seconds * PIECE_S) if seconds > 0 else MAX_PIECE
        self.bytes = max(MIN_PIECE, min(MAX_PIECE, 2 * self.bytes, rate_fits)) // MIN_PIECE * MIN_PIECE


class ForegroundReads:
    """How many reads serving has in flight (any thread); the warm-up waits until there are none."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._count = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._idle:
            self._count += 1
        try:
            yield
        finally:
            with self._idle:
                self._count -= 1
                if self._count == 0:
                    self._idle.notify_all()

    def wait_idle(self, stop: threading.Event) -> float:
        """Block while a read is in flight (or until `stop`); the seconds waited."""
        t0 = time.perf_counter()
        with self._idle:
            while self._count and not stop.is_set():
                self._idle.wait(IDLE_POLL_S)
        return time.perf_counter() - t0


@attrs.frozen
class Warmed:
    """What a warm-up did: the bytes of the files it chose (within the budget), the bytes it read
    (files serving had read already are skipped), the seconds it stepped aside for serving's reads,
    its seconds in all, and whether `stop` ended it first."""

    chosen_bytes: int = 0
    read_bytes: int = 0
    files: int = 0
    skipped_resident: int = 0
    paused_s: float = 0.0
    seconds: float = 0.0
    stopped: bool = False


def warm(
    files: Iterable[tuple[int, Sequence[Path]]],
    budget_bytes: int,
    reads: ForegroundReads,
    *,
    stop: threading.Event | None = None,
    resident: Callable[[Path], tuple[int, int]] | None = None,
) -> Warmed:
    """Read `files` (each record's bytes and its paths, newest first) into the page cache while their
    bytes fit `budget_bytes`; `resident(path)` -> (resident, total) pages skips a file already there.
    Unreadable files are skipped (a restore then treats them as a miss)."""
    stop = stop if stop is not None else threading.Event()
    t0 = time.perf_counter()
    chosen = read = count = skipped = 0
    paused = 0.0
    view = memoryview(bytearray(MAX_PIECE))
    piece = PieceSize()
    for nbytes, paths in files:
        if chosen + nbytes > budget_bytes or stop.is_set():
            break
        chosen += nbytes
        for path in paths:
            if stop.is_set():
                break
            if resident is not None:
                try:
                    have, total = resident(path)
                except OSError:
                    have, total = 0, 1
                if total and have >= total:
                    skipped += 1
                    continue
            got, waited = _read_through(path, view, piece, reads, stop)
            read, paused, count = read + got, paused + waited, count + 1
    return Warmed(chosen, read, count, skipped, round(paused, 4), round(time.perf_counter() - t0, 4), stop.is_set())


def _read_through(
    path: Path, view: memoryview, piece: PieceSize, reads: ForegroundReads, stop: threading.Event
) -> tuple[int, float]:
    """Read one file piece by piece, each after serving's reads are done; (bytes read, seconds waited)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return 0, 0.0  # vanished or unreadable
    got, waited = 0, 0.0
    try:
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None:  # no kernel readahead past the piece: it would queue ahead of serving's reads
            with contextlib.suppress(OSError):
                advise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while not stop.is_set():
            waited += reads.wait_idle(stop)
            if stop.is_set():
                break
            into = view[: piece.bytes]
            t0 = time.perf_counter()
            try:
                n = os.preadv(fd, [into], got) if hasattr(os, "preadv") else _pread_into(fd, into, got)
            except OSError:
                break
            if n <= 0:
                break
            if n == len(into):  # a whole piece (a file's last one says nothing about the rate)
                piece.measured(n, time.perf_counter() - t0)
            got += n
    finally:
        os.close(fd)
    return got, waited


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)
