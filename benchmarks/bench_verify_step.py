# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What one verifying step costs next to a plain one: wall ms, host syncs and attention shapes, per step kind.

    python benchmarks/bench_verify_step.py [--preset test] [--tokens 128] [--k 4] [--rounds 3]
        [--batch 8] [--draft-self] [--draft-preset PRESET ...] [--no-whole] [--temperature 4]

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
buffer (`ngram_whole`, spec_batch.WHOLE_BUFFER, CUDA's default; `--no-whole`
leaves it out); with `--draft-self` / `--draft-preset P`, a draft model arm
each (`draft=self`, `draft=P`). `--batch B` decodes B rows together (each its
own prompt length). Counted too: `wait_ms`, the time spent inside those sync
calls (a `tolist` of an array made from host values costs nothing; one of an
array still being computed waits for it), and `copied_kb`, the KV bytes the
draft model's batch copied (rows' KV gathered into a batch) plus the target's
per-row rollback shifts. Runs against another checkout too (exact arm only):
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
        self.wait = 0.0  # seconds inside the wrapped sync calls while on
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
        self.copied = 0  # KV bytes copied: the draft batch's gathers, the target's rollback shifts
        self._wrap_copies()

    def _wrap_copies(self) -> None:
        from mlxd.engine import draft, spec_batch

        if hasattr(draft, "COPIED"):  # a tree that counts its own draft-batch copies
            self._draft_counter = draft.COPIED
        elif hasattr(draft, "_batch_caches"):  # before: every row's KV gathered into a new batch per step
            real_batch = draft._batch_caches

            def batch_caches(rows: Any, pads: Any, **kw: Any) -> Any:
                if self.on:
                    for layer in zip(*rows, strict=True):
                        for c in layer:
                            if c.offset > 0:
                                self.copied += c.offset * c.keys.shape[1] * (c.keys.shape[3] + c.values.shape[3]) \
                                    * c.keys.dtype.size
                return real_batch(rows, pads, **kw)

            draft._batch_caches = batch_caches
        real_shift = spec_batch._shift_right

        def shift(cache: Any, shifts: Any, pads: Any = None) -> Any:
            if self.on:
                end = cache._idx
                self.copied += cache.keys[..., :end, :].nbytes + cache.values[..., :end, :].nbytes
            return real_shift(cache, shifts, pads)

        spec_batch._shift_right = shift

    def copied_bytes(self) -> int:
        counter = getattr(self, "_draft_counter", None)
        return self.copied + (counter.bytes if counter is not None else 0)

    def _wrap(self, owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            if not self.on:
                return real(*a, **kw)
            self.counts[name] += 1
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.wait += time.perf_counter() - t0

        setattr(owner, name, wrapped)

    def _wrap_method(self, name: str) -> None:
        real = getattr(mx.array, name)

        def wrapped(arr: Any, *a: Any, **kw: Any) -> Any:
            if not self.on:
                return real(arr, *a, **kw)
            self.counts[name] += 1
            t0 = time.perf_counter()
            try:
                return real(arr, *a, **kw)
            finally:
                self.wait += time.perf_counter() - t0

        try:
            setattr(mx.array, name, wrapped)
        except TypeError:  # a nanobind type may refuse: then those are not counted
            print(f"note: mx.array.{name} cannot be wrapped; not counted", file=sys.stderr)


TEMPERATURE = 0.0  # --temperature: rows sample (seeded) instead of greedy


def request(vocab: int, tokens: int, span: int, lead: int, row: int = 0) -> GenerationRequest:
    """The repetitive prompt after `lead` filler tokens (each round its own lengths, as requests have)."""
    rnd = random.Random(f"repetitive-{1 + row}")
    quoted = [rnd.randrange(3, vocab) for _ in range(span)]
    prompt = [rnd.randrange(3, vocab) for _ in range(lead)] + quoted + [rnd.randrange(3, vocab) for _ in range(8)]
    prompt += quoted + quoted[: span // 8]
    sampling = (SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, seed=100 + row) if TEMPERATURE
                else SamplingParams(max_tokens=tokens))
    return GenerationRequest(request_id=f"r{row}", prompt=tuple(prompt), sampling=sampling)


def requests(vocab: int, tokens: int, span: int, lead: int, batch: int) -> list[GenerationRequest]:
    """`batch` rows, each with its own prompt and length (row i leads with `lead + 3 i` filler tokens)."""
    return [request(vocab, tokens, span, lead + 3 * i, i) for i in range(batch)]


def run(core: EngineCore, reqs: list[GenerationRequest], probe: Probe | None
        ) -> tuple[dict[str, list[int]], list[dict[str, Any]]]:
    """Rows to their end; per engine step: its kind, wall ms, tokens and counts."""
    from mlxd.engine.ops import RowStart, StepOps
    from mlxd.runtime.kernel.messages import GenerationFinished, TokenGenerated

    ops = StepOps(starts=tuple(RowStart(request=r) for r in reqs))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    steps: list[dict[str, Any]] = []
    finished: set[str] = set()
    while len(finished) < len(reqs):
        before = dict(probe.counts) if probe else {}
        wait0, copied0 = (probe.wait, probe.copied_bytes()) if probe else (0.0, 0)
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
        emitted = [e for e in result.emits if isinstance(e.event, TokenGenerated)]
        every_row_had_one = all(tokens.values())
        for e in emitted:
            tokens[e.request_id].append(e.event.token)
        finished |= {e.request_id for e in result.emits if isinstance(e.event, GenerationFinished)}
        verified = (core._drafts.counters.verify_steps if getattr(core, "_drafts", None) is not None else 0) > drafts
        kind = "verify" if verified else ("plain" if every_row_had_one else "prefill")  # after every row's first token
        counts = {k: v - before.get(k, 0) for k, v in (probe.counts.items() if probe else ())}
        if probe:
            counts["wait_ms"] = (probe.wait - wait0) * 1e3
            counts["copied_kb"] = (probe.copied_bytes() - copied0) / 1024
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
        out[kind]["means"] = {k: round(statistics.fmean(s.get(k, 0) for s in mine), 3) for k in keys}
        out[kind]["mean_ms"] = statistics.fmean(s["ms"] for s in mine)
        out[kind]["mean_copied_kb"] = statistics.fmean(s.get("copied_kb", 0) for s in mine)
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
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (each its own prompt length)")
    p.add_argument("--draft-self", action="store_true", help="also an arm with the model as its own draft")
    p.add_argument("--draft-preset", action="append", default=[], metavar="PRESET",
                   help="also an arm with this built-in preset as the draft model")
    p.add_argument("--no-whole", dest="whole", action="store_false",
                   help="leave out the n-gram arm over the whole KV buffer")
    p.add_argument("--no-ngram", dest="ngram", action="store_false", help="leave out the n-gram arms")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="rows sample at this temperature (seeded): at 4 nothing repeats, n-gram lookups find "
                        "nothing (what a lookup costs a step that does not verify)")
    args = p.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    from mlxd.engine import spec_batch

    model = bf16_model(args.bf16_shape) if args.bf16_shape else ensure_model(args.preset)
    base = dict(model=str(model), max_batch=args.batch, prompt_cache_bytes=0, device_probe="off",
                default_max_tokens=args.tokens, max_context=8192)
    off = EngineCore(RuntimeConfig(**base))
    spec = EngineCore(RuntimeConfig(**base, speculative="ngram", num_draft_tokens=args.k))
    info = off.load()
    # Arms: speculation off; ngram with attention over the keys held (exact) and over the whole KV
    # buffer (spec_batch.WHOLE_BUFFER: CUDA's default; a checkout without it has the exact arm only);
    # draft models (the gate forced open too: their cost per step is what is measured).
    arms: dict[str, tuple[EngineCore, bool | None]] = {"off": (off, None)}
    if args.ngram:
        spec.load()
        force_gate_open(spec)
        arms["ngram_exact"] = (spec, False)
        if hasattr(spec_batch, "WHOLE_BUFFER") and args.whole:
            arms["ngram_whole"] = (spec, True)
    default = getattr(spec_batch, "WHOLE_BUFFER", None)
    drafts = ([str(model)] if args.draft_self else []) + [str(ensure_model(d)) for d in args.draft_preset]
    for d in drafts:
        name = "draft=self" if d == str(model) else f"draft={Path(d).name}"
        core = EngineCore(RuntimeConfig(**base, speculative="draft", draft_model=d, num_draft_tokens=args.k))
        core.load()
        force_gate_open(core)
        arms[name] = (core, default)  # the device's own choice (CUDA: the whole buffer)
    warm = requests(info.vocab_size, 24, args.span, 0, args.batch)
    for core, whole in arms.values():  # warm-up: kernels, nothing measured
        if whole is not None and default is not None:
            spec_batch.WHOLE_BUFFER = whole
        run(core, warm, None)
    probe = Probe()
    rounds: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in arms}
    same = dict.fromkeys(arms, True)
    for r in range(args.rounds):
        req = requests(info.vocab_size, args.tokens, args.span, 1 + r, args.batch)
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
    print(f"{args.bf16_shape or args.preset} on {mx.default_device()}, batch {args.batch}, {args.tokens} tokens, k={args.k}, {args.rounds} rounds, "
          f"load {load[0]:.1f}; tokens identical to off: {same}")
    for arm in arms:
        for kind, s in summary[arm].items():
            counts = ", ".join(f"{k} {v:g}" for k, v in s.items() if k not in ("steps", "ms", "mean_ms", "mean_copied_kb", "means"))
            print(f"  {arm:11s} {kind:6s}: {s['steps']:4d} steps, median {s['ms']:.2f} ms/step "
                  f"(mean {s['mean_ms']:.2f}, copied KV mean {s['mean_copied_kb']:.0f} KiB); per step (median): {counts}; "
                  f"means: {', '.join(f'{k} {v:g}' for k, v in s['means'].items() if k in ('eval', 'tolist', 'item', 'wait_ms'))}")
    ratio = None
    if "ngram_whole" in summary and "verify" in summary["ngram_whole"] and "verify" in summary["ngram_exact"]:
        ratio = summary["ngram_whole"]["verify"]["ms"] / summary["ngram_exact"]["verify"]["ms"]
        print(f"verify step ms, whole buffer / exact keys: {ratio:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"verify_step-{args.label or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps({
        "command": " ".join(["python", "benchmarks/bench_verify_step.py", *sys.argv[1:]]),
        "mlxd": str(Path(mlxd.__file__).parent), "device": str(mx.default_device()), "load": load,
        "batch": args.batch,
        "identical": same, "verify_ms_whole_over_exact": ratio, "summary": summary,
    }, indent=2) + "\n"
    out.write_text(text)
    if os.environ.get("OUT"):  # a device run's files come back from there
        (Path(os.environ["OUT"]) / out.name).write_text(text)
    print(out)


if __name__ == "__main__":
    main()
