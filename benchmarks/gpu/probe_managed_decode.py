# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Does decode run slower on KV memory that the SSD tier's host access has touched? (issue 28)

On the H100, 8 streams decoded 0.948 / 0.937x mlx_lm with the SSD tier against 0.980 / 0.973 RAM only,
with nothing written beside the decode (docs/benchmarks.md, "H100, 2026-12-05 23:01"). What the SSD tier
does that RAM only does not, to memory decode may later use: MLX's CUDA backend converts an array to managed
memory at its first host access (the write plan's memoryviews), the SSD writer marks the buffers
`cudaMemAdviseSetReadMostly` and stages them with DMA copies, and a converted buffer, once freed, goes back to
MLX's buffer cache as managed memory and is handed out again by size, to whatever asks for that size next.

Here, no model and no server: the attention half of a decode step of the 1.7B shape (28 layers, 16 query
heads over 8 KV heads, head dim 128, bf16; each step writes one token's K and V in place and attends over all),
`--rows` rows over a `--prefix`-token prefix, for `--steps` steps, on KV buffers that each arm prepared:

- `device`: fresh buffers, never touched by the host (RAM only, as serving has them)
- `converted`: a memoryview of each buffer first (the write plan: MLX converts it to managed memory)
- `staged`: converted, then copied to pinned host memory by DMA (`host_memory.to_host`: the SSD writer's staging)
- `read_mostly`: converted, marked read-mostly, then read by the host (the writer's advice and a host read)
- `host_read`: converted, then read by the host with no advice (its pages move to the host)

Each arm decodes on its own buffers (`live`), then frees them and decodes on new buffers of the same shapes
(`recycled`: MLX's cache hands back the freed ones; the bytes it reused are reported), then frees those and
times `mx.clear_cache()` (`clear_ms`: mlx-lm's prompt phase calls it after every prefill chunk; a converted buffer
is managed memory, freed by `cudaFree`), so each arm starts from an empty cache. Per arm and phase: the first step (page faults land there) and the median
of the rest, ms; the arms rotate their order each round. On the CPU every arm is the same memory (a smoke run).

    python3 benchmarks/gpu/probe_managed_decode.py --cases 8x8192 1x16384 --steps 48 --rounds 3 --json OUT.json
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 28, 16, 8, 128
ARMS = ("device", "converted", "staged", "read_mostly", "host_read")


def kv_buffers(rows: int, capacity: int, layers: int, heads: int, dim: int) -> list[tuple[Any, Any]]:
    """Each layer's K and V buffers, evaluated: (rows, heads, capacity, dim) bf16, non-zero."""
    import mlx.core as mx

    out = []
    for i in range(layers):
        k = mx.full((rows, heads, capacity, dim), 0.01 * (i + 1), dtype=mx.bfloat16)
        v = mx.full((rows, heads, capacity, dim), 0.02 * (i + 1), dtype=mx.bfloat16)
        out.append((k, v))
    mx.eval(out)
    return out


def touch(arm: str, kv: list[tuple[Any, Any]]) -> dict[str, float]:
    """What the arm's host access does to the buffers; its cost in ms."""
    import mlx.core as mx
    import numpy as np

    from mlxd.runtime import device_memory, host_memory

    if arm == "device":
        return {}
    arrays = [a for pair in kv for a in pair]
    shared = [a.view(mx.uint16) for a in arrays]  # views of the same buffers (as kinds.plan_snapshot takes them)
    mx.eval(shared)
    t0 = time.perf_counter()
    views = [memoryview(a) for a in shared]  # the first host access: MLX converts each buffer
    out = {"convert_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    t0 = time.perf_counter()
    if arm == "staged":
        host, _ = host_memory.to_host(views)
        del host
    elif arm in ("read_mostly", "host_read"):
        if arm == "read_mostly":
            out["advised_mb"] = round(device_memory.read_mostly(views) / 1e6, 1)
        total = 0
        for view in views:  # every page read on the host, as the writer's file write reads them
            total += int(np.frombuffer(view, dtype=np.uint16)[:: 2048].sum())
        out["read_sum"] = float(total)
    out["access_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    return out


def decode(kv: list[tuple[Any, Any]], prefix: int, steps: int, q_heads: int) -> list[float]:
    """`steps` decode steps' attention on the buffers: write one token at the end, attend over all; ms each."""
    import mlx.core as mx

    rows, heads, _, dim = kv[0][0].shape
    q = mx.full((rows, q_heads, 1, dim), 0.05, dtype=mx.bfloat16)
    new = mx.full((rows, heads, 1, dim), 0.03, dtype=mx.bfloat16)
    mx.eval(q, new)
    scale = dim**-0.5
    times = []
    for s in range(steps):
        at = prefix + s
        t0 = time.perf_counter()
        outs = []
        for k, v in kv:
            k[:, :, at : at + 1, :] = new
            v[:, :, at : at + 1, :] = new
            outs.append(mx.fast.scaled_dot_product_attention(q, k[:, :, : at + 1, :], v[:, :, : at + 1, :], scale=scale))
        mx.eval(outs, [a for pair in kv for a in pair])
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def summary(times: list[float]) -> dict[str, float]:
    rest = times[1:] or times
    return {"first_ms": round(times[0], 2), "median_ms": round(statistics.median(rest), 3),
            "max_rest_ms": round(max(rest), 2)}


def one(arm: str, rows: int, prefix: int, args: argparse.Namespace, shape: tuple[int, int, int, int]) -> dict[str, Any]:
    import mlx.core as mx

    layers, q_heads, heads, dim = shape
    capacity = prefix + args.steps
    mx.clear_cache()
    kv = kv_buffers(rows, capacity, layers, heads, dim)
    row: dict[str, Any] = {"arm": arm, "rows": rows, "prefix": prefix, "kv_mb": round(
        sum(a.nbytes for pair in kv for a in pair) / 1e6, 1), **touch(arm, kv)}
    row["live"] = summary(decode(kv, prefix, args.steps, q_heads))
    del kv
    cached = mx.get_cache_memory()
    kv = kv_buffers(rows, capacity, layers, heads, dim)
    row["reused_mb"] = round((cached - mx.get_cache_memory()) / 1e6, 1)
    row["recycled"] = summary(decode(kv, prefix, args.steps, q_heads))
    del kv
    # Freeing them: mlx-lm's prompt phase calls mx.clear_cache() after every prefill chunk (and its decode every
    # 512 steps), which frees every cached buffer; a converted one is managed memory (cudaFree, which waits for
    # the device) where a never-touched one goes back to the pool.
    t0 = time.perf_counter()
    mx.clear_cache()
    row["clear_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["8x8192", "1x16384"], help="ROWSxPREFIX")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--small", action="store_true", help="2 layers, 2 KV heads, head dim 32 (a CPU smoke run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import mlx.core as mx

    from mlxd.runtime import device_memory

    shape = (2, 4, 2, 32) if args.small else (LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases]
    rows_out: list[dict[str, Any]] = []
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__,
                           "managed": device_memory.managed() is not None, "shape": shape, "steps": args.steps,
                           "rows": rows_out}

    def save() -> None:  # after every row: a run cut short still reports what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1))

    one(args.arms[0], 1, 256, argparse.Namespace(steps=4), shape)  # warm-up: kernels, allocator
    for r in range(args.rounds):
        for rows, prefix in cases:
            k = r % len(args.arms)
            for arm in args.arms[k:] + args.arms[:k]:
                row = {"round": r, **one(arm, rows, prefix, args, shape)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                save()
    table: dict[str, Any] = {}
    for rows, prefix in cases:
        for arm in args.arms:
            mine = [x for x in rows_out if x["arm"] == arm and x["rows"] == rows and x["prefix"] == prefix]
            table[f"{rows}x{prefix} {arm}"] = {
                phase: {"first_ms": statistics.median(x[phase]["first_ms"] for x in mine),
                        "median_ms": statistics.median(x[phase]["median_ms"] for x in mine)}
                for phase in ("live", "recycled")} | {"reused_mb": statistics.median(x["reused_mb"] for x in mine),
                                                      "clear_ms": statistics.median(x["clear_ms"] for x in mine)}
    for name, t in table.items():
        print(f"{name:>26}: live first {t['live']['first_ms']:8.2f} steady {t['live']['median_ms']:7.3f} ms | "
              f"recycled first {t['recycled']['first_ms']:8.2f} steady {t['recycled']['median_ms']:7.3f} ms "
              f"(reused {t['reused_mb']} MB) | clear_cache {t['clear_ms']:.1f} ms", flush=True)
    out["medians"] = table
    save()
    if args.json:
        print("->", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
