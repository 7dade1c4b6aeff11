"""Per-tensor checksum cost: zlib.crc32 (file format 2) vs hashlib.sha256 (format 1), side by side.

    python benchmarks/bench_checksum.py [--mb 256] [--rounds 5]

Alternating rounds over one buffer of random bytes in memory; the medians go to
benchmarks/results/checksum-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path


def gb_per_s(fn, buf: memoryview) -> float:
    t = time.perf_counter()
    fn(buf)
    return len(buf) / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    buf = memoryview(os.urandom(args.mb << 20))
    arms = {"crc32": lambda b: zlib.crc32(b), "sha256": lambda b: hashlib.sha256(b).digest()}
    speeds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            speeds[name].append(gb_per_s(fn, buf))
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    for name, v in medians.items():
        print(f"{name:7s} {v:6.2f} GB/s  ({1e3 / (v * 1e3):.2f} ms/MB)")
    print(f"crc32 / sha256: {medians['crc32'] / medians['sha256']:.2f}x")
    out = Path(__file__).resolve().parent / "results" / f"checksum-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/bench_checksum.py", *sys.argv[1:]]),
        "buffer_mb": args.mb, "gb_per_s": speeds, "median_gb_per_s": medians,
        "ratio_crc32_over_sha256": medians["crc32"] / medians["sha256"],
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
