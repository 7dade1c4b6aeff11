# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What does a draft model's prefix cost on a RAM-hit turn, recomputed or taken from the prompt cache?

With `--speculative draft`, a row's draft model needs the KV of the row's whole
prefix before its first proposal, and that first proposal comes before the
row's first token. On a RAM hit the target prefills only the new suffix; the
draft either recomputes the whole prefix (arm `recompute`) or starts from its
own checkpoint in the prompt cache (arm `cached`: the draft's entries in their
own namespace, published beside the target's). Three engine cores over the
same target run the same follow-up turn (a long shared prefix, the previous
reply, a short new message) from the same RAM entries, side by side in one
process, in rotating order: speculation off, draft recomputing, draft cached.

Reported per prefix length: median TTFT per arm (from the step that starts the
row to its first token), each arm ÷ off and cached ÷ recompute, the draft's
prefill alone (its first proposal timed by itself: from nothing, from the
cached prefix in RAM, and from the same checkpoint written as an SSD tier file
then read back, adopted and lent: the restore path, page cache warm), and
whether every arm's tokens equal off's.

    python benchmarks/bench_draft_prefix.py [--target-preset bench] [--draft-preset default]
        [--prefix 3072] [--rounds 3] [--tokens 16] [--k 4]

Results go to benchmarks/results/draft-prefix-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import attrs

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.engine.ops import RowStart
from mlxd.engine.speculative import draft_namespace
from mlxd.kv.prompt_cache import PromptCache
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import (
    DraftPrefix,
    GenerationRequest,
    PublishPrefix,
)

RESULTS = Path(__file__).resolve().parent / "results"


def run(core: EngineCore, start: RowStart) -> tuple[float, list[int], list[PublishPrefix]]:
    """One row to its end: seconds to its first token, its tokens, the checkpoints it published."""
    run = run_rows(core, [start])
    rid = start.request.request_id
    return run.first_token_s[rid], run.tokens[rid], run.notes


def draft_prefill(draft: Any, prompt: tuple[int, ...], cached: Any, k: int) -> float:
    """The draft's first proposal alone: from nothing, or from its cached prefix (a CacheHit)."""
    from mlxd.engine.draft import ModelDrafts
    from mlxd.kv import kinds

    row = ModelDrafts(draft)
    if cached is not None:
        lent = kinds.lend(cached.entry.payload, cached.usable, total=len(cached.entry.tokens))
        row.start(lent, prompt[: cached.usable])
    t0 = time.perf_counter()
    row.propose(prompt, 5, k)
    return time.perf_counter() - t0


def write_draft_file(core: EngineCore, entry: Any, namespace: str, root: Path) -> Any:
    """The draft's cached checkpoint written as an SSD tier file (what a spill or a flush writes)."""
    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import SsdStore, Stored

    plan = kinds.plan_snapshot(entry.payload, meta=core.store_identity.meta(tuple(entry.tokens), namespace))
    root.mkdir(parents=True, exist_ok=True)
    store = SsdStore(root, core.store_identity)
    outcome = store.write(plan)
    assert isinstance(outcome, Stored), outcome
    return store, outcome.record


def draft_from_file(draft: Any, prompt: tuple[int, ...], file: Any, usable: int, k: int) -> float:
    """The draft's first proposal from its SSD file: read (page cache warm), adopted, lent, then the step."""
    from mlxd.engine.draft import ModelDrafts
    from mlxd.kv import kinds

    store, record = file
    t0 = time.perf_counter()
    loaded = store.load(record)
    assert loaded is not None
    caches = kinds.adopt(loaded)
    row = ModelDrafts(draft)
    row.start(kinds.lend(caches, usable, total=len(record.tokens)), prompt[:usable])
    row.propose(prompt, 5, k)
    return time.perf_counter() - t0


def case(
    cores: dict[str, EngineCore], draft: Any, tag: str, prefix_len: int, args: argparse.Namespace, vocab: int
) -> dict:
    rnd = random.Random(prefix_len)
    prefix = tuple(rnd.randrange(3, vocab) for _ in range(prefix_len))
    sampling = SamplingParams(max_tokens=args.tokens)
    first = GenerationRequest(request_id="turn1", prompt=prefix, sampling=sampling)
    t0 = time.perf_counter()
    _, reply, notes = run(cores["cached"], RowStart(request=first))  # publishes the target's and the draft's KV
    cold_s = time.perf_counter() - t0
    ram = PromptCache(max_bytes=1 << 34)
    for n in notes:
        ram.put(n.tokens, n.namespace, payload=n.payload, nbytes=n.nbytes, trimmable=n.trimmable)
    follow = prefix + tuple(reply) + tuple(rnd.randrange(3, vocab) for _ in range(args.new))
    ns = draft_namespace("", tag)
    hit, dhit = ram.peek(follow, ""), ram.peek(follow, ns)
    assert hit is not None and dhit is not None, "turn 1 published no checkpoint"
    req = GenerationRequest(request_id="turn2", prompt=follow, sampling=sampling)
    starts = {"off": RowStart(request=req, hit=hit), "recompute": RowStart(request=req, hit=hit),
              "cached": RowStart(request=req, hit=hit, draft=DraftPrefix(ns, dhit))}
    core_of = {"off": "off", "recompute": "cached", "cached": "cached"}  # the draft core serves both draft arms
    arms = list(starts)
    ttft: dict[str, list[float]] = {a: [] for a in arms}
    outputs: dict[str, list[list[int]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms[r % 3:] + arms[: r % 3]:  # rotate who goes first
            seconds, tokens, _ = run(cores[core_of[arm]], starts[arm])
            ttft[arm].append(seconds)
            outputs[arm].append(tokens)
    alone: dict[str, list[float]] = {"recompute": [], "cached": [], "ssd": []}
    file = write_draft_file(cores["cached"], dhit.entry, ns, Path(args.ssd_dir) / str(prefix_len))
    for _ in range(args.rounds):
        alone["recompute"].append(draft_prefill(draft, follow, None, args.k))
        alone["cached"].append(draft_prefill(draft, follow, dhit, args.k))
        alone["ssd"].append(draft_from_file(draft, follow, file, dhit.usable, args.k))
    med = {a: statistics.median(v) for a, v in ttft.items()}
    out = {
        "prefix_tokens": prefix_len, "prompt_tokens": len(follow), "target_hit": hit.usable, "draft_hit": dhit.usable,
        "turn1_s": cold_s, "ttft_s": ttft, "ttft_median_s": med,
        "recompute_over_off": med["recompute"] / med["off"], "cached_over_off": med["cached"] / med["off"],
        "cached_over_recompute": med["cached"] / med["recompute"],
        "draft_first_step_s": alone, "draft_first_step_median_s": {a: statistics.median(v) for a, v in alone.items()},
        "identical": {a: all(t == outputs["off"][0] for t in outputs[a]) for a in arms},
    }
    d = out["draft_first_step_median_s"]
    print(f"prefix {prefix_len} (prompt {len(follow)}, target hit {hit.usable}, draft hit {dhit.usable}): TTFT off "
          f"{med['off'] * 1000:.0f} ms, recompute {med['recompute'] * 1000:.0f} ms "
          f"({out['recompute_over_off']:.2f}x off), cached {med['cached'] * 1000:.0f} ms "
          f"({out['cached_over_off']:.2f}x off, {out['cached_over_recompute']:.3f}x recompute); draft first step "
          f"alone: recompute {d['recompute'] * 1000:.0f} ms, cached {d['cached'] * 1000:.0f} ms, from its SSD file "
          f"{d['ssd'] * 1000:.0f} ms; identical "
          f"{out['identical']}", flush=True)
    return out


def main(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    target = ensure_model(args.target_preset)
    draft = ensure_model(args.draft_preset)
    base = RuntimeConfig(model=str(target), device_probe="off", max_context=16384, default_max_tokens=args.tokens)
    cores = {"off": EngineCore(base),
             "cached": EngineCore(attrs.evolve(base, speculative="draft", draft_model=str(draft),
                                               num_draft_tokens=args.k))}
    infos = {name: core.load() for name, core in cores.items()}
    tag = infos["cached"].draft_tag
    assert tag is not None
    from mlxd.engine.draft import load_draft

    alone = load_draft(str(draft), cores["off"].tokenizer, prefill_step=cores["off"].prefill_step_size)
    result: dict[str, Any] = {
        "target": args.target_preset, "draft": args.draft_preset, "device": str(mx.default_device()),
        "rounds": args.rounds, "tokens": args.tokens, "new_tokens": args.new, "k": args.k,
        "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cases": {},
    }
    for n in args.prefix:
        result["cases"][str(n)] = case(cores, alone, tag, n, args, infos["off"].vocab_size)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-preset", default="bench")
    p.add_argument("--draft-preset", default="default", help="a preset with the target's tokenizer")
    p.add_argument("--prefix", type=int, nargs="+", default=[3072], help="tokens of the shared prefix")
    p.add_argument("--new", type=int, default=32, help="tokens of the follow-up's new message")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each turn")
    p.add_argument("--k", type=int, default=4, help="--num-draft-tokens")
    p.add_argument("--ssd-dir", default="/tmp/mlxd-bench-draft-prefix", help="where the draft's checkpoint file goes")
    parsed = p.parse_args()
    res = main(parsed)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"draft-prefix-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=2))
    print(path)
