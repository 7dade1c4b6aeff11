# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""What does structured output cost decode, and what does a cached grammar save?

1. Decode: one runtime decodes `--batch` rows at once, `--tokens` each (end
   tokens banned, so every row runs to its limit), free or under a constraint
   that stays open the whole way (a regex, and a JSON schema of a long array),
   so every step computes a mask. Arms alternate for `--rounds` rounds in one
   process; reported: median decode tokens/s per arm and the median of its
   per-round ratios to "free" (the goal: >= 0.97), per batch size, and the
   process's CPU time per token (every thread) with its ratio to "free": on a
   host whose cores are busy, the extra work a constrained step costs.
2. Time to first token with a grammar compiled for this request (a schema no
   earlier request used) against one from the grammar cache (the same schema
   again), per schema in `TTFT_SCHEMAS` (a one-property object, a 30-property
   tool's parameters, a nested schema); the prompt is a RAM hit in both. Timed
   from the request's fields, so the HTTP side's check is in it (`check_ms`).
   The forced-call check of the 30-property tool (`tool_call_constraint`) is
   timed alone: the preset's tokenizer may lack `<tool_call>`.

    python benchmarks/bench_structured.py [--preset default] [--rounds 5] [--tokens 128] [--batch 1 8] [--ttft-only]
        [--mask-modes engine ahead ahead-bool ahead-early ahead-early:2 ahead-bool/0.5]

`--mask-modes` runs each constrained arm once per `MLXD_MASK_MODE` (where a GPU step's masks
are made, engine/features.py; the runtime reads it every step), as arms `regex@ahead`, ...;
`MODE:THREADS` also sets `MLXD_MASK_THREADS` (llguidance's fill pool) for that arm and
`MODE/MS` the GIL's switch interval (`sys.setswitchinterval`, with a `free/MS` arm beside it),
alternating with the others in every round. `MLXD_MASK_DEVICE=gpu` in the environment times
the GPU path on a CPU host.

Results go to benchmarks/results/structured-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from mlxd import RuntimeConfig, SamplingParams, TokenGenerated, open_runtime
from mlxd.engine.features import MASK_MODES
from mlxd.model import ensure_model
from mlxd.structured.spec import constraint_from_request, tool_call_constraint

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ARMS: dict[str, dict[str, Any] | None] = {
    "free": None,
    "regex": {"regex": "[a-z ]{0,1000000}"},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "long", "schema": {
        "type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 100000}}}},
}


CPU_MS: list[float] = []  # the last decode_rate's CPU time of this process per token (every thread), in ms


async def decode_rate(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams, batch: int) -> float:
    """Tokens/s of `batch` rows decoding together, from the first token of the batch to the last.

    Also notes the process's CPU time per token over the same span in CPU_MS: on a host
    whose cores are all busy that is what a step's extra work costs, whatever it overlaps.
    """
    stamps: list[float] = []
    cpu: list[float] = []

    async def row() -> None:
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated):
                    stamps.append(time.perf_counter())
                    cpu.append(time.process_time())

    async with trio.open_nursery() as nursery:
        for _ in range(batch):
            nursery.start_soon(row)
    stamps.sort()
    cpu.sort()
    CPU_MS[:] = [1000 * (cpu[-1] - cpu[batch - 1]) / (len(cpu) - batch)]
    return (len(stamps) - batch) / (stamps[-1] - stamps[batch - 1])


async def ttft(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams) -> float:
    t0 = time.perf_counter()
    async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def _nested(tag: str) -> dict[str, Any]:
    """An order with customers, line items and shipping: objects in arrays in objects, enums, bounds."""
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "options": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "name": {"enum": ["size", "colour", "material", tag]}, "value": {"type": "string", "maxLength": 20}},
            "required": ["name", "value"], "additionalProperties": False}}},
        "required": ["sku", "qty"], "additionalProperties": False}
    address = {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 40},
        "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}}, "required": ["city", "country"],
        "additionalProperties": False}
    return {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                      "email": {"type": "string", "format": "email"},
                                                      "address": address},
                     "required": ["name", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": item},
        "shipping": {"anyOf": [{"type": "object", "properties": {"method": {"const": "pickup"}},
                                "required": ["method"], "additionalProperties": False},
                               {"type": "object", "properties": {"method": {"enum": ["standard", "express"]},
                                                                 "to": address},
                                "required": ["method", "to"], "additionalProperties": False}]}},
        "required": ["customer", "items", "shipping"], "additionalProperties": False}


