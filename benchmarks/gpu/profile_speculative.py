# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Where a verify step's time goes (forward, sampling, KV roll-back) next to a plain step; GPU or CPU."""

from __future__ import annotations

import mlxd  # noqa: F401

import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_speculative import decode, workload  # noqa: E402

from mlxd import RuntimeConfig  # noqa: E402
from mlxd.engine import spec_batch  # noqa: E402
from mlxd.engine.core import EngineCore  # noqa: E402

T: dict[str, float] = defaultdict(float)
N: dict[str, int] = defaultdict(int)


def timed(name, fn):
    def wrap(self, *a, **k):
        mx.synchronize()
        t0 = time.perf_counter()
        r = fn(self, *a, **k)
        mx.eval(self.prompt_cache[0].keys) if self.prompt_cache else None
        mx.synchronize()
        T[name] += time.perf_counter() - t0
        N[name] += 1
        return r
    return wrap


B = spec_batch.SpeculativeBatch
B._drop_rejected = timed("drop_rejected", B._drop_rejected)
B._sample = timed("sample", B._sample)
B._verify = timed("verify_total", B._verify)
B._step = timed("plain_step", B._step)

model = sys.argv[1]
for batch, temp in ((8, 2.0), (1, 2.0), (8, 4.0)):
    core = EngineCore(RuntimeConfig(model=model, max_batch=8, prompt_cache_bytes=0, device_probe="off",
                                    speculative="ngram", max_context=8192))
    info = core.load()
    reqs = workload("non-repetitive", batch, 128, info.vocab_size, 256, temp)
    decode(core, reqs)
    T.clear()
    N.clear()
    t0 = time.perf_counter()
    rate, _ = decode(core, reqs)
    total = time.perf_counter() - t0
    print(f"batch {batch} temp {temp}: {rate:.1f} tok/s, total {total:.2f}s", core.stats().speculation)
    for k in T:
        print(f"  {k}: {T[k]*1000/N[k]:.2f} ms x {N[k]} = {T[k]:.2f}s")
