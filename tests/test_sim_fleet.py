"""Fleet simulation: N replays of the serving cache core on one virtual clock, behind a router."""

from __future__ import annotations

import json

import pytest

from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.cli import main as simulate
from mlxd.sim.fleet import replay_fleet
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRequest


def conversations(n_conv: int = 9, turns: int = 4, gap: float = 30.0) -> list[TraceRequest]:
    """Mooncake-shaped multi-turn chats: each turn repeats the conversation's blocks and adds new ones."""
    reqs = []
    next_id = 1
    blocks = {c: [0] for c in range(n_conv)}  # block 0: a system prompt everyone shares
    for turn in range(turns):
        for c in range(n_conv):
            new = 4 if turn == 0 else 2  # the shared block is under SMG's 0.3 match threshold
            blocks[c] += list(range(next_id, next_id + new))
            next_id += new
            ids = tuple(blocks[c])
            reqs.append(TraceRequest(index=len(reqs), t=turn * gap + c * 0.5, input_length=512 * len(ids),
                                     output_tokens=8, hash_ids=ids))
    return reqs


def test_one_replica_is_the_single_server_replay():
    reqs = conversations()
    single = replay_mlxd(reqs, policy="lru", cost=DEFAULT, ram_bytes=None, slots=2)
    fleet = replay_fleet(reqs, replicas=1, router="round_robin", policy="lru", cost=DEFAULT, ram_bytes=None, slots=2)
    assert fleet.hit_tokens == single.hit_tokens and fleet.requests == single.requests
    assert fleet.ttft_s == pytest.approx(single.ttft_s)


@pytest.mark.parametrize("router", ["cache_aware", "session"])
def test_conversation_aware_routing_beats_round_robin(router):
    reqs = conversations()
    rr = replay_fleet(reqs, replicas=4, router="round_robin", policy="lru", cost=DEFAULT, ram_bytes=None, slots=2)
    smart = replay_fleet(reqs, replicas=4, router=router, policy="lru", cost=DEFAULT, ram_bytes=None, slots=2)
    for result in (rr, smart):
        assert sum(p["requests"] for p in result.per_replica) == len(reqs)
        assert sum(p["hit_tokens"] for p in result.per_replica) == result.hit_tokens
    assert [p["requests"] for p in rr.per_replica] == [9, 9, 9, 9]
    # 9 conversations over 4 replicas: round-robin moves a conversation every turn.
    assert smart.token_hit_rate > rr.token_hit_rate + 0.2
    assert smart.ttft_s["mean"] < rr.ttft_s["mean"]
    # Every follow-up turn hits: only each conversation's first turn is a full miss.
    assert smart.misses <= 9


def test_simulate_cli_compares_routers(tmp_path, capsys):
    trace = tmp_path / "chats.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": int(r.t * 1000), "input_length": r.input_length,
                                         "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in conversations()))
    assert simulate([str(trace), "--replicas", "4", "--router", "round_robin,cache_aware", "--policy", "lru",
                     "--slots", "2", "--out", str(tmp_path / "out"), "--name", "chats"]) == 0
    table = capsys.readouterr().out
    assert "round_robin" in table and "cache_aware" in table
    runs = json.loads((tmp_path / "out" / "chats.json").read_text())["runs"]
    assert [r["router"] for r in runs] == ["round_robin", "cache_aware"]
    assert all(len(r["per_replica"]) == 4 and r["replicas"] == 4 for r in runs)
    assert runs[1]["token_hit_rate"] > runs[0]["token_hit_rate"]
    assert (tmp_path / "out" / "chats_fleet.png").stat().st_size > 0
