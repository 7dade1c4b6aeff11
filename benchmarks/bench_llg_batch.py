# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""llguidance's batch calls for 8 rows a step, against a row at a time (issue 22, why the feed stays serial).

Eight matchers walk the bench's regex or JSON arm (bench_structured.ARMS) over a preset's tokenizer, a
random allowed token each step. Per step: the batched fill (`LLExecutor.unsafe_compute_mask_ptr`, the
GIL released, on `--threads` rayon threads), and the feed two ways on forks of the same matchers:
`try_consume_tokens` row by row (the GIL held, what `Matcher.consume` does) and one
`LLExecutor.consume_token_par` call (the GIL released, on the pool).

    python benchmarks/bench_llg_batch.py [--preset default] [--steps 200] [--threads N]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import random
import sys
import time
from pathlib import Path

import llguidance as llg
import numpy as np

from mlxd.model import ensure_model
from mlxd.structured import GrammarCache, bitmask_words, constraint_from_request, load_vocabulary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import ARMS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, help="llguidance's pool (default: 80%% of the cores)")
    args = parser.parse_args()
    cache = GrammarCache(load_vocabulary(ensure_model(args.preset)))
    executor = llg.LLExecutor(args.threads)
    eos = list(cache.vocab.eos_ids)
    for arm in ("regex", "json_schema"):
        rows = [cache.matcher(constraint_from_request(ARMS[arm])) for _ in range(args.rows)]
        vocab, words = rows[0].vocab_size, bitmask_words(rows[0].vocab_size)
        bits = np.zeros((args.rows, words), dtype=np.int32)
        rng = random.Random(0)
        fill = serial = par = 0.0
        for _ in range(args.steps):
            t0 = time.perf_counter()
            executor.unsafe_compute_mask_ptr([(r._ll, i) for i, r in enumerate(rows)], bits.ctypes.data, words * 4,
                                             args.rows)
            fill += time.perf_counter() - t0
            allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little").astype(bool)
            allowed[:, eos] = False
            tokens = [int(rng.choice(np.flatnonzero(a))) for a in allowed]
            one, many = [r.fork() for r in rows], [r.fork() for r in rows]
            t0 = time.perf_counter()
            taken = [r._ll.try_consume_tokens([t]) for r, t in zip(one, tokens, strict=True)]
            serial += time.perf_counter() - t0
            t0 = time.perf_counter()
            took = executor.consume_token_par([(r._ll, t) for r, t in zip(many, tokens, strict=True)])
            par += time.perf_counter() - t0
            assert taken == [1] * args.rows and all(took)
            for r, t in zip(rows, tokens, strict=True):
                assert r.consume(t)
        n = args.steps
        print(f"{arm:11s} {args.rows} rows, ms a step: fill (batched) {1000 * fill / n:.3f}; feed: try_consume_tokens "
              f"row by row {1000 * serial / n:.3f}, consume_token_par {1000 * par / n:.3f}", flush=True)


if __name__ == "__main__":
    main()
