# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Does SSD-writer work slow decode down?

Six rows decode the bench model (mlx-lm BatchGenerator, one thread) while a side
thread does nothing, hashes 40 MB/s with SHA-256, or writes + fsyncs 40 MB/s (the
checkpoint rate of `bench_ssd_tier.py writebehind`). Prints decode tok/s per case.

    python benchmarks/bench_writer_interference.py
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mlx_lm.generate import BatchGenerator

from mlxd.model import ensure_model, load_model

RATE_BYTES = 40 << 20  # per second
CHUNK = os.urandom(8 << 20)


def decode_rate(model, seconds: float = 12.0) -> float:
    gen = BatchGenerator(model, max_tokens=100_000, completion_batch_size=6, prefill_batch_size=6)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8]] * 6)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, generated = gen.next()
        tokens += len(generated)
    rate = tokens / (time.perf_counter() - start)
    gen.close()
    return rate


def paced(work: Callable[[], None], stop: threading.Event) -> None:
    """Run `work` (40 MB) once per second until stopped."""
    while not stop.is_set():
        started = time.perf_counter()
        work()
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))


def hash_40mb() -> None:
    for _ in range(RATE_BYTES // len(CHUNK)):
        hashlib.sha256(CHUNK).digest()


def write_40mb(path: Path) -> None:
    with open(path, "wb") as f:
        for _ in range(RATE_BYTES // len(CHUNK)):
            f.write(CHUNK)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    model, _ = load_model(ensure_model("bench"))
    scratch = Path(tempfile.mkdtemp(prefix="mlxd-wb-")) / "probe.bin"
    cases: list[tuple[str, Callable[[], None] | None]] = [
        ("nothing", None),
        ("sha256 40 MB/s", hash_40mb),
        ("write+fsync 40 MB/s", lambda: write_40mb(scratch)),
        ("nothing (again)", None),
    ]
    for name, work in cases:
        stop = threading.Event()
        side = threading.Thread(target=paced, args=(work, stop)) if work else None
        if side:
            side.start()
        rate = decode_rate(model)
        stop.set()
        if side:
            side.join()
        print(f"{name:22s} {rate:6.1f} tok/s", flush=True)
    scratch.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
