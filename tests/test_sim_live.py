"""A trace recorded from live traffic replays to the hit counts the live server reported."""

from __future__ import annotations

import attrs
import httpx
import pytest

from mlxd.cli import record_trace
from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import load_trace

from serving import ServerThread, config_for


@pytest.mark.parametrize("ram_bytes", [2 * 1024**3, 400_000], ids=["roomy", "tight"])
def test_recorded_trace_reproduces_live_hit_counts(tiny_model_dir, tmp_path, ram_bytes):
    trace = tmp_path / "live.jsonl"
    with ServerThread(config_for(tiny_model_dir, prompt_cache_bytes=ram_bytes)) as server:
        record_trace(server.runtime, trace)
        kv_per_token = server.runtime.info.kv_bytes_per_token

        def chat(messages):
            body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 5}
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        conversations = [[{"role": "system", "content": f"Persona {i}. " * (20 + 10 * i)}] for i in range(3)]
        for turn in range(3):
            for conv in conversations:
                conv.append({"role": "user", "content": f"Question {turn}?"})
                conv.append({"role": "assistant", "content": chat(conv)})
        chat(conversations[0][:2])  # a retry of the very first request
        live = server.call(server.runtime.stats).cache.tiers.ram

    reqs = load_trace(trace)
    assert len(reqs) == 10
    cost = attrs.evolve(DEFAULT, kv_bytes_per_token=kv_per_token)
    result = replay_mlxd(reqs, policy="lru", cost=cost, ram_bytes=ram_bytes, slots=1, granularity="token")
    assert live.hits > 0
    assert result.ram_hits == live.hits
    assert result.ram_hit_tokens == live.hit_tokens
    assert result.misses == live.misses
