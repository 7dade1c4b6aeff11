# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What does prompt-lookup speculation (--speculative ngram) buy decode, and what does it cost when it misses?

Two engine cores over the same model, one with speculation off and one with
`--speculative ngram`, decode the same rows in alternating rounds in one
process. Decode tok/s counts the tokens after every row's first one, over the
time from that step to the last (prefill excluded). Two workloads:

- repetitive (edit-style): greedy, the prompt quotes a long span twice and
  starts it a third time; a random-weight model does not copy it the way a
  trained one would, so the acceptance is whatever its own (looping) output
  gives, and it is reported next to the speed;
- non-repetitive: sampled (seeded, at each `--temperature`, default 2 and 4: a
  random-weight model at temperature 1 still collapses into a loop) from a
  prompt of random tokens; at 4 n-grams rarely match (the cost of trying and of
  the back-off), at 2 drafts are partly accepted.

Outputs are checked token for token between the arms. Reported per workload
and batch size: median tok/s per arm, the median per-round ratio on ÷ off,
acceptance rate and tokens per target forward.

    python benchmarks/bench_speculative.py [--preset default] [--rounds 5] [--tokens 128] [--batch 1 8] [--k 4]

Results go to benchmarks/results/speculative-*.json.
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

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.engine.ops import RowStart, StepOps
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import GenerationFinished, GenerationRequest, TokenGenerated

RESULTS = Path(__file__).resolve().parent / "results"


def workload(
    name: str, batch: int, tokens: int, vocab: int, span: int, temperature: float
) -> list[GenerationRequest]:
    rnd = random.Random(f"{name}-{batch}")
    requests = []
    for i in range(batch):
        if name == "repetitive":
            quoted = [rnd.randrange(3, vocab) for _ in range(span)]
            prompt = quoted + [rnd.randrange(3, vocab) for _ in range(8)] + quoted + quoted[: span // 8]
            sampling = SamplingParams(max_tokens=tokens)
        else:
            prompt = [rnd.randrange(3, vocab) for _ in range(2 * span)]
            sampling = SamplingParams(max_tokens=tokens, temperature=temperature, seed=1000 + i)
        requests.append(GenerationRequest(request_id=f"{name}-{i}", prompt=tuple(prompt), sampling=sampling))
    return requests


def decode(core: EngineCore, requests: list[GenerationRequest]) -> tuple[float, dict[str, list[int]]]:
    """Decode tok/s of the rows together, from the step where each has a token to the last step."""
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    done: set[str] = set()
    ops = StepOps(starts=tuple(RowStart(request=r) for r in requests))
    t0, counted = None, 0
    while len(done) < len(requests):
        result = core.step(ops)
        ops = StepOps()
        for emit in result.emits:
            if isinstance(emit.event, TokenGenerated):
                out[emit.request_id].append(emit.event.token)
                counted += t0 is not None
            elif isinstance(emit.event, GenerationFinished):
                done.add(emit.request_id)
        if t0 is None and all(out.values()):
            t0 = time.perf_counter()
    assert t0 is not None
    return counted / (time.perf_counter() - t0), out


def main(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    model = Path(args.model) if args.model else ensure_model(args.preset)
    base = RuntimeConfig(model=str(model), max_batch=max(args.batch), prompt_cache_bytes=0, device_probe="off",
                         default_max_tokens=args.tokens, max_context=8192)
    cores = {"off": EngineCore(base), "ngram": EngineCore(
        RuntimeConfig(**{**_fields(base), "speculative": "ngram", "num_draft_tokens": args.k}))}
    infos = {arm: core.load() for arm, core in cores.items()}
    vocab = infos["off"].vocab_size
    out: dict[str, Any] = {
        "model": args.model or args.preset, "device": str(mx.default_device()), "tokens": args.tokens,
        "rounds": args.rounds, "k": args.k, "temperatures": args.temperature, "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cases": {},
    }
    for name, temperature in [("repetitive", 0.0)] + [("non-repetitive", t) for t in args.temperature]:
        for batch in args.batch:
            requests = workload(name, batch, args.tokens, vocab, args.span, temperature)
            decode(cores["off"], requests[:1])  # warm both arms' kernels for this shape
            decode(cores["ngram"], requests[:1])
            rates: dict[str, list[float]] = {"off": [], "ngram": []}
            ratios: list[float] = []
            before = cores["ngram"].stats().speculation
            same = True
            # The same arm twice: is the platform itself deterministic for this workload?
            repeatable = decode(cores["off"], requests)[1] == decode(cores["off"], requests)[1]
            for r in range(args.rounds):
                order = ("off", "ngram") if r % 2 == 0 else ("ngram", "off")
                got: dict[str, tuple[float, dict[str, list[int]]]] = {}
                for arm in order:
                    got[arm] = decode(cores[arm], requests)
                    rates[arm].append(got[arm][0])
                same = same and got["off"][1] == got["ngram"][1]
                ratios.append(got["ngram"][0] / got["off"][0])
            after = cores["ngram"].stats().speculation
            assert before is not None and after is not None
            proposed, accepted = after.proposed - before.proposed, after.accepted - before.accepted
            rows = after.verified_rows - before.verified_rows
            case = {
                "batch": batch, "off_tok_s": statistics.median(rates["off"]),
                "ngram_tok_s": statistics.median(rates["ngram"]), "ratio_median": statistics.median(ratios),
                "ratios": [round(x, 3) for x in ratios], "acceptance": accepted / proposed if proposed else 0.0,
                "tokens_per_forward": (rows + accepted) / rows if rows else 0.0, "proposed": proposed,
                "accepted": accepted, "identical": same, "off_repeatable": repeatable,
            }
            label = name if name == "repetitive" else f"{name} t={temperature:g}"
            out["cases"][f"{label}/batch{batch}"] = case
            print(f"{label:>20} batch {batch}: off {case['off_tok_s']:.1f} tok/s, ngram {case['ngram_tok_s']:.1f} "
                  f"tok/s, ratio {case['ratio_median']:.3f} {case['ratios']}, acceptance {case['acceptance']:.2f}, "
                  f"tokens/forward {case['tokens_per_forward']:.2f}, identical {same} (off vs off: {repeatable})", flush=True)
    return out


def _fields(config: RuntimeConfig) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(config, f.name) for f in attrs.fields(RuntimeConfig)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--model", help="a model directory (default: the built-in --preset)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=256, help="tokens of the quoted span (repetitive) / half the prompt")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=4, help="--num-draft-tokens")
    p.add_argument("--temperature", type=float, nargs="+", default=[2.0, 4.0],
                   help="of the non-repetitive workload (one case per value)")
    result = main(p.parse_args())
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"speculative-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(path)