def _one_property(tag: str) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{tag}": {"enum": ["x", "y"]}},
            "required": [f"field_{tag}"], "additionalProperties": False}


def _tool_30(tag: str) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from bench_grammar_compile import tool_with_30_properties

    return tool_with_30_properties(tag)


# Each schema from a tag that makes every round's schema new (a cold grammar), as response_format.
TTFT_SCHEMAS: dict[str, Any] = {
    "one_property": _one_property,
    "tool_30_props": lambda tag: _tool_30(tag)["function"]["parameters"],
    "nested": _nested,
}


async def ttft_cases(rt: Any, prompt: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """Per schema: TTFT from the request's fields with a new grammar, then the same again (cached)."""
    out: dict[str, Any] = {}
    for name, make in TTFT_SCHEMAS.items():
        check, cold, cached = [], [], []
        for r in range(rounds):
            body = {"response_format": {"type": "json_schema", "json_schema": {
                "name": f"s{r}", "schema": make(f"{r}x{time.perf_counter_ns() % 10**9}")}}}
            for times in (cold, cached):
                t0 = time.perf_counter()
                s = SamplingParams(max_tokens=1, constraint=constraint_from_request(body))
                if times is cold:
                    check.append(time.perf_counter() - t0)
                await ttft(rt, prompt, s)
                times.append(time.perf_counter() - t0)
        out[name] = {"cold_grammar_ms": round(1000 * statistics.median(cold), 2),
                     "cached_grammar_ms": round(1000 * statistics.median(cached), 2),
                     "check_ms": round(1000 * statistics.median(check), 2),
                     "cold": [round(1000 * x, 2) for x in cold], "cached": [round(1000 * x, 2) for x in cached]}
        print(f"ttft {name}: cold grammar {out[name]['cold_grammar_ms']} ms (check {out[name]['check_ms']} ms), "
              f"cached {out[name]['cached_grammar_ms']} ms", flush=True)
    forced = []
    for r in range(rounds):  # the forced call's check alone (no model needed)
        tool = _tool_30(f"f{r}x{time.perf_counter_ns() % 10**9}")
        t0 = time.perf_counter()
        tool_call_constraint([tool], "required")
        forced.append(time.perf_counter() - t0)
    out["tool_30_props_forced_call_check_ms"] = round(1000 * statistics.median(forced), 2)
    print(f"forced-call check, 30-property tool: {out['tool_30_props_forced_call_check_ms']} ms", flush=True)
    return out


def mask_spec(spec: str) -> str:
    """A `--mask-modes` entry: MODE[:THREADS][/MS] (MLXD_MASK_MODE, MLXD_MASK_THREADS, the GIL's switch interval)."""
    head, _, ms = spec.partition("/")
    mode, _, threads = head.partition(":")
    ok = mode in MASK_MODES and (not threads or (threads.isdigit() and int(threads) >= 1))
    try:
        ok = ok and (not ms or float(ms) > 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{spec!r}: MODE[:THREADS][/MS], MODE one of {', '.join(MASK_MODES)}")
    return spec


def switch_ms(spec: str | None) -> str | None:
    """The /MS part of an arm's spec (`free/0.5` for a free arm at that switch interval), or None."""
    return spec.partition("/")[2] or None if spec else None


@contextlib.contextmanager
def mask_env(spec: str | None) -> Iterator[None]:
    """An arm's settings for its run: MLXD_MASK_MODE and MLXD_MASK_THREADS (the runtime reads them every
    step) and, with /MS, `sys.setswitchinterval` (how soon a thread waiting for the GIL, the mask worker
    or trio's, forces the engine thread to let it go; Python's default is 5 ms)."""
    if spec is None:
        yield
        return
    head, _, ms = spec.partition("/")
    mode, _, threads = head.partition(":")
    if mode != "free":
        os.environ["MLXD_MASK_MODE"] = mode
    if threads:
        os.environ["MLXD_MASK_THREADS"] = threads
    interval = sys.getswitchinterval()
    if ms:
        sys.setswitchinterval(float(ms) / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        os.environ.pop("MLXD_MASK_MODE", None)
        os.environ.pop("MLXD_MASK_THREADS", None)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else ensure_model(args.preset)
    config = RuntimeConfig(model=str(model), max_batch=max(args.batch), device_probe="off")
    import mlx.core as mx

    out: dict[str, Any] = {"preset": args.model or args.preset, "device": str(mx.default_device()), "tokens": args.tokens, "rounds": args.rounds,
                           "host": platform.node(), "decode": {}, "ttft": {}}
    async with open_runtime(config) as rt:
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        prompt = await rt.render_chat([{"role": "user", "content": "Write a long list of words."}])
        base = SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, logit_bias=no_eos)
        arms: dict[str, tuple[dict[str, Any] | None, str | None]] = {}  # arm -> (request body, mask mode)
        for arm, body in ARMS.items():
            for mode in [None] if body is None or not args.mask_modes else args.mask_modes:
                arms[arm if mode is None else f"{arm}@{mode}"] = (body, mode)
            if body is None:  # free decode at each switch interval the constrained arms use
                for ms in sorted({switch_ms(m) for m in args.mask_modes or []} - {None}):
                    arms[f"free/{ms}"] = (None, f"free/{ms}")
        samplings = {arm: SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=1, logit_bias=no_eos,
                                         constraint=constraint_from_request(body) if body else None)
                     for arm, (body, _) in arms.items()}
        out["mask_device"] = os.environ.get("MLXD_MASK_DEVICE", "default")

        async def rate(arm: str, batch: int) -> float:
            with mask_env(arms[arm][1]):
                return await decode_rate(rt, prompt, samplings[arm], batch)

        await decode_rate(rt, prompt, base, 1)  # warm: the prompt's checkpoint, MLX kernels, grammars
        for arm in arms:
            await rate(arm, 1)
        for batch in [] if args.ttft_only else args.batch:
            await decode_rate(rt, prompt, base, batch)  # warm this batch size's kernels before the first round
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            cpu: dict[str, list[float]] = {arm: [] for arm in arms}
            for r in range(args.rounds):
                order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
                for arm in order:
                    rates[arm].append(await rate(arm, batch))
                    cpu[arm].append(CPU_MS[0])
            # The ratio is the median of per-round ratios: each round's arms ran back to back.
            out["decode"][str(batch)] = {
                arm: {"tok_s": round(statistics.median(v), 1),
                      "ratio": round(statistics.median(x / f for x, f in zip(v, rates["free"], strict=True)), 3),
                      "rounds": [round(x, 1) for x in v],
                      "cpu_ms_per_token": round(statistics.median(cpu[arm]), 3),
                      "cpu_ratio": round(statistics.median(c / f for c, f in zip(cpu[arm], cpu["free"], strict=True)), 3)}
                for arm, v in rates.items()
            }
            for arm, d in out["decode"][str(batch)].items():  # /MS arms: also against free decode at that interval
                ms = switch_ms(arms[arm][1])
                if ms is not None and not arm.startswith("free"):
                    same = rates[f"free/{ms}"]
                    d["ratio_same_switch"] = round(statistics.median(x / f for x, f in zip(rates[arm], same, strict=True)), 3)
            print(f"batch {batch}: " + ", ".join(f"{a} {d['tok_s']} tok/s ({d['ratio']}x; CPU {d['cpu_ms_per_token']} "
                                                 f"ms/token, {d['cpu_ratio']}x)"
                                                 for a, d in out["decode"][str(batch)].items()), flush=True)
        if not args.decode_only:
            out["ttft"] = await ttft_cases(rt, prompt, args.rounds)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--model", help="a model directory instead of a preset (e.g. the GPU driver's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ttft-only", action="store_true", help="skip the decode part")
    parser.add_argument("--decode-only", action="store_true", help="skip the TTFT part")
    parser.add_argument("--mask-modes", nargs="+", type=mask_spec, metavar="MODE[:THREADS]",
                        help="each constrained arm once per MLXD_MASK_MODE (and MLXD_MASK_THREADS)")
    args = parser.parse_args()
    result = trio.run(main, args)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(path)
