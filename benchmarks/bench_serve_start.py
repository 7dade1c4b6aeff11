"""How long `mlxd serve` takes to start (to its "mlxd: serving" line), arms interleaved round by round.

    python benchmarks/bench_serve_start.py [--rounds 5]

The test suite starts ~110 servers a run, so a start's cost is much of the suite's CPU. Arms, each
a real `mlxd serve` of the tiny model under PYTHONDONTWRITEBYTECODE=1 (as on these VMs):
- `compiled`: mlxd's modules as bytecode on disk (what `scripts/bootstrap` leaves, `compileall src`);
- `source`: the same with `src/**/__pycache__` removed before the start, so every module is compiled
  from source in the process (an editable install without that step);
- `sim_import`: compiled, but the process imports `mlxd.sim.cli` (the replay engine, trio.testing,
  pytest) before serving, as `mlxd serve`'s parser did before `sim/flags.py`.
Medians and each arm's ratio to `compiled` go to benchmarks/results/serve_start-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
RESULTS = ROOT / "benchmarks" / "results"
SERVE = ["serve", "--port", "0", "--log-format", "json", "--device-probe", "off", "--model"]


def compile_src() -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(SRC)], check=True)


def drop_bytecode() -> None:
    for cache in SRC.rglob("__pycache__"):
        shutil.rmtree(cache)


def start(arm: str, model: Path, log: Path) -> float:
    if arm == "source":
        drop_bytecode()
    else:
        compile_src()
    if arm == "sim_import":
        argv = [sys.executable, "-c", "import sys, mlxd.sim.cli; from mlxd.cli import main; sys.exit(main(sys.argv[1:]))"]
    else:
        argv = [sys.executable, "-m", "mlxd.cli"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*argv, *SERVE, str(model)], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while not re.search(r"mlxd: serving", log.read_text(errors="replace")):
                if proc.poll() is not None:
                    raise RuntimeError(f"{arm}: mlxd serve exited:\n{log.read_text()}")
                time.sleep(0.01)
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from mlxd.model import build_model

    arms = ("compiled", "source", "sim_import")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-serve-start-") as tmp:
        model = build_model(Path(tmp) / "tiny", "test", seed=0)
        try:
            for r in range(args.rounds):
                for arm in arms[r % len(arms):] + arms[: r % len(arms)]:  # each arm first in turn
                    times[arm].append(start(arm, model, Path(tmp) / "serve.log"))
                print(f"round {r + 1}: " + ", ".join(f"{a} {times[a][-1]:.2f} s" for a in arms), flush=True)
        finally:
            compile_src()  # leave the tree as bootstrap does
    medians = {arm: statistics.median(ts) for arm, ts in times.items()}
    result = {"rounds": args.rounds, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
              "seconds": times, "median_s": medians,
              "ratio_to_compiled": {arm: medians[arm] / medians["compiled"] for arm in arms}}
    for arm in arms:
        print(f"{arm:10} median {medians[arm]:.2f} s  x{result['ratio_to_compiled'][arm]:.3f} of compiled")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve_start-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
