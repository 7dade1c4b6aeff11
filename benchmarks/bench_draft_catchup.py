# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What a probe's catch-up costs the draft model: 8 new rows proposing together (each its prompt's prefill first).

`propose_rows` over 8 fresh rows (`default` preset as the draft, fp32, prompts of L .. L + 7 tokens),
4 times per L, ms each; run against another checkout for the tree before:
`PYTHONPATH=<tree>/src python benchmarks/bench_draft_catchup.py LABEL`.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import random
import sys
import time

import mlx.core as mx

from mlxd.engine.draft import DraftModel, ModelDrafts, propose_rows
from mlxd.model import ensure_model, load_model


def main(label: str) -> None:
    path = ensure_model("default")
    model, _ = load_model(path)
    model.set_dtype(mx.float32)
    draft = DraftModel(path, model, prefill_step=512)
    rnd = random.Random(1)
    for length in (144, 544):
        ms = []
        for _ in range(4):
            rows = [ModelDrafts(draft) for _ in range(8)]
            asks = [(row, [rnd.randrange(3, 8000) for _ in range(length + i)], 5, 4) for i, row in enumerate(rows)]
            t0 = time.perf_counter()
            propose_rows(asks)
            ms.append(round((time.perf_counter() - t0) * 1000))
        print(f"{label} prompt {length}: 8 rows' first drafts, ms {ms}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
