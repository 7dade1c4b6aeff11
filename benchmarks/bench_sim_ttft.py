"""`mlxd simulate` against a recorded run: TTFT p50/p95 per tier, measured vs predicted.

    python benchmarks/bench_sim_ttft.py [--preset test|default | --model DIR] [--conversations 6] [--turns 4]
    # on a GPU (builds the Qwen3-1.7B-shaped model if missing): benchmarks/gpu/bench_sim_ttft_gpu.py

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
benchmarks/results/sim_ttft-<time>.json. Before either run, `--warmup`
conversations are served by a runtime of their own in the same process (not
recorded; then each is restored once in a runtime restarted on its SSD
files), so the calibration run does not pay the process's one-off costs
(allocator growth, kernel compilation, the first restore) that the predicted
run, second in the process, does not. Once the recorded runtimes are open the heap is frozen, as
`mlxd serve` freezes it once it listens (`--no-gc-freeze`: not; every collection is timed either way
and the requests and slow SSD reads one landed in are counted): unfrozen, full collections of this
process's whole heap were inside every slow SSD read of the GPU runs (docs/benchmarks.md). `--stop-after` bounds the whole script: each run stops
sending new turns at its share of the budget, and the JSON is written even when a stage fails.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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


def runtime_config(args: argparse.Namespace, ssd_dir: Path, **changes: Any) -> Any:
    from mlxd import RuntimeConfig

    settings: dict[str, Any] = {
        "model": str(args.model) if args.model else None, "model_preset": args.preset, "ssd_cache_dir": ssd_dir,
        "device_probe": "on", "device_probe_budget_s": args.probe_s, "restore_choice": args.restore_choice,
        "snapshot_min_tokens": 64, "ssd_demote_idle_s": 0, "max_context": conversation_tokens(args) + 64,
        "prompt_cache_bytes": 1 << 40,  # the recorded runs' is set from the KV bytes per token (warm_up)
    }
    if args.prefill_slice_ms is not None:  # mlxd serve --prefill-slice-ms (0 = whole prefill steps)
        settings["prefill_slice_s"] = args.prefill_slice_ms / 1000
    return RuntimeConfig(**{**settings, **changes})


def conversation_tokens(args: argparse.Namespace) -> int:
    return args.first + args.turns * args.back_to_back * (args.new + args.max_tokens)


async def warm_up(args: argparse.Namespace, ssd_dir: Path) -> dict[str, Any]:
    """Serve `--warmup` conversations (first prompt, then the turns in a row) unrecorded, then, in a
    runtime restarted on their SSD files, the turns in a row again (the first a restore: the restore
    path's one-off costs too, then the second round's RAM-hit shapes); the KV bytes per token."""
    from mlxd import open_runtime

    rng = np.random.default_rng(10_000 + args.seed)
    t0 = time.perf_counter()
    turns: list[dict[str, Any]] = []
    histories: list[list[int]] = [[] for _ in range(args.warmup)]

    async def turn(rt: Any, c: int, n: int) -> None:
        t = time.perf_counter()
        histories[c] = await _conversation_turn(rt, histories[c], rng.integers(10, 1000, n).tolist(), args.max_tokens)
        turns.append({"tokens": len(histories[c]), "s": round(time.perf_counter() - t, 4)})
        await rt.flush()

    config = runtime_config(args, ssd_dir, device_probe="off", restore_choice="always")
    async with open_runtime(config) as rt:
        for c in range(args.warmup):
            for again in range(args.back_to_back):
                await turn(rt, c, args.first if again == 0 else args.new)
        per_token = rt.info.kv_bytes_per_token
    restores = None
    if args.warmup:
        async with open_runtime(config) as rt:  # RAM is empty: each conversation's next turn is restored
            for c in range(args.warmup):
                for _ in range(args.back_to_back):  # restored, then RAM hits: every shape the runs will serve
                    await turn(rt, c, args.new)
            restores = ((await rt.stats()).as_dict().get("ssd_cache") or {}).get("restore_decisions")
    return {"kv_bytes_per_token": per_token, "seconds": round(time.perf_counter() - t0, 1), "turns": turns,
            "restore_decisions": restores}


async def record(runs: list[tuple[argparse.Namespace, Path, Path]], per_token: int, deadline: float) -> list[dict[str, Any]]:
    """Serve the conversations with the recorder on (no new turn past `deadline`), one runtime per
    (args, trace, SSD dir) of `runs`; with two, interleaved: each turn of a group of conversations is served
    by one runtime, then by the other (its own seed's prompts), so both runs see the same machine load.
    The runtimes' own views."""
    import attrs
    import trio

    from mlxd import open_runtime
    from mlxd.cli import record_trace
    from mlxd.runtime import gc_pauses

    rngs = [np.random.default_rng(a.seed) for a, _, _ in runs]
    args = runs[0][0]
    conversation_bytes = per_token * conversation_tokens(args)
    configs = [attrs.evolve(runtime_config(a, ssd_dir), prompt_cache_bytes=int(a.ram_conversations * conversation_bytes))
               for a, _, ssd_dir in runs]
    histories: list[list[list[int]]] = [[[] for _ in range(args.conversations)] for _ in runs]
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    requests = [0 for _ in runs]
    stopped_early = False
    async with contextlib.AsyncExitStack() as stack:
        rts = [await stack.enter_async_context(open_runtime(config)) for config in configs]
        frozen = gc_pauses.freeze_heap() if args.gc_freeze else None  # as `mlxd serve` does once it listens
        origins = []  # each recording's t = 0 on time.monotonic() (record_trace's own, to within microseconds)
        for rt, (_, trace, _) in zip(rts, runs, strict=True):
            origins.append(time.monotonic())
            record_trace(rt, trace)
        collections = GcTimeline()
        started = time.perf_counter()
        wave = args.wave or args.conversations  # conversations taking all their turns before the next ones start
        rounds = [(turn, list(range(w, min(w + wave, args.conversations))))
                  for w in range(0, args.conversations, wave) for turn in range(args.turns)]
        for turn, order in rounds:
            for start in range(0, len(order), args.concurrency):
                if time.perf_counter() >= deadline:
                    stopped_early = True
                    break
                group = order[start : start + args.concurrency]
                served = list(enumerate(rts))
                if (start // args.concurrency) % 2:  # which runtime goes first alternates (ABBA): no order bias
                    served.reverse()
                for again in range(args.back_to_back):  # the turns after the first hit RAM
                    for k, rt in served:  # each turn by one runtime, then the other: seconds apart

                        async def one(c: int, turn: int = turn, again: int = again, k: int = k, rt: Any = rt) -> None:
                            n = args.first if turn == 0 and again == 0 else args.new
                            new = rngs[k].integers(10, 1000, n).tolist()
                            histories[k][c] = await _conversation_turn(rt, histories[k][c], new, args.max_tokens)
                            requests[k] += 1
                            if args.concurrency == 1:
                                await rt.flush()  # a barrier the replay keeps too: one request at a time

                        async with trio.open_nursery() as nursery:
                            for c in group:
                                nursery.start_soon(one, c)
                        if args.concurrency > 1:
                            await rt.flush()  # a barrier the replay keeps too
            if stopped_early:
                break
        served_s = time.perf_counter() - started
        collections.stop()
        if frozen is not None:
            gc_pauses.thaw()
        stats = [(await rt.stats()).as_dict() for rt in rts]
    return [{"serve_s": round(time.perf_counter() - t0, 1), "requests_s": round(served_s, 1), "requests": n,
             "stopped_early": stopped_early, "loadavg_before": load_before, "interleaved": len(runs) > 1,
             "kv_bytes_per_token": per_token, "prompt_cache_bytes": config.prompt_cache_bytes,
             "probe": st.get("device_probe"), "restore_decisions": (st.get("ssd_cache") or {}).get("restore_decisions"),
             "gc_frozen": frozen, "gc": collections.since(origin)}
            for n, config, st, origin in zip(requests, configs, stats, origins, strict=True)]


class GcTimeline:
    """Every garbage collection in this process while it is on (`gc.callbacks`): its start on
    time.monotonic(), seconds and generation. A collection holds the GIL throughout, so every thread
    of the process (the reader threads of an SSD read too) stops for it."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, int]] = []
        self._began: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.monotonic()
        elif self._began is not None:
            self.rows.append((self._began, time.monotonic() - self._began, int(info.get("generation", -1))))
            self._began = None

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def since(self, origin: float) -> list[list[float]]:
        """[t from `origin`, seconds, generation] of each collection."""
        return [[round(t - origin, 6), round(s, 6), g] for t, s, g in self.rows]


def gc_in_requests(trace: Path, collections: list[list[float]]) -> dict[str, Any]:
    """Which requests a garbage collection ran inside (between submission and first token), per tier,
    and the SSD reads above `SLOW_READ` x their median with and without one: is the SSD tier's tail
    the collector's?"""
    lines = [json.loads(x) for x in Path(trace).read_text().splitlines() if x.strip()]
    requests = [r for r in lines if "event" not in r and r.get("ttft_s") is not None]
    reads = [r["parts"]["read_s"] for r in requests if r.get("cache_tier") == "ssd" and (r.get("parts") or {}).get("read_s")]
    median = float(np.median(reads)) if reads else 0.0
    by: dict[str, dict[str, Any]] = {}
    for r in requests:
        t0, t1 = r["t"], r["t"] + r["ttft_s"]
        inside = [c for c in collections if c[0] < t1 and c[0] + c[1] > t0]
        tier = TIERS.get(r.get("cache_tier") or "none", "miss")
        row = by.setdefault(tier, {"requests": 0, "with_gc": 0, "gc_ms": [], "slow_reads": 0, "slow_reads_with_gc": 0,
                                   "reads_with_gc": 0})
        row["requests"] += 1
        if inside:
            row["with_gc"] += 1
            row["gc_ms"].append(round(sum(c[1] for c in inside) * 1000, 2))
        read = (r.get("parts") or {}).get("read_s") or 0.0
        if tier == "ssd" and read:
            row["reads_with_gc"] += bool(inside)
            if read > SLOW_READ * median:
                row["slow_reads"] += 1
                row["slow_reads_with_gc"] += bool(inside)
    full = [c for c in collections if c[2] == 2]
    return {"collections": len(collections), "full": len(full),
            "full_ms": sorted(round(c[1] * 1000, 2) for c in full), "by_tier": by}


def recorded_percentiles(trace: Path, warmup: int = 0) -> dict[str, dict[str, float]]:
    """Per tier: n, p50, p95 of the recorded TTFTs, each tier's first `warmup` requests left out (as
    `mlxd simulate --ttft-warmup`), and the 90% bootstrap interval of p50 and p95 relative to them
    (`p50_lo`..`p95_hi`: what the tier's own sample size leaves uncertain)."""
    from mlxd.sim.trace import load_recording
    from mlxd.sim.ttft_fit import tier_warmup_indices

    reqs = load_recording(trace).reqs
    skip = tier_warmup_indices(reqs, warmup)
    by: dict[str, list[float]] = {}
    for r in reqs:
        if r.ttft_s is not None and r.index not in skip:
            by.setdefault(TIERS.get(r.cache_tier or "none", r.cache_tier or "miss"), []).append(r.ttft_s)
    return {k: _pcts(v) for k, v in sorted(by.items())}


def _pcts(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    out = {"n": len(values), "p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95))}
    draws = np.random.default_rng(0).choice(a, size=(BOOTSTRAP, a.size))
    for p in ("p50", "p95"):
        q = np.percentile(draws, float(p[1:]), axis=1) / out[p] if out[p] > 0 else np.ones(BOOTSTRAP)
        out[f"{p}_lo"], out[f"{p}_hi"] = (round(float(x), 3) for x in np.percentile(q, (5, 95)))
    return out


BOOTSTRAP = 2000  # resamples for a percentile's interval


def simulate(trace: Path, *extra: str) -> dict[str, Any]:
    from mlxd.sim.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(trace), "--format", "json", *extra]) == 0
    (run,) = [d for d in (json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")) if "cache_model" in d]
    return run


def compare(recorded: dict[str, dict[str, float]], sim: dict[str, Any], warmup: int = 0) -> list[dict[str, Any]]:
    """Per tier: recorded and predicted p50 / p95 and predicted / recorded; `predicted_n` counts the replay's
    requests of the tier less its first `warmup` (left out of both sides' percentiles)."""
    rows = []
    counts = {"ram": sim["ram_hits"], "ssd": sim["ssd_hits"], "miss": sim["misses"], "host": sim.get("host_hits", 0)}
    counts = {k: max(0, v - warmup) for k, v in counts.items()}
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model", type=Path, help="a model directory instead of a preset (e.g. the GPU driver's)")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=768, help="tokens of a conversation's first prompt")
    p.add_argument("--new", type=int, default=64, help="new user tokens per later turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--ram-conversations", type=float, default=2.5, help="RAM tier size in conversations")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--back-to-back", type=int, default=2, help="turns a conversation takes in a row")
    p.add_argument("--probe-s", type=float, default=4.0, help="startup probe budget (seconds)")
    p.add_argument("--restore-choice", choices=("measured", "always"), default="measured",
                   help="always: every returning conversation is restored from SSD (a GPU recomputes instead)")
    p.add_argument("--warmup", type=int, default=1,
                   help="conversations served unrecorded in the same process before the recorded runs")
    p.add_argument("--fit-warmup", type=int, default=None, help="mlxd simulate --fit-warmup (default: its own)")
    p.add_argument("--outlier-fence", type=float, default=None,
                   help="mlxd simulate --fit-outlier-fence (default: its own, 3; 0 = every request in the spread)")
    p.add_argument("--outlier-floor", type=float, default=None,
                   help="mlxd simulate --fit-outlier-floor (default: its own, 2; 1 = the fence alone)")
    p.add_argument("--ttft-warmup", type=int, default=1,
                   help="each tier's first N requests of each run are left out of the fit and of the recorded and "
                   "predicted percentiles (mlxd simulate --ttft-warmup): a tier's first use pays one-off costs")
    p.add_argument("--stop-after", type=float, default=0.0,
                   help="seconds for the whole script (0 = no limit): each run stops sending turns at its share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-slice-ms", type=float, default=None,
                   help="the runtimes' --prefill-slice-ms (default: the server's; 0 = whole prefill steps, no slicer)")
    p.add_argument("--wave", type=int, default=0,
                   help="conversations that take all their turns before the next ones start (0 = all at once): "
                   "a run cut by --stop-after then keeps every tier (> --ram-conversations, so returns restore)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                   help="record the calibration and the predicted run at once, two runtimes taking turns request "
                   "by request, so both see the same machine load (--no-interleave: one after the other)")
    p.add_argument("--label", default="", help="in the result file's name (sim_ttft-LABEL-<time>.json)")
    p.add_argument("--trace", type=Path, help="replay this recording instead of recording one")
    p.add_argument("--calibration-trace", type=Path,
                   help="with --trace: the earlier recording to fit the cost model to (else one is recorded)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="freeze the heap once the recorded runtimes are open, as `mlxd serve` does once it listens "
                        "(runtime/gc_pauses.py; --no-gc-freeze: a full collection walks the whole heap, every thread "
                        "stopped, inside a request at random); every collection is timed either way")
    args = p.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").exists():
        p.error(f"--model {args.model}: no config.json there")
    if min(args.conversations, args.turns, args.first, args.new, args.back_to_back, args.concurrency) < 1:
        p.error("--conversations, --turns, --first, --new, --back-to-back and --concurrency must be >= 1")
    if args.stop_after < 0 or args.warmup < 0 or args.ttft_warmup < 0 or args.wave < 0:
        p.error("--stop-after, --warmup, --ttft-warmup and --wave must be >= 0")
    return args


RESERVE_S = 5.0  # of --stop-after, kept for the fit, the two replays and the JSON


def run(args: argparse.Namespace, tmp: Path, began: float, result: dict[str, Any]) -> None:
    """Record (unless given), fit, replay; fills `result` stage by stage (written even if a stage fails)."""
    import trio

    from mlxd.sim.cli import main as sim_main

    end = began + args.stop_after - RESERVE_S if args.stop_after else float("inf")
    traces = {"calibration": args.calibration_trace, "predicted": args.trace}
    live: dict[str, Any] = result.setdefault("live", {})
    if any(v is None for v in traces.values()):
        live["warmup"] = trio.run(warm_up, args, tmp / "ssd-warmup")
        print(f"warm-up: {live['warmup']}", flush=True)
    missing = [name for name in traces if traces[name] is None]
    if missing:  # record them: the calibration run and the predicted run (another seed)
        per_token = live["warmup"]["kv_bytes_per_token"]
        runs = {name: (argparse.Namespace(**{**vars(args), "seed": args.seed + i}), tmp / f"{name}.jsonl",
                       tmp / f"ssd-{name}") for i, name in enumerate(traces) if name in missing}
        batches = [missing] if args.interleave else [[name] for name in missing]
        try:
            for batch in batches:
                now = time.perf_counter()
                deadline = now + (end - now) / 2 if len(batches) == 2 and batch is batches[0] else end
                views = trio.run(record, [runs[name] for name in batch], per_token, deadline)
                for name, view in zip(batch, views, strict=True):
                    live[name] = view
                    print(f"{name} run: {view}", flush=True)
        finally:
            for name in missing:
                path = runs[name][1]
                if path.exists():
                    result.setdefault("traces", {})[name] = path.read_text().splitlines()
        for name in missing:
            traces[name] = runs[name][1]
    for name, path in traces.items():  # given ones too: the JSON carries both recordings
        result.setdefault("traces", {}).setdefault(name, Path(path).read_text().splitlines())
    fitted = tmp / "fitted.json"
    warm = ["--ttft-warmup", str(args.ttft_warmup)]
    fit_flags = warm + ([] if args.fit_warmup is None else ["--fit-warmup", str(args.fit_warmup)])
    fit_flags += [] if args.outlier_fence is None else ["--fit-outlier-fence", str(args.outlier_fence)]
    fit_flags += [] if args.outlier_floor is None else ["--fit-outlier-floor", str(args.outlier_floor)]
    with contextlib.redirect_stdout(io.StringIO()):  # prints the model it writes
        assert sim_main([str(traces["calibration"]), "--fit-ttft-out", str(fitted), *fit_flags]) == 0
    result["fitted_cost_model"] = json.loads(fitted.read_text())
    print(f"fit: far-out outliers left out of each tier's spread: {result['fitted_cost_model'].get('outliers') or 'none'}",
          flush=True)
    recorded = recorded_percentiles(traces["predicted"], args.ttft_warmup)
    calibration = recorded_percentiles(traces["calibration"], args.ttft_warmup)
    result["recorded"] = {"predicted": recorded, "calibration": calibration}
    sims = {
        "probe": simulate(traces["predicted"], *warm),  # the recording's own probe model, calibrated per flush
        "fit": simulate(traces["predicted"], "--cost-model", str(fitted), *warm),  # fitted to the other run
        # the fit replaying the run it was fitted to: what the model itself gets wrong, with no live drift
        "fit_own": simulate(traces["calibration"], "--cost-model", str(fitted), *warm),
    }
    result["sim"] = {k: {f: v.get(f) for f in ("ttft_by_source_s", "ram_hits", "ssd_hits", "misses", "restore_decisions")}
                     for k, v in sims.items()}
    rows = result["rows"] = {k: compare(calibration if k == "fit_own" else recorded, v, args.ttft_warmup)
                             for k, v in sims.items()}
    worst: dict[str, float | None] = result.setdefault("worst_abs_ratio_minus_1", {})
    for name, title in (("probe", "startup probe + online calibration (the recording's own)"),
                        ("fit", "cost model fitted to the calibration run's TTFTs (held-out run)"),
                        ("fit_own", "same fit, replaying the calibration run itself")):
        print(f"predicted with the {title}:")
        print(table(rows[name]))
        ratios = [abs(r[f"ratio_{p}"] - 1) for r in rows[name] for p in ("p50", "p95") if r[f"ratio_{p}"]]
        worst[name] = max(ratios) if ratios else None
        print(f"worst |ratio - 1|: {worst[name]:.3f}\n" if worst[name] is not None else "no comparable tier\n")
    # How far the live server moved between the two runs: no model of the first run predicts that part.
    result["parts"] = {name: ttft_parts(path, args.ttft_warmup) for name, path in traces.items()}
    print("TTFT parts, median ms per tier (queue = submission to slot; lookup; fetch = SSD read wait; engine = "
          "the rest; read = of the fetch, the read itself):\n" + "\n".join(f"  {name} {tier}: " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in p.items())
                                     for name, by in result["parts"].items() for tier, p in by.items()))
    # The SSD tier's p95 follows a few reads 2.5-5.5x slower than the rest (docs/benchmarks.md, 2026-12-05 CPU
    # section): each one's parts, so a run shows whether the landing, the checks or the reads were slow.
    result["slow_reads"] = {name: slow_reads(path) for name, path in traces.items()}
    for name, slow in result["slow_reads"].items():
        print(f"{name}: {slow['slow']} of {slow['reads']} SSD reads above {SLOW_READ}x their median "
              f"{slow['median_read_s'] * 1000:.1f} ms" + "".join(
                  f"\n  read {r['read_s'] * 1000:.0f} ms: land {r['land_s'] * 1000:.0f}, verify {r['verify_s'] * 1000:.0f}, "
                  f"rest {r['rest_s'] * 1000:.0f}, at {r['t']:.1f} s" for r in slow["rows"]))
    result["gc"] = {name: gc_in_requests(path, live[name]["gc"]) for name, path in traces.items()
                    if (live.get(name) or {}).get("gc") is not None}
    for name, g in result["gc"].items():
        ssd = g["by_tier"].get("ssd") or {}
        print(f"{name}: {g['collections']} garbage collections while recording, {g['full']} full "
              f"({', '.join(f'{x:.0f}' for x in g['full_ms'][-5:])} ms the longest); slow SSD reads with one inside "
              f"{ssd.get('slow_reads_with_gc', 0)} of {ssd.get('slow_reads', 0)}, all SSD reads "
              f"{ssd.get('reads_with_gc', 0)} of {ssd.get('requests', 0)}", flush=True)
    result["drift"] = drift(calibration, recorded)
    result["noise"] = noise(rows["fit"], result["drift"], recorded)
    print(noise_table(result["noise"]))


def ttft_parts(trace: Path, warmup: int = 0) -> dict[str, dict[str, float]]:
    """Per tier, the median of each part of the recorded TTFT (each tier's first `warmup` left out):
    queue (submission to a slot), lookup, fetch (waiting for an SSD hit's file; `read`: of it, the read
    itself on its thread, landing included, in recordings that have it; `land` and `verify`: of the read,
    making its memory and the CRC checks, in recordings since 2026-12-05) and engine (the rest: restore
    adoption, prefill, first token, the trip back)."""
    from mlxd.sim.trace import load_recording
    from mlxd.sim.ttft_fit import tier_warmup_indices

    skip = tier_warmup_indices(load_recording(trace).reqs, warmup)
    by: dict[str, list[dict[str, float]]] = {}
    lines = [json.loads(x) for x in Path(trace).read_text().splitlines() if x.strip()]
    reqs = sorted((r for r in lines if "event" not in r), key=lambda r: r["t"])  # load_recording's order
    for index, r in enumerate(reqs):
        if r.get("ttft_s") is None or index in skip:
            continue
        parts = r.get("parts") or {}
        row = {"queue": r.get("queued_s") or 0.0, "lookup": parts.get("lookup_s", 0.0), "fetch": parts.get("fetch_s", 0.0)}
        row["engine"] = r["ttft_s"] - sum(row.values())
        row["read"] = parts.get("read_s", 0.0)  # of the fetch, the read itself (landing included)
        row["land"] = parts.get("land_s", 0.0)  # of the read, making the memory it lands in
        row["verify"] = parts.get("verify_s", 0.0)  # of the read, the CRC checks (reader threads summed)
        row["ttft"] = r["ttft_s"]
        by.setdefault(TIERS.get(r.get("cache_tier") or "none", "miss"), []).append(row)
    return {t: {k: round(float(np.median([x[k] for x in rows])), 5) for k in rows[0]} for t, rows in sorted(by.items())}


SLOW_READ = 2.0  # an SSD read this many times its run's median is listed with its parts


def slow_reads(trace: Path) -> dict[str, Any]:
    """The SSD hits' reads above `SLOW_READ` x their median, each with its parts (land, verify, the rest:
    the reads and opens); land and verify are 0 in recordings before 3ab129d (2026-12-05)."""
    lines = [json.loads(x) for x in Path(trace).read_text().splitlines() if x.strip()]
    hits = [r for r in lines if "event" not in r and r.get("cache_tier") == "ssd" and (r.get("parts") or {}).get("read_s")]
    if not hits:
        return {"reads": 0, "slow": 0, "median_read_s": 0.0, "rows": []}
    median = float(np.median([r["parts"]["read_s"] for r in hits]))
    rows = []
    for r in sorted(hits, key=lambda r: r["t"]):
        p = r["parts"]
        if p["read_s"] > SLOW_READ * median:
            land, verify = p.get("land_s", 0.0), p.get("verify_s", 0.0)
            rows.append({"t": r["t"], "read_s": p["read_s"], "land_s": land, "verify_s": verify,
                         "rest_s": p["read_s"] - land - verify})
    return {"reads": len(hits), "slow": len(rows), "median_read_s": median, "rows": rows}


TOLERANCE = 0.10  # the goal: predicted / recorded within 1 +- this


def noise(fit_rows: list[dict[str, Any]], drifts: dict[str, dict[str, float]],
          recorded: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per tier, the fit's error beside the system's own noise: the live drift between the two runs and
    the 90% bootstrap interval of the held-out run's own percentile (its sample size). The p95 is
    `checkable` only where its live drift is itself within the tolerance: where the live server's tail
    moved further between two runs of one workload, no model of one run can be held to +-10% on the
    other (`p95_verdict`: "ok", "miss", or "below noise"). The p50 is always judged ("ok" / "miss"),
    its drift beside it."""
    out = []
    for r in fit_rows:
        t, rec = r["tier"], recorded.get(r["tier"], {})
        row: dict[str, Any] = {"tier": t, "n": r["recorded_n"]}
        for p in ("p50", "p95"):
            ratio, live = r[f"ratio_{p}"], drifts.get(t, {}).get(p)
            row[f"sim_{p}"] = ratio
            row[f"drift_{p}"] = live
            row[f"interval_{p}"] = [rec.get(f"{p}_lo"), rec.get(f"{p}_hi")]
            row[f"sim_{p}_within_10pct"] = within = ratio is not None and abs(ratio - 1) <= TOLERANCE
            row[f"{p}_checkable"] = checkable = live is not None and abs(live - 1) <= TOLERANCE
            row[f"{p}_verdict"] = ("ok" if within else "miss") if checkable or p == "p50" else "below noise"
        out.append(row)
    return out


def noise_table(rows: list[dict[str, Any]]) -> str:
    lines = ["the fit's error beside the live noise (ratios; interval = 90% bootstrap of the held-out percentile):",
             "tier    n   sim p50  drift p50  interval p50    sim p95  drift p95  interval p95"]

    def q(x: float | None) -> str:
        return "    -" if x is None else f"{x:5.2f}"

    for r in rows:
        lines.append(f"{r['tier']:<5} {r['n']:>4}   {q(r['sim_p50'])}    {q(r['drift_p50'])}    "
                     f"{q(r['interval_p50'][0])}-{q(r['interval_p50'][1])}    {q(r['sim_p95'])}    "
                     f"{q(r['drift_p95'])}    {q(r['interval_p95'][0])}-{q(r['interval_p95'][1])}")
    lines.append(f"verdict (within +-{TOLERANCE:.0%}; the p95 is checked only where the live drift between the two "
                 "runs is itself within it):")
    for r in rows:
        said = []
        for p in ("p50", "p95"):
            if r[f"{p}_verdict"] == "below noise":
                said.append(f"{p} {q(r[f'sim_{p}']).strip()}: live drift {p} {q(r[f'drift_{p}']).strip()}: the check "
                            "is below the system's own noise")
            else:
                beyond = "" if r[f"{p}_checkable"] else f" (live drift {p} {q(r[f'drift_{p}']).strip()})"
                said.append(f"{p} {q(r[f'sim_{p}']).strip()} {'ok' if r[f'{p}_verdict'] == 'ok' else 'MISS'}{beyond}")
        lines.append(f"  {r['tier']:<5} " + "; ".join(said))
    return "\n".join(lines)


def drift(calibration: dict[str, dict[str, float]], predicted: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per tier in both runs: the predicted run's recorded p50 and p95 over the calibration run's."""
    return {t: {p: round(predicted[t][p] / calibration[t][p], 3) for p in ("p50", "p95")}
            for t in predicted if t in calibration and min(calibration[t]["p50"], calibration[t]["p95"]) > 0}


def main(argv: list[str] | None = None) -> Path | None:
    args = parse_args(argv)
    began = time.perf_counter()
    result: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "loadavg_before": os.getloadavg(), "cpus": os.cpu_count(),
    }
    out = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-sim-ttft-") as tmp:
            run(args, Path(tmp), began, result)
    except BaseException as exc:  # the JSON still says how far it got
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        result["loadavg_after"] = os.getloadavg()
        result["seconds"] = round(time.perf_counter() - began, 1)
        if not args.no_save:
            RESULTS.mkdir(exist_ok=True)
            label = f"{args.label}-" if args.label else ""
            out = RESULTS / f"sim_ttft-{label}{time.strftime('%Y%m%d-%H%M%S')}.json"
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
            print(f"wrote {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
