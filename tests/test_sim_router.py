"""Fleet routers: round-robin, session affinity, and SMG-style cache-aware routing."""

from __future__ import annotations

import pytest

from mlxd.sim.router import CacheAware, make_router


def test_round_robin_cycles_whatever_the_request():
    r = make_router("round_robin", 3)
    assert [r.pick([1, 2], None, [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_session_affinity_is_sticky_and_spreads():
    r = make_router("session", 4)
    picks = {s: r.pick([0, 1], f"conv-{s}", [0] * 4) for s in range(40)}
    assert all(r.pick([9, 9, 9], f"conv-{s}", [5, 0, 0, 0]) == i for s, i in picks.items())
    assert len(set(picks.values())) == 4
    # Without a session id, the first blocks stand in for it.
    assert r.pick([0, 7, 8], None, [0] * 4) == r.pick([0, 7, 8, 9, 10], None, [0] * 4)


def test_cache_aware_follows_the_prefix_and_spreads_new_ones():
    r = CacheAware(2)
    a = r.pick([0, 1, 2, 3], None, [0, 0])
    b = r.pick([0, 10, 11, 12], None, [1, 0])  # shares 1 of 4 blocks (< 0.3): the emptier replica
    assert b != a
    assert r.pick([0, 1, 2, 3, 4, 5], None, [0, 0]) == a  # a follow-up turn returns to its replica
    assert r.pick([0, 10, 11, 12, 13], None, [0, 0]) == b
    assert r.matched(a, [0, 1, 2, 3, 4, 5, 6]) == 6


def test_cache_aware_balances_past_both_thresholds():
    r = CacheAware(2, balance_abs=4, balance_rel=1.5)
    home = r.pick([5, 6, 7], None, [0, 0])
    loads = [0, 0]
    loads[home] = 10
    assert r.pick([5, 6, 7, 8], None, loads) == 1 - home  # 10 - 0 > 4 and 10 > 0 * 1.5
    loads[1 - home] = 8
    assert r.pick([5, 6, 7, 8, 9], None, loads) == 1 - home  # balanced enough: the longest prefix wins
    assert r.matched(home, [5, 6, 7, 8, 9]) == 3


def test_unknown_router_is_an_error():
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", 2)
