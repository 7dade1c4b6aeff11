"""The memory budget held under a load that would pass it (`--memory-budget`).

    python benchmarks/bench_memory_budget.py [--preset default] [--context 1024] [--conversations 6]
                                             [--turns 3] [--share 0.4]

Several long conversations, each `--turns` turns deep, run in two fresh
processes through the in-process runtime API (`open_runtime`), RAM and SSD
tiers on, the RAM tier's byte cap far above the load (16 GiB) so that only
the budget can bound memory:

1. "none": a budget too large to act (2^50 bytes), so the engine still
   measures. Its largest measurement (between steps) and the most its RAM
   tier held give the budget of the second run: that measurement less
   `--share` of that cache, a budget the load passes but that the cache
   alone can meet (weights and working buffers are not the cache's to free);
2. "budget": the same load with that budget.

Each turn runs every conversation once, one after another (with
`--concurrent`, all at once: they batch, and batch buffers grow with them),
then the next turn extends every prompt by its reply and 64 new tokens. A sampler task reads,
every 20 ms, MLX active memory and the RAM tier's bytes (both in this
process; the RAM tier's arrays are part of active memory); MLX's own peak
(`mx.get_peak_memory`, reset after load) catches spikes between samples.
Follow-ups report where their prefix came from (RAM, SSD or none) and the
same tokens come out in both runs (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SUFFIX = 64
UNBOUNDED = 1 << 50  # a budget that never acts: the engine measures, nothing moves
REPLY = 16


async def _turn(rt: Any, prompt: list[int]) -> dict[str, Any]:
    from mlxd import SamplingParams
    from mlxd.runtime.kernel.messages import TokenGenerated

    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=REPLY))) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                first = first or time.perf_counter() - t0
                tokens.append(event.token)
    assert stream.accepted is not None
    return {"ttft_s": first, "tier": stream.accepted.cache_tier, "cached": stream.accepted.cached_tokens,
            "tokens": tokens}


async def _one(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np
    import trio

    from mlxd import RuntimeConfig, open_runtime

    ssd = Path(tempfile.mkdtemp(prefix="bench-budget-"))
    config = RuntimeConfig(
        model_preset=args.preset, ssd_cache_dir=ssd, prompt_cache_bytes=16 << 30, memory_budget_bytes=budget,
        max_context=args.context + args.turns * (SUFFIX + REPLY) + 8, ssd_demote_idle_s=0,
        snapshot_min_tokens=256, device_probe="off",
    )
    rng = np.random.default_rng(11)
    samples: list[tuple[int, int]] = []
    async with open_runtime(config) as rt:
        loaded = mx.get_active_memory()
        mx.reset_peak_memory()
        vocab = rt.info.vocab_size
        prompts = [rng.integers(16, vocab, size=args.context).tolist() for _ in range(args.conversations)]
        turns: list[list[dict[str, Any]]] = []

        async def sample(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                samples.append((mx.get_active_memory(), rt.cache_owner.cache.bytes))
                await trio.sleep(0.02)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            await nursery.start(sample)
            for _ in range(args.turns):
                results: list[dict[str, Any]] = [{} for _ in prompts]

                async def one(i: int, results: list[dict[str, Any]] = results) -> None:
                    results[i] = await _turn(rt, prompts[i])

                if args.concurrent:
                    async with trio.open_nursery() as batch:
                        for i in range(len(prompts)):
                            batch.start_soon(one, i)
                else:
                    for i in range(len(prompts)):
                        await one(i)
                turns.append(results)
                for i, r in enumerate(results):
                    prompts[i] = prompts[i] + r["tokens"] + rng.integers(16, vocab, size=SUFFIX).tolist()
            nursery.cancel_scope.cancel()
        elapsed = time.perf_counter() - t0
        peak = mx.get_peak_memory()
        stats = (await rt.stats()).as_dict()  # recorded as /stats shows it
    followups = [r for results in turns[1:] for r in results]
    return {
        "budget_bytes": budget,
        "loaded_active_bytes": loaded,
        "peak_active_bytes": peak,
        "max_sampled_active_bytes": max(a for a, _ in samples),
        "max_cache_bytes": max(c for _, c in samples),
        "final_cache_bytes": stats["cache"]["ram"]["bytes"],
        "samples": len(samples),
        "seconds": elapsed,
        "followup_tiers": {t: sum(r["tier"] == t for r in followups) for t in ("ram", "ssd", "none")},
        "followup_ttft_s": [r["ttft_s"] for r in followups],
        "tokens": [[r["tokens"] for r in results] for results in turns],
        "memory": stats["cache"].get("memory"),
        "ssd": {k: stats["cache"].get("ssd", {}).get(k) for k in ("entries", "bytes", "demotions")},
        "dropped_spills": stats.get("ssd_cache", {}).get("dropped_spills"),
    }


def _child(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", str(budget), "--preset", args.preset, "--context", str(args.context),
           "--conversations", str(args.conversations), "--turns", str(args.turns),
           *(["--concurrent"] if args.concurrent else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "MLXD_LOG_LEVEL": "warning"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--concurrent", action="store_true", help="run a turn's conversations at once (batched)")
    p.add_argument("--share", type=float, default=0.5,
                   help="budget = the unbudgeted run's largest measurement less this share of its largest cache")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        import trio

        sys.path.insert(0, str(REPO / "src"))
        print(json.dumps(trio.run(_one, args, args.one)))
        return

    free = _child(args, UNBOUNDED)
    budget = int(free["memory"]["max_active_bytes"] - args.share * free["max_cache_bytes"])
    held = _child(args, budget)
    same = free["tokens"] == held["tokens"]
    print(f"{args.conversations} conversations x {args.turns} turns from {args.context} tokens, preset {args.preset}"
          f"{', concurrent' if args.concurrent else ''}; "
          f"budget {budget / 2**20:.1f} MiB = unbudgeted largest measurement - {args.share} x its largest cache")
    print("run      loaded MiB  peak active MiB  max sampled MiB  max cache MiB  final cache MiB  follow-ups ram/ssd/none"
          "  follow-up TTFT ms")
    for name, row in (("none", free), ("budget", held)):
        t = row["followup_tiers"]
        print(f"{name:8s} {_mib(row['loaded_active_bytes'])}    {_mib(row['peak_active_bytes'])}         "
              f"{_mib(row['max_sampled_active_bytes'])}         {_mib(row['max_cache_bytes'])}       "
              f"{_mib(row['final_cache_bytes'])}        {t['ram']}/{t['ssd']}/{t['none']}"
              f"              {statistics.median(row['followup_ttft_s']) * 1e3:8.1f}")
    ratio = held["peak_active_bytes"] / budget
    measured = held["memory"]["max_active_bytes"]
    print(f"peak / budget: none {free['peak_active_bytes'] / budget:.3f}, budget {ratio:.3f}; largest measurement "
          f"(between steps) / budget: none {free['memory']['max_active_bytes'] / budget:.3f}, budget "
          f"{measured / budget:.3f}; same tokens in both runs: {same}")
    summary = {
        "budget_bytes": budget,
        "peak_over_budget": {"none": free["peak_active_bytes"] / budget, "budget": ratio},
        "max_measured_over_budget": {"none": free["memory"]["max_active_bytes"] / budget, "budget": measured / budget},
        "max_sampled_over_budget": {"none": free["max_sampled_active_bytes"] / budget,
                                    "budget": held["max_sampled_active_bytes"] / budget},
        "max_cache_MiB": {"none": free["max_cache_bytes"] / 2**20, "budget": held["max_cache_bytes"] / 2**20},
        "followup_tiers": {"none": free["followup_tiers"], "budget": held["followup_tiers"]},
        "followup_ttft_ms": {k: statistics.median(r["followup_ttft_s"]) * 1e3 for k, r in (("none", free), ("budget", held))},
        "same_tokens": same,
    }
    out = REPO / "benchmarks" / "results" / f"memory_budget-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items() if k != "one"},
        "summary": summary,
        "runs": {"none": free, "budget": held},
    }, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
