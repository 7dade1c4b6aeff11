"""PromptCache: take/put/evict rules of the RAM tier (seed §4)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.kv.prompt_cache import CacheHit, PromptCache, PutOutcome
from mlxd.kv.retention import make_policy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(max_bytes=1000, policy="lru"):
    clock = FakeClock()
    return PromptCache(max_bytes=max_bytes, policy=make_policy(policy), clock=clock), clock


def put(cache, tokens, ns="", *, nbytes=10, trimmable=True, payload=None):
    return cache.put(tokens, ns, payload=payload, nbytes=nbytes, trimmable=trimmable)


def test_take_longest_usable_and_stats():
    cache, clock = make_cache()
    a = put(cache, [1, 2, 3], trimmable=False).entry
    b = put(cache, [1, 2, 3, 4, 5, 6], trimmable=False).entry
    clock.now = 5.0
    assert cache.take([1, 2, 3, 4, 5, 6, 7]) == CacheHit(b, 6)
    # the same prompt: capped at len - 1, and b cannot trim, so a serves
    assert cache.take([1, 2, 3, 4, 5, 6]) == CacheHit(a, 3)
    assert cache.take([9, 9]) is None
    assert cache.take([1]) is None  # nothing usable when len - 1 == 0
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.hit_tokens) == (2, 2, 9)
    assert stats.lookup_tokens == 7 + 6 + 2 + 1
    assert (b.hits, b.last_used, a.hits) == (1, 5.0, 1)
    assert (stats.entries, stats.bytes, stats.policy) == (2, 20, "lru")


def test_trimmable_entry_serves_shorter_prompt():
    cache, _ = make_cache()
    entry = put(cache, [1, 2, 3, 4, 5, 6], trimmable=True).entry
    hit = cache.take([1, 2, 3, 9])
    assert hit == CacheHit(entry, 3) and hit.needs_trim
    assert cache.take([1, 2, 3, 4, 5, 6]) == CacheHit(entry, 5)


def test_peek_does_not_count_or_touch():
    cache, clock = make_cache()
    entry = put(cache, [1, 2, 3]).entry
    clock.now = 9.0
    assert cache.peek([1, 2, 3, 4]) == CacheHit(entry, 3)
    assert cache.peek([1, 2, 3, 4], limit=2) == CacheHit(entry, 2)
    assert (cache.stats.hits, cache.stats.misses, entry.hits, entry.last_used) == (0, 0, 0, 0.0)


def test_namespaces_never_cross():
    cache, _ = make_cache()
    put(cache, [1, 2, 3], "lora-a")
    assert cache.take([1, 2, 3, 4], "") is None
    assert cache.take([1, 2, 3, 4], "lora-b") is None
    assert cache.take([1, 2, 3, 4], "lora-a").usable == 3
    out = put(cache, [1, 2, 3, 4], "lora-b")
    assert out.superseded == ()  # the lora-a ancestor is in another namespace
    assert sorted(cache.namespaces()) == ["lora-a", "lora-b"]


def test_exact_duplicate_replaced_regardless_of_trimmability():
    cache, _ = make_cache()
    first = put(cache, [1, 2, 3], nbytes=10, trimmable=True).entry
    out = put(cache, (1, 2, 3), nbytes=30, trimmable=False)
    assert out.replaced is first and out.superseded == ()
    assert cache.find_exact([1, 2, 3]) is out.entry
    assert (cache.stats.entries, cache.stats.bytes, cache.stats.replaced) == (1, 30, 1)


def test_ancestors_superseded_only_by_trimmable_entry():
    cache, _ = make_cache()
    snap = put(cache, [1, 2], trimmable=True).entry
    prompt = put(cache, [1, 2, 3], trimmable=False).entry
    # an untrimmable (e.g. wrapped ring) descendant must leave the snapshots alone
    out = put(cache, [1, 2, 3, 4, 5], trimmable=False)
    assert out.superseded == ()
    assert len(cache) == 3
    reply = out.entry
    out = put(cache, [1, 2, 3, 4, 5, 6], trimmable=True)
    assert out.superseded == (snap, prompt, reply)  # shortest first
    assert len(cache) == 1 and cache.bytes == 10
    assert cache.stats.superseded == 3
    # siblings are not ancestors
    put(cache, [1, 2, 7], trimmable=True)
    assert len(cache) == 2


def test_evict_in_policy_order_until_under_cap():
    cache, clock = make_cache(max_bytes=25)
    entries = []
    for n in range(4):
        clock.now = n
        entries.append(put(cache, [n, 0, 0], nbytes=10).entry)
    cache.take([0, 0, 0, 1])  # refresh entry 0
    ev = cache.evict()
    assert ev.evicted == (entries[1], entries[2]) and ev.blocked is None
    assert ev.freed_bytes == 20 and cache.bytes == 20
    assert cache.find_exact([1, 0, 0]) is None
    assert cache.evict().evicted == ()


def test_evict_stops_at_first_blocked_victim():
    cache, _ = make_cache(max_bytes=15)
    a, b, c = (put(cache, [n], nbytes=10).entry for n in range(3))
    b.durable = True
    ev = cache.evict(may_evict=lambda e: e.durable)
    # a is coldest and not durable: nothing hotter is evicted in its place
    assert ev.evicted == () and ev.blocked is a
    a.durable = True
    ev = cache.evict(may_evict=lambda e: e.durable)
    assert ev.evicted == (a, b) and ev.blocked is None
    assert cache.stats.blocked == 1 and cache.stats.evictions == 2


def test_oversized_entry_is_inserted_then_evictable():
    cache, _ = make_cache(max_bytes=100)
    out = put(cache, [1, 2, 3], nbytes=500)
    assert out.stored and cache.bytes == 500
    ev = cache.evict(may_evict=lambda e: False)
    assert ev.blocked is out.entry  # a tier can spill it first
    assert cache.evict().evicted == (out.entry,)
    assert cache.bytes == 0 and len(cache) == 0


def test_disabled_cache_stores_nothing():
    cache, _ = make_cache(max_bytes=0)
    out = put(cache, [1, 2, 3])
    assert out == PutOutcome(None) and not out.stored
    assert cache.take([1, 2, 3, 4]) is None
    assert cache.stats.misses == 1 and len(cache) == 0


def test_remove_and_idle_entries():
    cache, clock = make_cache()
    a = put(cache, [1]).entry
    clock.now = 10
    b = put(cache, [2]).entry
    clock.now = 20
    c = put(cache, [3]).entry
    assert cache.idle_entries(idle_for=10) == [a, b]
    assert cache.idle_entries(idle_for=0) == [a, b, c]
    cache.remove(b)
    cache.remove(b)  # idempotent
    replaced = put(cache, [1]).replaced
    cache.remove(replaced)  # a stale entry does not remove its replacement
    assert {tuple(e.tokens) for e in cache.entries()} == {(1,), (3,)}
    assert cache.bytes == 20


def test_numpy_tokens_are_frozen_copies():
    cache, _ = make_cache()
    tokens = np.arange(100, dtype=np.int64)
    entry = put(cache, tokens).entry
    tokens[0] = 99
    assert entry.tokens.dtype == np.int32 and not entry.tokens.flags.writeable
    assert entry.tokens[0] == 0
    assert cache.take(np.arange(101)).usable == 100
    assert cache.find_exact(list(range(100))) is entry


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["lru", "lfu", "cost"]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "take", "evict", "remove"]),
            st.lists(st.integers(0, 2), max_size=7),
            st.sampled_from(["", "x"]),
            st.booleans(),
            st.integers(1, 40),
        ),
        max_size=50,
    ),
)
def test_invariants_against_reference(policy, ops):
    cache, clock = make_cache(max_bytes=60, policy=policy)
    model: dict = {}  # (ns, tokens) -> entry
    for step, (op, tokens, ns, trimmable, nbytes) in enumerate(ops):
        clock.now = step
        key = (ns, tuple(tokens))
        if op == "put":
            out = put(cache, tokens, ns, nbytes=nbytes, trimmable=trimmable)
            assert out.replaced is model.pop(key, None)
            want = [k for k in model if k[0] == ns and len(k[1]) < len(tokens)]
            want = [k for k in want if tuple(tokens[: len(k[1])]) == k[1]] if trimmable else []
            assert sorted(tuple(e.tokens) for e in out.superseded) == sorted(k[1] for k in want)
            for k in want:
                del model[k]
            model[key] = out.entry
        elif op == "take":
            hit = cache.take(tokens, ns)
            assert (hit.usable if hit else 0) == reference_usable(model, ns, tokens)
        elif op == "evict":
            ev = cache.evict(may_evict=lambda e: e.nbytes % 7 != 0)
            for e in ev.evicted:
                del model[(e.namespace, tuple(e.tokens))]
            assert cache.bytes <= cache.max_bytes or ev.blocked is not None
        elif model:
            victim = sorted(model, key=str)[len(tokens) % len(model)]
            cache.remove(model.pop(victim))
        assert cache.bytes == sum(e.nbytes for e in model.values())
        assert set(cache.entries()) == set(model.values())


def reference_usable(model, ns, prompt) -> int:
    limit, best = len(prompt) - 1, 0
    for (entry_ns, tokens), entry in model.items():
        if entry_ns != ns:
            continue
        common = 0
        for a, b in zip(tokens, prompt[:limit], strict=False):
            if a != b:
                break
            common += 1
        if common == len(tokens) or entry.trimmable:
            best = max(best, common)
    return best


def test_policy_must_be_keyword():
    with pytest.raises(TypeError):
        PromptCache(100)
