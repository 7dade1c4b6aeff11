"""The exactness contract: replay requests over every cache path and compare them with a cold recompute.

One *cell* is a model (one cache family) and a KV scheme. Its workload is a
set of random conversations (greedy or seeded; plain turns, tool turns, n = 2,
stop strings) whose prompt ids are rendered once, by the reference runtime,
which serves every request cold (`prompt_cache_bytes=0`, the same KV scheme:
KV8 and KV4 are compared with KV8 and KV4 recompute). Each request is then
replayed through real runtimes over one real SSD directory:

- ``cold``: first sight in a runtime with the cache on (partial prefix hits count here);
- ``ram``: the same request again at once (a RAM hit);
- ``ssd``: after a flush and idle demotion emptied the RAM tier (a restore in the same process);
- ``resumed``: a client drops mid-generation and the identical request resumes its generation checkpoint;
- ``restart``: a new runtime over the same directory (restored from the files the first one left);
- ``replica``: a second runtime sharing the directory (``ssd_shared``) restores files the other wrote
  while both ran.

Tokens must be equal; logprobs (chosen and top-2) within `tolerance(cell)`. A
token divergence where the reference's top two logprobs are closer than that
tolerance is reported as a ``tie`` (float noise may pick either), not a mismatch;
in quantized cells, equal tokens with logprobs past the tolerance but within
`KV_NOISE` are ``kv-noise`` (counted and listed, not a mismatch).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxd import RuntimeConfig, SamplingParams, TokenGenerated, open_runtime
from mlxd.runtime.chat.text import TextAssembler
from mlxd.runtime.supervisor import GenerationStream, Runtime

# (preset, kv_bits): plain attention, quantized KV8 / KV4, sliding window, hybrid, pure recurrent, CacheList.
CELLS: tuple[tuple[str, int | None], ...] = (
    ("test", None),
    ("test-wide", 8),
    ("test-wide", 4),
    ("test-gemma3", None),
    ("test-qwen3next", None),
    ("test-mamba2", None),
    ("falcon_h1", None),  # every layer a CacheList(ArraysCache, KVCache): built by falcon_h1_dir, not a preset
    ("falcon_h1", 8),
)
SCENARIOS = ("cold", "ram", "ssd", "resumed", "restart", "replica")
FEATURES = ("plain", "tools", "n2", "stop")
CHECKPOINT_EVERY = 4  # generation checkpoint interval (tokens) of the runtime that resumes

_WORDS = (
    "cache prefix token model restore durable flush replica shard window state layer tool weather city "
    "answer question brief careful note blue green river mountain number seven index block file disk "
    "memory quick slow the a of and to in is it that for on with as"
).split()
_SYSTEMS = (
    "You are a careful assistant who answers briefly and keeps every cached prefix.",
    "NOTEBOOK. You keep careful notes of what the user says and repeat them back.",
    "You plan tool calls: look up facts with the tools before you answer.",
)
TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
)
STOPS = (" the", "e", ".", "a", "\n", "in")
# Quantized schemes (KV8, KV4): a replay whose tokens all match but whose logprobs differ from the
# reference by more than the tolerance and at most this is "kv-noise", counted apart from mismatches.
# Seen only in quantized cells, only in some runs of a seed (timing), with every cached path of the
# request agreeing with each other: an ulp-level difference upstream of a quantizer that moves one
# value to the next level (docs/benchmarks.md, "Exactness").
KV_NOISE = 1e-2


def tolerance(preset: str, kv_bits: int | None) -> float:
    """The logprob tolerance the suite uses for restored caches of this kind (see docs/benchmarks.md)."""
    return 1e-4 if preset == "test" and kv_bits is None else 2e-4


# --- requests and outcomes ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Spec:
    """One request: exact prompt ids, sampling, and what the client does with the reply."""

    name: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    feature: str
    n: int = 1
    stop: tuple[str, ...] = ()


@attrs.frozen
class Choice:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # empty when not asked
    top: tuple[tuple[tuple[int, float], ...], ...]
    reason: str
    cached: int
    tier: str


@attrs.frozen
class Replay:
    cell: str
    scenario: str
    spec: str
    feature: str
    greedy: bool
    tier: str  # the tier the first choice's prefix came from
    verdict: str  # "ok" | "tie" | "mismatch"
    max_logprob_diff: float
    detail: str = ""


def _cut_to_text(tokenizer: Any, ids: list[int], shown: str) -> list[int]:
    """The reply's ids cut to the text the client saw (what the HTTP layer remembers after a stop string)."""
    k = len(ids)
    while k > 0 and len(text := tokenizer.decode(ids[:k])) >= len(shown) and text != shown:
        k -= 1
    return ids[:k]


