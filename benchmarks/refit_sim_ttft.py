"""Fit `mlxd simulate`'s TTFT model again to committed recordings, at several outlier fences.

Each `bench_sim_ttft.py` result file carries both of its recordings (the calibration run and the
held-out run). This replays them offline with `--fit-outlier-fence` set to each value given, so a
change to the fit is judged on every run already recorded (GPU ones included) without a device:
per file and fence, the tiers' predicted / recorded p50 and p95 for the held-out run (`fit`) and for
the calibration run itself (`fit_own`: what the model gets wrong with no live drift), and how many
ratios each tier's spread left out; per file, each recording's SSD reads above 2x its median
(`bench_sim_ttft.slow_reads`: the reads that decide the SSD p95).

    python benchmarks/refit_sim_ttft.py benchmarks/results/sim_ttft-h*.json --fences 3 0
    python benchmarks/refit_sim_ttft.py $(ls benchmarks/results/sim_ttft-*.json | grep -v -e try -e refit) --fences 3 --floors 1 2 --label refit-floors

With `--floors`, each fence is fitted at each `--fit-outlier-floor` too (keys `FENCE/FLOOR`); the summary
counts, per fit, the percentiles within +-10% of the recorded ones (held out and own run, all and GPU only).
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


def refit(path: Path, fence: float, floor: float | None = None) -> dict[str, Any]:
    recorded = json.loads(path.read_text())
    warmup = int(recorded["args"].get("ttft_warmup") or 0)
    with tempfile.TemporaryDirectory(prefix="refit-sim-ttft-") as tmp:
        traces = {}
        for name in ("calibration", "predicted"):
            traces[name] = Path(tmp) / f"{name}.jsonl"
            traces[name].write_text("\n".join(recorded["traces"][name]) + "\n")
        args = bench.parse_args(["--trace", str(traces["predicted"]), "--calibration-trace", str(traces["calibration"]),
                                 "--ttft-warmup", str(warmup), "--outlier-fence", str(fence), "--no-save",
                                 *([] if floor is None else ["--outlier-floor", str(floor)])])
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


def within(files: dict[str, dict[str, Any]], key: str) -> dict[str, list[int]]:
    """Per fit kind (`fit`: the held-out run, `fit_own`: the calibration run), and GPU recordings alone, how many
    predicted p50s and p95s are within +-10% of the recorded ones: [within, all]."""
    out = {name: [0, 0] for name in ("fit", "fit_own", "fit_gpu", "fit_own_gpu")}
    for name, fits in files.items():
        gpu = any(x in name for x in ("h100", "h200", "gpu"))
        for kind in ("fit", "fit_own"):
            for row in (fits.get(key) or {}).get("rows", {}).get(kind, []):
                for q in ("ratio_p50", "ratio_p95"):
                    if row[q] is None:
                        continue
                    for slot in (kind, f"{kind}_gpu") if gpu else (kind,):
                        out[slot][0] += abs(row[q] - 1) <= 0.1
                        out[slot][1] += 1
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_sim_ttft.py result JSON files")
    p.add_argument("--fences", nargs="+", type=float, default=[3.0, 0.0], help="outlier fences to fit with")
    p.add_argument("--floors", nargs="+", type=float, default=None,
                   help="outlier floors to fit each fence with (default: the fit's own)")
    p.add_argument("--label", default="refit")
    args = p.parse_args(argv)
    out: dict[str, Any] = {"fences": args.fences, "floors": args.floors, "files": {}}
    fits = [(fence, floor, str(fence) if floor is None else f"{fence:g}/{floor:g}")
            for fence in args.fences for floor in (args.floors or [None])]
    for path in args.files:
        out["files"][path.name] = by_fence = {}
        reads = slow_reads(path)
        out.setdefault("slow_reads", {})[path.name] = reads
        print(f"{path.name} slow SSD reads: " + ", ".join(
            f"{name} {r['slow']} of {r['reads']} (median {r['median_read_s'] * 1000:.0f} ms"
            + (f", slow {min(x['read_s'] for x in r['rows']) * 1000:.0f}-{max(x['read_s'] for x in r['rows']) * 1000:.0f} ms"
               if r["rows"] else "") + ")" for name, r in reads.items()), flush=True)
        for fence, floor, key in fits:
            try:
                by_fence[key] = r = refit(path, fence, floor)
            except Exception as exc:  # an older recording this code no longer reads: say so, go on
                by_fence[key] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{path.name} fence {key}: {type(exc).__name__}: {exc}", flush=True)
                continue
            for kind in ("fit", "fit_own"):
                cells = " ".join(f"{row['tier']} {row['ratio_p50']}/{row['ratio_p95']}" for row in r["rows"][kind])
                print(f"{path.name} fence {key} {kind:7} (p50/p95) {cells}  outliers {r['outliers']}", flush=True)
    out["within_10pct"] = {key: within(out["files"], key) for _, _, key in fits}
    print("percentiles within +-10% (within / all):", json.dumps(out["within_10pct"]), flush=True)
    dest = RESULTS / f"sim_ttft-{args.label}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return dest


if __name__ == "__main__":
    main()
