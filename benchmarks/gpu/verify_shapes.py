"""What a short forward over a new key length costs: a verifying forward's attention plan, first call vs second.

On CUDA, MLX runs attention of several queries through a cuDNN graph built and cached per exact
shape (queries, keys, mask): a speculative verify (1 + K queries) or a draft model's catch-up at a
key length no forward had before may pay a graph build (model/suffix_attention.py). This times, on
one model, a forward of `q` new tokens at `--lengths` consecutive key lengths, twice at each length
(the second call's shape is cached: first − second is what a new shape costs), along three paths:

- `fused`: MLX's kernel over the exact keys (a causal mask): what a draft's catch-up and, before the
  whole-buffer view, a verify got: one shape per key length;
- `whole`: MLX's kernel over the whole KV buffer under an array mask (spec_batch.WholeBuffer, what
  verifies and the draft's first forward get on CUDA): one shape per 256 positions;
- `routed`: the engine's routing as installed at load (suffix_attention.install(force=True)): short
  queries (2..SHORT_QUERY) attended as plain operations over any keys, no graph at all.

A plain decode step (one query) is timed beside them for scale. `--small`: the `default` preset's
shape in bf16 (checks the script on the CPU, where no path builds anything).

    python3 benchmarks/gpu/verify_shapes.py [--small] [--context 512] [--lengths 20] [--queries 2 5 17 64]

Prints one line per (path, queries): first-call and second-call medians (ms) and the median of
their per-length difference; the JSON goes to benchmarks/results/verify-shapes-*.json (and $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "src"))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, build  # noqa: E402

from mlxd.engine import spec_batch  # noqa: E402
from mlxd.model import presets, suffix_attention  # noqa: E402

RESULTS = HERE.parent / "results"


def timed_forward(model: Any, cache: list[Any], ids: list[int], *, whole: bool) -> float:
    """Seconds of one forward of `ids` (evaluated), its KV then dropped again."""
    caches = [spec_batch.WholeBuffer(c) for c in cache] if whole else cache
    t0 = time.perf_counter()
    logits = model(mx.array([ids]), cache=caches)
    mx.eval(logits)
    took = time.perf_counter() - t0
    for c in cache:
        c.trim(len(ids))
    return took


def run_path(model: Any, path: str, q: int, context: int, lengths: int, seed: int) -> dict[str, Any]:
    import random

    from mlx_lm.models.cache import make_prompt_cache

    rnd = random.Random(seed)
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model)
    prompt = [rnd.randrange(3, vocab) for _ in range(context)]
    for at in range(0, context, 512):
        model(mx.array([prompt[at:at + 512]]), cache=cache)
        mx.eval([c.state for c in cache])
    if path == "routed":
        suffix_attention.install(force=True)
    else:
        suffix_attention.uninstall()
    first, second = [], []
    try:
        for _ in range(lengths):
            ids = [rnd.randrange(3, vocab) for _ in range(q)]
            whole = path == "whole"
            if q == 1:  # a plain decode step: one query (MLX's vector kernel or cuDNN's decoding graph)
                whole = False
            first.append(timed_forward(model, cache, ids, whole=whole))
            second.append(timed_forward(model, cache, ids, whole=whole))
            model(mx.array([[rnd.randrange(3, vocab)]]), cache=cache)  # one token on: the next key length
            mx.eval([c.state for c in cache])
    finally:
        suffix_attention.uninstall()
    ms = [x * 1000 for x in first], [x * 1000 for x in second]
    return {"path": path, "queries": q, "keys_from": context, "lengths": lengths,
            "first_ms": round(statistics.median(ms[0]), 3), "second_ms": round(statistics.median(ms[1]), 3),
            "new_shape_ms": round(statistics.median(a - b for a, b in zip(*ms, strict=True)), 3),
            "first_all": [round(x, 2) for x in ms[0]], "second_all": [round(x, 2) for x in ms[1]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="the `default` preset's shape (a CPU check)")
    p.add_argument("--context", type=int, default=512, help="keys before the first timed length")
    p.add_argument("--lengths", type=int, default=20, help="consecutive key lengths timed per path")
    p.add_argument("--queries", type=int, nargs="+", default=[1, 5, 17, 64])
    p.add_argument("--paths", nargs="+", default=["fused", "whole", "routed"], choices=("fused", "whole", "routed"))
    args = p.parse_args()
    began = time.perf_counter()
    shape = attrs.evolve(presets.PRESETS["default"], name="default-bf16-shape") if args.small else QWEN3_1_7B
    where = Path(f"/tmp/models/{shape.name}")
    if not (where / "config.json").exists():
        build(shape, where)
    from mlxd.model import load_model

    model, _ = load_model(where)
    print(f"[{time.perf_counter() - began:.0f} s] model {where} on {mx.default_device()}", flush=True)
    out: dict[str, Any] = {"model": shape.name, "device": str(mx.default_device()), "context": args.context,
                           "short_query": suffix_attention.SHORT_QUERY, "runs": []}
    for n, q in enumerate(args.queries):
        for m, path in enumerate(args.paths if q > 1 else ["fused"]):
            # Key lengths of their own per (queries, path): a path must not find the plans an earlier one built
            # (at 21:09 `routed` q=17/64, not routed, read the `fused` run's cached plans as "no build").
            start = args.context + (len(args.paths) * n + m) * (args.lengths + 8)
            r = run_path(model, path, q, start, args.lengths, seed=n)
            out["runs"].append(r)
            print(f"{path:>7} q={q:<3} keys {r['keys_from']}..{r['keys_from'] + args.lengths - 1}: first "
                  f"{r['first_ms']:.2f} ms, second {r['second_ms']:.2f} ms, new shape +{r['new_shape_ms']:.2f} ms "
                  f"(first {r['first_all'][:6]}...)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    result = RESULTS / f"verify-shapes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps(out, indent=2)
    result.write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / result.name).write_text(text)
    print(f"[{time.perf_counter() - began:.0f} s] {result}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