async def _read_choice(rt: Runtime, stream: GenerationStream, stop: Sequence[str], primed: list[Any]) -> tuple[
        Choice, str, list[int]]:
    """Drain a stream as the HTTP layer does: stop strings end the row; tokens past one are not counted."""
    text = TextAssembler(rt.tokenizer, stop=stop, eos_ids=rt.info.eos_token_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []

    async def events():
        for e in primed:
            yield e
        async for e in stream:
            yield e

    async with stream:
        async for event in events():
            if not isinstance(event, TokenGenerated) or text.done:
                continue
            tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob)
                top.append(tuple(event.top_logprobs))
            text.add(event.token)
            if text.stopped_by_string:
                await rt.stop_generation(stream.request.request_id)
    text.finish()
    shown = text.text
    reason = "stop" if text.stopped_by_string else stream.finished.reason
    accepted = stream.accepted
    choice = Choice(tuple(tokens), tuple(logprobs), tuple(top), reason, accepted.cached_tokens, accepted.cache_tier)
    ids = _cut_to_text(rt.tokenizer, tokens, shown) if text.stopped_by_string else tokens
    return choice, shown, ids


async def run_spec(rt: Runtime, spec: Spec, *, logprobs: bool = True) -> tuple[list[Choice], str, list[int]]:
    """Serve `spec` as the HTTP layer would (n > 1: the rest start once the first has a token)."""
    sampling = spec.sampling if logprobs else attrs.evolve(spec.sampling, logprobs=False, top_logprobs=0)
    streams, primed = [], []
    for i in range(spec.n):
        seed = None if sampling.seed is None else (sampling.seed + i) % 2**32
        streams.append(rt.submit(rt.request(spec.prompt, sampling=attrs.evolve(sampling, seed=seed))))
        if i == 0 and spec.n > 1:  # the first row's prompt checkpoint is published by its first token
            async for event in streams[0]:
                primed.append(event)
                if isinstance(event, TokenGenerated):
                    break
    results: list[Any] = [None] * spec.n

    async def one(i: int) -> None:
        results[i] = await _read_choice(rt, streams[i], spec.stop, primed if i == 0 else [])

    async with trio.open_nursery() as nursery:
        for i in range(spec.n):
            nursery.start_soon(one, i)
    return [r[0] for r in results], results[0][1], results[0][2]


async def run_dropped_then_resumed(rt: Runtime, spec: Spec, drop_at: int) -> Choice:
    """Drop the client after `drop_at` tokens, wait for the checkpoint to settle, send the request again."""
    sampling = attrs.evolve(spec.sampling, logprobs=False, top_logprobs=0)
    seen = 0
    async with rt.submit(rt.request(spec.prompt, sampling=sampling)) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                seen += 1
                if seen == drop_at:
                    break
    ckpt = rt.cold.checkpointer
    with trio.fail_after(60):
        while ckpt.snapshot_stats()["pending"] or ckpt.snapshot_stats()["owned"]:  # noqa: ASYNC110
            await trio.sleep(0.01)
    choices, _, _ = await run_spec(rt, attrs.evolve(spec, sampling=sampling), logprobs=False)
    return choices[0]


# --- the workload ---------------------------------------------------------------------------


def _sentence(rng: random.Random, lo: int = 4, hi: int = 14) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "?"


