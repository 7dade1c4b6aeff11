# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What one verifying step costs next to a plain one: wall ms, host syncs and attention shapes, per step kind.

    python benchmarks/bench_verify_step.py [--preset test] [--tokens 128] [--k 4] [--rounds 3]

One row (batch 1), greedy, a repetitive prompt (n-gram drafts at acceptance
~1.0), `--speculative ngram` with the gate forced on (every step verifies when
the row has drafts) next to speculation off. Each engine step is classed by
what the batch did (plain: mlx-lm's own step; verify: drafts checked in one
forward) and counted: wall ms, host syncs (mx.eval, mx.async_eval,
array.item, array.tolist, np.array of an MLX array), and the attention calls'
(query length, key length) shapes. On CUDA a query longer than 1 with a mask
goes to cuDNN, whose execution plan is built once per exact shape: a key
length new at every step is a plan built at every step (tens of ms), which
the CPU does not show; `new attention shapes` counts those.

Arms, side by side, rotating order, each round its own prompt length (so its
own key lengths, as every request has): speculation off; n-gram with attention
over the keys held (`ngram_exact`); n-gram with attention over the whole KV
buffer (`ngram_whole`, spec_batch.WHOLE_BUFFER, CUDA's default). Runs against
another checkout too (exact arm only):
`PYTHONPATH=/work/wt/old/src python benchmarks/bench_verify_step.py`.
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
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd import RuntimeConfig, SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.model import ensure_model
from mlxd.runtime.kernel.messages import GenerationRequest

RESULTS = Path(__file__).resolve().parent / "results"


class Probe:
    """Counts host syncs and attention shapes while on (wraps mx.eval and friends)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.shapes: set[tuple[int, int, bool]] = set()  # this step's attention (q len, k len, array mask?)
        self.on = False
        for name in ("eval", "async_eval"):
            self._wrap(mx, name)
        self._wrap_method("item")
        self._wrap_method("tolist")
        real_np_array = np.array

        def np_array(obj: Any, *a: Any, **kw: Any) -> Any:
            if self.on and isinstance(obj, mx.array):
                self.counts["np.array"] += 1
            return real_np_array(obj, *a, **kw)

        np.array = np_array  # type: ignore[assignment]
        real_sdpa = mx.fast.scaled_dot_product_attention

        def sdpa(q: Any, k: Any, v: Any, *a: Any, **kw: Any) -> Any:
            mask = kw.get("mask")
            key = (q.shape[2], k.shape[2], mask is not None and not isinstance(mask, str))
            if self.on:
                self.counts["attention"] += 1
                self.shapes.add(key)
            return real_sdpa(q, k, v, *a, **kw)

        mx.fast.scaled_dot_product_attention = sdpa

    def _wrap(self, owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            if self.on:
                self.counts[name] += 1
            return real(*a, **kw)

        setattr(owner, name, wrapped)

    def _wrap_method(self, name: str) -> None:
        real = getattr(mx.array, name)

        def wrapped(arr: Any, *a: Any, **kw: Any) -> Any:
            if self.on:
                self.counts[name] += 1
            return real(arr, *a, **kw)

        try:
            setattr(mx.array, name, wrapped)
        except TypeError:  # a nanobind type may refuse: then those are not counted
            print(f"note: mx.array.{name} cannot be wrapped; not counted", file=sys.stderr)


def request(vocab: int, tokens: int, span: int, lead: int) -> GenerationRequest:
    """The repetitive prompt after `lead` filler tokens (each round its own lengths, as requests have)."""
    rnd = random.Random("repetitive-1")
    quoted = [rnd.randrange(3, vocab) for _ in range(span)]
    prompt = [rnd.randrange(3, vocab) for _ in range(lead)] + quoted + [rnd.randrange(3, vocab) for _ in range(8)]
    prompt += quoted + quoted[: span // 8]
    return GenerationRequest(request_id="r", prompt=tuple(prompt), sampling=SamplingParams(max_tokens=tokens))


def run(core: EngineCore, req: GenerationRequest, probe: Probe | None) -> tuple[list[int], list[dict[str, Any]]]:
    """One row to its end; per engine step: its kind, wall ms, tokens and counts."""
    from mlxd.engine.ops import RowStart, StepOps
    from mlxd.runtime.kernel.messages import GenerationFinished, TokenGenerated

    ops, tokens, steps, done = StepOps(starts=(RowStart(request=req),)), [], [], False
    while not done:
        before = dict(probe.counts) if probe else {}
        if probe:
            probe.shapes = set()
        drafts = core._drafts.counters.verify_steps if getattr(core, "_drafts", None) is not None else 0
        if probe:
            probe.on = True
        t0 = time.perf_counter()
        result = core.step(ops)
        ms = (time.perf_counter() - t0) * 1e3
        if probe:
            probe.on = False
        ops = StepOps()
        emitted = [e.event for e in result.emits if isinstance(e.event, TokenGenerated)]
        tokens += [e.token for e in emitted]
        done = any(isinstance(e.event, GenerationFinished) for e in result.emits)
        verified = (core._drafts.counters.verify_steps if getattr(core, "_drafts", None) is not None else 0) > drafts
        decoding = len(tokens) > len(emitted)  # a step after the row's first token
        kind = "verify" if verified else ("plain" if decoding else "prefill")
        counts = {k: v - before.get(k, 0) for k, v in (probe.counts.items() if probe else ())}
        steps.append({"kind": kind, "ms": ms, "tokens": len(emitted), **counts,
                      "shapes": sorted(probe.shapes) if probe else []})
    return tokens, steps


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per step kind: steps, medians of ms and counts per step, and the distinct attention shapes over
    all rounds (CUDA builds an attention plan once per shape with several query positions)."""
    out: dict[str, Any] = {}
    for kind in ("plain", "verify"):
        mine = [s for r in rounds for s in r if s["kind"] == kind]
        if not mine:
            continue
        keys = sorted({k for s in mine for k in s} - {"kind", "shapes"})
        out[kind] = {"steps": len(mine), **{k: statistics.median(s.get(k, 0) for s in mine) for k in keys}}
        out[kind]["distinct_attention_shapes"] = len({tuple(x) for s in mine for x in s["shapes"]})
    return out


def force_gate_open(core: EngineCore) -> None:
    """Every step may verify (the gate's timing decisions are not what is measured here)."""
    gate = core._drafts.gate
    for name in ("min_samples", "min_tries", "probe_every"):  # never judged, never probing plain (older gates too)
        if hasattr(gate, name):
            setattr(gate, name, 10**9)


def bf16_model(shape_name: str) -> Path:
    """The H200 benchmarks' Qwen3-1.7B shape (or `default`'s) in bf16, built once under /tmp/models."""
    import attrs

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    from bench_gpu import QWEN3_1_7B, build

    from mlxd.model import presets

    shape = QWEN3_1_7B if shape_name == "qwen3-1.7b" else attrs.evolve(presets.PRESETS["default"],
                                                                         name="default-bf16-shape")
    model = Path(f"/tmp/models/{shape.name}")
    if not (model / "config.json").exists():
        build(shape, model)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="test")
    p.add_argument("--bf16-shape", choices=("qwen3-1.7b", "default"),
                   help="instead of --preset: a random bf16 model of this shape, built once under /tmp/models "
                        "(CUDA's attention plans are for bf16/fp16 only; the presets are fp32)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with its own prompt length (1 more token)")
    p.add_argument("--label", default="")
    args = p.parse_args()
    from mlxd.engine import spec_batch

    model = bf16_model(args.bf16_shape) if args.bf16_shape else ensure_model(args.preset)
    base = dict(model=str(model), max_batch=1, prompt_cache_bytes=0, device_probe="off",
                default_max_tokens=args.tokens, max_context=8192)
    off = EngineCore(RuntimeConfig(**base))
    spec = EngineCore(RuntimeConfig(**base, speculative="ngram", num_draft_tokens=args.k))
    info = off.load()
    spec.load()
    force_gate_open(spec)
    # Arms: speculation off; ngram with attention over the keys held (exact) and over the whole KV
    # buffer (spec_batch.WHOLE_BUFFER: CUDA's default; a checkout without it has the exact arm only).
    arms: dict[str, tuple[EngineCore, bool | None]] = {"off": (off, None), "ngram_exact": (spec, False)}
    if hasattr(spec_batch, "WHOLE_BUFFER"):
        arms["ngram_whole"] = (spec, True)
    default = getattr(spec_batch, "WHOLE_BUFFER", None)
    warm = request(info.vocab_size, 24, args.span, 0)
    for core, whole in arms.values():  # warm-up: kernels, nothing measured
        if whole is not None and default is not None:
            spec_batch.WHOLE_BUFFER = whole
        run(core, warm, None)
    probe = Probe()
    rounds: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in arms}
    same = dict.fromkeys(arms, True)
    for r in range(args.rounds):
        req = request(info.vocab_size, args.tokens, args.span, 1 + r)
        names = list(arms)
        got = {}
        for arm in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            core, whole = arms[arm]
            if whole is not None and default is not None:
                spec_batch.WHOLE_BUFFER = whole
            got[arm], steps = run(core, req, probe)
            rounds[arm].append(steps)
        for arm in arms:
            same[arm] = same[arm] and got[arm] == got["off"]
    if default is not None:
        spec_batch.WHOLE_BUFFER = default
    summary = {arm: summarize(steps) for arm, steps in rounds.items()}
    load = os.getloadavg()
    print(f"{args.bf16_shape or args.preset} on {mx.default_device()}, batch 1, {args.tokens} tokens, k={args.k}, {args.rounds} rounds, "
          f"load {load[0]:.1f}; tokens identical to off: {same}")
    for arm in arms:
        for kind, s in summary[arm].items():
            counts = ", ".join(f"{k} {v:g}" for k, v in s.items() if k not in ("steps", "ms"))
            print(f"  {arm:11s} {kind:6s}: {s['steps']:4d} steps, median {s['ms']:.2f} ms/step; per step (median): "
                  f"{counts}")
    ratio = None
    if "ngram_whole" in summary and "verify" in summary["ngram_whole"] and "verify" in summary["ngram_exact"]:
        ratio = summary["ngram_whole"]["verify"]["ms"] / summary["ngram_exact"]["verify"]["ms"]
        print(f"verify step ms, whole buffer / exact keys: {ratio:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"verify_step-{args.label or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps({
        "command": " ".join(["python", "benchmarks/bench_verify_step.py", *sys.argv[1:]]),
        "mlxd": str(Path(mlxd.__file__).parent), "device": str(mx.default_device()), "load": load,
        "identical": same, "verify_ms_whole_over_exact": ratio, "summary": summary,
    }, indent=2) + "\n"
    out.write_text(text)
    if os.environ.get("OUT"):  # a device run's files come back from there
        (Path(os.environ["OUT"]) / out.name).write_text(text)
    print(out)


if __name__ == "__main__":
    main()
