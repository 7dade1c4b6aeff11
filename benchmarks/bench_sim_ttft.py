"""`mlxd simulate` against a recorded run: TTFT p50/p95 per tier, measured vs predicted.

    python benchmarks/bench_sim_ttft.py [--preset test|default] [--conversations 6] [--turns 4]

A live runtime (`open_runtime`, startup probe on, an SSD tier, a RAM tier of
about `--ram-conversations` conversations) serves multi-turn conversations
while `--record-trace`'s recorder writes the trace: first turns miss, a
returning conversation still in RAM hits RAM, one pushed out by the others
is restored from SSD (or recomputed, as the restore advisor decides).
`--concurrency` > 1 sends that many conversations' turns at once (queueing).
Two runs are recorded (seeds `--seed` and `--seed + 1`): the first is the
calibration run, the second is predicted. `mlxd simulate` replays the second
twice: with no other flags (the recording's own startup-probe model, scaled
by the online calibration at each flush), and with `--cost-model` fitted to
the first run's measured TTFTs (`mlxd simulate --fit-ttft-out`). The script
prints the recorded and the predicted TTFT p50/p95 per tier side by side, with
the ratio predicted / recorded (goal: within 0.9-1.1), and writes them to
benchmarks/results/sim_ttft-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TIERS = {"ram": "ram", "ssd": "ssd", "none": "miss", "host": "host"}
RESULTS = Path(__file__).resolve().parent / "results"


async def _conversation_turn(rt: Any, history: list[int], new: list[int], max_tokens: int) -> list[int]:
    from mlxd import SamplingParams

    prompt = history + new
    async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=max_tokens))) as stream:
        reply = await stream.tokens()
    return prompt + reply


async def record(args: argparse.Namespace, trace: Path, ssd_dir: Path) -> dict[str, Any]:
    """Serve the conversations with the recorder on; the runtime's own view of what it did."""
    import trio

    from mlxd import RuntimeConfig, open_runtime
    from mlxd.cli import record_trace

    rng = np.random.default_rng(args.seed)
    per_token = None
    config = RuntimeConfig(
        model_preset=args.preset, ssd_cache_dir=ssd_dir, device_probe="on", device_probe_budget_s=args.probe_s,
        snapshot_min_tokens=64, ssd_demote_idle_s=0, max_context=args.first + args.turns * args.back_to_back * (args.new + args.max_tokens) + 64,
        prompt_cache_bytes=1 << 40,  # resized below, once the KV bytes per token are known
    )
    async with open_runtime(config) as probe_rt:
        per_token = probe_rt.info.kv_bytes_per_token
    conversation_bytes = per_token * (args.first + args.turns * args.back_to_back * (args.new + args.max_tokens))
    import attrs

    config = attrs.evolve(config, prompt_cache_bytes=int(args.ram_conversations * conversation_bytes))
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    async with open_runtime(config) as rt:
        record_trace(rt, trace)
        for turn in range(args.turns):
            order = list(range(args.conversations))
            for start in range(0, len(order), args.concurrency):
                group = order[start : start + args.concurrency]

                async def one(c: int, turn: int = turn) -> None:
                    for again in range(args.back_to_back):  # the turns after the first hit RAM
                        n = args.first if turn == 0 and again == 0 else args.new
                        new = rng.integers(10, 1000, n).tolist()
                        histories[c] = await _conversation_turn(rt, histories[c], new, args.max_tokens)
                        if args.concurrency == 1:
                            await rt.flush()  # a barrier the replay keeps too: one request at a time

                async with trio.open_nursery() as nursery:
                    for c in group:
                        nursery.start_soon(one, c)
                if args.concurrency > 1:
                    await rt.flush()  # a barrier the replay keeps too
        stats = (await rt.stats()).as_dict()
    return {"serve_s": round(time.perf_counter() - t0, 1), "loadavg_before": load_before,
            "kv_bytes_per_token": per_token, "prompt_cache_bytes": config.prompt_cache_bytes, "probe": stats.get("device_probe"),
            "restore_decisions": (stats.get("ssd_cache") or {}).get("restore_decisions")}


def recorded_percentiles(trace: Path) -> dict[str, dict[str, float]]:
    from mlxd.sim.trace import load_recording

    by: dict[str, list[float]] = {}
    for r in load_recording(trace).reqs:
        if r.ttft_s is not None:
            by.setdefault(TIERS.get(r.cache_tier or "none", r.cache_tier or "miss"), []).append(r.ttft_s)
    return {k: _pcts(v) for k, v in sorted(by.items())}


