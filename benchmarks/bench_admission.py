"""A burst of long prompts with and without admission by KV bytes (`--kv-admission`), side by side.

    python benchmarks/bench_admission.py [--preset default] [--requests 32] [--prompt-tokens 1500]
                                         [--max-tokens 64] [--room 3]

Each arm runs in a fresh process through the in-process runtime (`open_runtime`),
RAM tier off (only rows hold KV), the same memory budget: this runtime's own
memory as the engine measured it at load (`EngineInfo.own_memory`: active
memory after load and warm-up minus before), one request's prefill working
memory (as admission models it), plus `--room` requests' KV (prompt +
max_tokens, in 256-token steps). `--requests` distinct long
prompts arrive at once (the admission queue holds them all). Reported per arm:
MLX's peak memory after load (`mx.get_peak_memory`, reset after load) ÷ the
budget, requests that failed, the most rows that held KV reservations at
once, admissions that waited, and the burst's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    import trio

    from mlxd import RuntimeConfig, SamplingParams, open_runtime
    from mlxd.kv.admission import KvAdmission, weights_bytes
    from mlxd.model.tiny import ensure_model

    model = ensure_model(args.preset)

    async def probe() -> dict[str, Any]:
        """(its own process: a closed runtime's model stays in MLX memory) the sizes the budget is made of."""
        config = RuntimeConfig(model=str(model), prompt_cache_bytes=0, memory_budget_bytes=0, device_probe="off",
                               kv_admission=True)
        async with open_runtime(config) as rt:
            own = rt.info.own_memory
            assert own is not None
            rule = KvAdmission(1, rt.info.kv_bytes_per_token, kv_step=256, prefill_step=config.prefill_step_size,
                               prefill_per_token=own.prefill.per_token,
                               prefill_per_token_context=own.prefill.per_token_context)
            return {
                "kv_bytes_per_token": rt.info.kv_bytes_per_token, "vocab": rt.info.vocab_size,
                "resident_bytes_measured": own.resident_bytes,
                "prefill_cost": [own.prefill.per_token, own.prefill.per_token_context],
                "kv_bytes_per_request": rule.kv_bytes(args.prompt_tokens, args.max_tokens),
                "prefill_bytes_per_request": rule.prefill_bytes(args.prompt_tokens),
            }

    if args.arm == "probe":
        return trio.run(probe)
    sizes = json.loads(args.sizes)

    async def main() -> dict[str, Any]:
        per_token, vocab = sizes["kv_bytes_per_token"], sizes["vocab"]
        need, work = sizes["kv_bytes_per_request"], sizes["prefill_bytes_per_request"]
        fixed = max(weights_bytes(model), sizes["resident_bytes_measured"])
        budget = fixed + work + args.room * need
        config = RuntimeConfig(
            model=str(model), prompt_cache_bytes=0, memory_budget_bytes=budget, kv_admission=args.arm == "admission",
            max_queue=args.requests, device_probe="off", max_batch=args.max_batch, prefill_batch=args.max_batch,
            queue_timeout_s=0,  # the burst queues whole: this compares memory, not refusals for time
            prefill_slice_s=args.prefill_slice_s,
        )
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        failed: list[str] = []
        done = 0
        running = peak_running = 0
        async with open_runtime(config) as rt:
            mx.reset_peak_memory()
            base = mx.get_active_memory()  # the only runtime in this process: its own memory after load

            async def one(i: int) -> None:
                nonlocal done, running, peak_running
                prompt = [(i * 7919 + k * 31) % (vocab - 10) + 5 for k in range(args.prompt_tokens)]
                try:
                    async with rt.submit(rt.request(prompt, sampling=sampling, request_id=f"b{i}")) as stream:
                        async for _ in stream:
                            pass
                    done += 1
                except Exception as exc:  # a failure is a result here
                    failed.append(f"{type(exc).__name__}: {exc}")

            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(args.requests):
                    nursery.start_soon(one, i)
            wall = time.perf_counter() - t0
            kv = rt.scheduler.kv_admission
            peak = mx.get_peak_memory()
            return {
                "arm": args.arm, "budget_bytes": budget, "weights_bytes": weights_bytes(model), **sizes,
                "fixed_bytes_counted": kv.fixed_bytes if kv else fixed,
                "kv_bytes_per_token": per_token, "active_after_load_bytes": base,
                "peak_bytes": peak, "peak_over_budget": peak / budget, "completed": done, "failed": failed,
                "wall_s": wall, "max_rows_reserved": kv.peak_running if kv else None,
                "waited": kv.waited if kv else None,
            }

    return trio.run(main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--room", type=int, default=3, help="requests' KV the budget holds beside the weights")
    p.add_argument("--prefill-slice-s", type=float, default=0.05,
                   help="--prefill-slice-s of both arms (0: whole prefill chunks, as a fast device takes them)")
    p.add_argument("--arm", choices=("admission", "none", "probe"), default=None, help="(internal) run one arm")
    p.add_argument("--sizes", default="{}", help="(internal) the probe's sizes, JSON")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    if args.arm is not None:
        print(json.dumps(run_arm(args)), flush=True)
        return 0
    given = argv if argv is not None else sys.argv[1:]
    cmd = [sys.executable, __file__, "--arm", "probe", *given]
    sizes = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    arms = {}
    for arm in ("none", "admission"):
        cmd = [sys.executable, __file__, "--arm", arm, "--sizes", sizes, *given]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        arms[arm] = json.loads(out.stdout.strip().splitlines()[-1])
        a = arms[arm]
        print(f"{arm:9s}: peak {a['peak_bytes'] / 2**20:.0f} MiB = {a['peak_over_budget']:.2f} x budget "
              f"({a['budget_bytes'] / 2**20:.0f} MiB); completed {a['completed']}, failed {len(a['failed'])}; "
              f"rows reserved at most {a['max_rows_reserved']}, waited {a['waited']}; {a['wall_s']:.1f} s", flush=True)
    result = {"command": "admission", "arms": arms, "args": {k: str(v) for k, v in vars(args).items()},
              "loadavg": os.getloadavg(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "peak_ratio_admission_over_none": arms["admission"]["peak_bytes"] / arms["none"]["peak_bytes"]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"admission-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
