# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""When a finished row's final checkpoint is taken (`MLXD_FINAL_PLAN`), in one process, arms side by side (issue 28).

Rows decode together and end over a few consecutive steps (`--groups`); one `EngineCore` per arm (`MODE`, or
`MODE:PACK_MB` with `MLXD_PLAN_PACK_MB`), each on the same model, driven step by step as the engine actor drives it (no HTTP, no cache owner: the checkpoints' notes are
built, with their write plans under `--ssd`, and dropped). Per run, from the time each step handed its events out:
every row's own rate (its tokens after the first over first-to-last token, summed over rows: the HTTP bench's
`stream_sum_tok_s`), the rate while every row decodes (`all_rows`), their ratio, the step gaps in the steps where
rows end beyond the median step, and the time to the last finish. Arms in a rotating order each round; each arm ÷
the first paired per round (median + IQR). The ending steps are taken apart too: each one's time inside mlx-lm's
`BatchGenerator.next` (the forward's dispatch, the wait for the tokens, filtering finished rows out of the batch) and
the leaving rows' `leave_s` (their final checkpoints: with the SSD tier the write plans, on CUDA the host reads).
An arm `MODE[:PACK_MB][@ram|@ssd][+mlxfilter][+planmain][+hostread]` picks its tier itself (default: `--ssd`'s), so
one run can set RAM only beside the SSD tier; `+mlxfilter`: rows leave the batch by mlx-lm's own filter, which waits
for the forward in flight (`MLXD_BATCH_FILTER`, model/batch_filter.py); `+planmain`: the write plans' slices on the
generation stream, behind the forward (`MLXD_PLAN_STREAM=main`); `+hostread`: the write plans' buffers host views,
whose first read converts the KV to managed memory on CUDA (`MLXD_PLAN_DEVICE=0`), not device addresses. The plans
are dropped unwritten, so an arm's leave time is the plan's own cost (by address: the kernel reading addresses).

    PYTHONPATH=src python benchmarks/bench_final_plan.py [--preset default] [--rows 8] [--prompt 512] [--tokens 48]
        [--groups 2] [--rounds 8] [--arms with-token,after-forward,after-forward:64,after-forward@ram] [--ssd]
        [--model DIR]
    on a GPU: `wave3.sh finalplan` (the 1.7B shape, 8k-token prompts, the SSD tier)
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def decode_run(core: Any, rows: int, prompt: int, tokens: int, groups: int, seed: int) -> dict[str, Any]:
    """One batch of `rows` fresh prompts, rows ending over `groups` consecutive steps; the run's timings."""
    from mlxd.engine.ops import RowStart, StepOps
    from mlxd.runtime.kernel.messages import GenerationFinished, GenerationRequest, SamplingParams, TokenGenerated

    rng = random.Random(seed)
    vocab = core.tokenizer.vocab_size
    ban = tuple((t, -100.0) for t in sorted(core.tokenizer.eos_token_ids))  # every row runs to its max_tokens
    starts = tuple(
        RowStart(request=GenerationRequest(
            request_id=f"s{seed}-{i}", prompt=tuple(rng.randrange(10, vocab) for _ in range(prompt)),
            sampling=SamplingParams(max_tokens=tokens + i % groups, logit_bias=ban)))
        for i in range(rows))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    done: dict[str, float] = {}
    handed: list[tuple[float, int, int]] = []  # (time, tokens handed, rows that ended)
    parts: list[tuple[float, float]] = []  # per step: seconds in BatchGenerator.next, the leaving rows' leave_s
    inside_next = [0.0]
    generator_next = core.generator.next

    def timed_next() -> Any:
        t = time.perf_counter()
        try:
            return generator_next()
        finally:
            inside_next[0] += time.perf_counter() - t

    core.generator.next = timed_next  # this instance only, for this run (restored below)
    t0 = time.perf_counter()
    ops = StepOps(starts=starts)
    try:
        while len(done) < rows:
            inside_next[0] = 0.0
            result = core.step(ops)
            ops = StepOps()
            if result.rejected:
                raise RuntimeError(f"rows refused: {result.rejected}")
            now = time.perf_counter() - t0
            n = ended = 0
            leave = 0.0
            for e in result.emits:
                if isinstance(e.event, TokenGenerated):
                    first.setdefault(e.request_id, now)
                    last[e.request_id] = now
                    count[e.request_id] = count.get(e.request_id, 0) + 1
                    n += 1
                elif isinstance(e.event, GenerationFinished):
                    done[e.request_id] = now
                    ended += 1
                    leave += e.event.leave_s
            handed.append((now, n, ended))
            parts.append((inside_next[0], leave))
    finally:
        del core.generator.next
    own = sum((count[r] - 1) / (last[r] - first[r]) for r in count if last[r] > first[r])
    all_from, all_to = max(first.values()), min(last.values())  # every row has its first token, none its last
    inside = [(t, n) for t, n, _ in handed if all_from < t <= all_to]
    all_rows = sum(n for _, n in inside) / (all_to - all_from) if all_to > all_from else None
    gaps = [b[0] - a[0] for a, b in zip(handed, handed[1:], strict=False) if b[1]]  # steps that handed tokens
    median_gap = statistics.median(gaps) if gaps else 0.0
    # the steps from the one that handed out the first row's last token to the last finish: where ending rows cost
    # the others (the default waits before that first last token; the late modes in the steps after it)
    end_from, end_to = min(last.values()), max(done.values())
    end_steps = [b[0] - a[0] for a, b in zip(handed, handed[1:], strict=False) if end_from <= b[0] <= end_to]
    end_parts = [p for (t, _, _), p in zip(handed[1:], parts[1:], strict=True) if end_from <= t <= end_to]
    median_next = statistics.median(p[0] for p in parts[1:]) if len(parts) > 1 else 0.0
    return {
        "own_tok_s": own, "all_rows_tok_s": all_rows, "own_over_all_rows": own / all_rows if all_rows else None,
        "median_step_ms": 1e3 * median_gap, "end_steps_ms": [round(1e3 * g, 2) for g in end_steps],
        "end_excess_ms": 1e3 * sum(max(0.0, g - median_gap) for g in end_steps),
        # of the ending steps: their time in BatchGenerator.next beyond a median step's, and their rows' leave_s
        "end_next_ms": [round(1e3 * p[0], 2) for p in end_parts], "end_leave_ms": [round(1e3 * p[1], 2) for p in end_parts],
        "end_next_excess_ms": 1e3 * sum(max(0.0, p[0] - median_next) for p in end_parts),
        "end_leave_total_ms": 1e3 * sum(p[1] for p in end_parts), "median_next_ms": 1e3 * median_next,
        "last_finish_s": max(done.values()), "decode_span_s": max(last.values()) - min(first.values()),
        "tokens": sum(count.values()),
    }


def arm_parts(arm: str, *, ssd: bool) -> tuple[str, str, str, set[str]]:
    """`MODE[:PACK_MB][@TIER][+mlxfilter][+planmain][+hostread]` -> (MLXD_FINAL_PLAN, MLXD_PLAN_PACK_MB, "ram" or
    "ssd", the flags: `mlxfilter`, rows leave the batch by mlx-lm's own filter, not `MLXD_BATCH_FILTER`'s;
    `planmain`, write plans on the generation stream, `MLXD_PLAN_STREAM=main`; `hostread`, write plans of host views,
    `MLXD_PLAN_DEVICE=0`); no @: `ssd` decides."""
    spec, *flags = arm.split("+")
    rest, _, tier = spec.partition("@")
    mode, _, pack = rest.partition(":")
    tier = tier or ("ssd" if ssd else "ram")
    if tier not in ("ram", "ssd"):
        raise SystemExit(f"bench_final_plan: arm {arm!r}: the tier after @ is ram or ssd, not {tier!r}")
    if set(flags) - {"mlxfilter", "planmain", "hostread"}:
        raise SystemExit(f"bench_final_plan: arm {arm!r}: the flags after + are mlxfilter, planmain and hostread")
    return mode, pack, tier, set(flags)


def filtered(by_mlx_lm: bool) -> None:
    """Rows leave the batch by mlx-lm's own `BatchKVCache.filter` or by `MLXD_BATCH_FILTER`'s (process-wide: set
    before each arm's run)."""
    from mlxd.model import batch_filter

    if by_mlx_lm:
        batch_filter.uninstall()
    else:
        batch_filter.install(force=True)


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:  # e.g. no span where every row decodes (rows that reached their first token in different steps)
        return None
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", help="the model preset built under --work (without --model)")
    ap.add_argument("--model", type=Path, default=None, help="a model directory instead of a preset")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a row (fresh each run)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens of the first rows to end")
    ap.add_argument("--groups", type=int, default=2, help="rows end over this many consecutive steps")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: no round starts that would end past it (0: no limit); the rounds done are kept")
    ap.add_argument("--arms", default="with-token,after-forward",
                    help="MLXD_FINAL_PLAN values, each optionally with :PACK_MB (MLXD_PLAN_PACK_MB, with the SSD tier), "
                         "@ram or @ssd (its tier; default --ssd's), +mlxfilter (mlx-lm's own batch filter), +planmain "
                         "(MLXD_PLAN_STREAM=main) and +hostread (MLXD_PLAN_DEVICE=0)")
    ap.add_argument("--ssd", action="store_true", help="an SSD tier (arms without @): every checkpoint builds its "
                                                       "write plan")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "final-plan-work")
    args = ap.parse_args()
    import mlx.core as mx

    from mlxd import RuntimeConfig
    from mlxd.engine.core import EngineCore
    from mlxd.model.tiny import build_model

    model_dir = args.model or args.work / f"model-{args.preset}"
    if args.model is None and not (model_dir / "config.json").exists():
        build_model(model_dir, args.preset, seed=0)
    arms = [a for a in args.arms.split(",") if a]
    cores: dict[str, Any] = {}
    for i, arm in enumerate(arms):
        mode, pack, tier, flags = arm_parts(arm, ssd=args.ssd)
        os.environ["MLXD_FINAL_PLAN"] = mode  # the three read when the core is built
        os.environ["MLXD_PLAN_PACK_MB"] = pack
        os.environ["MLXD_PLAN_STREAM"] = "main" if "planmain" in flags else "side"
        os.environ["MLXD_PLAN_DEVICE"] = "0" if "hostread" in flags else "1"
        ssd = args.work / f"ssd-{i}" if tier == "ssd" else None
        config = RuntimeConfig(model=str(model_dir), model_name=args.preset, prompt_cache_bytes=1 << 30,
                               device_probe="off", max_batch=args.rows, prefill_batch=args.rows,
                               ssd_cache_dir=ssd, max_context=args.prompt + args.tokens + args.groups + 64)
        cores[arm] = EngineCore(config)
        cores[arm].load()
        filtered("mlxfilter" in flags)
        decode_run(cores[arm], args.rows, min(args.prompt, 64), 4, 1, seed=-1 - i)  # warm: shapes, kernels
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    load_before = os.getloadavg()
    begun = time.perf_counter()
    done = 0
    for r in range(args.rounds):
        spent = time.perf_counter() - begun
        if args.budget and done and spent + spent / done > args.budget:
            print(f"budget: {done} rounds in {spent:.0f} s, no room for another", flush=True)
            break
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for arm in order:
            filtered("mlxfilter" in arm_parts(arm, ssd=args.ssd)[3])
            runs[arm].append(decode_run(cores[arm], args.rows, args.prompt, args.tokens, args.groups, seed=r))
        done += 1
        line = {arm: (round(runs[arm][-1]["own_tok_s"], 1), round(runs[arm][-1]["end_excess_ms"], 1)) for arm in arms}
        print(f"round {r + 1}/{args.rounds} load {os.getloadavg()[0]:.2f} (own tok/s, end excess ms) {line}",
              flush=True)
    for core in cores.values():
        core.close()
    base = arms[0]
    out: dict[str, Any] = {
        "device": str(mx.default_device()), "model": str(model_dir), "rows": args.rows, "prompt": args.prompt,
        "tokens": args.tokens, "groups": args.groups, "rounds": done, "ssd": args.ssd,
        "load_before": load_before, "load_after": os.getloadavg(), "arms": {},
    }
    for arm in arms:
        rs = runs[arm]
        out["arms"][arm] = {k: summary([x[k] for x in rs if x[k] is not None])
                            for k in ("own_tok_s", "all_rows_tok_s", "own_over_all_rows", "median_step_ms",
                                      "end_excess_ms", "end_next_excess_ms", "end_leave_total_ms",
                                      "median_next_ms", "last_finish_s", "decode_span_s")}
        if arm != base:
            out["arms"][arm]["own_vs_" + base] = summary(
                [a["own_tok_s"] / b["own_tok_s"] for a, b in zip(rs, runs[base], strict=True)])
            out["arms"][arm]["last_finish_vs_" + base] = summary(
                [a["last_finish_s"] / b["last_finish_s"] for a, b in zip(rs, runs[base], strict=True)])
        out["arms"][arm]["runs"] = rs
        a = {k: v or {"median": float("nan"), "q1": float("nan"), "q3": float("nan")}
             for k, v in out["arms"][arm].items()}
        paired = (f"; own ÷ {base} {a['own_vs_' + base]['median']:.3f} [{a['own_vs_' + base]['q1']:.3f}-"
                  f"{a['own_vs_' + base]['q3']:.3f}], last finish ÷ {base} {a['last_finish_vs_' + base]['median']:.3f}"
                  if arm != base else "")
        print(f"{arm}: own {a['own_tok_s']['median']:.1f} tok/s, own ÷ all-rows {a['own_over_all_rows']['median']:.3f}, "
              f"step {a['median_step_ms']['median']:.2f} ms, end excess {a['end_excess_ms']['median']:.1f} ms "
              f"[{a['end_excess_ms']['q1']:.1f}-{a['end_excess_ms']['q3']:.1f}] (of it in mlx-lm's next "
              f"{a['end_next_excess_ms']['median']:.1f}, leaving {a['end_leave_total_ms']['median']:.1f}){paired}",
              flush=True)
    print(f"load {load_before[0]:.2f} -> {out['load_after'][0]:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    tiers = {arm_parts(arm, ssd=args.ssd)[2] for arm in arms}
    tag = "ssd-" if tiers == {"ssd"} else "ram-" if tiers == {"ram"} else "tiers-"
    path = args.out / f"final_plan-{tag}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
