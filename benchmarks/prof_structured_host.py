# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Where the host's time goes in a constrained decode step (issue 22), per step, in ms.

Wraps the constrained path's pieces with timers (whichever of them the code under
PYTHONPATH has, so the same script measures an older tree) and decodes `--batch`
rows free, then under the bench's regex and JSON schema (bench_structured.ARMS: every mask new).
Reported per step: the logits processors' total, the part spent in `mx.async_eval`
(on the CPU that runs the forward pass; on a GPU it returns at once, so the rest is
what a GPU host pays serially), and the pieces: the token read, matchers fed,
masks filled, the worker hand-off, the mask's device copy and unpack graph built; in
the ahead modes the worker's job (its wait for the tokens), and how long the engine
thread waits for it at the join. A summary per arm: the worker's feed and fill per
row, the join's wait per step, and the engine thread's own processor work per row.
Per run also the CPU ms a step of the process, the engine thread and the mask worker; `--cpu-clock`
times every piece by its own thread's CPU time instead of the wall clock (a busy host stretches
wall time, CPU time far less). Then the mask ops alone (evaluated) for a few vocab sizes, old op vs new op.

    PYTHONPATH=src python benchmarks/prof_structured_host.py [--preset test] [--batch 1 8] [--tokens 128]
        [--arms regex json_schema] [--mask-modes ahead-bool ahead-early] [--model DIR] [--no-ops] [--cpu-clock]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import collections
import functools
import statistics
import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import ARMS, cpu_now, mask_env, mask_spec, thread_clocks  # noqa: E402  (the bench's arms, settings, clocks)

