"""The Mooncake block-cache model on hand-made traces with known answers."""

from pathlib import Path

import pytest

from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.blocks import BlockCache, replay_blocks
from mlxd.sim.trace import TraceRequest

TRACES = Path(__file__).resolve().parents[1] / "simulations" / "traces"


def req(i, ids, n=None, t=0.0):
    n = n if n is not None else 512 * len(ids)
    return TraceRequest(index=i, t=t, input_length=n, output_tokens=1, hash_ids=tuple(ids))


def hits(reqs, capacity, policy):
    cache = BlockCache(capacity, policy)
    out = []
    for r in reqs:
        out.append(cache.lookup(r.hash_ids))
        cache.touch(r.hash_ids, r.t)
    return out


def test_hit_is_leading_resident_run():
    reqs = [req(0, [1, 2, 3]), req(1, [1, 2, 9, 3]), req(2, [5, 2])]
    assert hits(reqs, None, "lru") == [0, 2, 0]  # block 2 is resident, but not leading


def test_lru_evicts_least_recently_used_block():
    reqs = [req(0, [1, 2]), req(1, [3]), req(2, [1, 2])]
    assert hits(reqs, 2, "lru") == [0, 0, 0]  # 3 pushed out block 1
    assert hits(reqs, 3, "lru") == [0, 0, 2]


def test_lfu_keeps_the_frequent_block():
    reqs = [req(0, [1]), req(1, [1]), req(2, [2]), req(3, [3]), req(4, [1])]
    assert hits(reqs, 2, "lru")[-1] == 0
    assert hits(reqs, 2, "lfu")[-1] == 1


def test_hit_tokens_capped_at_input_length():
    reqs = [req(0, [1, 2], n=700), req(1, [1, 2], n=700)]
    r = replay_blocks(reqs, capacity=None, policy="lru", cost=DEFAULT)
    assert r.hit_tokens == 700
    assert r.token_hit_rate == pytest.approx(0.5)
    assert r.mean_request_hit_rate == pytest.approx(0.5)


def test_unlimited_conversation_slice_matches_a_direct_count():
    from mlxd.sim.trace import load_trace

    reqs = load_trace(TRACES / "conversation_trace.jsonl", limit=2000)
    seen, expect = set(), 0
    for r in reqs:
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in seen:
            k += 1
        expect += min(k * 512, r.input_length)
        seen.update(r.hash_ids)
    result = replay_blocks(reqs, capacity=None, policy="lru", cost=DEFAULT)
    assert result.hit_tokens == expect
    assert result.requests == 2000 and result.evictions == 0
