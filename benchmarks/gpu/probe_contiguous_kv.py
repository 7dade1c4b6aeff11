# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""A 16k prefill after a short cached prefix, its chunks aligned, with the keys as slices and as contiguous copies.

Issue 28: cuDNN's attention graph is cached by the keys' strides as well as their shape
(mlx/backend/cuda/scaled_dot_product_attention.cpp, `build_sdpa_cache_key`), and a KV cache hands out its keys
as a slice of a buffer grown 256 positions at a time. Aligned chunks (engine/prefill_slices.aligned) repeat the
key lengths of a prompt prefilled from 0, but after a 3-token prefix the buffer sizes differ (256, 2,304, ...).
p1, p2: a prompt from 0 (p2 warm); p7: 3-token prefix, aligned, slices as they are; then with mlxd's attention
wrapper installed (model/suffix_attention.py: a chunk's keys and values contiguous): p7 twice, a 5-token prefix
aligned (p8) and a 3-token one unaligned (p6: new key lengths, contiguous or not). ms per step, the prefix's
step first. H100 18:36 (contiguous-kv-h100-20261205-1836.log, the same patch inline): p7 793 ms sliced, 481
contiguous the first time, 217 the second, against p2's 193.

    python3 benchmarks/gpu/probe_contiguous_kv.py [--work DIR]
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import QWEN3_1_7B, built, load  # noqa: E402
from probe_first_prefill import prefill  # noqa: E402

from mlxd.model import suffix_attention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/host-servers-work"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()
    model, _ = load(built(QWEN3_1_7B, args.work))
    rng = random.Random(7)

    def run(name: str, prefix: int, align: bool) -> None:
        _, steps = prefill(model, [rng.randrange(3, 8000) for _ in range(args.tokens)], args.chunk,
                           prefix=prefix, align=align)
        print(name, round(sum(steps), 1), steps, flush=True)

    run("p1", 0, False)
    run("p2", 0, False)
    run("p7 plain", 3, True)
    suffix_attention.install(force=True)
    for name, prefix, align in (("p7 contiguous", 3, True), ("p7 contiguous again", 3, True),
                                ("p8 5 aligned contiguous", 5, True), ("p6 3 unaligned contiguous", 3, False)):
        run(name, prefix, align)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
