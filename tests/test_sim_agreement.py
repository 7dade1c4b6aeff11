"""A live server and `mlxd simulate` of its recording agree per tier (one shared cache core).

A slice of a public Mooncake trace (conversations that return, from
simulations/traces, not written for this test) is shaped into token-id
prompts the tiny model can serve: each 512-token hash block becomes
`BLOCK` pseudo-random ids seeded by its hash id, so shared blocks share ids.
A live runtime with a small RAM tier and a capped SSD tier (both caps bind)
serves them one at a time, flushing after each, while `--record-trace`'s
recorder writes the trace. `mlxd simulate TRACE --cache-model mlxd --format
json` with no other flags must then report RAM and SSD hit tokens within 1%
of the prompt tokens of what the live server reported per request.

The server runs its startup device probe, so whether a cold prefix is
restored or recomputed depends on what the probe (and the online
calibration after it) measured on this machine, loaded or not. Prompts are
long enough that recomputing a returning conversation costs many times a
restore's latency, so the SSD tier serves hits whatever was measured.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import trio

from mlxd import SamplingParams, open_runtime
from mlxd.cli import record_trace
from mlxd.sim.trace import TraceRequest, load_recording, load_trace

from serving import config_for

TRACE = Path(__file__).resolve().parents[1] / "simulations" / "traces" / "conversation_trace.jsonl"
# Tokens per Mooncake block here (512 in the trace). Prefill grows with the square of the
# length and a restore about linearly: at 8, every restore saved < 40 ms of prefill, within
# a loaded machine's restore latency, and the advisor could rightly recompute them all.
BLOCK = 32
CONVERSATIONS = 10
VOCAB = 1024  # the tiny "test" model's


def returning_conversations(reqs: list[TraceRequest], count: int) -> list[TraceRequest]:
    """The requests of the first `count` conversations (same first two blocks) with 3+ turns."""
    by_conv: dict[tuple[int, ...], list[TraceRequest]] = defaultdict(list)
    for r in reqs:
        if r.hash_ids and len(r.hash_ids) >= 2:
            by_conv[r.hash_ids[:2]].append(r)
    chosen = [k for k, v in by_conv.items() if len(v) >= 3][:count]
    return sorted((r for k in chosen for r in by_conv[k]), key=lambda r: r.t)


def shaped_prompt(r: TraceRequest) -> tuple[int, ...]:
    ids: list[int] = []
    for h in r.hash_ids or ():
        ids += np.random.default_rng(h).integers(1, VOCAB, BLOCK).tolist()
    return tuple(ids[: max(2, math.ceil(r.input_length * BLOCK / 512))])


def tiers_of(reqs: list[TraceRequest]) -> dict[str, int]:
    out = {"ram": 0, "ssd": 0}
    for r in reqs:
        if r.cache_tier in out:
            out[r.cache_tier] += r.cached_tokens or 0
    return out


async def test_live_server_and_its_replay_agree_per_tier(tiny_model_dir, tmp_path):
    requests = returning_conversations(load_trace(TRACE), CONVERSATIONS)
    config = config_for(
        tiny_model_dir,
        device_probe="on",  # as `mlxd serve --ssd-cache` starts: the recording carries the probe's model
        restore_choice="measured",  # the default, which conftest.py turns to "always" for other tests
        ssd_cache_dir=tmp_path / "ssd",
        prompt_cache_bytes=2_400_000,  # a few conversations of KV (512 bytes per token)
        ssd_cache_max_bytes=6_000_000,  # 2.5x that
        ssd_demote_idle_s=0,
    )
    trace = tmp_path / "live.jsonl"
    async with open_runtime(config) as rt:
        record_trace(rt, trace)
        for r in requests:
            sampling = SamplingParams(max_tokens=max(1, min(r.output_tokens, 8)))
            async with rt.submit(rt.request(shaped_prompt(r), sampling=sampling)) as stream:
                await stream.tokens()
            await rt.flush()
        stats = await rt.stats()
    assert stats.ssd is not None
    decisions = stats.ssd.restore_decisions

    recording = load_recording(trace)
    # One flush per request, and the one open_runtime makes on exit.
    assert len(recording.reqs) == len(requests) and len(recording.flushes) == len(requests) + 1
    assert recording.server["prompt_cache_bytes"] == 2_400_000
    live = tiers_of(recording.reqs)
    prompt_tokens = sum(r.input_length for r in recording.reqs)
    # Each SSD hit's line says where its read went: making the memory it landed in, the CRC checks.
    ssd_parts = [line["parts"] for line in map(json.loads, trace.read_text().splitlines())
                 if line.get("cache_tier") == "ssd"]
    assert ssd_parts and all(0 <= p["land_s"] <= p["read_s"] and p["verify_s"] >= 0 for p in ssd_parts), ssd_parts
    assert any(p["verify_s"] > 0 for p in ssd_parts), ssd_parts  # verified by default
    # Both caps bind: RAM demoted entries to SSD, and the SSD cap deleted files.
    assert stats.ssd.demotions > 0
    assert stats.cache.tiers.ssd_evictions > 0
    floor = 0.05 * prompt_tokens
    assert live["ram"] > floor and live["ssd"] > floor, (live, prompt_tokens, decisions)

    with trio.fail_after(120):
        out = await trio.run_process(
            [sys.executable, "-m", "mlxd.cli", "simulate", str(trace), "--cache-model", "mlxd", "--format", "json"],
            capture_stdout=True, capture_stderr=True,
        )
    (sim,) = [json.loads(line) for line in out.stdout.decode().splitlines() if line.startswith("{")]
    print("agreement", prompt_tokens, live, sim["ram_hit_tokens"], sim["ssd_hit_tokens"], stats.ssd.demotions, stats.cache.tiers.ssd_evictions, decisions)
    assert sim["input_tokens"] == prompt_tokens
    for tier in ("ram", "ssd"):
        gap = abs(sim[f"{tier}_hit_tokens"] - live[tier]) / prompt_tokens
        assert gap <= 0.01, (tier, live, sim["ram_hit_tokens"], sim["ssd_hit_tokens"], prompt_tokens)
