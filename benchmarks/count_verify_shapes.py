# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""How many attention shapes would build a cuDNN graph in a batch-1 round under a draft model? (CPU count)

On CUDA, MLX attends several queries through a cuDNN graph cached per exact shape (queries, keys,
mask); one query goes to a vector kernel, or to cuDNN's decoding graph keyed by the KV buffer's size
(mlx/backend/cuda/scaled_dot_product_attention.cpp). No cuDNN here, but the shapes are the same: this
runs the engine at batch 1 with a draft model (a 1-layer model of the `default` shape: cheap enough
for the gate to try it) and `spec_batch.WHOLE_BUFFER` on as on CUDA, records every call that reaches
MLX's fused attention (below model/suffix_attention.py's routing, installed as on a GPU) and counts
the distinct shapes a CUDA device would have built a graph for: per round, new ones (the cache keeps
256; the first round's include the prompt's prefill).

Routings: `before` = suffix_attention as it was (2..MAX_QUERY queries over MIN_KEYS keys or more,
causal or no mask: SHORT_QUERY = 1), `now` = the current one (also 2..SHORT_QUERY queries over any
keys and under array masks). Gates: `real` (the engine's gate: an unrelated draft backs off) and
`always` (every step verifies: the most shapes a round can make).

    python benchmarks/count_verify_shapes.py [--rounds 4] [--tokens 48] [--span 256]
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine import spec_batch
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.kv.ngram import SpeculationGate
from mlxd.model import ensure_model, presets, suffix_attention
from mlxd.model.tiny import build_model
from mlxd.runtime.kernel.messages import GenerationRequest

RESULTS = Path(__file__).resolve().parent / "results"
DRAFT = attrs.evolve(presets.PRESETS["default"], name="default-1layer", num_hidden_layers=1)


def draft_dir() -> Path:
    where = Path(f"/tmp/models/{DRAFT.name}")
    if not (where / "config.json").exists():
        presets.PRESETS[DRAFT.name] = DRAFT
        build_model(where, DRAFT.name, seed=1)
    return where


class Recorder:
    """Every call reaching MLX's fused attention: its would-be cuDNN graph key, or None (no graph)."""

    def __init__(self) -> None:
        self.keys: list[tuple[Any, ...] | None] = []
        self.original = mx.fast.scaled_dot_product_attention

    def __call__(self, q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, **kwargs: Any) -> Any:
        self.keys.append(graph_key(q, k, mask))
        return self.original(q, k, v, scale=scale, mask=mask, **kwargs)


def graph_key(q: Any, k: Any, mask: Any) -> tuple[Any, ...] | None:
    array_mask = mask is not None and not isinstance(mask, str)
    if q.shape[2] == 1:  # one query: the vector kernel, or cuDNN's decoding graph per 256-position buffer
        if array_mask or k.shape[2] < 256:
            return None
        return ("decode", q.shape[0], -(-k.shape[2] // 256) * 256)
    return ("chunk", q.shape[0], q.shape[2], k.shape[2], tuple(mask.shape) if array_mask else mask)


def run(routing: str, gate: str, args: argparse.Namespace, target: Path, draft: Path) -> dict[str, Any]:
    recorder = Recorder()
    mx.fast.scaled_dot_product_attention = recorder
    short = getattr(suffix_attention, "SHORT_QUERY", 1)  # (none before it: 2..MAX_QUERY over MIN_KEYS only)
    if routing == "before":
        suffix_attention.SHORT_QUERY = 1
    suffix_attention.install(force=True)
    decide = SpeculationGate.decide
    if gate == "always":
        SpeculationGate.decide = lambda self, rows: "verify"  # type: ignore[method-assign]
    spec_batch.WHOLE_BUFFER = True
    try:
        config = RuntimeConfig(model=str(target), max_batch=1, prompt_cache_bytes=0, device_probe="off",
                               speculative="draft", draft_model=str(draft), num_draft_tokens=args.k,
                               default_max_tokens=args.tokens, max_context=8192, prefill_slice_s=0.0)
        core = EngineCore(config)
        core.load()
        rnd = random.Random(5)
        vocab = 8192
        seen: set[Any] = set()
        rounds = []
        for r in range(args.rounds):
            prompt = tuple(rnd.randrange(3, vocab) for _ in range(2 * args.span))
            request = GenerationRequest(request_id=f"r{r}", prompt=prompt, sampling=SamplingParams(
                max_tokens=args.tokens, temperature=4.0, seed=1000 + r))
            at = len(recorder.keys)
            run_rows(core, [request])
            keys = [x for x in recorder.keys[at:] if x is not None]
            new = {x for x in keys if x not in seen}
            seen |= new
            brief = {x for x in new if x[0] == "chunk" and x[2] <= 16}  # a verify's 1 + K, a draft's forwards
            rounds.append({"calls": len(recorder.keys) - at, "graph_calls": len(keys), "new_shapes": len(new),
                           "new_short_shapes": len(brief),
                           "new_chunk_shapes": sorted(x[2:4] for x in new if x[0] == "chunk")})
        spec = core.stats().speculation
        core.close()
    finally:
        mx.fast.scaled_dot_product_attention = recorder.original
        suffix_attention.uninstall()
        suffix_attention.SHORT_QUERY = short
        SpeculationGate.decide = decide  # type: ignore[method-assign]
    assert spec is not None
    return {"routing": routing, "gate": gate, "rounds": rounds, "verify_steps": spec.verify_steps,
            "draft_steps": spec.draft_steps, "probes": spec.gate_probes, "distinct_shapes": len(seen)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--span", type=int, default=256, help="half the prompt (the bench's non-repetitive case)")
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    import os

    os.environ.setdefault("MLXD_DRAFT_COST", "0.1")  # the gate prices the draft as on a GPU (bytes, bf16 both)
    target, draft = ensure_model("default"), draft_dir()
    out: dict[str, Any] = {"tokens": args.tokens, "rounds": args.rounds, "span": args.span, "runs": []}
    for gate in ("always", "real"):
        for routing in ("before", "now"):
            r = run(routing, gate, args, target, draft)
            out["runs"].append(r)
            per_round = [x["new_shapes"] for x in r["rounds"]]
            short = [x["new_short_shapes"] for x in r["rounds"]]
            print(f"gate {gate:>6}, routing {routing:>6}: {r['distinct_shapes']} distinct graph shapes, new per "
                  f"round {per_round}, of 2..16 queries {short} (verify steps {r['verify_steps']}, draft steps {r['draft_steps']}, probes "
                  f"{r['probes']}); round 2's new chunk shapes (queries, keys): {r['rounds'][1]['new_chunk_shapes']}",
                  flush=True)
    RESULTS.mkdir(exist_ok=True)
    result = RESULTS / f"verify-shapes-count-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result.write_text(json.dumps(out, indent=2))
    print(result)


if __name__ == "__main__":
    main()