TIMES: dict[str, list[float]] = collections.defaultdict(list)
INSIDE = [0]
CLOCK = [time.perf_counter]  # --cpu-clock: time.thread_time (the calling thread's CPU; a busy host moves it less)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name with a wrapper that adds its duration to TIMES[label] (if it exists)."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        clock = CLOCK[0]
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            TIMES[label].append(clock() - t0)

    static = isinstance(getattr(owner, "__dict__", {}).get(name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def instrument() -> None:
    timed(features.Constrained, "mask", "processor total")
    inner = mx.async_eval

    def async_eval(*a: Any) -> Any:  # timed only inside the constrained processors
        t0 = CLOCK[0]()
        try:
            return inner(*a)
        finally:
            if INSIDE[0]:
                TIMES["mx.async_eval (in processor)"].append(CLOCK[0]() - t0)

    mx.async_eval = async_eval
    outer = features.Constrained.mask

    def mask(*a: Any, **k: Any) -> Any:
        INSIDE[0] += 1
        later = getattr(a[0].masks, "_step", None) is not None  # the step's masks made by an earlier row
        t0 = CLOCK[0]()
        try:
            return outer(*a, **k)
        finally:
            INSIDE[0] -= 1
            if later:
                TIMES["processor (rows after the first)"].append(CLOCK[0]() - t0)

    features.Constrained.mask = mask
    timed(gen_hook, "step_inputs", "token read")  # the old tree's StepInputs.read holds the function itself
    if hasattr(engine_core.EngineCore, "_step_inputs"):
        timed(engine_core.EngineCore, "_step_inputs", "token read (core)")
    timed(features.Constrained, "_consume", "matcher fed")
    timed(features.Constrained, "take", "take (one row's feed)")
    timed(matcher_mod.Matcher, "allowed_mask", "mask made (numpy bool)")
    timed(matcher_mod.Matcher, "fill_bitmask", "mask filled (packed)")
    if hasattr(matcher_mod, "BatchMasks"):
        timed(matcher_mod.BatchMasks, "fill", "batch fill")
    if hasattr(features, "StepMasks"):
        timed(features.StepMasks, "_compute", "StepMasks._compute")
        timed(features.StepMasks, "_walk", "walk (on the worker on CPU)")
        timed(features.StepMasks, "_alone", "one row: fed, filled, unpacked")
        timed(features.StepMasks, "_unpacked", "device copy + unpack graph")
        # mode "ahead"/"ahead-bool": the worker's job, its wait for the tokens, and the engine thread's join
        timed(features.StepMasks, "_ahead_work", "worker: job total")
        timed(features.StepMasks, "_read_ahead", "worker: waits for the tokens")
        timed(features.StepMasks, "_walk_unpacked", "walk + numpy unpack")
        timed(features.StepMasks, "_joined", "engine: join + mask copy")
        timed(features.StepMasks, "_wait", "engine: waits for the worker")
        timed(features.StepMasks, "start", "engine: masks.start")
        timed(features.StepMasks, "prepare", "engine: masks.prepare (starts the worker)")
        timed(features.StepMasks, "_device_masks", "engine: kept masks or copies")
        timed(features.StepMasks, "_walk_keyed", "walk + keys (+ unpack of new bits)")
    step = engine_core.EngineCore.step if hasattr(engine_core.EngineCore, "step") else None
    if step is not None:
        timed(engine_core.EngineCore, "step", "engine step")
    if hasattr(engine_core.EngineCore, "_next"):
        timed(engine_core.EngineCore, "_next", "engine: _next (generator step + events)")


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
    model = Path(args.model) if args.model else ensure_model(args.preset)
    config = RuntimeConfig(model=str(model), max_batch=max(args.batch), device_probe="off")
    instrument()
    async with open_runtime(config) as rt:
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        prompt = await rt.render_chat([{"role": "user", "content": "Write a long list of words."}])
        arms: dict[str, tuple[Any, str | None]] = {"free": (None, None)}
        for name in args.arms:
            for mode in args.mask_modes or [None]:
                arms[name if mode is None else f"{name}@{mode}"] = (constraint_from_request(ARMS[name]), mode)
        for batch in args.batch:
            for arm, (constraint, mode) in arms.items():
                s = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, logit_bias=no_eos, constraint=constraint)
                with mask_env(mode):
                    await decode(rt, prompt, s, batch)  # warm
                    TIMES.clear()
                    clocks = thread_clocks()
                    t0, c0 = time.perf_counter(), cpu_now(clocks)
                    n = await decode(rt, prompt, s, batch)
                    wall, c1 = time.perf_counter() - t0, cpu_now(clocks)
                steps = max(1, n // batch)
                cpu = {name: 1000 * (c1[name] - c0.get(name, 0.0)) / steps for name in c1}
                print(f"batch {batch} {arm}: {n / wall:.1f} tok/s, {1000 * wall / steps:.3f} ms/step wall, "
                      f"{cpu['process']:.3f} ms/step CPU (every thread), engine thread {cpu.get('engine', 0):.3f}, "
                      f"mask worker {cpu.get('masks', 0):.3f}", flush=True)
                report(arm, steps)
                total, ae = sum(TIMES["processor total"]), sum(TIMES["mx.async_eval (in processor)"])
                if total:
                    print(f"    => processor minus async_eval (serial host work on a GPU): {1000 * (total - ae) / steps:.3f} ms/step")
                    summary(steps, batch)


def per_step(label: str, steps: int) -> float:
    return 1000 * sum(TIMES.get(label, ())) / steps


def summary(steps: int, batch: int) -> None:
    """The figures issue 22's batch-8 JSON question asks for, per step (ms) and per constrained row."""
    rows = max(1, batch)
    fed, fill, job = per_step("take (one row's feed)", steps), per_step("batch fill", steps), per_step("worker: job total", steps)
    tokens = per_step("worker: waits for the tokens", steps)
    wait, joined = per_step("engine: waits for the worker", steps), per_step("engine: join + mask copy", steps)
    later = TIMES.get("processor (rows after the first)", [])
    extra = 1000 * statistics.median(later) if later else 0.0
    print(f"    => worker: feed {fed / rows:.4f} + fill {fill / rows:.4f} ms a row; job {job:.3f} ms a step "
          f"({tokens:.3f} of it waiting for the tokens)")
    print(f"    => engine thread: waits {wait:.3f} ms a step for the worker (join + copy {joined:.3f}); "
          f"a later row's processor {extra:.4f} ms (median)")


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
    parser.add_argument("--model", help="a model directory instead of a preset (e.g. the GPU driver's)")
    parser.add_argument("--mask-modes", nargs="+", type=mask_spec, metavar="MODE[:THREADS][/MS][~KEPT][+LAUNCH]",
                        help="each constrained arm once per MLXD_MASK_MODE (MLXD_MASK_THREADS, GIL switch ms, "
                             "MLXD_MASK_CACHE, MLXD_MASK_LAUNCH)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time each piece by its thread's CPU time (time.thread_time), not the wall clock")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--arms", nargs="+", choices=["regex", "json_schema"], default=["regex", "json_schema"])
    parser.add_argument("--ops-only", action="store_true")
    parser.add_argument("--no-ops", action="store_true", help="skip the mask ops alone")
    args = parser.parse_args()
    print(f"code: {Path(features.__file__).resolve().parents[2]}")
    if args.cpu_clock:
        CLOCK[0] = time.thread_time
    if not args.ops_only:
        trio.run(main, args)
    if args.no_ops:
        sys.exit(0)
    print("mask ops alone (evaluated):")
    for vocab in (1024, 8192, 151936):
        for rows in sorted(set(args.batch)):
            mask_ops(vocab, rows)
