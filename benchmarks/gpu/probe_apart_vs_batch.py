"""A lone long prompt's first token: prefilled in the engine's batch, or apart on its own caches (issue 28's lead).

    # on the CUDA host (../shared/GPU.md), the 1.7B shape (built once, ~30 s):
    python3 benchmarks/gpu/probe_apart_vs_batch.py --out $OUT
    # here, on the CPU, with the small `bench` model:
    python benchmarks/gpu/probe_apart_vs_batch.py --small --out /tmp/apart-vs-batch

The H100 restart runs of 2026-12-06 20:56 showed overlapped heads of ~14,600 tokens, prefilled apart (the row's
own caches, whole chunks, outside mlx-lm's batch), in 160-182 ms, where the recompute arm's whole 16,454-token
prompts spent 252-394 ms in their forward passes in the batch. This puts the two paths side by side on one
`EngineCore` (serving's own, its prefill step and slicer as `mlxd serve` sets them), on the same prompt length,
fresh random prompts each time, arms alternating and each first in turn, both warmed first:

- `batch`: the prompt as a request with an empty batch, stepped to its first token (`engine.drive.run_rows`):
  serving's path for a lone long prompt today;
- `apart`: `EngineCore._prefill_apart` (serving's path for a prompt prefilled beside others, and the overlap's
  head) up to the last token, then the last token's forward and its argmax, evaluated.

What to look at: `apart_vs_batch` (median seconds apart ÷ median in the batch) per length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlxd  # noqa: F401  (BLAS preload decision before mlx)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import log, probe_model, probe_options, tokens  # noqa: E402

from mlxd import SamplingParams  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.drive import run_rows  # noqa: E402
from mlxd.runtime.config import RuntimeConfig  # noqa: E402
from mlxd.runtime.kernel.messages import GenerationRequest  # noqa: E402


def in_batch(core: EngineCore, prompt: list[int], rid: str) -> float:
    """Seconds from the request's start to its first token, stepped through the engine's batch."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    run_rows(core, [GenerationRequest(request_id=rid, prompt=tuple(prompt), sampling=sampling)])
    return time.perf_counter() - t0


def apart(core: EngineCore, prompt: list[int]) -> float:
    """Seconds to prefill `prompt` apart up to its last token, then that token's forward and argmax."""
    t0 = time.perf_counter()
    caches, end = core._prefill_apart(tuple(prompt), None, 0)
    logits = core.model(mx.array([prompt[end:]]), cache=caches)
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
    seconds = time.perf_counter() - t0
    del caches, logits
    mx.clear_cache()
    return seconds


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probe_options(ap, Path("/tmp/apart-vs-batch"))
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="prompt lengths (default 4096 16384; "
                    "--small 512)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per length (each runs both arms)")
    ap.add_argument("--step", type=int, default=2048, help="the engine's prefill step (`--prefill-step-size`)")
    args = ap.parse_args(argv)
    preset, model_dir = probe_model(args)
    sizes = args.tokens or ([512] if args.small else [4096, 16384])
    core = EngineCore(RuntimeConfig(model=str(model_dir), device_probe="off",
                                    prefill_step_size=args.step, max_context=max(sizes) + 64))
    core.load()
    result: dict = {"device": str(mx.default_device()), "argv": sys.argv, "step": args.step,
                    "prefill_slice_s": core.prefill_slice_s, "sizes": {}}
    dest = args.out / f"apart_vs_batch-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    seed = 1
    try:
        for n in sizes:
            seed += 2
            apart(core, tokens(n, seed, preset.vocab_size))  # each path's shapes built once, untimed
            in_batch(core, tokens(n, seed + 1, preset.vocab_size), f"warm-{n}")
            rounds = []
            for r in range(args.rounds):
                times: dict[str, float] = {}
                for arm in (("apart", "batch") if r % 2 == 0 else ("batch", "apart")):
                    seed += 1
                    prompt = tokens(n, 1000 + seed, preset.vocab_size)
                    times[arm] = apart(core, prompt) if arm == "apart" else in_batch(core, prompt, f"b{n}-{r}")
                rounds.append(times)
            med = {arm: statistics.median(t[arm] for t in rounds) for arm in ("apart", "batch")}
            summary = {"apart_s": med["apart"], "batch_s": med["batch"], "apart_vs_batch": med["apart"] / med["batch"]}
            result["sizes"][str(n)] = {"rounds": rounds, "summary": summary}
            log(f"n={n}: apart {med['apart']:.3f}s, batch {med['batch']:.3f}s, apart / batch "
                f"{summary['apart_vs_batch']:.3f} ({args.rounds} rounds)")
            dest.write_text(json.dumps(result, indent=1))
    finally:
        core.close()
    return dest


if __name__ == "__main__":
    main()
