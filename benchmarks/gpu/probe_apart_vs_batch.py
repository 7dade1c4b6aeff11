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

- `batch`: the prompt as a request with an empty batch, stepped to its first token (`engine.drive.run_rows`)
  through mlx-lm's batch (the slicer's apart rule turned off for the arm): serving's path for a lone long
  prompt until 2026-12-07;
- `apart`: `EngineCore._prefill_apart` (serving's path for a prompt prefilled beside others, and the overlap's
  head) up to the last token, then the last token's forward and its argmax, evaluated;
- `served` (with `--arms`): the request stepped as serving steps it now, where a lone prompt of a whole step or
  more is prefilled apart a slice a step (`engine/apart.py`, `PrefillSlicer.alone`), then joins the
  batch for its first token, handed out with the step that sampled it (`MLXD_FIRST_TOKEN_EARLY`, on by default);
- `served_late`: the same, its first token handed out with the next step, as mlx-lm hands it out (the H100
  runs of 07:13 and 07:14 measured `served` so, 17-21 ms behind `apart`). Every arm but `served` hands the first
  token out so.

Each batch arm asks for two tokens and is timed to the first (a one-token reply's token goes with the step
that ends it); until 2026-12-07 08:00 they asked for one and were timed to the row's end, the same step.

What to look at: `apart_vs_batch` (median seconds apart ÷ median in the batch) per length, and `served_vs_batch`.

`--arms` adds the batch path with one difference from the apart path put back or taken away, to find which one
costs (H100 2026-12-07 04:34 and 04:42, before `model/keep_buffers.py`: apart ÷ batch 0.66-0.75 at 4k and 16k
tokens, a fixed ~8 ms a chunk):

- `batch_keep`: mlx-lm's prompt phase without its `mx.clear_cache` after every chunk (`model/keep_buffers.py`,
  installed for the arm; the other batch arms run mlx-lm's prompt phase as it is, with its clears, whatever
  `MLXD_KEEP_BUFFERS` says; the apart path never clears). H100 07:13 and 07:14: kept ÷ cleared 0.78-0.82,
  so serving keeps them since;
- `batch_nosync`: the batch cache's mask "causal" without looking (mlxd's `model/fast_mask.py` passes "causal"
  for an unpadded batch after reading whether any row is padded: one tiny evaluated reduction a forward,
  which the apart path's `KVCache` does not make).

`steps` holds, for each batch arm's last round, every generator step's prefill chunk and seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlxd  # noqa: F401  (BLAS preload decision before mlx)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import log, probe_model, probe_options, tokens  # noqa: E402

from mlxd import SamplingParams  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.engine.drive import run_rows  # noqa: E402
from mlxd.engine.prefill_slices import PrefillSlicer  # noqa: E402
from mlxd.model import keep_buffers  # noqa: E402
from mlxd.runtime.config import RuntimeConfig  # noqa: E402
from mlxd.runtime.kernel.messages import GenerationRequest  # noqa: E402

BATCH_ARMS = ("batch", "served", "batch_keep", "batch_nosync", "served_late")


