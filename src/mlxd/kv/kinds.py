"""Signatures, trimmability and zero-copy lending over mlx-lm's cache classes.

A cache entry's payload is a list of mlx-lm per-layer caches. Lending gives a
borrower fresh cache objects that hold *new* array objects — slices of the
entry's arrays — never the entry's own objects: mlx-lm's `update_and_fetch`
assigns into the array object a cache holds, and MLX only copies-on-write
when that object's buffer is shared. So a lend copies no data; the
borrower's first write copies what it needs, and the entry stays
bit-identical whatever the borrower does.

Supported classes (matched exactly, never by subclass): KVCache,
RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList. Anything else —
including the batch variants and ChunkedKVCache — raises `UnknownCacheKind`:
an unknown class is a bug, never a route. These functions build MLX graph
nodes, so they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)


class UnknownCacheKind(TypeError):
    """A cache class this module does not know how to sign, trim or lend."""


def _unknown(cache: Any) -> UnknownCacheKind:
    return UnknownCacheKind(
        f"unknown cache kind {type(cache).__module__}.{type(cache).__qualname__}"
    )


def signature(cache: Any) -> str:
    """Stable storage identity of one layer cache, e.g. "kv" or "quant:8:64"."""
    kind = type(cache)
    if kind is KVCache:
        return "kv"
    if kind is RotatingKVCache:
        return f"rotating:{cache.max_size}:{cache.keep}"
    if kind is QuantizedKVCache:
        return f"quant:{cache.bits}:{cache.group_size}"
    if kind is ArraysCache:
        return f"arrays:{len(cache.cache)}"
    if kind is CacheList:
        return "list(" + ",".join(signature(c) for c in cache.caches) + ")"
    raise _unknown(cache)


def signatures(caches: Sequence[Any]) -> tuple[str, ...]:
    return tuple(signature(c) for c in caches)


def _layer_trimmable(cache: Any) -> bool:
    kind = type(cache)
    if kind in (KVCache, QuantizedKVCache):
        return True
    if kind is RotatingKVCache:
        return cache.offset < cache.max_size  # a wrapped ring has lost its oldest tokens
    if kind is ArraysCache:
        return False  # recurrent state cannot step back
    if kind is CacheList:
        return all(_layer_trimmable(c) for c in cache.caches)
    raise _unknown(cache)


def is_trimmable(caches: Sequence[Any]) -> bool:
    """Whether every layer can drop trailing tokens (checks every layer's kind)."""
    flags = [_layer_trimmable(c) for c in caches]
    return all(flags)


def _layer_offsets(cache: Any) -> list[int]:
    """Token counts of the token-tracking parts of one layer (none for ArraysCache)."""
    kind = type(cache)
    if kind in (KVCache, QuantizedKVCache, RotatingKVCache):
        return [cache.offset]
    if kind is ArraysCache:
        return []
    if kind is CacheList:
        return [n for c in cache.caches for n in _layer_offsets(c)]
    raise _unknown(cache)


def num_tokens(caches: Sequence[Any]) -> int:
    """Tokens the caches encode; every token-tracking layer must agree."""
    offsets = {n for c in caches for n in _layer_offsets(c)}
    if len(offsets) != 1:
        detail = "no layer tracks a token count" if not offsets else f"offsets {sorted(offsets)}"
        raise ValueError(f"cannot tell how many tokens these caches hold: {detail}")
    return offsets.pop()


def _token_slice(array: mx.array, length: int) -> mx.array:
    """A new array object viewing the first `length` tokens (axis -2); no data copy."""
    return array[..., :length, :]


def _lend_kv(cache: KVCache, length: int) -> KVCache:
    lent = KVCache()
    if cache.keys is not None:
        lent.keys = _token_slice(cache.keys, length)
        lent.values = _token_slice(cache.values, length)
    lent.offset = length
    return lent


def _lend_quant(cache: QuantizedKVCache, length: int) -> QuantizedKVCache:
    lent = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    if cache.keys is not None:
        # (packed, scales, biases): groups run along head_dim, so token slicing is exact
        lent.keys = tuple(_token_slice(a, length) for a in cache.keys)
        lent.values = tuple(_token_slice(a, length) for a in cache.values)
    lent.offset = length
    return lent


def _lend_rotating(cache: RotatingKVCache, length: int) -> RotatingKVCache:
    lent = RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if cache.keys is None:
        return lent
    if cache.offset < cache.max_size:
        # before wrapping the ring is linear: token i sits at index i
        lent.keys = _token_slice(cache.keys, length)
        lent.values = _token_slice(cache.values, length)
        lent.offset, lent._idx = length, length
    else:
        # wrapped: only the exact state can be lent; copy the ring position
        lent.keys = cache.keys[...]
        lent.values = cache.values[...]
        lent.offset, lent._idx = cache.offset, cache._idx
    return lent


def _lend_arrays(cache: ArraysCache) -> ArraysCache:
    lent = ArraysCache(len(cache.cache))
    lent.cache = [None if a is None else a[...] for a in cache.cache]
    lent.left_padding, lent.lengths = cache.left_padding, cache.lengths
    return lent


def _lend_layer(cache: Any, length: int) -> Any:
    kind = type(cache)
    if kind is KVCache:
        return _lend_kv(cache, length)
    if kind is QuantizedKVCache:
        return _lend_quant(cache, length)
    if kind is RotatingKVCache:
        return _lend_rotating(cache, length)
    if kind is ArraysCache:
        return _lend_arrays(cache)
    if kind is CacheList:
        return CacheList(*(_lend_layer(c, length) for c in cache.caches))
    raise _unknown(cache)


def lend(caches: Sequence[Any], length: int) -> list[Any]:
    """Fresh caches covering the first `length` tokens, sharing the entry's data.

    Nothing is copied, and nothing the borrower does changes the entry.
    `length` below the entry's token count requires every layer to be trimmable.
    """
    total = num_tokens(caches)
    if not 0 <= length <= total:
        raise ValueError(f"cannot lend {length} tokens from caches holding {total}")
    if length < total and not is_trimmable(caches):
        raise ValueError(f"caches {signatures(caches)} cannot be trimmed from {total} to {length}")
    return [_lend_layer(c, length) for c in caches]


def _sliced_nbytes(array: mx.array, tokens: int) -> int:
    """Bytes of the first `tokens` rows along axis -2 (a dense array's slack excluded)."""
    rows = array.shape[-2]
    return array.nbytes // rows * min(tokens, rows) if rows else 0


def _layer_nbytes(cache: Any) -> int:
    kind = type(cache)
    if kind in (KVCache, RotatingKVCache, QuantizedKVCache):
        if cache.keys is None:
            return 0
        arrays = [cache.keys, cache.values]
        if kind is QuantizedKVCache:
            arrays = [*cache.keys, *cache.values]
        return sum(_sliced_nbytes(a, cache.offset) for a in arrays)
    if kind is ArraysCache:
        return sum(a.nbytes for a in cache.cache if a is not None)
    if kind is CacheList:
        return sum(_layer_nbytes(c) for c in cache.caches)
    raise _unknown(cache)


def nbytes(caches: Sequence[Any]) -> int:
    """Logical bytes: tokens up to each layer's offset, without allocation slack."""
    return sum(_layer_nbytes(c) for c in caches)
