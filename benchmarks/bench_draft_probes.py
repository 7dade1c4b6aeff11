# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What a draft model's probes cost at batch 8 when its drafts are never accepted: step by step.

Engine cores over the same target (`bench` preset by default) decode the same non-repetitive rows
(t = 4, acceptance ≈ 0 for a random-weight draft): speculation off, and `--speculative draft`
with a smaller draft (`default`) whose gate probes by verifying the whole batch
(`MLXD_DRAFT_PROBE_ROWS=0`, as before) or with one row's unverified draft (the default now). Each
`EngineCore.step` is timed; a step whose `verify_steps` or `gate_probes` counter moved is a probe
step. A run's probing cost is its probe steps' seconds less as many of the run's own median plain
step (the run's own pace: the loaded host moves whole runs by 2x), over the run's seconds. Runs alternate between the arms;
each arm's first run starts with a fresh gate (as a fresh server's first rows would).

    python benchmarks/bench_draft_probes.py [--preset bench] [--draft-preset default] [--batch 8]
        [--tokens 96] [--span 64] [--rounds 3]

Results go to benchmarks/results/draft-probes-*.json (and $OUT when set).
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative import RESULTS, _fields, save, workload  # noqa: E402

from mlxd import RuntimeConfig  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.ops import RowStart, StepOps  # noqa: E402
from mlxd.model import ensure_model  # noqa: E402
from mlxd.runtime.kernel.messages import GenerationFinished  # noqa: E402


def _counts(core: EngineCore) -> tuple[int, int, int]:
    spec = core.stats().speculation
    return (spec.verify_steps, spec.draft_rows, spec.gate_probes) if spec is not None else (0, 0, 0)


def timed_run(core: EngineCore, requests: list[Any]) -> dict[str, Any]:
    """One run of the rows to their end: each step's seconds, and whether it verified drafts or
    made a probe's (unverified) drafts."""
    ops, left, steps = StepOps(starts=tuple(RowStart(request=r) for r in requests)), len(requests), []
    before = _counts(core)
    while left:
        t0 = time.perf_counter()
        result = core.step(ops)
        seconds = time.perf_counter() - t0
        ops = StepOps()
        left -= sum(isinstance(e.event, GenerationFinished) for e in result.emits)
        now = _counts(core)
        # A probe step: it verified (the whole batch's drafts, or the rows that drafted) or made a
        # probe's unverified drafts; its rows that drafted.
        steps.append((seconds, now[0] > before[0] or now[2] > before[2], now[1] - before[1] + now[2] - before[2]))
        before = now
    decode = steps[1:]  # the first step prefills every row
    plain = statistics.median(s for s, v, _ in decode if not v)
    probes = [(s, d) for s, v, d in decode if v]
    total = sum(s for s, _, _ in decode)
    excess = sum(s - plain for s, _ in probes)
    return {"seconds": total, "steps": len(decode), "plain_step_s": plain, "probe_steps": len(probes),
            "probe_step_s": [round(s, 4) for s, _ in probes], "draft_rows": [d for _, d in probes],
            "probe_excess_s": excess, "probe_excess": excess / total,
            "excess_s": total - len(decode) * plain, "excess": (total - len(decode) * plain) / total}


def main(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_model(args.preset)
    draft = str(ensure_model(args.draft_preset))
    base = RuntimeConfig(model=str(model), max_batch=args.batch, prompt_cache_bytes=0, device_probe="off",
                         default_max_tokens=args.tokens, max_context=8192)
    cores = {"off": EngineCore(base)}
    for arm, probe in (("probe-all", "0"), ("probe-1", "1")):
        os.environ["MLXD_DRAFT_PROBE_ROWS"] = probe  # read when the core is built
        cores[arm] = EngineCore(RuntimeConfig(**{**_fields(base), "speculative": "draft", "draft_model": draft,
                                                 "num_draft_tokens": args.k}))
    del os.environ["MLXD_DRAFT_PROBE_ROWS"]
    vocab = {arm: c.load() for arm, c in cores.items()}["off"].vocab_size
    requests = workload("non-repetitive", args.batch, args.tokens, vocab, args.span, args.temperature)
    out: dict[str, Any] = {"model": args.preset, "draft": args.draft_preset, "batch": args.batch,
                           "tokens": args.tokens, "span": args.span, "k": args.k, "load_before": os.getloadavg(),
                           "runs": {arm: [] for arm in cores}}
    arms = list(cores)
    for r in range(args.rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            got = timed_run(cores[arm], requests)
            out["runs"][arm].append(got)
            print(f"round {r} {arm:>9}: {got['seconds']:.2f} s, {got['steps']} steps, plain step "
                  f"{got['plain_step_s'] * 1000:.1f} ms, probe steps {got['probe_steps']} "
                  f"{got['probe_step_s']} (rows drafting {got['draft_rows']}): {got['probe_excess_s']:.3f} s over "
                  f"plain steps = {100 * got['probe_excess']:.1f}% of the run; all steps over the median "
                  f"{100 * got['excess']:.1f}%", flush=True)
    out["load_after"] = os.getloadavg()
    for arm in arms:
        runs = out["runs"][arm]
        print(f"{arm:>9}: probe steps {sum(x['probe_steps'] for x in runs)} in {len(runs)} runs, their cost "
              f"{[round(100 * x['probe_excess'], 1) for x in runs]} % of each run; all steps over the median "
              f"{[round(100 * x['excess'], 1) for x in runs]} %")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--draft-preset", default="default")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--span", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=4.0)
    parsed = p.parse_args()
    path = RESULTS / f"draft-probes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save(main(parsed), path)
    print(path)
