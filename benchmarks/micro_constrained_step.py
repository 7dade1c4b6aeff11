# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""The constrained path's host cost per decode step with no forward pass (issue 22), old and new code alike.

Drives the rows' logits processors the way mlx-lm calls them, on already-evaluated
logits (so `mx.async_eval` returns at once, as on a GPU), with real llguidance
matchers over a preset's tokenizer, under the bench's regex (`[a-z ]{0,1000000}`:
every mask new). Reported per step, median over `--steps`: the processors' host
time (what a GPU host pays before the step's sampling can be queued), the mask
ops' evaluation, and the CPU time of the whole process over both (every thread:
the worker's and llguidance's included; what a CPU host without a spare core pays). Works against the tree before cb51efb too (`StepInputs`).

    PYTHONPATH=src python benchmarks/micro_constrained_step.py [--preset default] [--batch 1 8] [--steps 300] [--pending 4096]

On a GPU, `--pending 4096` puts a few ms of device work behind each step's logits:
host time that grows with it means the path waits for the device (a sync).
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engine import features
from mlxd.model import ensure_model
from mlxd.structured import GrammarCache, constraint_from_request, load_vocabulary

PROMPT = 5


def run(cache: GrammarCache, batch: int, steps: int, body: dict[str, Any], pending: int = 0) -> tuple[float, float, float]:
    fed: dict[int, int] = {}
    if hasattr(features, "StepMasks"):
        rows_ref: list[Any] = []
        hub = features.StepMasks(lambda: dict(fed), lambda: [(r.uid, p) for r, p in rows_ref])
    else:
        hub = features.StepInputs(lambda: dict(fed))
    rows = [(SimpleNamespace(uid=u), features.Constrained(cache.matcher(constraint_from_request(body)), PROMPT, hub))
            for u in range(batch)]
    if hasattr(features, "StepMasks"):
        rows_ref.extend(rows)
    context = [[1] * PROMPT for _ in rows]
    size = cache.vocab.size
    rng = np.random.default_rng(0)
    host, ev, cpu = [], [], []
    for _ in range(steps):
        logits = mx.array(rng.standard_normal((batch, size)).astype(np.float32))
        mx.eval(logits)
        if pending:  # a forward pass still to run behind the logits: a sync in the path waits for it
            work = mx.ones((pending, pending))
            for _ in range(4):
                work = work @ work / pending
            logits = logits + work[0, 0] * 0
        ctx = [mx.array(c) for c in context]
        mx.eval(*ctx)
        hub.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        out = [part.mask(row, ctx[i], logits[i: i + 1]) for i, (row, part) in enumerate(rows)]
        t1 = time.perf_counter()
        mx.eval(*out)
        t2, c2 = time.perf_counter(), time.process_time()
        host.append(t1 - t0)
        ev.append(t2 - t1)
        cpu.append(c2 - c0)
        for i, o in enumerate(out):
            token = int(mx.argmax(o[0]).item())
            context[i].append(token)
            fed[i] = token
    if hasattr(hub, "close"):
        hub.close()
    return tuple(1000 * statistics.median(x[10:]) for x in (host, ev, cpu))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pending", type=int, default=0,
                        help="a lazy n x n matmul chain behind the logits (on a GPU: any sync shows as host time)")
    args = parser.parse_args()
    cache = GrammarCache(load_vocabulary(ensure_model(args.preset)))
    print(f"code {features.__file__}, vocab {cache.vocab.size}, device {mx.default_device()}")
    for body in ({"regex": "[a-z ]{0,1000000}"},
                 {"guided_json": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 100000}}):
        for batch in args.batch:
            host, ev, cpu = run(cache, batch, args.steps, body, args.pending)
            print(f"  {next(iter(body))} batch {batch}: processors' host time {host:.3f} ms/step, mask ops evaluated "
                  f"{ev:.3f} ms/step, CPU time of the process (every thread) {cpu:.3f} ms/step")


if __name__ == "__main__":
    main()
