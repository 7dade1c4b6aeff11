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
        [--mask-modes engine ahead ahead-bool ahead-early ahead-early:2 ahead-bool/0.5 ahead-early~0
         ahead-early+ready] [--pairs] [--stop-after S]

`--mask-modes` runs each constrained arm once per `MLXD_MASK_MODE` (where a GPU step's masks
are made, engine/features.py; the runtime reads it every step), as arms `regex@ahead`, ...;
`MODE:THREADS` also sets `MLXD_MASK_THREADS` (llguidance's fill pool) for that arm and
`MODE/MS` the GIL's switch interval (`sys.setswitchinterval`, with a `free/MS` arm beside it),
`MODE~KEPT` sets `MLXD_MASK_CACHE` (`~0`: every mask copied every step, the path before kept masks),
`MODE+ready` sets `MLXD_MASK_LAUNCH=ready` (one launch a step when the ahead masks are made in time),
alternating with the others in every round. `--pairs` decodes each arm right beside a free decode
instead, `--rounds` pairs per arm, with a `free2` control (free beside free: the host's noise floor),
and reports per-pair ratios (median, IQR) of tok/s and of CPU ms per token: the process's, the
engine thread's (on a host-bound GPU, the step's critical path) and the mask worker's. `MLXD_MASK_DEVICE=gpu` in the environment times
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from mlxd import RuntimeConfig, SamplingParams, TokenGenerated, open_runtime
from mlxd.engine.features import MASK_LAUNCHES, MASK_MODES
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


def thread_clocks() -> dict[str, int]:
    """CPU clocks of the engine thread and the mask worker (found by name), where they run now."""
    clocks: dict[str, int] = {}
    for t in threading.enumerate():
        name = "engine" if t.name == "mlxd-engine" else "masks" if t.name.startswith("mlxd-masks") else None
        if name is not None and t.ident is not None:
            with contextlib.suppress(OSError, AttributeError):
                clocks[name] = time.pthread_getcpuclockid(t.ident)
    return clocks


NOTES = {"steps": 0.0, "ready": 0.0, "wait_s": 0.0, "read": 0.0}  # constrained steps (`note_masks`)


def note_masks() -> None:
    """Count each constrained step's first mask (`StepMasks._compute`), those whose ahead masks were made by
    then, those the engine thread made itself (it read the step's tokens: mode "engine", a stolen or
    dropped ahead job), and the engine thread's wait for the worker at the join (`StepMasks._wait`)."""
    from mlxd.engine import features, gen_hook

    compute, wait, read = features.StepMasks._compute, features.StepMasks._wait, gen_hook.step_inputs

    def step_inputs(generator: Any) -> Any:
        NOTES["read"] += 1
        return read(generator)

    gen_hook.step_inputs = step_inputs

    def _compute(self: Any, logits: Any) -> Any:
        NOTES["steps"] += 1
        NOTES["ready"] += self._ahead is not None and self._ahead.future.done()
        return compute(self, logits)

    def _wait(job: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return wait(job)
        finally:
            NOTES["wait_s"] += time.perf_counter() - t0

    features.StepMasks._compute = _compute  # type: ignore[method-assign]
    features.StepMasks._wait = staticmethod(_wait)  # type: ignore[method-assign]


def cpu_now(clocks: dict[str, int]) -> dict[str, float]:
    """The process's CPU time (every thread) and each clock's thread's, in s; and the constrained steps' NOTES."""
    now = {"process": time.process_time(), **{f"note_{k}": v for k, v in NOTES.items()}}
    for name, clock in clocks.items():
        with contextlib.suppress(OSError):
            now[name] = time.clock_gettime(clock)
    return now


async def decode_once(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams, batch: int) -> dict[str, float]:
    """`batch` rows decoding together, from the batch's first token to its last: tokens/s, and CPU ms per
    token over the same span: the process's (every thread), the engine thread's and the mask worker's.

    On a host whose cores are busy (other tenants) CPU time per token moves far less than wall time:
    it is what a step's extra work costs, whatever it overlaps.
    """
    stamps: list[float] = []
    last = batch * sampling.max_tokens  # every row runs to its limit (end tokens banned)
    clocks = thread_clocks()
    spans: dict[str, dict[str, float]] = {}

    async def row() -> None:
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated):
                    stamps.append(time.perf_counter())
                    if len(stamps) in (batch, last):
                        spans["start" if len(stamps) == batch else "end"] = cpu_now(clocks)

    async with trio.open_nursery() as nursery:
        for _ in range(batch):
            nursery.start_soon(row)
    stamps.sort()
    tokens = len(stamps) - batch
    start, end = spans["start"], spans.get("end") or cpu_now(clocks)
    out = {"tok_s": tokens / (stamps[-1] - stamps[batch - 1])}
    for name in ("process", "engine", "masks"):
        out[f"{name}_cpu_ms"] = 1000 * (end.get(name, 0.0) - start.get(name, 0.0)) / tokens
    steps = end["note_steps"] - start["note_steps"]  # constrained steps (0 in a free decode)
    out["join_wait_ms"] = 1000 * (end["note_wait_s"] - start["note_wait_s"]) / steps if steps else 0.0
    out["ready_at_mask"] = (end["note_ready"] - start["note_ready"]) / steps if steps else 0.0
    out["made_by_engine"] = (end["note_read"] - start["note_read"]) / steps if steps else 0.0
    return out


async def decode_rate(rt: Any, prompt: tuple[int, ...], sampling: SamplingParams, batch: int) -> float:
    """Tokens/s of `batch` rows decoding together (`decode_once`); the process's CPU ms a token in CPU_MS."""
    once = await decode_once(rt, prompt, sampling, batch)
    CPU_MS[:] = [once["process_cpu_ms"]]
    return once["tok_s"]


def spread(values: list[float]) -> dict[str, float]:
    """Median and quartiles (the IQR's ends) of per-pair ratios."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 3), "q1": round(q[0], 3), "q3": round(q[2], 3),
            "min": round(min(values), 3), "max": round(max(values), 3)}


async def paired(run: Any, arms: list[str], rounds: int, deadline: float) -> dict[str, Any]:
    """Each arm decoded right beside a free decode, many times: per pair, arm ÷ free.

    A round pairs every arm (the control `free2` included) with a free decode, each pair ~1-2 s,
    which of the two goes first alternating pair by pair for each arm, the arms' order rotating round by round.
    A host's slow spell then hits a pair's two decodes alike more often than two far-apart decodes,
    and `free2 ÷ free` shows what is left of the noise. Rounds stop at `deadline` (perf_counter).
    """
    pairs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            if time.perf_counter() > deadline:
                break
            # Each arm's own pairs alternate (a count over all pairs kept an arm's order fixed round after
            # round: free2 ran second in every pair of the H200's 18:20 run), so whatever a decode leaves
            # the next (a fill pool still spinning) falls on the arm and on free alike.
            if len(pairs[arm]) % 2 == 0:
                free, x = await run("free"), await run(arm)
            else:
                x, free = await run(arm), await run("free")
            pairs[arm].append((x, free))
    out: dict[str, Any] = {}
    for arm, got in pairs.items():
        if not got:
            continue
        d: dict[str, Any] = {"pairs": len(got), "tok_s": round(statistics.median(x["tok_s"] for x, _ in got), 1),
                             "free_tok_s": round(statistics.median(f["tok_s"] for _, f in got), 1),
                             "ratio": spread([x["tok_s"] / f["tok_s"] for x, f in got])}
        for name in ("process", "engine", "masks"):
            key = f"{name}_cpu_ms"
            d[key] = round(statistics.median(x[key] for x, _ in got), 3)
            d[f"free_{key}"] = round(statistics.median(f[key] for _, f in got), 3)
            if name != "masks":  # free decode uses no mask worker
                d[f"{name}_cpu_ratio"] = spread([x[key] / f[key] for x, f in got if f[key] > 0] or [0.0])
        d["join_wait_ms"] = round(statistics.median(x["join_wait_ms"] for x, _ in got), 4)  # a step, at the join
        d["ready_at_mask"] = round(statistics.median(x["ready_at_mask"] for x, _ in got), 3)  # masks made by then
        d["made_by_engine"] = round(statistics.median(x["made_by_engine"] for x, _ in got), 3)  # steps, its own way
        d["rounds"] = [[round(x["tok_s"], 1), round(f["tok_s"], 1)] for x, f in got]
        out[arm] = d
    return out


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


def parse_spec(spec: str) -> tuple[str, str, str, str, str]:
    """MODE[:THREADS][/MS][~KEPT][+LAUNCH] -> (MODE, THREADS, MS, KEPT, LAUNCH), the absent parts ''."""
    spec, _, launch = spec.partition("+")
    rest, _, kept = spec.partition("~")
    head, _, ms = rest.partition("/")
    mode, _, threads = head.partition(":")
    return mode, threads, ms, kept, launch


def mask_spec(spec: str) -> str:
    """A `--mask-modes` entry: MODE[:THREADS][/MS][~KEPT][+LAUNCH] (MLXD_MASK_MODE, MLXD_MASK_THREADS, the GIL's
    switch interval, MLXD_MASK_CACHE: ~0 copies every mask every step, as before kept device masks;
    MLXD_MASK_LAUNCH: +ready launches the forward pass at the mask only when the masks are not made yet)."""
    mode, threads, ms, kept, launch = parse_spec(spec)
    ok = mode in MASK_MODES and (not threads or (threads.isdigit() and int(threads) >= 1))
    ok = ok and (not kept or kept.isdigit()) and (not launch or launch in MASK_LAUNCHES)
    try:
        ok = ok and (not ms or float(ms) > 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{spec!r}: MODE[:THREADS][/MS][~KEPT][+LAUNCH], MODE one of "
                                         f"{', '.join(MASK_MODES)}, LAUNCH one of {', '.join(MASK_LAUNCHES)}")
    return spec


def switch_ms(spec: str | None) -> str | None:
    """The /MS part of an arm's spec (`free/0.5` for a free arm at that switch interval), or None."""
    return parse_spec(spec)[2] or None if spec else None


@contextlib.contextmanager
def mask_env(spec: str | None) -> Iterator[None]:
    """An arm's settings for its run: MLXD_MASK_MODE, MLXD_MASK_THREADS and MLXD_MASK_CACHE (the runtime
    reads them every step) and, with /MS, `sys.setswitchinterval` (how soon a thread waiting for the GIL,
    the mask worker or trio's, forces the engine thread to let it go; Python's default is 5 ms)."""
    if spec is None:
        yield
        return
    mode, threads, ms, kept, launch = parse_spec(spec)
    if mode != "free":
        os.environ["MLXD_MASK_MODE"] = mode
    if threads:
        os.environ["MLXD_MASK_THREADS"] = threads
    if kept:
        os.environ["MLXD_MASK_CACHE"] = kept
    if launch:
        os.environ["MLXD_MASK_LAUNCH"] = launch
    interval = sys.getswitchinterval()
    if ms:
        sys.setswitchinterval(float(ms) / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        for name in ("MLXD_MASK_MODE", "MLXD_MASK_THREADS", "MLXD_MASK_CACHE", "MLXD_MASK_LAUNCH"):
            os.environ.pop(name, None)


STARTED = time.perf_counter()
PATH = RESULTS / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"


def save(result: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    PATH.write_text(json.dumps(result, indent=2) + "\n")


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
        if args.pairs:
            note_masks()
            arms["free2"] = (None, None)  # the control: free decode paired with free decode
            samplings["free2"] = samplings["free"]  # (the warm-up above started the mask worker: its clock is read)
            out["pairs"] = {}
            batches = [] if args.ttft_only else args.batch
            for i, batch in enumerate(batches):
                await decode_rate(rt, prompt, base, batch)  # warm this batch size's kernels before the first pair

                async def run(arm: str, batch: int = batch) -> dict[str, float]:
                    with mask_env(arms[arm][1]):
                        return await decode_once(rt, prompt, samplings[arm], batch)

                # The time left shared by the batch sizes still to run (--stop-after: a cut run still reports).
                deadline = time.perf_counter() + (STARTED + args.stop_after - time.perf_counter()) / (len(batches) - i)
                got = out["pairs"][str(batch)] = await paired(run, [a for a in arms if a != "free"], args.rounds, deadline)
                save(out)
                for arm, d in got.items():
                    r, c, e = d["ratio"], d["process_cpu_ratio"], d["engine_cpu_ratio"]
                    print(f"batch {batch} {arm}: {d['pairs']} pairs, {d['tok_s']} tok/s (free {d['free_tok_s']}); "
                          f"tok/s ratio {r['median']} [IQR {r['q1']}-{r['q3']}]; CPU ms/token process "
                          f"{d['process_cpu_ms']} (free {d['free_process_cpu_ms']}) ratio {c['median']} "
                          f"[{c['q1']}-{c['q3']}], engine thread {d['engine_cpu_ms']} (free {d['free_engine_cpu_ms']}) "
                          f"ratio {e['median']} [{e['q1']}-{e['q3']}], mask worker {d['masks_cpu_ms']}; join wait "
                          f"{d['join_wait_ms']} ms a step, masks ready at the first mask {d['ready_at_mask']}, made by the "
                          f"engine thread {d['made_by_engine']}", flush=True)
        for batch in [] if args.ttft_only or args.pairs else args.batch:
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
    parser.add_argument("--mask-modes", nargs="+", type=mask_spec, metavar="MODE[:THREADS][/MS][~KEPT][+LAUNCH]",
                        help="each constrained arm once per MLXD_MASK_MODE (MLXD_MASK_THREADS, GIL switch ms, "
                             "MLXD_MASK_CACHE, MLXD_MASK_LAUNCH)")
    parser.add_argument("--pairs", action="store_true",
                        help="pair every arm with a free decode, --rounds times each (and a free2 control arm)")
    parser.add_argument("--stop-after", type=float, default=1e9, metavar="S",
                        help="--pairs: start no pair after S seconds from the start (the results so far are kept)")
    args = parser.parse_args()
    result = trio.run(main, args)
    save(result)
    print(PATH)
