"""kinds: signatures, trimmability, byte counts and zero-copy lending of mlx-lm caches."""

import mlxd  # noqa: F401, I001  # preloads OpenBLAS before mlx

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen3

from models import tiny_qwen3 as _tiny_qwen3
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxd.kv import kinds
from mlxd.kv.kinds import UnknownCacheKind, is_trimmable, lend, nbytes, num_tokens, signature

HEADS, DIM = 2, 64


def kv(n_tokens: int, cls=KVCache, *args, step: int | None = None, **kwargs):
    """A cache of class `cls` fed `n_tokens` random tokens in one prefill."""
    cache = cls(*args, **kwargs)
    if n_tokens:
        keys = mx.random.normal((1, HEADS, n_tokens, DIM))
        values = mx.random.normal((1, HEADS, n_tokens, DIM))
        cache.update_and_fetch(keys, values)
    mx.eval(arrays_of(cache))
    return cache


def decode(cache, steps: int = 3) -> None:
    """Run a borrower: several one-token updates, then a multi-token one."""
    for _ in range(steps):
        cache.update_and_fetch(mx.ones((1, HEADS, 1, DIM)), mx.ones((1, HEADS, 1, DIM)))
    cache.update_and_fetch(mx.ones((1, HEADS, 5, DIM)) * 2, mx.ones((1, HEADS, 5, DIM)) * 2)
    mx.eval(arrays_of(cache))


def arrays_of(cache) -> list:
    """Every mx.array a cache holds (flattened)."""
    if isinstance(cache, CacheList):
        return [a for c in cache.caches for a in arrays_of(c)]
    if isinstance(cache, ArraysCache):
        return [a for a in cache.cache if a is not None]
    if cache.keys is None:
        return []
    if isinstance(cache.keys, tuple):
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]


def snapshot(caches) -> list:
    """Host copies of every array plus the scalar state, to prove nothing changed."""
    out = []
    for c in caches:
        out.append([(id(a), np.array(a)) for a in arrays_of(c)])
        out.append(getattr(c, "offset", None))
        out.append(getattr(c, "_idx", None))
    return out


def assert_unchanged(before, caches) -> None:
    after = snapshot(caches)
    assert len(before) == len(after)
    for b, a in zip(before, after, strict=True):
        if isinstance(b, list):
            assert [i for i, _ in b] == [i for i, _ in a], "entry holds different array objects"
            for (_, x), (_, y) in zip(b, a, strict=True):
                assert x.dtype == y.dtype and np.array_equal(x, y), "entry data changed"
        else:
            assert b == a


def data_pointer(array) -> int:
    return np.asarray(memoryview(array)).__array_interface__["data"][0]


def test_signatures():
    assert signature(KVCache()) == "kv"
    assert signature(RotatingKVCache(max_size=128, keep=4)) == "rotating:128:4"
    assert signature(QuantizedKVCache(group_size=32, bits=4)) == "quant:4:32"
    assert signature(ArraysCache(2)) == "arrays:2"
    nested = CacheList(KVCache(), CacheList(ArraysCache(1), RotatingKVCache(max_size=8)))
    assert signature(nested) == "list(kv,list(arrays:1,rotating:8:0))"
    assert kinds.signatures([KVCache(), ArraysCache(3)]) == ("kv", "arrays:3")


class MyKVCache(KVCache):
    pass


@pytest.mark.parametrize(
    "cache",
    [ChunkedKVCache(64), BatchKVCache([0]), MyKVCache(), object(), CacheList(KVCache(), object())],
    ids=["chunked", "batch", "subclass", "object", "nested"],
)
def test_unknown_kinds_raise_everywhere(cache):
    for fn in (signature, lambda c: is_trimmable([c]), lambda c: nbytes([c])):
        with pytest.raises(UnknownCacheKind):
            fn(cache)


def test_trimmability():
    assert is_trimmable([kv(10), kv(10, QuantizedKVCache, group_size=64, bits=8)])
    assert is_trimmable([kv(10, RotatingKVCache, max_size=16)])
    assert not is_trimmable([kv(16, RotatingKVCache, max_size=16)])  # full ring
    assert not is_trimmable([kv(10), ArraysCache(1)])
    assert is_trimmable([CacheList(kv(4), kv(4))])
    assert not is_trimmable([CacheList(kv(4), ArraysCache(1))])


