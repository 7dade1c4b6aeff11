# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What the target's rollback after a verifying step costs at batch 8 when rows accept different counts.

`spec_batch._drop_rejected` trims what every row drops (free: an index moves) and shifts each row
with more to drop right by the rest (`_shift_right`: a roll of every layer's keys and values over
every held position of the batch, since mlx-lm's batch cache keeps every row ending at one index).
Timed here on `BatchKVCache`s filled with random KV of a model's shape, per held context length:
a trim alone (every row accepted the same count) vs the shift (rows accepted 0..K), with the bytes
the shift reads and writes, next to one plain decode step's KV read (every held position, once);
and the row-by-row form (`per_row`, the engine's since c36a6a2 on the CPU and dcaff95 on CUDA): each row
that shifts copies its own held span out and writes it back one place over (its bytes only, no
index arrays; but 4 operations per shifted row and layer instead of 2 per layer). Both must leave
the same KV (checked).

    python benchmarks/bench_rollback.py [--shape default|bench|qwen3-1.7b] [--batch 8] [--context 256 1024 4096]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import os
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxd.engine.spec_batch import _shift_right

# (layers, kv heads, head dim, dtype) of the KV a model keeps
SHAPES = {"default": (8, 2, 64, mx.float32), "bench": (12, 4, 64, mx.float32), "qwen3-1.7b": (28, 8, 128, mx.bfloat16)}


def filled(batch: int, context: int, k: int, shape: tuple[int, int, int, mx.Dtype]) -> list[BatchKVCache]:
    layers, heads, dim, dtype = shape
    caches = []
    for _ in range(layers):
        c = BatchKVCache([0] * batch)
        kv = mx.random.normal((batch, heads, context + 1 + k, dim)).astype(dtype)
        c.update_and_fetch(kv, kv + 1)
        caches.append(c)
    mx.eval([x for c in caches for x in (c.keys, c.values)])
    return caches


def per_row(cache: BatchKVCache, shifts: list[int]) -> None:
    """`_shift_right` row by row (its `pads` form): a shifted row's held span copied out, then written back."""
    _shift_right(cache, shifts, cache.left_padding.tolist())


def roll(cache: BatchKVCache, shifts: list[int]) -> None:
    _shift_right(cache, shifts)


def timed(batch: int, context: int, k: int, shape: tuple[int, int, int, mx.Dtype], how: str,
          reps: int) -> tuple[float, list[BatchKVCache]]:
    times = []
    for rep in range(reps):
        mx.random.seed(rep)
        caches = filled(batch, context, k, shape)
        extra = [(i % (k + 1)) if how != "trim" else k for i in range(batch)]  # rows keep 1 + accepted of 1 + k
        common = min(extra)
        rest = [e - common for e in extra]
        t0 = time.perf_counter()
        for c in caches:
            c.trim(common)
            if any(rest):
                (per_row if how == "per_row" else roll)(c, rest)
        mx.eval([x for c in caches for x in (c.keys, c.values)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times), caches


def same(a: list[BatchKVCache], b: list[BatchKVCache]) -> bool:
    """Every row's held KV equal (positions from its left padding to the end)."""
    for x, y in zip(a, b, strict=True):
        pads = x.left_padding.tolist()
        if pads != y.left_padding.tolist() or x._idx != y._idx:
            return False
        for i, lo in enumerate(pads):
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                if not mx.array_equal(u[i, :, lo : x._idx], v[i, :, lo : x._idx]).item():
                    return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    layers, heads, dim, dtype = shape
    print(f"load {os.getloadavg()[0]:.1f}; {args.shape}: {layers} layers x {heads} kv heads x {dim}, {dtype}, "
          f"batch {args.batch}, K {args.k}", flush=True)
    for n in args.context:
        trim, _ = timed(args.batch, n, args.k, shape, "trim", args.reps)
        shift, rolled = timed(args.batch, n, args.k, shape, "roll", args.reps)
        rows, moved = timed(args.batch, n, args.k, shape, "per_row", args.reps)
        held = args.batch * layers * heads * (n + 1) * dim * 2 * dtype.size  # keys and values
        print(f"context {n}: trim {trim * 1e3:.2f} ms, shift {shift * 1e3:.2f} ms (per_row {rows * 1e3:.2f} ms, "
              f"same KV: {same(rolled, moved)}); the shift reads and writes {2 * held / 1e6:.1f} MB (a decode "
              f"step reads the {held / 1e6:.1f} MB once)", flush=True)


if __name__ == "__main__":
    main()
