# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Decode with a row that ends early: carried (MLXD_CARRY_ROWS, model/carry_rows.py) ÷ mlx-lm's filter.

Rows of one long prompt (its KV made once, copied into each row: a cache hit, as the servers bench's 8-stream
runs start) decode under mlx-lm's `BatchGenerator`; the first row ends `--early` steps before the others. Per
round, both arms interleaved (order alternating): the seconds of the step after the first row's last token
(`after_end_s`: the step whose forward mlx-lm's copy of the batch comes before) and of the whole decode
(`decode_s`), each step's seconds and rows recorded.
Ratios carried ÷ filtered per round, median + IQR. `--early 1` is the servers bench's case (rows started a step
apart end a step apart); a larger one shows what carrying costs until the row is filtered a step late. Where the
first row ends 4 or more steps early, the filtered arm's steps also price a longer carry on this device:
`break_even_steps` = the gather's extra seconds (the step after the end less a step of the rows left) ÷ what one
more row adds to a step (a step of all rows less one of the rows left): how many steps a carried row could stay
before carrying costs more than the copy (model/carry_rows.py carries one).

    PYTHONPATH=src python benchmarks/bench_carry_rows.py [--preset bench] [--context 4096] [--rows 8]
        [--early 1 20] [--tokens 24] [--rounds 8] [--model DIR]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

HERE = Path(__file__).resolve().parent


def row_caches(prefix: list[Any]) -> list[Any]:
    """A fresh copy of the prompt's KV caches (each row writes its own)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in prefix:
        fresh = KVCache()
        fresh.keys = mx.contiguous(c.keys[..., : c.offset, :])
        fresh.values = mx.contiguous(c.values[..., : c.offset, :])
        fresh.offset = c.offset
        out.append(fresh)
    mx.eval([(c.keys, c.values) for c in out])
    return out


def run(model: Any, prompt: list[int], prefix: list[Any], rows: int, tokens: int, early: int) -> dict[str, Any]:
    """One decode: each step's seconds and rows, the step after the first row ended, the whole decode."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows)
    limits = [tokens - early] + [tokens] * (rows - 1)
    caches = [row_caches(prefix) for _ in range(rows)]
    uids = gen.insert([prompt[-1:]] * rows, max_tokens=limits, caches=caches)
    steps: list[float] = []
    sizes: list[int] = []
    ended = None
    try:
        while True:
            t0 = time.perf_counter()
            _, responses = gen.next()
            steps.append(time.perf_counter() - t0)
            sizes.append(len(gen._generation_batch))
            for r in responses:
                if r.finish_reason is not None:  # its KV kept, as a server keeps it (its final checkpoint)
                    mx.async_eval([c.state for c in r.prompt_cache])
                    ended = len(steps) - 1 if r.uid == uids[0] else ended
            del responses  # (nothing else holds the batch's buffers into the next step)
            if len(steps) > 2 and not gen._generation_batch.uids:
                break
    finally:
        gen.close()
    assert ended is not None
    decoding = [i for i, n in enumerate(sizes) if n] + [len(sizes) - 1]
    return {"after_end_s": steps[ended + 1], "decode_s": sum(steps[decoding[0]:]), "steps_s": steps, "rows": sizes,
            "first_step": decoding[0], "ended_step": ended}


def break_even(run: dict[str, Any]) -> float | None:
    """A filtered run's copy ÷ one row's share of a step, in steps (None where too few steps on either side)."""
    steps, first, ended = run["steps_s"], run["first_step"], run["ended_step"]
    full = steps[first + 1: ended + 1]  # all rows (the first decode step left out: it may compile)
    left = steps[ended + 2: -2]  # the rows left, after the copy (the last steps left out: rows end there)
    if len(full) < 2 or len(left) < 2:
        return None
    one_row = statistics.median(full) - statistics.median(left)
    return (run["after_end_s"] - statistics.median(left)) / one_row if one_row > 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--model", type=Path, help="a model directory (default: the preset built in a temp dir)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24, help="tokens each row that does not end early decodes")
    ap.add_argument("--early", type=int, nargs="+", default=[1, 20])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    if max(args.early) >= args.tokens or min(args.early) < 1:
        ap.error(f"--early must be 1 to --tokens - 1 ({args.tokens - 1}): {args.early}")

    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.model import batch_filter, build_model, carry_rows

    batch_filter.install(force=True)  # (as mlxd serves)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_model(Path(tmp) / args.preset, args.preset, seed=0)
        model, _ = load(str(path))
        prompt = [(7 * i) % 1000 + 5 for i in range(args.context)]
        prefix = make_prompt_cache(model)
        for at in range(0, args.context - 1, 512):
            model(mx.array([prompt[at: min(at + 512, args.context - 1)]]), cache=prefix)
            mx.eval([c.state for c in prefix])
        results: dict[str, Any] = {"argv": sys.argv[1:], "device": str(mx.default_device()), "cases": {}}
        for early in args.early:
            runs: dict[str, list[dict[str, float]]] = {"carried": [], "filtered": []}
            for r in range(args.rounds + 1):  # round 0: warm-up, not kept
                for arm in (("carried", "filtered") if r % 2 else ("filtered", "carried")):
                    carry_rows.uninstall()
                    if arm == "carried":
                        carry_rows.install(force=True)
                    got = run(model, prompt, prefix, args.rows, args.tokens, early)
                    if r:
                        runs[arm].append(got)
            carry_rows.uninstall()
            case: dict[str, Any] = {"runs": runs}
            for key in ("after_end_s", "decode_s"):
                ratios = sorted(c[key] / f[key] for c, f in zip(runs["carried"], runs["filtered"], strict=True))
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                case[key] = {"carried_ms": round(1000 * statistics.median(x[key] for x in runs["carried"]), 2),
                             "filtered_ms": round(1000 * statistics.median(x[key] for x in runs["filtered"]), 2),
                             "ratio": round(statistics.median(ratios), 4), "iqr": [round(q[0], 4), round(q[2], 4)]}
                print(f"early {early:3d} {key:11s} carried {case[key]['carried_ms']:9.2f} ms  filtered "
                      f"{case[key]['filtered_ms']:9.2f} ms  carried ÷ filtered {case[key]['ratio']:.4f} "
                      f"[{case[key]['iqr'][0]:.4f}–{case[key]['iqr'][1]:.4f}]", flush=True)
            priced = sorted(b for b in map(break_even, runs["filtered"]) if b is not None)
            if priced:
                case["break_even_steps"] = {"median": round(statistics.median(priced), 2),
                                            "min": round(priced[0], 2), "max": round(priced[-1], 2)}
                print(f"early {early:3d} break-even carry (filtered arm's copy ÷ one row's share of a step): "
                      f"{case['break_even_steps']['median']:.2f} steps [{priced[0]:.2f}–{priced[-1]:.2f}]", flush=True)
            results["cases"][str(early)] = case
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if mx.default_device() == mx.cpu else "gpu"
    out = args.out / f"carry_rows-{tag}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