def test_num_tokens():
    assert num_tokens([kv(7), kv(7, RotatingKVCache, max_size=4), ArraysCache(1)]) == 7
    assert num_tokens([CacheList(kv(3), kv(3))]) == 3
    with pytest.raises(ValueError, match="offsets"):
        num_tokens([kv(3), kv(4)])
    with pytest.raises(ValueError, match="no layer"):
        num_tokens([ArraysCache(1)])
    # a pure-recurrent entry's count is its key's length; tracked counts must agree with it
    assert num_tokens([ArraysCache(1)], total=12) == 12
    assert num_tokens([kv(7)], total=7) == 7
    with pytest.raises(ValueError, match="key"):
        num_tokens([kv(7)], total=8)


def test_pure_recurrent_lends_only_its_exact_state():
    state = ArraysCache(2)
    state[0] = mx.random.normal((1, 4, 8))
    state[1] = mx.random.normal((1, 3))
    entry = [state, ArraysCache(1)]
    before = snapshot(entry)
    with pytest.raises(ValueError, match="no layer"):
        lend(entry, 5)  # a layer cannot say how many tokens it holds: the key must
    with pytest.raises(ValueError, match="cannot be trimmed"):
        lend(entry, 4, total=5)
    lent = lend(entry, 5, total=5)
    assert lent[0][0] is not state[0] and data_pointer(lent[0][0]) == data_pointer(state[0])
    lent[0][0] = lent[0][0] + 1
    mx.eval(lent[0][0])
    assert_unchanged(before, entry)


def test_one_table_row_per_supported_class():
    classes = [k.cls for k in kinds.KINDS]
    assert classes == [KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList]
    assert len({k.name for k in kinds.KINDS}) == len(kinds.KINDS)
    for k in kinds.KINDS:
        assert kinds.kind_of(k.cls.__new__(k.cls)) is k


def test_model_caches_are_checked_at_load():
    kinds.check_model_caches([KVCache(), RotatingKVCache(max_size=8), CacheList(ArraysCache(1), KVCache())])
    with pytest.raises(UnknownCacheKind, match=r"ChunkedKVCache \(layers 1, 2\).*mlxd serves KVCache"):
        kinds.check_model_caches([KVCache(), ChunkedKVCache(8), CacheList(ChunkedKVCache(8))])


def test_nbytes_counts_up_to_offset_without_slack():
    cache = kv(300)  # KVCache allocates 512 rows
    assert cache.keys.shape[2] == 512
    per_token = 2 * HEADS * DIM * 4  # keys + values, fp32
    assert nbytes([cache]) == 300 * per_token
    assert nbytes([KVCache()]) == 0
    quant = kv(300, QuantizedKVCache, group_size=64, bits=8)
    # per token and head: 64 packed bytes + fp32 scale + fp32 bias, for keys and values
    assert nbytes([quant]) == 300 * HEADS * 2 * (64 + 4 + 4)
    ring = kv(300, RotatingKVCache, max_size=128)  # wrapped: the ring holds what it holds
    assert nbytes([ring]) == ring.keys.nbytes + ring.values.nbytes
    state = ArraysCache(2)
    state[0] = mx.zeros((1, 4, 8))
    assert nbytes([state, CacheList(cache, quant)]) == 4 * 8 * 4 + 300 * per_token + nbytes([quant])


@pytest.mark.parametrize(("held", "length"), [(300, 0), (300, 100), (300, 300), (256, 256)])
def test_lend_kv_is_zero_copy_and_isolated(held, length):
    entry = [kv(held)]  # 256 fills KVCache's allocation exactly: no slack to slice off
    before = snapshot(entry)
    mem = mx.get_active_memory()
    (lent,) = lend(entry, length)
    assert lent is not entry[0] and lent.offset == length
    assert lent.keys is not entry[0].keys and lent.values is not entry[0].values
    mx.eval(lent.keys, lent.values)
    assert mx.get_active_memory() == mem  # a view: no buffer was allocated
    if length:
        assert data_pointer(lent.keys) == data_pointer(entry[0].keys)
        assert np.array_equal(np.array(lent.keys), np.array(entry[0].keys)[..., :length, :])
    decode(lent)
    assert lent.offset == length + 8
    assert_unchanged(before, entry)


