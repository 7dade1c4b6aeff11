# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""A draft model's step for several rows (engine/draft.py `propose_rows`): ms per step and KV bytes copied, by context.

    python benchmarks/bench_draft_batch.py [--preset default] [--rows 8] [--context 128 512 2048] [--steps 12] [--k 4]

Rows of `--context` prompt tokens (each a few tokens longer than the one
before) propose together step after step, the target accepting every draft
(the next step feeds the last draft and a new pending token) or, with
`--accept-varied`, a row-dependent number of them; per step: wall ms and
CPU ms (the process's threads: less moved by other work on a shared host than
wall time) and the KV bytes the step copied. The first
step (every row's prefill) is left out. Before the draft batch was kept from
step to step, every step gathered every row's whole KV into a new batch (bytes
∝ context); run another checkout with `PYTHONPATH=OTHER/src`.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.engine import draft as draft_mod
from mlxd.engine.draft import DraftModel, ModelDrafts, propose_rows
from mlxd.model import ensure_model
from mlxd.model.detok import load_model

RESULTS = Path(__file__).resolve().parent / "results"


class Copies:
    """KV bytes copied into or out of the draft batch: the tree's own counter, or (before) the gathers."""

    def __init__(self) -> None:
        self.before = 0
        if hasattr(draft_mod, "COPIED"):
            return
        real = draft_mod._batch_caches

        def batch_caches(rows: Any, pads: Any, **kw: Any) -> Any:
            for layer in zip(*rows, strict=True):
                for c in layer:
                    if c.offset > 0:
                        self.before += c.offset * c.keys.shape[1] * (c.keys.shape[3] + c.values.shape[3]) * c.keys.dtype.size
            return real(rows, pads, **kw)

        draft_mod._batch_caches = batch_caches

    def bytes(self) -> int:
        counter = getattr(draft_mod, "COPIED", None)
        return self.before + (counter.bytes if counter is not None else 0)


def run(draft: DraftModel, rows: int, context: int, steps: int, k: int, varied: bool, copies: Copies) -> dict[str, Any]:
    rnd = random.Random(context)
    tokens = [[rnd.randrange(3, 1000) for _ in range(context + 3 * i)] for i in range(rows)]
    pending = [rnd.randrange(3, 1000) for _ in range(rows)]
    drafts = [ModelDrafts(draft) for _ in range(rows)]
    ms, cpu, copied = [], [], []
    for step in range(steps + 1):
        b0, t0, c0 = copies.bytes(), time.perf_counter(), time.process_time()
        out = propose_rows([(d, t, p, k) for d, t, p in zip(drafts, tokens, pending, strict=True)])
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step:
            ms.append(dt * 1e3)
            cpu.append(dc * 1e3)
            copied.append(copies.bytes() - b0)
        for i, proposal in enumerate(out):
            n = (i + step) % (len(proposal) + 1) if varied else len(proposal)
            tokens[i] = [*tokens[i], pending[i], *proposal[:n]]
            pending[i] = rnd.randrange(3, 1000)
    return {"ms_median": statistics.median(ms), "ms": [round(x, 2) for x in ms],
            "cpu_ms_median": statistics.median(cpu), "cpu_ms": [round(x, 2) for x in cpu],
            "copied_kb_median": statistics.median(copied) / 1024, "copied_kb_mean": statistics.fmean(copied) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--accept-varied", action="store_true", help="rows accept different numbers of drafts")
    p.add_argument("--label", default="")
    args = p.parse_args()
    path = ensure_model(args.preset)
    model, _ = load_model(path)
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    draft = DraftModel(path, model, prefill_step=512)
    copies = Copies()
    run(draft, args.rows, 16, 3, args.k, args.accept_varied, copies)  # warm-up
    out: dict[str, Any] = {}
    for context in args.context:
        out[str(context)] = run(draft, args.rows, context, args.steps, args.k, args.accept_varied, copies)
        r = out[str(context)]
        print(f"context {context:5d}: {r['ms_median']:7.2f} ms/step, CPU {r['cpu_ms_median']:7.2f} ms/step (medians), copied {r['copied_kb_median']:9.0f} KiB/step "
              f"(median; mean {r['copied_kb_mean']:.0f})", flush=True)
    load = os.getloadavg()
    print(f"{args.preset}, {args.rows} rows, k={args.k}, load {load[0]:.1f}, mlxd from {Path(mlxd.__file__).parent}")
    RESULTS.mkdir(exist_ok=True)
    name = RESULTS / f"draft_batch-{args.label or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    name.write_text(json.dumps({"command": " ".join(["python", "benchmarks/bench_draft_batch.py", *sys.argv[1:]]),
                                "mlxd": str(Path(mlxd.__file__).parent), "load": load, "results": out}, indent=2) + "\n")
    print(name)


if __name__ == "__main__":
    main()
