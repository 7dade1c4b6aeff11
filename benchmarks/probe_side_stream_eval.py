"""Does evaluating a small copy wait behind a forward already dispatched on the same stream? (issue 28)

The end-of-decode gaps (docs/benchmarks.md, H100 2026-12-06 03:40): a finishing row's checkpoint evaluates a copy
of its KV right after mlx-lm dispatched the next forward, on the engine's stream, so the copy waits for that
forward. Here: a chain of matmuls dispatched (`mx.async_eval`, the forward), then a copy of a slice of a KV-shaped
array made and evaluated on the same stream or on a new one; how long the copy's eval waited, arms alternated.

    python benchmarks/probe_side_stream_eval.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1024, help="the forward's matmuls are size x size")
    ap.add_argument("--matmuls", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    a = mx.random.normal((args.size, args.size))
    kv = mx.random.normal((8, 8, 4096, 128))
    mx.eval(a, kv)
    side = mx.new_stream(mx.default_device())
    rows = []
    for r in range(args.rounds):
        for arm in ("same", "side"):
            y = a
            for _ in range(args.matmuls):
                y = y @ a
            mx.async_eval(y)  # the forward the step dispatched
            t = time.perf_counter()
            with mx.stream(side if arm == "side" else mx.default_stream(mx.default_device())):
                copy = kv[2:3, :, :1000, :] * 1  # a finished row's KV, copied
                mx.eval(copy)
            waited = time.perf_counter() - t
            mx.eval(y)
            rows.append({"round": r, "arm": arm, "copy_waited_ms": round(waited * 1e3, 2),
                         "forward_done_ms": round((time.perf_counter() - t) * 1e3, 2)})
            print(json.dumps(rows[-1]))
    print(json.dumps({"device": str(mx.default_device()), **{arm: sorted(x["copy_waited_ms"] for x in rows
                                                                         if x["arm"] == arm) for arm in ("same", "side")}}))


if __name__ == "__main__":
    main()