def _sampling(rng: random.Random, max_tokens: tuple[int, int]) -> SamplingParams:
    kw: dict[str, Any] = {"max_tokens": rng.randint(*max_tokens), "logprobs": True, "top_logprobs": 2}
    if rng.random() < 0.8:  # random weights: most run to max_tokens (or a stop string), some may end early
        kw["logit_bias"] = ((0, -100.0), (1, -100.0), (2, -100.0))
    if rng.random() < 0.3:  # history-dependent processors: they must see a cached prefix's tokens too
        kw.update(repetition_penalty=rng.choice((1.1, 1.5)), repetition_context_size=rng.choice((8, 20, 64)))
    if rng.random() < 0.2:
        kw.update(presence_penalty=rng.choice((0.5, 1.0)), frequency_penalty=rng.choice((0.0, 0.5)))
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice((0.6, 0.9, 1.3)), top_p=rng.choice((1.0, 0.9)), top_k=rng.choice((0, 0, 20)),
                  min_p=rng.choice((0.0, 0.0, 0.05)), seed=rng.randrange(2**31))
    return SamplingParams(**kw)


async def build_workload(rt: Runtime, rng: random.Random, *, conversations: int, prefix: str,
                         max_tokens: tuple[int, int]) -> tuple[list[Spec], dict[str, list[Choice]]]:
    """Random conversations served by the reference runtime: their specs and reference choices.

    Later turns quote the reference reply, whose exact ids `remember_reply` keeps, so every
    turn's prompt extends the previous turn's prompt + reply (the end-of-turn checkpoint).
    """
    specs: list[Spec] = []
    refs: dict[str, list[Choice]] = {}
    for c in range(conversations):
        feature = rng.choice(FEATURES)
        tools = TOOLS if feature == "tools" else ()
        system = rng.choice(_SYSTEMS) + (" " + _sentence(rng, 20, 60) if rng.random() < 0.5 else "")
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": _sentence(rng)})
            if feature == "tools" and turn > 0:  # the model called a tool; its result closes the turn
                call = {"id": f"call_{c}_{turn}", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": rng.choice(_WORDS)}}}
                messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": _sentence(rng, 2, 6)}]
            prompt = await rt.render_chat(messages, tools=tools)
            spec = Spec(name=f"{prefix}c{c}t{turn}", prompt=prompt, sampling=_sampling(rng, max_tokens), feature=feature,
                        n=2 if feature == "n2" else 1,
                        stop=(rng.choice(STOPS), rng.choice(STOPS)) if feature == "stop" else ())
            choices, shown, ids = await run_spec(rt, spec)
            specs.append(spec)
            refs[spec.name] = choices
            rt.remember_reply(shown, ids)
            messages.append({"role": "assistant", "content": shown})
    return specs, refs


# --- comparing ------------------------------------------------------------------------------


def compare(ref: Sequence[Choice], got: Sequence[Choice], tol: float, *, quantized: bool = False) -> tuple[
        str, float, str]:
    """(verdict, largest logprob difference, detail) of one replay against its reference.

    "kv-noise": a quantized KV scheme, every token and finish equal, logprobs past `tol` but
    within `KV_NOISE` (see the module docstring); "mismatch" is everything else past `tol`.
    """
    worst, where = 0.0, ""
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        same = 0
        while same < min(len(a.tokens), len(b.tokens)) and a.tokens[same] == b.tokens[same]:
            same += 1
        if b.logprobs:  # resumed replays carry no logprobs
            for k in range(same):
                ta, tb = dict(a.top[k]), dict(b.top[k])
                here = max(abs(a.logprobs[k] - b.logprobs[k]), *(abs(ta[t] - tb[t]) for t in ta.keys() & tb.keys()))
                if here > worst:
                    worst, where = here, f" (choice {i}, token {k}: {a.logprobs[k]:.6f} vs {b.logprobs[k]:.6f})"
        if a.tokens != b.tokens:
            if same < len(a.tokens) and same < len(b.tokens) and len(a.top[same]) == 2:
                (_, lp1), (_, lp2) = a.top[same]
                if lp1 - lp2 <= tol:
                    return "tie", worst, f"choice {i}: near-tie at token {same} (gap {lp1 - lp2:.2e})"
            return "mismatch", worst, f"choice {i}: tokens differ at {same}: {a.tokens} vs {b.tokens}"
        if a.reason != b.reason:
            return "mismatch", worst, f"choice {i}: finish {a.reason} vs {b.reason}"
    if worst > tol:
        verdict = "kv-noise" if quantized and worst <= KV_NOISE else "mismatch"
        return verdict, worst, f"logprob difference {worst:.2e} > {tol:.0e}{where}"
    return "ok", worst, ""


# --- one cell -------------------------------------------------------------------------------


def base_config(model_dir: Path, kv_bits: int | None, **kw: Any) -> RuntimeConfig:
    return RuntimeConfig(model=str(model_dir), model_name="tiny", snapshot_min_tokens=16, max_context=4096,
                         device_probe="off", kv_bits=kv_bits, **kw)


async def _empty_ram(rt: Runtime) -> None:
    with trio.fail_after(60):
        while len(rt.cache_owner.cache):  # noqa: ASYNC110 - polling an actor from a harness
            await trio.sleep(0.05)


async def run_cell(model_dir: Path, preset: str, kv_bits: int | None, work: Path, *, conversations: int,
                   seed: int, scenarios: Sequence[str] = SCENARIOS, checkpoint_every: int = CHECKPOINT_EVERY,
                   max_tokens: tuple[int, int] = (3 * CHECKPOINT_EVERY, 24), concurrency: int = 1,
                   demote_idle_s: float = 3.0, ssd_layout: str = "whole", restore_landing: str = "auto",
                   ) -> list[Replay]:
    """Every scenario of one cell: the reference, then the replays, as `Replay` records.

    `max_tokens` is the range each request's limit is drawn from; its low end must leave room
    to drop a client past a generation checkpoint (every `checkpoint_every` tokens). With
    `concurrency` > 1 the passes send that many requests at once, so replays also run batched
    with other rows (the reference serves one request at a time); the resumed pass stays serial.
    `ssd_layout` and `restore_landing` pick the first runtime's SSD store format and restore
    path (the sharing runtimes read its files; they write whole files, as sharing requires).
    """
    assert max_tokens[0] >= 2 * checkpoint_every + 2
    rng = random.Random(seed)
    cell = f"{preset}/{'kv' + str(kv_bits) if kv_bits else 'native'}"
    tol = tolerance(preset, kv_bits)
    out: list[Replay] = []

    def record(scenario: str, spec: Spec, got: Sequence[Choice]) -> None:
        verdict, worst, detail = compare(refs[spec.name], got, tol, quantized=kv_bits is not None)
        out.append(Replay(cell, scenario, spec.name, spec.feature, spec.sampling.temperature == 0, got[0].tier,
                          verdict, worst, detail))

    async def replay(rt: Runtime, scenario: str, spec: Spec) -> None:
        choices, _, _ = await run_spec(rt, spec)
        record(scenario, spec, choices)

    async def each(specs: Sequence[Spec], fn: Callable[[Spec], Awaitable[None]]) -> None:
        """`fn` for every spec, `concurrency` at a time (their rows batch together)."""
        limit = trio.CapacityLimiter(concurrency)

        async def one(spec: Spec) -> None:
            async with limit:
                await fn(spec)

        async with trio.open_nursery() as nursery:
            for spec in specs:
                nursery.start_soon(one, spec)

    # The reference: every request cold, same KV scheme. Half the conversations are held out for the replica.
    async with open_runtime(base_config(model_dir, kv_bits, prompt_cache_bytes=0)) as ref:
        main, refs = await build_workload(ref, rng, conversations=conversations, prefix="a", max_tokens=max_tokens)
        held, held_refs = await build_workload(ref, rng, conversations=max(1, conversations // 2), prefix="b",
                                               max_tokens=max_tokens)
        refs.update(held_refs)

    ssd = work / f"ssd-{preset}-{kv_bits}-{seed}"
    ssd.mkdir(parents=True, exist_ok=True)
    main_config = base_config(model_dir, kv_bits, ssd_cache_dir=ssd, ssd_demote_idle_s=demote_idle_s,
                              generation_checkpoint=checkpoint_every, ssd_layout=ssd_layout,
                              restore_landing=restore_landing)

    async def first_runtime() -> None:  # its own frame: nothing keeps the runtime alive after it
        async with open_runtime(main_config) as rt:
            async def cold_then_ram(spec: Spec) -> None:
                choices, _, _ = await run_spec(rt, spec)
                record("cold", spec, choices)
                if "ram" in scenarios:
                    choices, _, _ = await run_spec(rt, spec)
                    record("ram", spec, choices)

            await each(main, cold_then_ram)
            if "ssd" in scenarios:
                await rt.flush()
                await _empty_ram(rt)
                await each(main, lambda spec: replay(rt, "ssd", spec))
            if "resumed" in scenarios:
                for spec in main:
                    if spec.n == 1 and not spec.stop:
                        drop_at = rng.randint(checkpoint_every + 1, spec.sampling.max_tokens // 2)
                        record("resumed", spec, [await run_dropped_then_resumed(rt, spec, drop_at)])

    await first_runtime()
    if not {"restart", "replica"} & set(scenarios):
        return out
    gc.collect()  # the closed store's directory lock goes with its last reference (the sharers lock shared)
    shared = attrs.evolve(main_config, ssd_shared=True, ssd_rescan_s=0.2, ssd_demote_idle_s=300.0,
                          generation_checkpoint=0, ssd_layout="whole")
    async with open_runtime(shared) as first, open_runtime(shared) as second:
        if "restart" in scenarios:
            await each(main, lambda spec: replay(first, "restart", spec))
        if "replica" in scenarios:
            files = set(ssd.rglob("*.mlxkv"))
            await each(held, lambda spec: replay(first, "cold", spec))
            report = await first.flush()
            if not report["durable"]:  # a defect of its own (not an answer): recorded, and the replay goes on
                out.append(Replay(cell, "flush", "-", "-", True, "-", "mismatch", 0.0,
                                  f"flush not durable: {report['reason']}"))
            new = len(set(ssd.rglob("*.mlxkv")) - files)
            with trio.fail_after(60):  # the replica's rescan finds the other's new files
                while (await second.ssd_stats()).shared["discovered"] < new:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            await each(held, lambda spec: replay(second, "replica", spec))
    return out


# --- summaries ------------------------------------------------------------------------------


def summarize(replays: Sequence[Replay]) -> dict[str, Any]:
    """Counts by scenario, by cell, by feature and by tier, with the largest logprob difference."""

    def group(key) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for r in replays:
            g = out.setdefault(key(r), {"replays": 0, "ok": 0, "tie": 0, "kv-noise": 0, "mismatch": 0,
                                       "max_logprob_diff": 0.0})
            g["replays"] += 1
            g[r.verdict] += 1
            g["max_logprob_diff"] = max(g["max_logprob_diff"], r.max_logprob_diff)
        return dict(sorted(out.items()))

    return {
        "replays": len(replays),
        "mismatches": sum(r.verdict == "mismatch" for r in replays),
        "ties": sum(r.verdict == "tie" for r in replays),
        "kv_noise": sum(r.verdict == "kv-noise" for r in replays),
        "by_scenario": group(lambda r: r.scenario),
        "by_cell": group(lambda r: r.cell),
        "by_feature": group(lambda r: r.feature),
        "by_sampling": group(lambda r: "greedy" if r.greedy else "seeded"),
        "by_tier": group(lambda r: f"{r.scenario}:{r.tier}"),
    }


def table(summary: dict[str, Any], key: str) -> str:
    rows = [f"{key:<24} {'replays':>8} {'ok':>8} {'tie':>5} {'kv-noise':>9} {'mismatch':>9} {'max |dlogprob|':>15}"]
    for name, g in summary[key].items():
        rows.append(f"{name:<24} {g['replays']:>8} {g['ok']:>8} {g['tie']:>5} {g['kv-noise']:>9} {g['mismatch']:>9} "
                    f"{g['max_logprob_diff']:>15.2e}")
    return "\n".join(rows)


def now() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


# --- a model whose layers are CacheLists --------------------------------------------------------


def falcon_h1_dir(tokenizer_dir: Path, dest: Path) -> Path:
    """The harness's falcon_h1 cell (tests/models.py), with the weights its recorded runs used."""
    from models import falcon_h1_dir as build

    return build(tokenizer_dir, dest, seed=0)
