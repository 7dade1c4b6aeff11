"""Replay a recorded run's prompts through the prefill slicer with a step-cost model: chunks and TTFT per tier.

    python benchmarks/replay_slicer.py benchmarks/results/sim_ttft-h200-20261204-155620.json [--sigma 0.003]
    # the slicer of another revision: git worktree add /tmp/old 33bbbde; ... --src /tmp/old/src

No model, no MLX: each recorded request (one at a time, as bench_sim_ttft serves them) prefills its new
tokens but the last in the chunks `engine/prefill_slices.PrefillSlicer` asks for, alone; a step costs
`--fixed` + `--per-token` x chunk + |N(0, `--sigma`)| (an H200 serving the 1.7B shape: ~36 ms a step, the
probe's ~5 us a token), the first RAM hit's chunk `--first-ram-extra` more (each run's first RAM hit took
~170 ms against ~75 ms), and the first token one more step. It shows what the slicer alone does to a run's
tail: with the slicer before 5e723b9, a run of 127-token turns or one slow chunk left later 1,024-token
misses in 16-128-token chunks (8-32 steps), as the recorded outliers were.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def replay(trace: list[str], args: argparse.Namespace) -> dict[str, list[tuple[float, int]]]:
    """Per tier, (modelled TTFT seconds, steps) of each request in recorded order."""
    from mlxd.engine.prefill_slices import PrefillSlicer

    rng = np.random.default_rng(args.seed)
    slicer = PrefillSlicer(args.slice_ms / 1000)
    out: dict[str, list[tuple[float, int]]] = {}
    first_ram = True
    for r in (json.loads(x) for x in trace if x.strip()):
        if "event" in r:
            continue
        tier = r.get("cache_tier") or "none"
        left, seconds, steps = len(r["tokens"]) - (r.get("cached_tokens") or 0) - 1, 0.0, 0
        while left > 0:
            chunk = min(left, slicer.chunk(args.step, newcomers=[], shared=False))
            took = args.fixed + args.per_token * chunk + abs(rng.normal(0.0, args.sigma))
            if tier == "ram" and first_ram:
                took, first_ram = took + args.first_ram_extra, False
            slicer.measured(chunk, took)
            seconds, left, steps = seconds + took, left - chunk, steps + 1
        out.setdefault(tier, []).append((seconds + args.fixed, steps))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path, help="a bench_sim_ttft result JSON (its recorded traces)")
    p.add_argument("--src", type=Path, help="import mlxd from here (another revision's src/)")
    p.add_argument("--fixed", type=float, default=0.036, help="seconds a step costs whatever its chunk")
    p.add_argument("--per-token", type=float, default=5e-6)
    p.add_argument("--sigma", type=float, default=0.003, help="step time noise (seconds, half-normal)")
    p.add_argument("--first-ram-extra", type=float, default=0.1)
    p.add_argument("--slice-ms", type=float, default=50.0)
    p.add_argument("--step", type=int, default=2048, help="prefill step size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.src is not None:
        sys.path.insert(0, str(args.src))
    for name, trace in json.loads(args.result.read_text())["traces"].items():
        for tier, rows in replay(trace, args).items():
            ms = np.array([s for s, _ in rows[1:]]) * 1000  # each tier's first left out, as --ttft-warmup 1
            slow = [(round(s * 1000), k) for s, k in rows[1:] if s * 1000 > 2 * np.median(ms)]
            print(f"{name:<11} {tier:<4} n={ms.size:3d} p50 {np.median(ms):6.0f} ms  p95 {np.percentile(ms, 95):6.0f} ms  "
                  f"> 2x p50: {len(slow)} {slow[:8]} (ms, steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
