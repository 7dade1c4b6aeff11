# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Prompts and suffixes whose chunk shapes are new: cuDNN's graph vs plain-op attention (issue 28, MLXD_UNFUSED_AREA).

A prompt's last chunk ends where the prompt does: a key length of its own, so on CUDA it builds a cuDNN graph
(~80-200 ms on the H100, `contiguous-kv-h100-20261205-1836.log`) wherever it starts, against a few ms of
attention for a short prompt. `mlxd simulate`'s fit of a GPU run with 1,024-token prompts found prefill time
flat in the tokens (81 ms fixed, 0 per token: `sim_ttft-h100-20261205-152449.json`). Here, one process, the
1.7B shape, arms interleaved per case (fused: MLX's kernel; area:N, one per --area: model/suffix_attention.py
installed with AREA = N, chunks with queries x keys up to N attended as plain operations, others contiguous to
MLX's), each arm and case a length no forward before had:
  cold: a whole prompt of N tokens from an empty cache (one forward: N <= --chunk);
  suffix: N tokens after a 16k prefix (prefilled once; the cache trimmed back after each suffix);
  repeat: one new length per arm, --repeat-lengths tokens + the arm's index, prompted --repeats times from an
  empty cache with `suffix_attention.next_forward()` before each (as the engine counts forwards): the area
  arms rent a shape FUSE_AFTER - 1 times and build its graph on the FUSE_AFTER-th, the fused arm builds it
  on the first; each arm's ms per sighting.
Prints ms per forward (evaluated and synchronized) and the medians per arm.

    python3 benchmarks/gpu/probe_unfused_area.py [--area 4194304 16777216] [--json OUT.json]
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, built, load  # noqa: E402

from mlxd.model import presets, suffix_attention  # noqa: E402


def timed(model, tokens: list[int], cache) -> float:
    t0 = time.perf_counter()
    out = model(mx.array([tokens]), cache=cache)
    mx.eval(out, [c.state for c in cache])
    mx.synchronize()
    return round((time.perf_counter() - t0) * 1000, 2)


def main() -> int:
    from mlx_lm.models.cache import make_prompt_cache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/host-servers-work"))
    ap.add_argument("--area", type=int, nargs="+", default=[4 << 20, 16 << 20])
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--cold", type=int, nargs="+", default=[301, 517, 779, 1021, 1283, 1531, 1789, 2039])
    ap.add_argument("--suffix", type=int, nargs="+", default=[131, 197, 263, 389, 521, 643, 769, 1031])
    ap.add_argument("--repeat-lengths", type=int, nargs="+", default=[1093, 1601])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--small", action="store_true", help="the `bench` preset, a 512-token prefix: a CPU smoke run")
    args = ap.parse_args()
    if args.small:
        args.prefix, args.cold, args.suffix, args.repeat_lengths = 512, [31, 67], [17, 41], [53]
    model, _ = load(built(presets.PRESETS["bench"] if args.small else QWEN3_1_7B, args.work))
    rng = random.Random(11)
    words = lambda n: [rng.randrange(3, 8000) for _ in range(n)]  # noqa: E731
    suffix_attention.install(force=True)
    wrapped = mx.fast.scaled_dot_product_attention
    arms = ["fused", *(f"area:{a}" for a in args.area)]
    out: dict = {"device": str(mx.default_device()), "areas": args.area, "fuse_after": suffix_attention.FUSE_AFTER,
                 "cold": [], "suffix": [], "repeat": []}

    def use(arm: str) -> None:
        if arm == "fused":
            mx.fast.scaled_dot_product_attention = suffix_attention._ORIGINAL
        else:
            mx.fast.scaled_dot_product_attention = wrapped
            suffix_attention.AREA = int(arm.split(":")[1])

    for arm in arms:  # each path's kernels built once (a length no case has)
        use(arm)
        timed(model, words(64), make_prompt_cache(model))
    for i, n in enumerate(args.cold):  # each arm its own length: a shape no forward saw
        for j, arm in enumerate(arms if i % 2 == 0 else arms[::-1]):
            use(arm)
            out["cold"].append({"arm": arm, "tokens": n + j, "ms": timed(model, words(n + j), make_prompt_cache(model))})
            print("cold", out["cold"][-1], flush=True)
    use(arms[-1])
    cache = make_prompt_cache(model)
    for at in range(0, args.prefix, 2048):
        timed(model, words(min(2048, args.prefix - at)), cache)
    for i, n in enumerate(args.suffix):
        for j, arm in enumerate(arms if i % 2 == 0 else arms[::-1]):
            use(arm)
            ms = timed(model, words(n + j), cache)
            for c in cache:
                c.trim(n + j)
            out["suffix"].append({"arm": arm, "tokens": n + j, "ms": ms})
            print("suffix", out["suffix"][-1], flush=True)
    for i, n in enumerate(args.repeat_lengths):  # the same new shape again and again: rent, then build, then cached
        for j, arm in enumerate(arms if i % 2 == 0 else arms[::-1]):
            use(arm)
            tokens = words(n + 10 + j)  # + 10: no cold case's length
            ms = []
            for _ in range(args.repeats):
                suffix_attention.next_forward()
                ms.append(timed(model, tokens, make_prompt_cache(model)))
            out["repeat"].append({"arm": arm, "tokens": len(tokens), "ms": ms, "sum_ms": round(sum(ms), 2)})
            print("repeat", out["repeat"][-1], flush=True)
    use(arms[-1])
    out["median_ms"] = {kind: {arm: statistics.median(r["ms"] for r in out[kind] if r["arm"] == arm) for arm in arms}
                        for kind in ("cold", "suffix")}
    out["median_ms"]["repeat_sum"] = {arm: statistics.median(r["sum_ms"] for r in out["repeat"] if r["arm"] == arm)
                                      for arm in arms}
    print(json.dumps(out["median_ms"]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
        print("->", args.json, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
