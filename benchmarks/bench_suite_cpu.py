"""What a slice of the test suite costs, in wall time and CPU, under environments interleaved round by round.

    python benchmarks/bench_suite_cpu.py [--rounds 3] [--arms default,blas1] [TEST ...]
    python benchmarks/bench_suite_cpu.py --baseline DIR [--rounds 3] [TEST ...]

Each run is `python -m pytest -q -n 2 -p no:cacheprovider TEST ...` in a child, as CI runs the suite (two
workers on a 2-core machine); its CPU is the child's and every process it waited for (the servers the
tests start). Arms differ only in their environment:
- `default`: OpenBLAS's own thread count, one a core (OPENBLAS_NUM_THREADS=0 is OpenBLAS's "unset": it
  reads the number, and 0 keeps its default);
- `blas1`: OPENBLAS_NUM_THREADS=1, one BLAS thread a process (two test workers and their servers share
  two cores: does OpenBLAS's spinning for work cost CPU there?);
- `nofork`: MLXD_TEST_FORK=0, every test server started with `python -m mlxd.cli serve`, none forked from
  the worker's zygote (tests/serve_zygote.py).
With `--baseline DIR` (a checkout of an earlier commit, e.g. `git worktree add DIR HEAD`) the arms are
instead `baseline` (the tests as DIR has them) and `tree` (this checkout's), both in the default
environment: a change to the tests measured side by side. Both import the installed mlxd (this venv's).
The arms alternate, each first in turn; medians and each arm's ratio to the first arm go to
benchmarks/results/suite_cpu-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ARMS = {"default": {"OPENBLAS_NUM_THREADS": "0"}, "blas1": {"OPENBLAS_NUM_THREADS": "1"},
        "nofork": {"OPENBLAS_NUM_THREADS": "0", "MLXD_TEST_FORK": "0"}}
DEFAULT_TESTS = ["tests/test_speculative.py", "tests/test_gen_checkpoint.py"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(arm: str, tests: list[str], baseline: Path | None) -> dict[str, float | int]:
    env = {**os.environ, **ARMS.get(arm, {})}
    cwd = baseline if arm == "baseline" else ROOT
    before, t0 = children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *tests],
                         cwd=cwd, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, children_cpu() - before
    if out.returncode != 0:
        raise SystemExit(f"{arm}: pytest exited {out.returncode}:\n{out.stdout[-3000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default="default,blas1", help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--baseline", type=Path, help="a checkout whose tests run as the `baseline` arm")
    parser.add_argument("tests", nargs="*", default=DEFAULT_TESTS)
    args = parser.parse_args()
    if args.baseline:
        arms = ["baseline", "tree"]  # --arms does not apply: both run in the default environment
    else:
        arms = args.arms.split(",")
        if unknown := set(arms) - ARMS.keys():
            parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    runs: dict[str, list[dict[str, float | int]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            runs[arm].append(run(arm, args.tests, args.baseline))
            print(f"round {r} {arm}: {runs[arm][-1]}", flush=True)
    medians = {arm: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s")} for arm, rs in runs.items()}
    first = arms[0]
    ratios = {arm: {k: round(m[k] / medians[first][k], 3) for k in m} for arm, m in medians.items()}
    result = {"tests": args.tests, "rounds": args.rounds, "arms": {a: ARMS.get(a, {}) for a in arms},
              "baseline": str(args.baseline) if args.baseline else None, "cores": os.cpu_count(),
              "runs": runs, "median": medians, f"ratio_to_{first}": ratios}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"suite_cpu-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median": medians, f"ratio_to_{first}": ratios}, indent=2))
    print(path)


if __name__ == "__main__":
    main()
