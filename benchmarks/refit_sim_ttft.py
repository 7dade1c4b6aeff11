"""Fit `mlxd simulate`'s TTFT model again to committed recordings, at several outlier fences.

Each `bench_sim_ttft.py` result file carries both of its recordings (the calibration run and the
held-out run). This replays them offline with `--fit-outlier-fence` set to each value given, so a
change to the fit is judged on every run already recorded (GPU ones included) without a device:
per file and fence, the tiers' predicted / recorded p50 and p95 for the held-out run (`fit`) and for
the calibration run itself (`fit_own`: what the model gets wrong with no live drift), and how many
ratios each tier's spread left out; per file, each recording's SSD reads above 2x its median
(`bench_sim_ttft.slow_reads`: the reads that decide the SSD p95).

    python benchmarks/refit_sim_ttft.py benchmarks/results/sim_ttft-h*.json --fences 3 0
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sim_ttft as bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def refit(path: Path, fence: float) -> dict[str, Any]:
    recorded = json.loads(path.read_text())
    warmup = int(recorded["args"].get("ttft_warmup") or 0)
    with tempfile.TemporaryDirectory(prefix="refit-sim-ttft-") as tmp:
        traces = {}
        for name in ("calibration", "predicted"):
            traces[name] = Path(tmp) / f"{name}.jsonl"
            traces[name].write_text("\n".join(recorded["traces"][name]) + "\n")
        args = bench.parse_args(["--trace", str(traces["predicted"]), "--calibration-trace", str(traces["calibration"]),
                                 "--ttft-warmup", str(warmup), "--outlier-fence", str(fence), "--no-save"])
        result: dict[str, Any] = {}
        with contextlib.redirect_stdout(io.StringIO()):
            bench.run(args, Path(tmp), time.perf_counter(), result)
    return {
        "outliers": result["fitted_cost_model"].get("outliers") or {},
        "rows": {k: result["rows"][k] for k in ("fit", "fit_own")},
        "drift": result["drift"],
    }


def slow_reads(path: Path) -> dict[str, Any]:
    """Both recordings' SSD reads above `bench_sim_ttft.SLOW_READ` x their median, with their times."""
    recorded = json.loads(path.read_text())
    out = {}
    with tempfile.TemporaryDirectory(prefix="refit-sim-ttft-") as tmp:
        for name in ("calibration", "predicted"):
            trace = Path(tmp) / f"{name}.jsonl"
            trace.write_text("\n".join(recorded["traces"][name]) + "\n")
            out[name] = bench.slow_reads(trace)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_sim_ttft.py result JSON files")
    p.add_argument("--fences", nargs="+", type=float, default=[3.0, 0.0], help="outlier fences to fit with")
    p.add_argument("--label", default="refit")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"fences": args.fences, "files": {}}
    for path in args.files:
        out["files"][path.name] = by_fence = {}
        reads = slow_reads(path)
        out.setdefault("slow_reads", {})[path.name] = reads
        print(f"{path.name} slow SSD reads: " + ", ".join(
            f"{name} {r['slow']} of {r['reads']} (median {r['median_read_s'] * 1000:.0f} ms"
            + (f", slow {min(x['read_s'] for x in r['rows']) * 1000:.0f}-{max(x['read_s'] for x in r['rows']) * 1000:.0f} ms"
               if r["rows"] else "") + ")" for name, r in reads.items()), flush=True)
        for fence in args.fences:
            try:
                by_fence[str(fence)] = r = refit(path, fence)
            except Exception as exc:  # an older recording this code no longer reads: say so, go on
                by_fence[str(fence)] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{path.name} fence {fence:g}: {type(exc).__name__}: {exc}", flush=True)
                continue
            for kind in ("fit", "fit_own"):
                cells = " ".join(f"{row['tier']} {row['ratio_p50']}/{row['ratio_p95']}" for row in r["rows"][kind])
                print(f"{path.name} fence {fence:g} {kind:7} (p50/p95) {cells}  outliers {r['outliers']}", flush=True)
    dest = RESULTS / f"sim_ttft-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return dest


if __name__ == "__main__":
    main()
