# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Speculation on image rows: decode tok/s of image rows (and image + text batches) ÷ speculation off.

Engine cores over one vision model (default: the `bench-vlm` preset), one with
speculation off, one with `--speculative ngram` and one with the model's own
language model as `--draft-model` (it reads an image's span as placeholder
tokens), decode the same rows in rotating order, round after round, in one
process. A row's prompt is edit-style: a quoted span of text, an image, a few
tokens, the span again and the start of a third copy (greedy). A random-weight
model does not copy it the way a trained one would, so the acceptance is
whatever its own output gives, reported next to the speed. Cases: image rows
only, and a batch half image rows, half text rows of the same layout. Decode
tok/s counts the tokens after every row's first one (the media prefill and the
prompt excluded). Outputs are checked token for token against off.

    python benchmarks/bench_vision_speculative.py [--preset bench-vlm] [--rounds 3] [--tokens 64] [--batch 1 4]

Results go to benchmarks/results/vision-speculative-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import base64
import io
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import GenerationRequest
from mlxd.vision.images import ImageLimits
from mlxd.vision.prepare import MediaPreparer

RESULTS = Path(__file__).resolve().parent / "results"


def png_url(seed: int, size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def workload(preparer: MediaPreparer, case: str, batch: int, tokens: int, span: int,
             size: tuple[int, int]) -> list[GenerationRequest]:
    rnd = random.Random(f"{case}-{batch}")
    out = []
    for i in range(batch):
        quoted = [rnd.randrange(3, 250) for _ in range(span)]
        text = [rnd.randrange(3, 250) for _ in range(8)]
        image = case == "images" or i % 2 == 0
        ids = [*quoted, *([preparer.placeholder] if image else []), *text, *quoted, *quoted[: span // 8]]
        media: tuple[Any, ...] = ()
        prompt: tuple[int, ...] = tuple(ids)
        if image:
            prompt, media = preparer.widen(ids, preparer.prepare([(png_url(100 + i, size), "auto", "bench")]))
        out.append(GenerationRequest(request_id=f"{case}-{i}", prompt=prompt, media=media,
                                     sampling=SamplingParams(max_tokens=tokens)))
    return out


def decode(core: EngineCore, requests: list[GenerationRequest]) -> tuple[float, dict[str, list[int]]]:
    """Decode tok/s of the rows together, from the step where each has a token to the last step."""
    run = run_rows(core, requests)
    return run.decode_tok_s(), run.tokens


def main(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    model = Path(args.model) if args.model else ensure_model(args.preset)
    preparer = MediaPreparer.for_model(model, limits=ImageLimits(), ssd_dir=None)
    assert preparer is not None, "a vision model is needed"
    common = {"model": str(model), "max_batch": max(args.batch), "prompt_cache_bytes": 0, "device_probe": "off",
              "default_max_tokens": args.tokens, "max_context": 8192}
    cores = {
        "off": EngineCore(RuntimeConfig(**common)),  # type: ignore[arg-type]
        "ngram": EngineCore(RuntimeConfig(**common, speculative="ngram", num_draft_tokens=args.k)),  # type: ignore[arg-type]
        "draft=self": EngineCore(RuntimeConfig(**common, speculative="draft", draft_model=str(model),  # type: ignore[arg-type]
                                               num_draft_tokens=args.k)),
    }
    for core in cores.values():
        core.load()
    out: dict[str, Any] = {"model": args.model or args.preset, "device": str(mx.default_device()),
                           "tokens": args.tokens, "rounds": args.rounds, "k": args.k, "host": platform.node(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cases": {}}
    for case in ("images", "images+text"):
        for batch in args.batch:
            if case == "images+text" and batch < 2:
                continue
            requests = workload(preparer, case, batch, args.tokens, args.span, (args.width, args.height))
            for core in cores.values():
                decode(core, requests[:1])  # warm every arm (its kernels, the image's encoder output)
            arms = list(cores)
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
            same = dict.fromkeys(arms[1:], True)
            before = {arm: cores[arm].stats().speculation for arm in arms[1:]}
            for r in range(args.rounds):
                order = arms[r % len(arms):] + arms[: r % len(arms)]
                got = {arm: decode(cores[arm], requests) for arm in order}
                for arm in arms:
                    rates[arm].append(got[arm][0])
                for arm in arms[1:]:
                    same[arm] = same[arm] and got[arm][1] == got["off"][1]
                    ratios[arm].append(got[arm][0] / got["off"][0])
            result: dict[str, Any] = {"batch": batch, "off_tok_s": statistics.median(rates["off"]), "arms": {}}
            for arm in arms[1:]:
                b, a = before[arm], cores[arm].stats().speculation
                assert b is not None and a is not None
                proposed, accepted = a.proposed - b.proposed, a.accepted - b.accepted
                rows = a.verified_rows - b.verified_rows
                c = result["arms"][arm] = {
                    "tok_s": statistics.median(rates[arm]), "ratio_median": statistics.median(ratios[arm]),
                    "ratios": [round(x, 3) for x in ratios[arm]],
                    "acceptance": accepted / proposed if proposed else 0.0,
                    "tokens_per_forward": (rows + accepted) / rows if rows else 0.0,
                    "proposed": proposed, "accepted": accepted, "identical": same[arm],
                }
                print(f"{case:>12} batch {batch} {arm:>10}: off {result['off_tok_s']:.1f} tok/s, {c['tok_s']:.1f} "
                      f"tok/s, ratio {c['ratio_median']:.3f} {c['ratios']}, acceptance {c['acceptance']:.2f}, "
                      f"tokens/forward {c['tokens_per_forward']:.2f}, identical {c['identical']}", flush=True)
            out["cases"][f"{case}/batch{batch}"] = result
    for core in cores.values():
        core.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench-vlm")
    p.add_argument("--model", help="a vision model directory (default: the built-in --preset)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--span", type=int, default=96, help="tokens of the quoted span")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--k", type=int, default=4, help="--num-draft-tokens")
    p.add_argument("--width", type=int, default=112)
    p.add_argument("--height", type=int, default=112)
    parsed = p.parse_args()
    result = main(parsed)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"vision-speculative-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(path)