def test_same_array_object_would_corrupt_the_entry():
    """The trap `lend` avoids: sharing the entry's own array object."""
    entry = kv(10)
    before = snapshot([entry])
    naive = KVCache()
    naive.keys, naive.values, naive.offset = entry.keys, entry.values, 5
    decode(naive, steps=1)
    with pytest.raises(AssertionError, match="data changed"):
        assert_unchanged(before, [entry])


def test_lend_quantized():
    entry = [kv(200, QuantizedKVCache, group_size=64, bits=4)]
    before = snapshot(entry)
    (lent,) = lend(entry, 150)
    assert (lent.bits, lent.group_size, lent.offset) == (4, 64, 150)
    for mine, theirs in zip(lent.keys, entry[0].keys, strict=True):
        assert mine is not theirs and mine.shape[2] == 150
        assert data_pointer(mine) == data_pointer(theirs)
    decode(lent)
    assert_unchanged(before, entry)


def test_lend_rotating_before_and_after_wrap():
    linear = [kv(40, RotatingKVCache, max_size=64, keep=4)]
    before = snapshot(linear)
    (lent,) = lend(linear, 30)
    assert (lent.offset, lent._idx, lent.max_size, lent.keep) == (30, 30, 64, 4)
    decode(lent, steps=40)  # wraps the borrower's ring
    assert_unchanged(before, linear)

    wrapped = [kv(100, RotatingKVCache, max_size=64, keep=4)]
    decode(wrapped[0], steps=2)
    before = snapshot(wrapped)
    with pytest.raises(ValueError, match="cannot be trimmed"):
        lend(wrapped, 90)
    (lent,) = lend(wrapped, wrapped[0].offset)
    assert (lent.offset, lent._idx) == (wrapped[0].offset, wrapped[0]._idx)
    assert lent.keys is not wrapped[0].keys
    decode(lent)
    assert_unchanged(before, wrapped)


def test_lend_arrays_and_lists():
    state = ArraysCache(2)
    state[0] = mx.random.normal((1, 4, 8))
    state[1] = mx.random.normal((1, 3))
    entry = [CacheList(kv(20), state)]
    before = snapshot(entry)
    with pytest.raises(ValueError, match="cannot be trimmed"):
        lend(entry, 10)
    (lent,) = lend(entry, 20)
    lent_kv, lent_state = lent.caches
    assert lent_state[0] is not state[0] and lent_kv.keys is not entry[0].caches[0].keys
    lent_state[0][..., 0] = 5.0  # an in-place write by a borrower
    lent_state[1] = mx.zeros((1, 3))
    decode(lent_kv)
    mx.eval(lent_state[0])
    assert_unchanged(before, entry)


def test_lend_rejects_bad_lengths():
    with pytest.raises(ValueError, match="cannot lend"):
        lend([kv(5)], 6)
    with pytest.raises(ValueError, match="cannot lend"):
        lend([kv(5)], -1)


def tiny_qwen3() -> qwen3.Model:
    return _tiny_qwen3(head_dim=64, max_position_embeddings=4096)


def model_caches(model, kind: str) -> list:
    n = len(model.layers)
    if kind == "kv":
        return [KVCache() for _ in range(n)]
    if kind == "quant":
        return [QuantizedKVCache(group_size=64, bits=8) for _ in range(n)]
    return [RotatingKVCache(max_size=128, keep=4) for _ in range(n)]


def forward(model, tokens, caches) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=caches)
    mx.eval(logits)
    return logits[0, -1]


@pytest.mark.parametrize("kind", ["kv", "quant", "rotating"])
def test_borrower_model_forward_leaves_entry_intact(kind):
    model = tiny_qwen3()
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, size=60).tolist()
    suffix = rng.integers(0, 256, size=9).tolist()
    entry = model_caches(model, kind)
    forward(model, prompt, entry)
    before = snapshot(entry)

    borrowed = lend(entry, 45)
    logits = forward(model, suffix, borrowed)
    for token in suffix[:4]:  # a few decode steps on top
        forward(model, [token], borrowed)
    assert_unchanged(before, entry)

    # the lent prefix is the real state: same logits as a fresh prefill
    fresh = model_caches(model, kind)
    want = forward(model, prompt[:45] + suffix, fresh)
    assert np.allclose(np.array(logits), np.array(want), atol=1e-4)

    # and the entry still serves a second borrower exactly as before
    again = forward(model, suffix, lend(entry, 45))
    assert np.array_equal(np.array(again), np.array(logits))
