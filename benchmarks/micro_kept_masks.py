# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""A step's mask work with kept device masks (MLXD_MASK_CACHE) against a copy every step, alone.

Per step, for `rows` rows over a `vocab`-wide logits row: the worker's part (numpy unpack of
the packed bits, or their keys and a lookup) and the engine thread's (one `mx.array` copy of
the bool rows, slices, `-inf` made per row and a `where` per row; or the kept arrays and one
`-inf`), timed by the thread's CPU clock (a busy host stretches wall time far more), arms
interleaved rep by rep; the graphs are evaluated outside the timed part.

    PYTHONPATH=src python benchmarks/micro_kept_masks.py [--reps 2000]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import statistics
import time

import numpy as np

import mlx.core as mx


def main(reps: int) -> None:
    rng = np.random.default_rng(0)
    for vocab in (8192, 151936):
        words = (vocab + 31) // 32
        for rows in (1, 8):
            bits = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
            logits = mx.array(rng.standard_normal((rows, vocab)).astype(np.float32)).astype(mx.bfloat16)
            mx.eval(logits)
            keys = [bits[i].tobytes() for i in range(rows)]
            kept = {k: mx.array(np.unpackbits(bits[i].view(np.uint8), count=vocab, bitorder="little").view(np.bool_)[None])
                    for i, k in enumerate(keys)}
            neg = mx.array(-mx.inf, dtype=logits.dtype)
            mx.eval(neg, *kept.values())
            times: dict[str, list[float]] = {"worker: unpack": [], "worker: keys + lookup": [],
                                             "engine: copy + where": [], "engine: kept + where": []}
            for _ in range(reps):
                t0 = time.thread_time()
                unpacked = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
                t1 = time.thread_time()
                found = [k in kept for k in (bits[i].tobytes() for i in range(rows))]
                t2 = time.thread_time()
                allowed = mx.array(unpacked)
                old = [mx.where(allowed[i:i + 1], logits[i:i + 1], mx.array(-mx.inf, dtype=logits.dtype)) for i in range(rows)]
                t3 = time.thread_time()
                new = [mx.where(kept[keys[i]], logits[i:i + 1], neg) for i in range(rows)]
                t4 = time.thread_time()
                mx.eval(*old, *new)
                assert all(found)
                for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[name].append(dt)
            print(f"vocab {vocab:6d} rows {rows}: " + ", ".join(
                f"{name} {1000 * statistics.median(v):.4f}" for name, v in times.items()) + " ms (median, thread CPU)",
                flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    main(parser.parse_args().reps)
