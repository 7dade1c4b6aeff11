# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Where the host's time goes in a constrained decode step (issue 22), per step, in ms.

Wraps the constrained path's pieces with timers (whichever of them the code under
PYTHONPATH has, so the same script measures an older tree) and decodes `--batch`
rows under the bench's regex (`[a-z ]{0,1000000}`: every mask new), then free.
Reported per step: the logits processors' total, the part spent in `mx.async_eval`
(on the CPU that runs the forward pass; on a GPU it returns at once, so the rest is
what a GPU host pays serially), and the pieces: the token read, matchers fed,
masks filled, the worker hand-off, the mask's device copy and unpack graph built.
Then the mask ops alone (evaluated) for a few vocab sizes, old op vs new op.

    PYTHONPATH=src python benchmarks/prof_structured_host.py [--preset test] [--batch 1 8] [--tokens 128]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import collections
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

import mlx.core as mx

from mlxd import RuntimeConfig, SamplingParams, TokenGenerated, open_runtime
from mlxd.engine import core as engine_core
from mlxd.engine import features, gen_hook
from mlxd.model import ensure_model
from mlxd.structured import matcher as matcher_mod
from mlxd.structured.spec import constraint_from_request

TIMES: dict[str, list[float]] = collections.defaultdict(list)
INSIDE = [0]


def timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that adds its duration to TIMES[label] (if it exists)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label].append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(features.Constrained, "mask", "processor total")
    inner = mx.async_eval

    def async_eval(*a: Any) -> Any:  # timed only inside the constrained processors
        t0 = time.perf_counter()
        try:
            return inner(*a)
        finally:
            if INSIDE[0]:
                TIMES["mx.async_eval (in processor)"].append(time.perf_counter() - t0)

    mx.async_eval = async_eval
    outer = features.Constrained.mask

    def mask(*a: Any, **k: Any) -> Any:
        INSIDE[0] += 1
        try:
            return outer(*a, **k)
        finally:
            INSIDE[0] -= 1

    features.Constrained.mask = mask
    timed(gen_hook, "step_inputs", "token read")  # the old tree's StepInputs.read holds the function itself
    if hasattr(engine_core.EngineCore, "_step_inputs"):
        timed(engine_core.EngineCore, "_step_inputs", "token read (core)")
    timed(features.Constrained, "_consume", "matcher fed")
    timed(matcher_mod.Matcher, "allowed_mask", "mask made (numpy bool)")
    timed(matcher_mod.Matcher, "fill_bitmask", "mask filled (packed)")
    if hasattr(matcher_mod, "BatchMasks"):
        timed(matcher_mod.BatchMasks, "fill", "batch fill")
    if hasattr(features, "StepMasks"):
        timed(features.StepMasks, "_compute", "StepMasks._compute")
        timed(features.StepMasks, "_walk", "walk (on the worker on CPU)")
        timed(features.StepMasks, "_alone", "one row: fed, filled, unpacked")
        timed(features.StepMasks, "_unpacked", "device copy + unpack graph")
    step = engine_core.EngineCore.step if hasattr(engine_core.EngineCore, "step") else None
    if step is not None:
        timed(engine_core.EngineCore, "step", "engine step")


async def decode(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams, batch: int) -> int:
    count = [0]

    async def row() -> None:
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated):
                    count[0] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(batch):
            nursery.start_soon(row)
    return count[0]


def report(title: str, steps: int) -> None:
    print(f"  {title}: {steps} steps")
    for label, v in sorted(TIMES.items()):
        if v:
            print(f"    {label:32s} calls/step {len(v) / steps:5.2f}  ms/step {1000 * sum(v) / steps:7.3f}  "
                  f"median ms/call {1000 * statistics.median(v):7.3f}")


async def main(args: argparse.Namespace) -> None:
    model = ensure_model(args.preset)
    config = RuntimeConfig(model=str(model), max_batch=max(args.batch), device_probe="off")
    instrument()
    async with open_runtime(config) as rt:
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        prompt = await rt.render_chat([{"role": "user", "content": "Write a long list of words."}])
        arms = {"free": None, "regex": constraint_from_request({"regex": "[a-z ]{0,1000000}"})}
        for batch in args.batch:
            for arm, constraint in arms.items():
                s = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, logit_bias=no_eos, constraint=constraint)
                await decode(rt, prompt, s, batch)  # warm
                TIMES.clear()
                t0 = time.perf_counter()
                n = await decode(rt, prompt, s, batch)
                wall = time.perf_counter() - t0
                steps = max(1, n // batch)
                print(f"batch {batch} {arm}: {n / wall:.1f} tok/s, {1000 * wall / steps:.3f} ms/step wall")
                report(arm, steps)
                total, ae = sum(TIMES["processor total"]), sum(TIMES["mx.async_eval (in processor)"])
                if total:
                    print(f"    => processor minus async_eval (serial host work on a GPU): {1000 * (total - ae) / steps:.3f} ms/step")


def mask_ops(vocab: int, rows: int, reps: int = 200) -> None:
    """The mask applied to `rows` rows' logits: the old op (bool array per row) vs the packed unpack."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((1, vocab)).astype(np.float32)).astype(mx.bfloat16)
    words = (vocab + 31) // 32
    bits = rng.integers(-(2**31), 2**31 - 1, size=(rows, words), dtype=np.int64).astype(np.int32)
    shifts = mx.arange(32, dtype=mx.int32)
    neg = mx.array(-mx.inf, dtype=logits.dtype)
    mx.eval(logits, shifts)

    def old() -> None:
        outs = []
        for i in range(rows):
            b = np.unpackbits(bits[i].view(np.uint8), bitorder="little")[:vocab].view(np.bool_)
            outs.append(mx.where(mx.array(b), logits, neg))
        mx.eval(*outs)

    def new() -> None:
        packed = mx.array(bits[:rows])
        allowed = ((packed[:, :, None] >> shifts) & 1).reshape(rows, -1)[:, :vocab].astype(mx.bool_)
        mx.eval(*[mx.where(allowed[i:i + 1], logits, neg) for i in range(rows)])

    for name, fn in (("old: numpy unpack + mx.array(bool) + where", old), ("new: mx.array(packed) + unpack graph + where", new)):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        print(f"  vocab {vocab:6d} rows {rows}: {name:46s} {1000 * (time.perf_counter() - t0) / reps:.3f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="test")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ops-only", action="store_true")
    args = parser.parse_args()
    print(f"code: {Path(features.__file__).resolve().parents[2]}")
    if not args.ops_only:
        trio.run(main, args)
    print("mask ops alone (evaluated):")
    for vocab in (1024, 8192, 151936):
        for rows in sorted(set(args.batch)):
            mask_ops(vocab, rows)
