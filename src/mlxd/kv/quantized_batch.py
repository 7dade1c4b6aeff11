"""Continuous batching over affine-quantized KV (mlx-lm's QuantizedKVCache).

mlx-lm 0.32's BatchGenerator merges each row's caches with the cache class's
`merge`, and QuantizedKVCache has none, so a quantized row cannot join a
batch. `BatchQuantizedKVCache` is BatchKVCache's layout (left-padded rows, one
write index, per-row offsets) over quantized triples (packed, scales, biases):
every operation BatchKVCache does to one array it does to each part. Tokens
are quantized one by one (groups run along head_dim), so a row's stored KV
and its logits do not depend on what it was batched with, on chunking, or on
whether its prefix came from a cache hit. Attention dispatches on the `bits`
attribute to mlx-lm's quantized SDPA, which takes the batch mask.

Rows join through `MergeableQuantizedKVCache`: a QuantizedKVCache with a
`merge`. It only lives inside the generator; what leaves it (`extract`) is a
plain QuantizedKVCache, the class the cache tiers store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

Parts = tuple[mx.array, mx.array, mx.array]  # packed uint32, scales, biases


def _map(fn: Any, parts: Parts) -> Parts:
    return tuple(fn(p) for p in parts)  # type: ignore[return-value]


def _ints(a: mx.array) -> list[int]:
    values: list[Any] = a.tolist()  # type: ignore[assignment]
    return [int(v) for v in values]


def kept_padding(left_padding: mx.array, batch_indices: Sequence[int]) -> tuple[mx.array, int]:
    """(the kept rows' left padding less the padding they all share, as a new array; that shared padding).

    A batch cache's `filter` (rows leaving): `left_padding` is read as it stands, with no device op queued for
    it, so an evaluated array is read at once, not behind the forward in flight (model/batch_filter.py); the
    result is made from host values, so the next read of it waits on nothing either. `batch_indices` must not
    be empty."""
    pads = _ints(left_padding)
    kept = [pads[int(i)] for i in batch_indices]
    shared = min(kept)
    return mx.array([p - shared for p in kept], dtype=left_padding.dtype), shared


class BatchQuantizedKVCache(BatchKVCache):
    """A batch of quantized KV rows, left-padded (see BatchKVCache)."""

    # BatchKVCache's state, typed here for mypy (mlx-lm is untyped)
    _idx: int
    offset: mx.array
    left_padding: mx.array
    _right_padding: mx.array | None

    def __init__(self, left_padding: list[int], *, group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits
        self.keys: Parts | None = None  # type: ignore[assignment]
        self.values: Parts | None = None  # type: ignore[assignment]

    def _empty_parts(self, like: Parts, tokens: int) -> Parts:
        return _map(lambda p: mx.zeros((*p.shape[:2], tokens, p.shape[3]), dtype=p.dtype), like)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        qk: Parts = mx.quantize(keys, group_size=self.group_size, bits=self.bits)  # type: ignore[assignment]
        qv: Parts = mx.quantize(values, group_size=self.group_size, bits=self.bits)  # type: ignore[assignment]
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            new_k, new_v = self._empty_parts(qk, grow), self._empty_parts(qv, grow)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                cut = (lambda p: p[..., :prev, :]) if prev % self.step else (lambda p: p)
                self.keys = tuple(mx.concatenate([cut(a), b], axis=2) for a, b in zip(self.keys, new_k, strict=True))  # type: ignore[assignment]
                self.values = tuple(mx.concatenate([cut(a), b], axis=2) for a, b in zip(self.values, new_v, strict=True))  # type: ignore[assignment]
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + n
        self._idx += n
        for dst, src in ((self.keys, qk), (self.values, qv)):
            for d, s in zip(dst, src, strict=True):
                d[..., prev : self._idx, :] = s
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        head = lambda p: p[..., : self._idx, :]  # noqa: E731
        return _map(head, self.keys), _map(head, self.values)

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            assert self.keys is not None and self.values is not None
            roll = lambda p: dynamic_roll(p, padding[:, None], axis=2)  # noqa: E731
            self.keys, self.values = _map(roll, self.keys), _map(roll, self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda p: p[batch_indices], self.keys)
            self.values = _map(lambda p: p[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        # the padding read as it stands, not gathered behind the forward in flight (model/batch_filter.py)
        self.left_padding, min_left_pad = kept_padding(self.left_padding, batch_indices)
        if min_left_pad > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda p: p[..., min_left_pad:, :], self.keys)
                self.values = _map(lambda p: p[..., min_left_pad:, :], self.values)
            self._idx -= min_left_pad

    def extend(self, other: BatchQuantizedKVCache) -> None:  # type: ignore[override]
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like_k = self.keys if self.keys is not None else other.keys
        like_v = self.values if self.values is not None else other.values
        assert like_k is not None and like_v is not None
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache) -> tuple[Parts, Parts, mx.array, mx.array]:
            rows = c.offset.shape[0]
            k = c.keys if c.keys is not None else _map(lambda p: mx.zeros((rows, *p.shape[1:2], 0, p.shape[3]), dtype=p.dtype), like_k)
            v = c.values if c.values is not None else _map(lambda p: mx.zeros((rows, *p.shape[1:2], 0, p.shape[3]), dtype=p.dtype), like_v)
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = _map(lambda p: p[..., :right, :], k), _map(lambda p: p[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = _map(lambda p: mx.pad(p, widths), k), _map(lambda p: mx.pad(p, widths), v)
            return k, v, c.offset, c.left_padding + left

        (ka, va, oa, la), (kb, vb, ob, lb) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(ka, kb, strict=True))  # type: ignore[assignment]
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(va, vb, strict=True))  # type: ignore[assignment]
        self.offset = mx.concatenate([oa, ob])
        self.left_padding = mx.concatenate([la, lb])
        self._idx = max_idx

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None or self.values is None:
            return cache
        padding = _ints(self.left_padding)[idx]
        row = lambda p: mx.contiguous(p[idx : idx + 1, :, padding : self._idx])  # noqa: E731
        cache.keys, cache.values = _map(row, self.keys), _map(row, self.values)
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:  # type: ignore[override]
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("cannot batch quantized caches of different schemes")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size=group_size, bits=bits)
        padding = [longest - n for n in lengths]
        full = next(c for c in caches if c.keys is not None)

        def stack(side: str) -> Parts:
            like: Parts = getattr(full, side)
            out = _map(lambda p: mx.zeros((len(caches), p.shape[1], longest, p.shape[3]), dtype=p.dtype), like)
            for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
                src = getattr(c, side)
                if src is None:
                    continue
                for d, s in zip(out, src, strict=True):
                    d[i : i + 1, :, pad : pad + c.offset] = s[..., : c.offset, :]
            return out

        cache = cls(padding, group_size=group_size, bits=bits)
        cache.keys, cache.values = stack("keys"), stack("values")
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(p.nbytes for p in (*self.keys, *self.values))


class MergeableQuantizedKVCache(QuantizedKVCache):
    """A row's QuantizedKVCache that can join a batch (generator-internal only)."""

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @classmethod
    def of(cls, cache: QuantizedKVCache) -> MergeableQuantizedKVCache:
        """The same state (the same array objects: a lent cache's own fresh ones)."""
        row = cls(group_size=cache.group_size, bits=cache.bits)
        row.keys, row.values, row.offset = cache.keys, cache.values, cache.offset
        return row


def batchable(caches: list[Any]) -> list[Any]:
    """A row's caches with every QuantizedKVCache made mergeable (inside CacheLists too)."""
    from mlx_lm.models.cache import CacheList

    def one(c: Any) -> Any:
        if type(c) is QuantizedKVCache:
            return MergeableQuantizedKVCache.of(c)
        if type(c) is CacheList:
            return CacheList(*(one(x) for x in c.caches))
        return c

    return [one(c) for c in caches]


def quantized_like(caches: list[Any], *, group_size: int, bits: int) -> list[Any]:
    """A fresh row's caches: every plain KVCache layer quantized, other kinds unchanged.

    Sliding-window rings and recurrent state keep their precision: mlx-lm's
    `to_quantized` of a RotatingKVCache would drop the window.

    The attention half of a hybrid layer (a KVCache inside a CacheList, as in
    falcon_h1) is quantized too: a scheme applies to every attention cache.
    """
    from mlx_lm.models.cache import CacheList, KVCache

    def one(c: Any) -> Any:
        if type(c) is KVCache:
            return QuantizedKVCache(group_size=group_size, bits=bits)
        if type(c) is CacheList:
            return CacheList(*(one(x) for x in c.caches))
        return c

    return [one(c) for c in caches]
