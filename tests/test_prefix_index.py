"""PrefixIndex: a compressed radix tree checked against brute-force references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.kv.prefix_index import IndexMatch, PrefixIndex, key_tokens, token_key


def brute_usable(entries: dict, prompt, limit: int) -> int:
    """Best usable length per the seed's rule, over every entry."""
    prompt = tuple(prompt)[: max(limit, 0)]
    best = 0
    for tokens, (_, trimmable) in entries.items():
        common = 0
        for a, b in zip(tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        if common == len(tokens) or trimmable:
            best = max(best, common)
    return best


def check_match(entries: dict, index: PrefixIndex, prompt, limit: int) -> None:
    match = index.longest_usable(prompt, limit=limit)
    want = brute_usable(entries, prompt, limit)
    if want == 0:
        assert match is None
        return
    assert match is not None and match.usable == want
    tokens = next(t for t, (v, _) in entries.items() if v is match.value)
    assert tuple(tokens[: match.usable]) == tuple(prompt[: match.usable])
    exact = len(tokens) == match.usable
    assert exact or entries[tokens][1], "a trimmed entry must be trimmable"
    if not exact:
        # no exact entry could have served the same length
        assert all(len(t) != want or tuple(t) != tuple(prompt[:want]) for t in entries)
        shortest = min(
            len(t)
            for t, (_, trim) in entries.items()
            if trim and tuple(t[:want]) == tuple(prompt[:want])
        )
        assert len(tokens) == shortest


def test_exact_get_insert_remove():
    index = PrefixIndex()
    assert index.insert([1, 2, 3], "a", trimmable=True) is None
    assert index.insert((1, 2, 3, 4, 5), "b", trimmable=False) is None
    assert index.insert(np.array([1, 2, 9]), "c", trimmable=True) is None
    assert len(index) == 3
    assert index.get([1, 2, 3]) == "a"
    assert index.get([1, 2]) is None
    assert index.get([1, 2, 3, 4]) is None
    assert index.insert([1, 2, 3], "a2", trimmable=False) == "a"
    assert len(index) == 3 and index.get((1, 2, 3)) == "a2"
    assert index.remove([1, 2, 3]) == "a2"
    assert index.remove([1, 2, 3]) is None
    assert sorted(index.values()) == ["b", "c"]
    assert sorted(index.items()) == [((1, 2, 3, 4, 5), "b"), ((1, 2, 9), "c")]


def test_edges_are_compressed():
    index = PrefixIndex()
    index.insert(range(10_000), "long", trimmable=True)
    assert index.node_count() == 2  # root + one leaf holding 10k tokens
    index.insert(list(range(5_000)) + [7], "branch", trimmable=True)
    assert index.node_count() == 4  # split node + two leaves
    index.remove(list(range(5_000)) + [7])
    assert index.node_count() == 2  # merged back
    assert index.get(range(10_000)) == "long"


def test_longest_usable_known_answers():
    index = PrefixIndex()
    index.insert([1, 2, 3, 4, 5], "untrim", trimmable=False)
    index.insert([1, 2, 3], "short", trimmable=False)
    index.insert([1, 7, 7, 7, 7, 7], "trim", trimmable=True)
    prompt = [1, 2, 3, 4, 5, 6]
    assert index.longest_usable(prompt, limit=5) == IndexMatch("untrim", 5, 5)
    # capped at len(prompt) - 1: the 5-token entry would need a trim it cannot do
    assert index.longest_usable([1, 2, 3, 4, 5], limit=4) == IndexMatch("short", 3, 3)
    assert index.longest_usable([1, 2, 3, 4, 9, 9], limit=5) == IndexMatch("short", 3, 3)
    # a trimmable entry is usable to where it leaves the prompt
    assert index.longest_usable([1, 7, 7, 7, 1], limit=4) == IndexMatch("trim", 4, 6)
    # a trimmable entry on another branch still serves the shared prefix
    assert index.longest_usable([1, 9], limit=2) == IndexMatch("trim", 1, 6)
    assert index.longest_usable([2, 2], limit=1) is None
    assert index.longest_usable([1, 2, 3], limit=0) is None


def test_prefers_exact_then_shortest_trimmable():
    index = PrefixIndex()
    index.insert([1, 2, 3, 4, 5, 6, 7, 8], "long", trimmable=True)
    index.insert([1, 2, 3, 4, 5, 6], "mid", trimmable=True)
    index.insert([1, 2, 3, 4], "exact", trimmable=False)
    assert index.longest_usable([1, 2, 3, 4, 0], limit=4).value == "exact"
    assert index.longest_usable([1, 2, 3, 4, 5, 0], limit=5) == IndexMatch("mid", 5, 6)
    index.remove([1, 2, 3, 4, 5, 6])
    assert index.longest_usable([1, 2, 3, 4, 5, 0], limit=5) == IndexMatch("long", 5, 8)


def test_strict_ancestors():
    index = PrefixIndex()
    index.insert([], "root", trimmable=True)
    index.insert([1], "one", trimmable=True)
    index.insert([1, 2, 3], "three", trimmable=False)
    index.insert([1, 2, 4], "other", trimmable=False)
    assert index.strict_ancestors([1, 2, 3]) == ["root", "one"]
    assert index.strict_ancestors([1, 2, 3, 4]) == ["root", "one", "three"]
    assert index.strict_ancestors([]) == []


def test_token_key_roundtrip_and_overflow():
    key = token_key([0, 1, 150_000, 2**31 - 1])
    assert key.num_tokens == 4
    assert key_tokens(key) == (0, 1, 150_000, 2**31 - 1)
    assert token_key(np.array([5, 6], dtype=np.int64)) == token_key((5, 6))
    with pytest.raises(OverflowError):
        token_key([2**40])
    with pytest.raises(TypeError):
        token_key(b"\x01\x02")


# Small alphabet so random sequences share prefixes and diverge mid-edge.
token_lists = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "del"]), token_lists, st.booleans()), max_size=40
    ),
    prompts=st.lists(token_lists, min_size=1, max_size=8),
)
def test_matches_brute_force(ops, prompts):
    index, entries = PrefixIndex(), {}
    for n, (op, tokens, trimmable) in enumerate(ops):
        key = tuple(tokens)
        if op == "put":
            old = index.insert(tokens, n, trimmable=trimmable)
            assert old == (entries[key][0] if key in entries else None)
            entries[key] = (n, trimmable)
        else:
            assert index.remove(tokens) == entries.pop(key, (None,))[0]
        assert len(index) == len(entries)
    assert dict(index.items()) == {k: v for k, (v, _) in entries.items()}
    for prompt in prompts + [list(k) + [0] for k in entries]:
        for limit in {len(prompt) - 1, len(prompt), len(prompt) // 2}:
            check_match(entries, index, prompt, limit)
        want = [
            v
            for k, (v, _) in entries.items()
            if len(k) < len(prompt) and tuple(prompt[: len(k)]) == k
        ]
        assert sorted(index.strict_ancestors(prompt)) == sorted(want)
    # subtree counts stay exact after every split and merge
    assert index._root.trim_count == sum(t for _, t in entries.values())


def test_large_tokens_and_numpy_prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 150_000, size=50_000, dtype=np.int32)
    index = PrefixIndex()
    index.insert(base, "a", trimmable=True)
    index.insert(np.concatenate([base[:30_000], [1, 2, 3]]), "b", trimmable=False)
    prompt = np.concatenate([base[:40_000], [9]])
    assert index.longest_usable(prompt, limit=len(prompt) - 1) == IndexMatch("a", 40_000, 50_000)
    assert index.longest_usable(prompt.tolist(), limit=len(prompt) - 1).usable == 40_000
