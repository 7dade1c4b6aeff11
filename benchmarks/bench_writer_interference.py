# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""How much does SSD-writer work slow decode down, by kind of work and by write rate?

Six rows decode the bench model (mlx-lm BatchGenerator on this thread, OpenBLAS
with its default threads) while a side thread (nice 10, like the SSD writer)
does writer-like work. Cases run interleaved, R rounds of S seconds each; per
case the script prints decode tok/s (median), its ratio to "nothing", the side
thread's CPU seconds, the MB it moved, and the hypervisor's steal time.

Two families of cases:
- back-to-back: sha256 / crc32 only, buffered write (with and without fsync),
  O_DIRECT write + fsync, sha256 + buffered write + fsync (the writer with a
  backlog and no pacing);
- paced (`--rates`): the writer's real path (`file_format.write_snapshot` of a
  ~104 MB bench-model checkpoint) through `pacing.Pacer` at each MB/s rate, in
  slices of `--slice-mb`.

    python benchmarks/bench_writer_interference.py [--rounds 4] [--seconds 5] [--rates 25,50,100]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import hashlib
import mmap
import os
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from mlx_lm.generate import BatchGenerator

from mlxd.model import ensure_model, load_model

FILE_BYTES = 104 << 20  # one bench-model checkpoint of ~4,200 tokens
CHUNK = 8 << 20


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


class Side:
    """Writer-like work repeated on a thread at `nice`, with its CPU time and bytes."""

    def __init__(self, work: Callable[[Side], None], nice: int) -> None:
        self.work, self.nice = work, nice
        self.stop = threading.Event()
        self.cpu = 0.0
        self.bytes = 0
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        t0 = time.thread_time()
        while not self.stop.is_set():
            self.work(self)
        self.cpu = time.thread_time() - t0


def back_to_back_cases(scratch: Path) -> dict[str, Callable[[Side], None]]:
    data = memoryview(os.urandom(CHUNK))
    aligned = mmap.mmap(-1, CHUNK)  # page-aligned, for O_DIRECT
    aligned.write(bytes(data))
    n = FILE_BYTES // CHUNK

    def digest(side: Side, fn: Callable[[memoryview], object]) -> None:
        for _ in range(n):
            if side.stop.is_set():
                return
            fn(data)
            side.bytes += CHUNK

    def write(side: Side, *, fsync: bool, hashed: bool, direct: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(scratch / "probe.bin", flags, 0o600)
        try:
            for _ in range(n):
                if side.stop.is_set():
                    break
                if hashed:
                    hashlib.sha256(data).digest()
                os.write(fd, aligned if direct else data)
                side.bytes += CHUNK
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    return {
        "sha256 only": lambda s: digest(s, lambda d: hashlib.sha256(d).digest()),
        "crc32 only": lambda s: digest(s, zlib.crc32),
        "write, no fsync": lambda s: write(s, fsync=False, hashed=False),
        "write + fsync": lambda s: write(s, fsync=True, hashed=False),
        "O_DIRECT write + fsync": lambda s: write(s, fsync=True, hashed=False, direct=True),
        "sha256 + write + fsync": lambda s: write(s, fsync=True, hashed=True),
    }


def paced_cases(scratch: Path, rates: list[float], slice_mb: float) -> dict[str, Callable[[Side], None]]:
    """The real writer path (write_snapshot) paced at each rate."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlc

    from mlxd.kv import file_format, kinds
    from mlxd.kv.pacing import Pacer, WriteInterrupted

    caches = []
    tokens = FILE_BYTES // (12 * 4 * 64 * 2 * 4)
    for _ in range(12):  # bench model: 12 layers x 4 KV heads x 64 dims, fp32, capacity-rounded like serving
        c = mlc.KVCache()
        c.update_and_fetch(mx.random.normal((1, 4, tokens, 64)), mx.random.normal((1, 4, tokens, 64)))
        caches.append(c)
    meta = file_format.SnapshotMeta(model_id="bench", config_fingerprint="probe", namespace="", tokenizer_hash="t",
                                    tokens=tuple(range(tokens)))
    plan = kinds.plan_snapshot(caches, meta=meta)
    cases: dict[str, Callable[[Side], None]] = {}
    for rate in rates:

        def work(side: Side, rate: float = rate) -> None:
            pacer = Pacer(rate_bytes_per_s=rate * 1e6, slice_bytes=int(slice_mb * 1e6), stop=side.stop.is_set)
            path = scratch / "paced.mlxkv"
            try:
                written = file_format.write_snapshot(plan, path, pacer=pacer)
            except WriteInterrupted:
                return
            side.bytes += written.nbytes
            path.unlink()

        cases[f"write_snapshot paced {rate:g} MB/s"] = work
    return cases


def decode_rate(model, seconds: float) -> float:
    """Tokens/s over `seconds` of 6-row greedy decode."""
    gen = BatchGenerator(model, max_tokens=100_000, completion_batch_size=6, prefill_batch_size=6)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8]] * 6)
    for _ in range(3):
        gen.next()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        _, generated = gen.next()
        tokens += len(generated)
    rate = tokens / (time.perf_counter() - start)
    gen.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--nice", type=int, default=10, help="the side thread's nice value")
    p.add_argument("--rates", default="", help="comma-separated MB/s for paced write_snapshot cases")
    p.add_argument("--slice-mb", type=float, default=2.0, help="paced cases: bytes per slice")
    p.add_argument("--no-back-to-back", action="store_true", help="only the paced cases")
    args = p.parse_args()
    model, _ = load_model(ensure_model("bench"))
    scratch = Path(tempfile.mkdtemp(prefix="mlxd-wb-", dir=os.environ.get("MLXD_BENCH_DIR", "/tmp")))
    cases: dict[str, Callable[[Side], None] | None] = {"nothing": None}
    if not args.no_back_to_back:
        cases.update(back_to_back_cases(scratch))
    if args.rates:
        cases.update(paced_cases(scratch, [float(r) for r in args.rates.split(",")], args.slice_mb))
    tick = os.sysconf("SC_CLK_TCK")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for rnd in range(args.rounds):
        names = list(cases) if rnd % 2 == 0 else list(reversed(cases))
        for name in names:
            work = cases[name]
            side = Side(work, args.nice) if work else None
            steal0 = steal_ticks()
            if side:
                side.thread.start()
            rate = decode_rate(model, args.seconds)
            if side:
                side.stop.set()
                side.thread.join()
            rows[name].append({"tok_s": rate, "side_cpu_s": side.cpu if side else 0.0,
                               "side_mb": side.bytes / 1e6 if side else 0.0,
                               "steal_s": (steal_ticks() - steal0) / tick})
            print(f"  round {rnd} {name:34s} {rate:6.1f} tok/s", flush=True)
    base = statistics.median(r["tok_s"] for r in rows["nothing"])
    print(f"\nside thread nice {args.nice}; {args.rounds} rounds x {args.seconds:g} s; medians:")
    print("| case | decode tok/s | ratio to nothing | side CPU s | side MB | steal s |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {name} | {med['tok_s']:.1f} | {med['tok_s'] / base:.3f} | {med['side_cpu_s']:.2f} | "
              f"{med['side_mb']:.0f} | {med['steal_s']:.2f} |")
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()


if __name__ == "__main__":
    main()