@contextlib.contextmanager
def patched(arm: str) -> Iterator[None]:
    """The batch path with `arm`'s difference (module doc)."""
    from mlx_lm.models import cache as cache_mod

    make_mask, kept = cache_mod.BatchKVCache.make_mask, bool(keep_buffers._ORIGINAL)

    def causal(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        one_row = self.left_padding is not None and self.left_padding.size == 1
        if N > 1 and not return_array and kwargs.get("window_size") is None and one_row:
            return "causal"  # one row, no padding (the probe's lone prompt): what a KVCache passes
        return make_mask(self, N, return_array=return_array, **kwargs)

    try:
        if arm == "batch_keep":
            keep_buffers.install(force=True)
        else:  # mlx-lm's own prompt phase, as the arm measured before serving kept the buffers
            keep_buffers.uninstall()
        if arm == "batch_nosync":
            cache_mod.BatchKVCache.make_mask = causal
        yield
    finally:
        cache_mod.BatchKVCache.make_mask = make_mask
        keep_buffers.install(force=True) if kept else keep_buffers.uninstall()


def in_batch(core: EngineCore, prompt: list[int], rid: str, arm: str = "batch",
             steps: list[tuple[int, float]] | None = None) -> float:
    """Seconds from the request's start to its first token, stepped through the engine's batch; `steps`
    (when given) gets each generator step's prefill chunk and seconds. Two tokens asked for: a one-token reply's
    only token goes with the step that ends it, never early (MLXD_FIRST_TOKEN_EARLY)."""
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    generator_next = core.generator.next

    def timed() -> Any:
        t = time.perf_counter()
        got = generator_next()
        if steps is not None:
            steps.append((core.generator.prefill_step_size, time.perf_counter() - t))
        return got

    core.generator.next = timed
    rule, early = PrefillSlicer.alone, core._early_first
    if not arm.startswith("served"):  # through the batch: the slicer's rule for a lone prompt off
        PrefillSlicer.alone = lambda *args, **kwargs: False  # type: ignore[method-assign]
    core._early_first = early and arm == "served"  # the other arms: the first token as mlx-lm hands it out
    try:
        with patched(arm):
            run = run_rows(core, [GenerationRequest(request_id=rid, prompt=tuple(prompt), sampling=sampling)])
            return run.first_token_s[rid]
    finally:
        del core.generator.next
        PrefillSlicer.alone, core._early_first = rule, early  # type: ignore[method-assign]


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
    ap.add_argument("--slice-ms", type=float, default=None, help="the engine's prefill slice (`--prefill-slice-ms`; "
                    "default: serving's; 0: whole steps, every chunk the step size, and nothing apart by the slicer)")
    ap.add_argument("--arms", nargs="+", default=["apart", "batch"], choices=["apart", *BATCH_ARMS],
                    help="arms, alternating, each first in turn (module doc)")
    args = ap.parse_args(argv)
    arms = list(dict.fromkeys(args.arms))
    preset, model_dir = probe_model(args)
    sizes = args.tokens or ([512] if args.small else [4096, 16384])
    sliced = {} if args.slice_ms is None else {"prefill_slice_s": args.slice_ms / 1000}
    core = EngineCore(RuntimeConfig(model=str(model_dir), device_probe="off",
                                    prefill_step_size=args.step, max_context=max(sizes) + 64, **sliced))
    core.load()
    result: dict = {"device": str(mx.default_device()), "argv": sys.argv, "step": args.step,
                    "keep_buffers": bool(keep_buffers._ORIGINAL),
                    "prefill_slice_s": core.prefill_slice_s, "sizes": {}}
    dest = args.out / f"apart_vs_batch-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    seed = 1
    try:
        for n in sizes:
            seed += 2
            for arm in arms:  # each path's shapes built once, untimed
                seed += 1
                warm = tokens(n, seed, preset.vocab_size)
                apart(core, warm) if arm == "apart" else in_batch(core, warm, f"warm-{arm}-{n}", arm)
            rounds, steps = [], {}
            for r in range(args.rounds):
                times: dict[str, float] = {}
                for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
                    seed += 1
                    prompt = tokens(n, 1000 + seed, preset.vocab_size)
                    if arm == "apart":
                        times[arm] = apart(core, prompt)
                    else:
                        steps[arm] = []
                        times[arm] = in_batch(core, prompt, f"{arm}{n}-{r}", arm, steps[arm])
                rounds.append(times)
            med = {arm: statistics.median(t[arm] for t in rounds) for arm in arms}
            summary: dict[str, float] = {f"{arm}_s": med[arm] for arm in arms}
            if "apart" in med and "batch" in med:
                summary["apart_vs_batch"] = med["apart"] / med["batch"]
            for arm in arms:
                if arm != "batch" and "batch" in med:
                    summary[f"{arm}_vs_batch"] = med[arm] / med["batch"]
            if "served" in med and "served_late" in med:  # the first token handed out early ÷ a step later
                summary["served_vs_served_late"] = med["served"] / med["served_late"]
            result["sizes"][str(n)] = {"rounds": rounds, "summary": summary, "steps": steps}
            log(f"n={n}: " + ", ".join(f"{arm} {med[arm]:.3f}s" for arm in arms) + " | " +
                ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if "_vs_" in k) +
                f" ({args.rounds} rounds)")
            dest.write_text(json.dumps(result, indent=1))
    finally:
        core.close()
    return dest


if __name__ == "__main__":
    main()