def _pcts(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"n": len(values), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95))}


def simulate(trace: Path, *extra: str) -> dict[str, Any]:
    from mlxd.sim.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(trace), "--format", "json", *extra]) == 0
    (run,) = [d for d in (json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")) if "cache_model" in d]
    return run


def compare(recorded: dict[str, dict[str, float]], sim: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    counts = {"ram": sim["ram_hits"], "ssd": sim["ssd_hits"], "miss": sim["misses"], "host": sim.get("host_hits", 0)}
    for tier, rec in recorded.items():
        pred = sim["ttft_by_source_s"].get(tier)
        row: dict[str, Any] = {"tier": tier, "recorded_n": rec["n"], "predicted_n": counts.get(tier, 0)}
        for p in ("p50", "p95"):
            row[f"recorded_{p}_s"] = round(rec[p], 4)
            row[f"predicted_{p}_s"] = None if pred is None else round(pred[p], 4)
            row[f"ratio_{p}"] = None if pred is None or rec[p] <= 0 else round(pred[p] / rec[p], 3)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["tier  n rec/sim   p50 rec    p50 sim   ratio   p95 rec    p95 sim   ratio"]
    for r in rows:
        def s(x: float | None) -> str:
            return "      -" if x is None else f"{x * 1000:8.1f}ms"

        def q(x: float | None) -> str:
            return "   -  " if x is None else f"{x:6.2f}"

        lines.append(
            f"{r['tier']:<5} {r['recorded_n']:>3}/{r['predicted_n']:<3}  {s(r['recorded_p50_s'])} {s(r['predicted_p50_s'])} "
            f"{q(r['ratio_p50'])}  {s(r['recorded_p95_s'])} {s(r['predicted_p95_s'])} {q(r['ratio_p95'])}"
        )
    return "\n".join(lines)


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=768, help="tokens of a conversation's first prompt")
    p.add_argument("--new", type=int, default=64, help="new user tokens per later turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ram-conversations", type=float, default=2.5, help="RAM tier size in conversations")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--back-to-back", type=int, default=2, help="turns a conversation takes in a row")
    p.add_argument("--probe-s", type=float, default=4.0, help="startup probe budget (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, help="replay this recording instead of recording one")
    p.add_argument("--calibration-trace", type=Path,
                   help="with --trace: the earlier recording to fit the cost model to (else one is recorded)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-sim-ttft-") as tmp:
        live: dict[str, Any] = {}
        traces = {"calibration": args.calibration_trace, "predicted": args.trace}
        for i, name in enumerate(traces):
            if traces[name] is None:  # record it: the calibration run, then the predicted run (another seed)
                traces[name] = Path(tmp) / f"{name}.jsonl"
                run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
                live[name] = trio.run(record, run_args, traces[name], Path(tmp) / f"ssd-{name}")
        fitted = Path(tmp) / "fitted.json"
        with contextlib.redirect_stdout(io.StringIO()):  # prints the model it writes
            from mlxd.sim.cli import main as sim_main

            assert sim_main([str(traces["calibration"]), "--fit-ttft-out", str(fitted)]) == 0
        recorded = recorded_percentiles(traces["predicted"])
        sims = {
            "probe": simulate(traces["predicted"]),  # the recording's own probe model, calibrated per flush
            "fit": simulate(traces["predicted"], "--cost-model", str(fitted)),  # fitted to the other run
        }
        rows = {k: compare(recorded, v) for k, v in sims.items()}
        saved = {k: Path(v).read_text().splitlines() for k, v in traces.items()}
        model = json.loads(fitted.read_text())
    worst: dict[str, float | None] = {}
    for name, title in (("probe", "startup probe + online calibration (the recording's own)"),
                        ("fit", "cost model fitted to the calibration run's TTFTs")):
        print(f"predicted with the {title}:")
        print(table(rows[name]))
        ratios = [abs(r[f"ratio_{p}"] - 1) for r in rows[name] for p in ("p50", "p95") if r[f"ratio_{p}"]]
        worst[name] = max(ratios) if ratios else None
        print(f"worst |ratio - 1|: {worst[name]:.3f}\n" if worst[name] is not None else "no comparable tier\n")
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"sim_ttft-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "live": live, "rows": rows, "worst_abs_ratio_minus_1": worst, "loadavg_after": os.getloadavg(),
            "fitted_cost_model": model,
            "sim": {k: {f: v[f] for f in ("ttft_by_source_s", "ram_hits", "ssd_hits", "misses", "restore_decisions")}
                    for k, v in sims.items()},
            "traces": saved,
        }, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
