# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What do in-flight generation checkpoints cost decode, and what does a resume save?

1. Overhead: one runtime (one model instance, one SSD tier) decodes a
   `--tokens` request alone with the engine's checkpoint interval set to
   off, 64 and 256 tokens in turn (the interval is the only difference; it is
   read per step). Cases run interleaved for `--rounds` rounds (rotating
   order), each after the checkpointer went idle, so no case decodes beside
   an earlier case's writes. Reported: median decode tokens/s per case, its
   ratio to "off", and the per-round ratios (the goal: >= 0.98); and the
   engine thread's time inside checkpoint snapshots (row extract + plan) as
   a share of the decode time, which the noise of a shared machine does not
   blur.
2. Resume: with checkpoints every 64 tokens, a `--resume-tokens` generation is
   dropped by its client near the end (`--drop-at`) and retried; the retry
   resumes from the last checkpoint. Compared with the same retry without a
   checkpoint (the whole generation again; its prompt is cached in RAM in both).

    python benchmarks/bench_gen_checkpoint.py [--preset bench] [--rounds 3] [--tokens 1024]

Results go to benchmarks/results/gen_checkpoint-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import TokenGenerated

PROMPT = "Write a long, careful report on how a durable prompt cache survives a crash. " * 12


async def decode_rate(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams) -> dict[str, float]:
    """One request alone: decode tokens/s after its first token, and the engine's checkpoint time."""
    snap_s = rt.engine.stats.checkpoint_s
    first = last = 0.0
    n = 0
    async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                last = time.perf_counter()
                first = first or last
                n += 1
    snap_s = rt.engine.stats.checkpoint_s - snap_s
    return {"tokens": n, "decode_tok_s": (n - 1) / (last - first), "decode_s": last - first,
            "engine_checkpoint_s": snap_s, "engine_checkpoint_share": snap_s / (last - first)}


async def idle(rt: Any) -> None:
    """Wait until this runtime's checkpointer has nothing queued or in flight."""
    ck = rt.cold.checkpointer if rt.cold is not None else None
    while ck is not None and (ck.snapshot_stats()["pending"] or ck.snapshot_stats()["writing"]):  # noqa: ASYNC110
        await trio.sleep(0.05)
    await trio.sleep(0.2)


def set_interval(rt: Any, every: int) -> None:
    """The engine's checkpoint interval (0 = off); it is read when each row joins the batch."""
    rt.engine.core._config = attrs.evolve(rt.engine.core._config, generation_checkpoint=every)


async def timed(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams, drop_at: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    n = 0
    async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                n += 1
                if n == drop_at:
                    break
        tier = stream.accepted.cache_tier if stream.accepted else None
    return {"seconds": time.perf_counter() - t0, "tokens": n, "cache_tier": tier}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_model(args.preset)
    root = Path(tempfile.mkdtemp(prefix="bench-gen-ckpt-", dir=args.dir))
    cases = {"off": 0, "every_64": 64, "every_256": 256}
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=7, logit_bias=((0, -100.0), (2, -100.0)))
    result: dict[str, Any] = {"cases": {}, "rounds": []}
    config = RuntimeConfig(model=str(model), ssd_cache_dir=root / "ssd", generation_checkpoint=64)
    async with open_runtime(config) as rt:
        prompt = rt.encode(PROMPT)
        await decode_rate(rt, prompt, SamplingParams(max_tokens=8))  # warm-up: the prompt is cached in RAM
        written = {}
        for r in range(args.rounds):
            order = list(cases)[r % 3:] + list(cases)[: r % 3]
            row = {}
            for name in order:
                await idle(rt)
                set_interval(rt, cases[name])
                before = rt.cold.checkpointer.stats["written"]
                row[name] = await decode_rate(rt, prompt, sampling)
                await idle(rt)
                row[name]["checkpoints_written"] = rt.cold.checkpointer.stats["written"] - before
                written[name] = written.get(name, 0) + row[name]["checkpoints_written"]
                print(f"round {r} {name}: {row[name]['decode_tok_s']:.1f} tok/s", flush=True)
            result["rounds"].append(row)
        for name in cases:
            rates = [row[name]["decode_tok_s"] for row in result["rounds"]]
            share = [row[name]["engine_checkpoint_share"] for row in result["rounds"]]
            result["cases"][name] = {"median_tok_s": statistics.median(rates), "rates": rates,
                                     "engine_checkpoint_share_median": statistics.median(share)}
        off = result["cases"]["off"]["median_tok_s"]
        for name in cases:
            result["cases"][name]["ratio_to_off"] = result["cases"][name]["median_tok_s"] / off
            per_round = [row[name]["decode_tok_s"] / row["off"]["decode_tok_s"] for row in result["rounds"]]
            result["cases"][name]["ratio_per_round"] = per_round
            result["cases"][name]["ratio_per_round_median"] = statistics.median(per_round)
        result["checkpoints_written"] = written
        result["checkpointer"] = rt.cold.checkpointer.snapshot_stats()

        # Resume: a long generation dropped near its end, then retried.
        long = SamplingParams(max_tokens=args.resume_tokens, temperature=0.8, seed=11,
                              logit_bias=((0, -100.0), (2, -100.0)))
        set_interval(rt, 0)
        full = await timed(rt, prompt, long)  # a retry without any checkpoint: everything again
        await idle(rt)
        set_interval(rt, 64)
        dropped = await timed(rt, prompt, long, drop_at=args.drop_at)
        await idle(rt)
        resumed = await timed(rt, prompt, long)
        result["resume"] = {
            "tokens": args.resume_tokens, "dropped_at": args.drop_at, "retry_without_checkpoint": full,
            "first_attempt": dropped, "retry_with_checkpoint": resumed,
            "saved_s": full["seconds"] - resumed["seconds"],
            "speedup": full["seconds"] / resumed["seconds"],
        }
        print(json.dumps(result["resume"], indent=1), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per overhead measurement")
    p.add_argument("--resume-tokens", type=int, default=2000)
    p.add_argument("--drop-at", type=int, default=1950)
    p.add_argument("--dir", help="where the SSD dirs go (default: the system temp dir)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    t0 = time.perf_counter()
    result = trio.run(run, args)
    result.update(
        command=" ".join([Path(sys.executable).name, *sys.argv]),
        runtime_s=time.perf_counter() - t0,
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
        args=vars(args) | {"out": str(args.out)},
    )
    for name, case in result["cases"].items():
        print(f"{name:>10}: {case['median_tok_s']:7.1f} tok/s  x{case['ratio_to_off']:.3f} of off  "
              f"engine thread in checkpoints {100 * case['engine_checkpoint_share_median']:.2f}% of decode")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / time.strftime("gen_checkpoint-%Y%m%d-%H%M%S.json")
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
