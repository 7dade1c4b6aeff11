"""Retention policies: eviction order, lazy deletion, GDSF aging."""

import itertools

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.kv.retention import CostPolicy, LfuPolicy, LruPolicy, RetentionPolicy, make_policy


@attrs.define(eq=False)
class Entry:
    name: str
    tokens: tuple = ()
    nbytes: int = 1


def order(policy) -> list[str]:
    return [e.name for e in policy.victims()]


def test_make_policy():
    for name, cls in [("lru", LruPolicy), ("lfu", LfuPolicy), ("cost", CostPolicy)]:
        policy = make_policy(name)
        assert isinstance(policy, cls) and isinstance(policy, RetentionPolicy)
        assert policy.name == name
    with pytest.raises(ValueError, match="unknown retention policy"):
        make_policy("fifo")


def test_lru_order():
    policy = LruPolicy()
    a, b, c = Entry("a"), Entry("b"), Entry("c")
    for n, e in enumerate([a, b, c]):
        policy.on_insert(e, n)
    policy.on_hit(a, 3)
    assert order(policy) == ["b", "c", "a"]
    policy.on_remove(c)
    assert order(policy) == ["b", "a"]


def test_lfu_frequency_then_recency():
    policy = LfuPolicy()
    a, b, c, d = (Entry(x) for x in "abcd")
    for e in (a, b, c, d):
        policy.on_insert(e, 0)
    policy.on_hit(a, 1)
    policy.on_hit(a, 2)
    policy.on_hit(c, 3)
    policy.on_hit(b, 4)
    # d: 1 use; c and b: 2 uses (c hit before b); a: 3 uses
    assert order(policy) == ["d", "c", "b", "a"]


def test_cost_prefers_keeping_cheap_bytes_per_token_and_ages():
    policy = CostPolicy()
    dense = Entry("dense", tokens=tuple(range(100)), nbytes=100 * 1000)
    quant = Entry("quant", tokens=tuple(range(100)), nbytes=100 * 250)
    policy.on_insert(dense, 0)
    policy.on_insert(quant, 0)
    assert order(policy) == ["dense", "quant"]
    # evicting raises the clock to the victim's priority: newcomers start above it
    victim = next(policy.victims())
    policy.on_remove(victim, evicted=True)
    assert policy.clock == pytest.approx(100 / (100 * 1000))
    fresh = Entry("fresh", tokens=tuple(range(100)), nbytes=100 * 1000)
    policy.on_insert(fresh, 1)
    assert order(policy) == ["fresh", "quant"]
    # a plain removal (supersession) does not age the cache
    policy.on_remove(fresh)
    assert policy.clock == pytest.approx(100 / (100 * 1000))


def test_cost_hits_multiply_priority():
    policy = CostPolicy()
    a = Entry("a", tokens=(1,) * 10, nbytes=10)
    b = Entry("b", tokens=(1,) * 10, nbytes=10)
    policy.on_insert(a, 0)
    policy.on_insert(b, 0)
    policy.on_hit(a, 1)
    assert order(policy) == ["b", "a"]


def test_victims_allows_removal_while_iterating_and_restores_on_stop():
    policy = LruPolicy()
    entries = [Entry(str(n)) for n in range(6)]
    for n, e in enumerate(entries):
        policy.on_insert(e, n)
    gen = policy.victims()
    assert next(gen).name == "0"
    policy.on_remove(entries[0], evicted=True)
    assert next(gen).name == "1"
    assert next(gen).name == "2"
    gen.close()  # stopped early: "1" and "2" stay, in order
    assert order(policy) == ["1", "2", "3", "4", "5"]
    assert len(policy) == 5


def test_stale_heap_items_are_compacted():
    policy = LfuPolicy()
    entries = [Entry(str(n)) for n in range(10)]
    for e in entries:
        policy.on_insert(e, 0)
    for _ in range(1000):
        for e in entries:
            policy.on_hit(e, 0)
    assert len(policy._heap) <= 2 * len(entries) + 65
    assert order(policy) == [str(n) for n in range(10)]


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(["lru", "lfu", "cost"]),
    ops=st.lists(
        st.tuples(st.sampled_from(["ins", "hit", "del", "evict"]), st.integers(0, 7)), max_size=60
    ),
)
def test_victims_match_reference_model(name, ops):
    """Each policy's victim order equals sorting a plain model by its documented key."""
    policy = make_policy(name)
    live, uses, last, gdsf = {}, {}, {}, {}
    clock, tick = 0.0, itertools.count()

    def touch(n):
        last[n] = next(tick)
        gdsf[n] = clock + uses[n] * len(live[n].tokens) / live[n].nbytes

    def model_key(n):
        return {"lru": (last[n],), "lfu": (uses[n], last[n]), "cost": (gdsf[n], last[n])}[name]

    for op, n in ops:
        if op == "ins" and n not in live:
            live[n], uses[n] = Entry(str(n), tokens=(0,) * (n + 1), nbytes=(n % 3 + 1) * 10), 1
            touch(n)
            policy.on_insert(live[n], 0)
        elif op == "hit" and n in live:
            uses[n] += 1
            touch(n)
            policy.on_hit(live[n], 0)
        elif op == "del" and n in live:
            policy.on_remove(live.pop(n))
        elif op == "evict" and live:
            coldest = min(live, key=model_key)
            victim = next(policy.victims())
            assert victim is live[coldest]
            policy.on_remove(live.pop(coldest), evicted=True)
            clock = max(clock, gdsf[coldest])
    assert order(policy) == [str(k) for k in sorted(live, key=model_key)]


@pytest.mark.parametrize("name", ["lru", "lfu", "cost"])
def test_a_removed_entry_releases_its_arrays_at_once(name):
    """The lazy heap must not keep a removed entry's MLX arrays alive until it is next rebuilt."""
    import mlxd  # noqa: F401, I001  # preloads OpenBLAS before mlx
    import mlx.core as mx

    from mlxd.kv.prompt_cache import PromptCache

    cache = PromptCache(max_bytes=1 << 30, policy=make_policy(name))
    mx.synchronize()
    before = mx.get_active_memory()
    for i in range(3):  # each a trimmable extension: it supersedes the one before
        payload = [mx.full((1 << 20,), float(i))]
        mx.eval(payload)
        cache.put(tuple(range(10 * (i + 1))), payload=payload, nbytes=4 << 20, trimmable=True)
        if i == 1:
            cache.take(tuple(range(25)))  # a hit re-keys the entry in the heap
    del payload
    assert len(cache) == 1
    assert mx.get_active_memory() - before == 4 << 20, "superseded entries are freed"
    (entry,) = cache.entries()
    cache.remove(entry, evicted=True)
    del entry
    assert mx.get_active_memory() == before, "a removed entry is freed"
