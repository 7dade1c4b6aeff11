"""Does the SSD writer's copy into its bounce buffer stall the other Python threads?

    python benchmarks/bench_gil_copy.py [--seconds 2]

A thread copies 16 MiB slices of a 512 MiB array into a 16 MiB anonymous
mapping, as `kv/file_format/write.py` does, either with a memoryview slice
assignment (holds the GIL for the whole copy) or with `np.copyto` (releases
it). Meanwhile the main thread sleeps 1 ms in a loop (an event loop, an
engine thread between native calls) and records how late it wakes. Both
variants run side by side in one process; the JSON lands in benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import mmap
import threading
import time
from pathlib import Path

import numpy as np

SLICE = 16 << 20


def copier(kind: str, src: np.ndarray, buf: memoryview, stop: threading.Event) -> None:
    mv = memoryview(src)
    pos = 0
    while not stop.is_set():
        piece = mv[pos : pos + SLICE]
        if kind == "memoryview":
            buf[:SLICE] = piece
        else:
            np.copyto(np.frombuffer(buf, dtype=np.uint8, count=SLICE), np.frombuffer(piece, dtype=np.uint8))
        pos = (pos + SLICE) % (len(src) - SLICE)


def wake_gaps(kind: str, seconds: float, src: np.ndarray, buf: memoryview) -> dict[str, float]:
    stop = threading.Event()
    t = threading.Thread(target=copier, args=(kind, src, buf, stop))
    t.start()
    gaps = []
    t0 = last = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    stop.set()
    t.join()
    gaps.sort()
    return {"p50_ms": 1e3 * gaps[len(gaps) // 2], "p99_ms": 1e3 * gaps[int(len(gaps) * 0.99)], "max_ms": 1e3 * gaps[-1],
            "wakeups": len(gaps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    src = np.random.default_rng(0).integers(0, 255, size=512 << 20, dtype=np.uint8)
    buf = memoryview(mmap.mmap(-1, SLICE))
    rows = []
    for r in range(args.rounds):
        for kind in (("memoryview", "numpy") if r % 2 == 0 else ("numpy", "memoryview")):
            row = {"round": r, "copy": kind, **wake_gaps(kind, args.seconds, src, buf)}
            rows.append(row)
            print(json.dumps(row))
    med = {k: sorted(x["p50_ms"] for x in rows if x["copy"] == k)[args.rounds // 2] for k in ("memoryview", "numpy")}
    out = {"rows": rows, "median_p50_ms": med, "ratio_memoryview_over_numpy": med["memoryview"] / med["numpy"]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gil_copy-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["median_p50_ms"]), "->", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
