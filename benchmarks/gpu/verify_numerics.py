# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Are a verifying forward's logits those of one-token decoding? (issue 23: draft arms "identical": false at t=4 on the H200)

One row, the model's own dtype (bf16 on the H200's Qwen3-1.7B shape; `--small`: the `default` preset's shape
in bf16, on the CPU too; `--fp32`: cast to float32 first, the CPU engine's dtype): a random prompt is prefilled,
then `--tokens` tokens are decoded greedily one forward per token (the logits kept); the cache is cut back
and the same tokens are fed again K + 1 at a time (a verifying forward's shape, over the whole KV buffer where
the engine does that: spec_batch.whole_buffers), and each position's logits are compared with decoding's.
Reported: the largest |logprob difference|, and of the positions how many would pick another token greedily
and sampled at each temperature with the same noise (Gumbel, one draw per position shared by both): a flip
there makes speculation's tokens differ from plain decoding's from that token on, by numerics alone.

    python benchmarks/gpu/verify_numerics.py [--small] [--fp32] [--prompt 512] [--tokens 192] [--k 4]
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(args: argparse.Namespace) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from bench_verify_step import bf16_model
    from mlxd.engine.spec_batch import whole_buffers

    path = bf16_model("default" if args.small else "qwen3-1.7b")
    model, _ = load(str(path))
    if args.fp32:
        from mlxd.engine.loading import cast_float_weights

        cast_float_weights(model, mx.float32)
    mx.random.seed(0)
    prompt = mx.random.randint(3, 8000, (1, args.prompt))
    cache = make_prompt_cache(model)
    model(prompt[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])
    token, decoded, plain = prompt[:, -1:], [], []
    for _ in range(args.tokens + 1):
        logits = model(token, cache=cache)[:, -1, :].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = mx.argmax(lp, axis=-1, keepdims=True)
        mx.eval(lp, token)
        plain.append(lp[0])
        decoded.append(token.item())
    for c in cache:
        c.trim(args.tokens + 1)
    fed = [prompt[0, -1].item(), *decoded[:-1]]  # each position's input, as decoding fed it
    verify = []
    for at in range(0, args.tokens + 1, args.k + 1):
        window = fed[at : at + args.k + 1]
        logits = model(mx.array([window]), cache=whole_buffers(cache) if len(window) > 1 else cache)
        logits = logits[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        verify.extend(lp[j] for j in range(len(window)))
    a, b = mx.stack(plain), mx.stack(verify)
    diff = mx.abs(a - b)
    dtype = tree_flatten(model.parameters())[0][1].dtype  # the weights' (bf16 on the GPU shape)
    out = {"device": str(mx.default_device()), "dtype": str(dtype),
        "prompt": args.prompt, "positions": args.tokens + 1, "k": args.k,
        "max_abs_logprob_diff": diff.max().item(), "mean_abs_logprob_diff": diff.mean().item(),
        "greedy_flips": int((mx.argmax(a, -1) != mx.argmax(b, -1)).sum().item()), "sampled_flips": {}}
    for t in args.temperature:
        g = -mx.log(-mx.log(mx.random.uniform(shape=a.shape, key=mx.random.key(7))))
        flips = (mx.argmax(a / t + g, -1) != mx.argmax(b / t + g, -1)).sum().item()
        out["sampled_flips"][str(t)] = int(flips)
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    args = p.parse_args()
    out = main(args)
    name = f"verify-numerics-{time.strftime('%Y%m%d-%H%M%S')}.json"
    results = HERE.parent / "results"
    (results / name).write_text(json.dumps(out, indent=2))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / name).write_text(json.dumps(out, indent=2))
