"""The session checkpoint index (seed §5.12): the pure index, eviction preference, and the HTTP surface."""

from __future__ import annotations

from mlxd.kv.prefix_index import token_key
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.sessions import SessionIndex


def test_a_session_points_at_its_latest_checkpoint_and_falls_back_when_it_does_not_fit():
    idx = SessionIndex()
    idx.advance("s1", "", (1, 2, 3))
    idx.advance("s1", "", (1, 2, 3, 4, 5))
    assert idx.latest("s1", "") == token_key((1, 2, 3, 4, 5))
    assert not idx.referenced("", (1, 2, 3)), "advancing drops the old reference"
    assert idx.referenced("", (1, 2, 3, 4, 5))
    assert idx.usable_for("s1", "", token_key((1, 2, 3, 4, 5, 6, 7))) == token_key((1, 2, 3, 4, 5))
    assert idx.usable_for("s1", "", token_key((1, 2, 9, 4, 5, 6))) is None  # an edited history
    assert idx.usable_for("s1", "", token_key((1, 2, 3, 4, 5))) is None  # not shorter than the prompt
    assert idx.usable_for("s1", "other-ns", token_key((1, 2, 3, 4, 5, 6))) is None  # namespaces are apart
    assert idx.usable_for("nobody", "", token_key((1, 2))) is None
    assert (idx.stats.hits, idx.stats.fallbacks) == (1, 2)


def test_close_drops_references_in_every_namespace():
    idx = SessionIndex()
    idx.advance("s1", "", (1, 2))
    idx.advance("s1", "lora", (1, 2))
    idx.advance("s2", "", (1, 2))  # two sessions share one checkpoint
    assert idx.close("s1")
    assert not idx.close("s1"), "closing twice: unknown"
    assert idx.referenced("", (1, 2)) and not idx.referenced("lora", (1, 2))
    assert idx.close("s2") and not idx.referenced("", (1, 2))
    assert len(idx) == 0 and idx.stats.closed == 2


def _fill(cache: PromptCache, n: int) -> list:
    out = []
    for i in range(n):
        out.append(cache.put((i, i + 1000), payload=None, nbytes=10, trimmable=True).entry)
    return out


def test_eviction_prefers_entries_no_session_references_but_does_not_pin():
    idx = SessionIndex()
    cache = PromptCache(max_bytes=100)
    entries = _fill(cache, 10)
    for e in entries[:3]:  # the three least recently used belong to sessions
        idx.advance(f"s{e.tokens[0]}", "", e.tokens)
    cache.put((99, 1), payload=None, nbytes=30, trimmable=True)  # 30 bytes over the cap

    def anonymous(entry) -> bool:
        return not idx.referenced(entry.namespace, entry.tokens)

    gone = cache.evict(prefer=anonymous).evicted
    assert [e.tokens for e in gone] == [entries[i].tokens for i in (3, 4, 5)]
    assert all(cache.find_exact(e.tokens) is not None for e in entries[:3])
    # Under more pressure than anonymous entries can relieve, referenced ones go too.
    cache.put((98, 1), payload=None, nbytes=90, trimmable=True)
    idx.advance("s-new", "", (98, 1))
    gone = cache.evict(prefer=anonymous).evicted
    assert [e.tokens for e in gone][-2:] == [entries[0].tokens, entries[1].tokens]
    assert cache.find_exact((98, 1)) is not None
    assert cache.bytes <= cache.max_bytes


def test_take_exact_counts_a_hit_without_a_scan():
    cache = PromptCache(max_bytes=1000)
    cache.put((1, 2, 3), payload=None, nbytes=10, trimmable=True)
    hit = cache.take_exact((1, 2, 3), "", prompt_tokens=5)
    assert hit is not None and hit.usable == 3
    assert cache.take_exact((1, 2), "", prompt_tokens=5) is None
    # Not resident: nothing counted (the caller falls back to `take`, which counts).
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (1, 0, 3)
