"""fp32 1024x1024 matmul GFLOP/s with MLX's own reference BLAS vs the OpenBLAS mlxd preloads.

    python benchmarks/bench_blas.py

Each arm runs in a fresh subprocess (the BLAS is chosen before MLX loads), alternating.
The medians go to benchmarks/results/blas-<timestamp>.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = """
import time, mlxd, mlx.core as mx
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b, a @ b)
t = time.perf_counter()
for _ in range(5):
    mx.eval(a @ b)
print(2 * 1024**3 * 5 / (time.perf_counter() - t) / 1e9, mlxd._blas.status["library"])
"""


def run(choice: str) -> tuple[float, str]:
    env = {**os.environ, "MLXD_BLAS": choice}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    gflops, lib = out.stdout.split()
    return float(gflops), lib


def main() -> None:
    results: dict[str, list[float]] = {"reference": [], "auto": []}
    libs = {}
    for _ in range(3):
        for choice in results:
            g, libs[choice] = run(choice)
            results[choice].append(g)
    for choice, values in results.items():
        print(f"MLXD_BLAS={choice:9s} {statistics.median(values):8.1f} GFLOP/s  (library: {libs[choice]})")
    ratio = statistics.median(results["auto"]) / statistics.median(results["reference"])
    print(f"ratio auto/reference: {ratio:.1f}x")
    out = Path(__file__).resolve().parent / "results" / f"blas-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/bench_blas.py",
        "gflops": results,
        "median_gflops": {c: statistics.median(v) for c, v in results.items()},
        "libraries": libs,
        "ratio_auto_over_reference": ratio,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
