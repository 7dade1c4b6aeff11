"""Every mlx-lm cache class mlxd knows, as one table per kind.

A cache entry's payload is a list of mlx-lm per-layer caches. Each supported
class has one `Kind` row saying how to sign it (its storage identity), whether
it can drop trailing tokens, which token counts it tracks, how to lend it,
how many bytes it holds, and how to plan it for the SSD writer and adopt it
back from loaded bytes (the MLX half of the `.mlxkv` file format, whose
header / write / read modules import no MLX).

Lending gives a borrower fresh cache objects that hold *new* array objects —
slices of the entry's arrays — never the entry's own objects: mlx-lm's
`update_and_fetch` assigns into the array object a cache holds, and MLX only
copies-on-write when that object's buffer is shared. So a lend copies no
data; the borrower's first write copies what it needs, and the entry stays
bit-identical whatever the borrower does.

Supported classes (matched exactly, never by subclass): KVCache,
RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList. Anything else —
including the batch variants and ChunkedKVCache — raises `UnknownCacheKind`:
an unknown class is a bug, never a route; `check_model_caches` applies the
same rule to a model's `make_cache()` when it loads. A pure-recurrent model
(ArraysCache only) tracks no token count in any layer: the count is the
checkpoint key's length, which callers pass as `total`. These functions
build MLX graph nodes, so they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxd.kv.file_format import (
    CacheDesc,
    FileHeader,
    Landing,
    LoadedSnapshot,
    SnapshotMeta,
    SnapshotPlan,
    TensorDesc,
    UnsupportedCache,
)
from mlxd.kv.file_format.header import NP_DTYPES

_MX_DTYPES = {name: getattr(mx, "bool_" if name == "bool" else name) for name in NP_DTYPES}
_MX_NAMES = {dt: name for name, dt in _MX_DTYPES.items()}

Take = Callable[[TensorDesc | None], "mx.array | None"]  # the next loaded tensor, in file order


class UnknownCacheKind(UnsupportedCache):
    """A cache class this module does not know how to sign, trim, lend or store."""


def _unknown(cache: Any) -> UnknownCacheKind:
    return UnknownCacheKind(
        f"unknown cache kind {type(cache).__module__}.{type(cache).__qualname__}"
    )


@attrs.frozen
class Kind:
    """What mlxd does with one mlx-lm cache class (one row of the table)."""

    name: str  # the kind in the file header
    cls: type
    sign: Callable[[Any], str]  # storage identity, e.g. "kv" or "quant:8:64"
    trimmable: Callable[[Any], bool]  # can it drop trailing tokens?
    offsets: Callable[[Any], list[int]]  # token counts its parts track (none when recurrent)
    lend: Callable[[Any, int], Any]  # a fresh cache of the first n tokens, sharing data
    nbytes: Callable[[Any], int]  # logical bytes, without allocation slack
    plan: Callable[[Any, list[mx.array]], CacheDesc]  # descriptor; appends its arrays
    adopt: Callable[[CacheDesc, Take], Any]  # a cache from a descriptor and loaded tensors


# ----------------------------------------------------------------- helpers


def _token_slice(array: mx.array, length: int) -> mx.array:
    """A new array object viewing the first `length` tokens (axis -2); no data copy."""
    return array[..., :length, :]


def _sliced_nbytes(array: mx.array, tokens: int) -> int:
    """Bytes of the first `tokens` rows along axis -2 (a dense array's slack excluded)."""
    rows = array.shape[-2]
    return array.nbytes // rows * min(tokens, rows) if rows else 0


def numpy_dtype(a: mx.array) -> np.dtype:
    """The numpy dtype of an MLX array's elements, as the file format names them (bfloat16 has none: plans view
    it as uint16 first)."""
    return np.dtype(NP_DTYPES[_MX_NAMES[a.dtype]])  # type: ignore[call-overload]


def _tensor(a: mx.array, out: list[mx.array]) -> TensorDesc:
    if a.dtype not in _MX_NAMES:
        raise UnsupportedCache(f"unsupported dtype {a.dtype}")
    out.append(a)
    return TensorDesc(dtype=_MX_NAMES[a.dtype], shape=tuple(a.shape), nbytes=a.nbytes)


# ------------------------------------------------------------------ KVCache


def _lend_kv(cache: KVCache, length: int) -> KVCache:
    lent = KVCache()
    if cache.keys is not None:
        lent.keys = _token_slice(cache.keys, length)
        lent.values = _token_slice(cache.values, length)
    lent.offset = length
    return lent


def _kv_nbytes(cache: KVCache | RotatingKVCache) -> int:
    if cache.keys is None:
        return 0
    return sum(_sliced_nbytes(a, cache.offset) for a in (cache.keys, cache.values))


def _plan_kv(c: KVCache, out: list[mx.array]) -> CacheDesc:
    if c.keys is None or c.offset == 0:
        return CacheDesc(kind="kv")
    n = c.offset
    tensors = (_tensor(c.keys[..., :n, :], out), _tensor(c.values[..., :n, :], out))
    return CacheDesc(kind="kv", offset=n, tensors=tensors)


def _adopt_kv(c: CacheDesc, take: Take) -> KVCache:
    parts = [take(t) for t in c.tensors]
    cache = KVCache()
    if parts:
        cache.keys, cache.values = parts
        cache.offset = c.offset
    return cache


KV = Kind(
    name="kv",
    cls=KVCache,
    sign=lambda c: "kv",
    trimmable=lambda c: True,
    offsets=lambda c: [c.offset],
    lend=_lend_kv,
    nbytes=_kv_nbytes,
    plan=_plan_kv,
    adopt=_adopt_kv,
)


# ---------------------------------------------------------- RotatingKVCache


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


def _plan_rotating(c: RotatingKVCache, out: list[mx.array]) -> CacheDesc:
    params = {"max_size": c.max_size, "keep": c.keep, "idx": c._idx}
    if c.keys is None:
        return CacheDesc(kind="rotating", offset=c.offset, **params)
    # Before the ring wraps, slots past `offset` are slack; after, the whole ring is live.
    n = c.offset if c._idx == c.offset and c.offset <= c.keys.shape[2] else c.keys.shape[2]
    tensors = (_tensor(c.keys[..., :n, :], out), _tensor(c.values[..., :n, :], out))
    return CacheDesc(kind="rotating", offset=c.offset, tensors=tensors, **params)


def _adopt_rotating(c: CacheDesc, take: Take) -> RotatingKVCache:
    parts = [take(t) for t in c.tensors]
    cache = RotatingKVCache(max_size=c.max_size, keep=c.keep or 0)
    if parts:
        cache.keys, cache.values = parts
    cache.offset, cache._idx = c.offset, c.idx or 0
    return cache


ROTATING = Kind(
    name="rotating",
    cls=RotatingKVCache,
    sign=lambda c: f"rotating:{c.max_size}:{c.keep}",
    # a wrapped ring has lost its oldest tokens: only its exact state is reusable
    trimmable=lambda c: c.offset < c.max_size,
    offsets=lambda c: [c.offset],
    lend=_lend_rotating,
    nbytes=_kv_nbytes,
    plan=_plan_rotating,
    adopt=_adopt_rotating,
)


# --------------------------------------------------------- QuantizedKVCache


def _lend_quant(cache: QuantizedKVCache, length: int) -> QuantizedKVCache:
    lent = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    if cache.keys is not None:
        # (packed, scales, biases): groups run along head_dim, so token slicing is exact
        lent.keys = tuple(_token_slice(a, length) for a in cache.keys)
        lent.values = tuple(_token_slice(a, length) for a in cache.values)
    lent.offset = length
    return lent


def _quant_nbytes(cache: QuantizedKVCache) -> int:
    if cache.keys is None:
        return 0
    return sum(_sliced_nbytes(a, cache.offset) for a in (*cache.keys, *cache.values))


def _plan_quant(c: QuantizedKVCache, out: list[mx.array]) -> CacheDesc:
    params = {"bits": c.bits, "group_size": c.group_size}
    if c.keys is None or c.offset == 0:
        return CacheDesc(kind="quant", **params)
    n = c.offset
    parts = [*c.keys, *c.values]
    tensors = tuple(_tensor(p[..., :n, :], out) for p in parts)
    return CacheDesc(kind="quant", offset=n, tensors=tensors, **params)


def _adopt_quant(c: CacheDesc, take: Take) -> QuantizedKVCache:
    parts = [take(t) for t in c.tensors]
    cache = QuantizedKVCache(group_size=c.group_size or 64, bits=c.bits or 8)
    if parts:
        half = len(parts) // 2
        cache.keys, cache.values = tuple(parts[:half]), tuple(parts[half:])
        cache.offset = c.offset
    return cache


QUANT = Kind(
    name="quant",
    cls=QuantizedKVCache,
    sign=lambda c: f"quant:{c.bits}:{c.group_size}",
    trimmable=lambda c: True,
    offsets=lambda c: [c.offset],
    lend=_lend_quant,
    nbytes=_quant_nbytes,
    plan=_plan_quant,
    adopt=_adopt_quant,
)


# -------------------------------------------------------------- ArraysCache


def _lend_arrays(cache: ArraysCache, length: int) -> ArraysCache:
    lent = ArraysCache(len(cache.cache))
    lent.cache = [None if a is None else a[...] for a in cache.cache]
    lent.left_padding, lent.lengths = cache.left_padding, cache.lengths
    return lent


def _plan_arrays(c: ArraysCache, out: list[mx.array]) -> CacheDesc:
    if c.left_padding is not None or c.lengths is not None:
        raise UnsupportedCache("ArraysCache carries batch state (left_padding/lengths)")
    tensors = tuple(None if a is None else _tensor(a[...], out) for a in c.cache)
    return CacheDesc(kind="arrays", tensors=tensors)


def _adopt_arrays(c: CacheDesc, take: Take) -> ArraysCache:
    cache = ArraysCache(len(c.tensors))
    cache.cache = [take(t) for t in c.tensors]
    return cache


ARRAYS = Kind(
    name="arrays",
    cls=ArraysCache,
    sign=lambda c: f"arrays:{len(c.cache)}",
    trimmable=lambda c: False,  # recurrent state cannot step back
    offsets=lambda c: [],  # tracks no token count: the checkpoint's key does
    lend=_lend_arrays,
    nbytes=lambda c: sum(a.nbytes for a in c.cache if a is not None),
    plan=_plan_arrays,
    adopt=_adopt_arrays,
)


# ---------------------------------------------------------------- CacheList


def _adopt_list(c: CacheDesc, take: Take) -> CacheList:
    return CacheList(*(_BY_NAME[x.kind].adopt(x, take) for x in c.children))


LIST = Kind(
    name="list",
    cls=CacheList,
    sign=lambda c: "list(" + ",".join(signature(x) for x in c.caches) + ")",
    trimmable=lambda c: all(kind_of(x).trimmable(x) for x in c.caches),
    offsets=lambda c: [n for x in c.caches for n in kind_of(x).offsets(x)],
    lend=lambda c, n: CacheList(*(kind_of(x).lend(x, n) for x in c.caches)),
    nbytes=lambda c: sum(kind_of(x).nbytes(x) for x in c.caches),
    plan=lambda c, out: CacheDesc(kind="list", children=tuple(kind_of(x).plan(x, out) for x in c.caches)),
    adopt=_adopt_list,
)


KINDS: tuple[Kind, ...] = (KV, ROTATING, QUANT, ARRAYS, LIST)
_BY_CLASS: dict[type, Kind] = {k.cls: k for k in KINDS}
_BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}


def kind_of(cache: Any) -> Kind:
    """The table row of this cache's exact class; UnknownCacheKind otherwise."""
    kind = _BY_CLASS.get(type(cache))
    if kind is None:
        raise _unknown(cache)
    return kind


# ------------------------------------------------------------ whole entries


def signature(cache: Any) -> str:
    """Stable storage identity of one layer cache, e.g. "kv" or "quant:8:64"."""
    return kind_of(cache).sign(cache)


def signatures(caches: Sequence[Any]) -> tuple[str, ...]:
    return tuple(signature(c) for c in caches)


def is_trimmable(caches: Sequence[Any]) -> bool:
    """Whether every layer can drop trailing tokens (checks every layer's kind)."""
    flags = [kind_of(c).trimmable(c) for c in caches]
    return all(flags)


def tracked_tokens(caches: Sequence[Any]) -> int | None:
    """The token count the layers agree on, or None when no layer tracks one (pure recurrent)."""
    offsets = {n for c in caches for n in kind_of(c).offsets(c)}
    if len(offsets) > 1:
        raise ValueError(f"cannot tell how many tokens these caches hold: offsets {sorted(offsets)}")
    return offsets.pop() if offsets else None


def num_tokens(caches: Sequence[Any], *, total: int | None = None) -> int:
    """Tokens the caches encode: `total` (the checkpoint key's length) checked against every layer.

    Without `total`, some layer must track a count.
    """
    tracked = tracked_tokens(caches)
    if total is None:
        if tracked is None:
            raise ValueError("cannot tell how many tokens these caches hold: no layer tracks a token count")
        return tracked
    if tracked is not None and tracked != total:
        raise ValueError(f"caches hold {tracked} tokens, their key {total}")
    return total


def lend(caches: Sequence[Any], length: int, *, total: int | None = None) -> list[Any]:
    """Fresh caches covering the first `length` tokens, sharing the entry's data.

    Nothing is copied, and nothing the borrower does changes the entry.
    `total` is the entry's token count (its key's length; required for a pure
    recurrent entry). `length` below it requires every layer to be trimmable.
    """
    held = num_tokens(caches, total=total)
    if not 0 <= length <= held:
        raise ValueError(f"cannot lend {length} tokens from caches holding {held}")
    if length < held and not is_trimmable(caches):
        raise ValueError(f"caches {signatures(caches)} cannot be trimmed from {held} to {length}")
    return [kind_of(c).lend(c, length) for c in caches]


def extend(caches: Sequence[Any], tail: Sequence[Any], *, skip: int, upto: int) -> bool:
    """Append the token rows [skip, upto) of `tail` to `caches`, layer by layer (engine thread).

    `tail` holds the KV of a run of tokens alone (`adopt` of a `blocks.trailing` read: plain attention
    caches whose offset is the run's length); `caches` a row's, holding the tokens before the run's
    first appended one. Each layer takes the rows through its own `update_and_fetch`, as the forward
    pass over those tokens would have. False, with nothing changed, where the layers do not pair up
    (a layer of another kind, or a run shorter than `upto`).
    """
    if len(caches) != len(tail) or not 0 <= skip < upto:
        return False
    if not all(type(t) is KVCache and t.keys is not None and t.offset >= upto for t in tail):
        return False
    if not all(hasattr(c, "update_and_fetch") and getattr(c, "offset", None) is not None for c in caches):
        return False
    for c, t in zip(caches, tail, strict=True):
        c.update_and_fetch(t.keys[..., skip:upto, :], t.values[..., skip:upto, :])
    return True


def nbytes(caches: Sequence[Any]) -> int:
    """Logical bytes: tokens up to each layer's offset, without allocation slack."""
    return sum(kind_of(c).nbytes(c) for c in caches)


def check_model_caches(caches: Sequence[Any]) -> None:
    """Raise UnknownCacheKind naming every layer class this module cannot serve (at model load)."""
    bad: dict[str, list[int]] = {}

    def visit(c: Any, layer: int) -> None:
        if type(c) is CacheList:
            for x in c.caches:
                visit(x, layer)
        elif type(c) not in _BY_CLASS:
            bad.setdefault(f"{type(c).__module__}.{type(c).__qualname__}", []).append(layer)

    for i, c in enumerate(caches):
        visit(c, i)
    if bad:
        listed = "; ".join(f"{name} (layers {', '.join(map(str, layers))})" for name, layers in bad.items())
        known = ", ".join(k.cls.__name__ for k in KINDS)
        raise UnknownCacheKind(f"this model's caches are not supported: {listed}; mlxd serves {known}")


# ------------------------------------------------ the file format's MLX half


def plan_snapshot(
    caches: Sequence[Any], *, meta: SnapshotMeta, pack_max_bytes: int = 0, device: bool = False
) -> SnapshotPlan:
    """Describe mlx-lm caches for writing (engine thread: evaluates arrays).

    Plain and quantized KV tensors are sliced to `offset`. Every array handed
    to the writer is a *new* array object (a slice), so the cache can keep
    decoding in place without touching the bytes being written.

    `pack_max_bytes` (`MLXD_PLAN_PACK_MB`; 0: never): a plan of several tensors and at most that many bytes is
    written from one packed copy of them (`packed_buffers`), not from the caches' own arrays.

    `device` (CUDA, `MLXD_PLAN_DEVICE`; only for a writer that stages: the SSD writer, the generation
    checkpointer): the buffers are the arrays' device addresses (`runtime/device_pointers.py`), so no host access
    converts them to managed memory here; the plan is `on_device` and keeps the arrays. Where addresses cannot be
    had (off CUDA), memoryviews.
    """
    arrays: list[mx.array] = []
    descs = tuple(kind_of(c).plan(c, arrays) for c in caches)
    mx.eval(arrays)
    views = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    if len(views) > 1 and 0 < sum(a.nbytes for a in views) <= pack_max_bytes:
        return SnapshotPlan(meta=meta, caches=descs, buffers=packed_buffers(views), packed=True)
    if device:
        from mlxd.runtime import device_pointers

        on_device = device_pointers.device_views(views)  # (on the current stream: the engine's planning one)
        if on_device is not None:
            addressed = tuple(memoryview(v) for v in on_device)  # type: ignore[arg-type]
            return SnapshotPlan(meta=meta, caches=descs, buffers=addressed, on_device=True, keep=tuple(views))
    buffers = tuple(memoryview(a) for a in views)  # type: ignore[arg-type]
    return SnapshotPlan(meta=meta, caches=descs, buffers=buffers)


def packed_buffers(arrays: Sequence[mx.array]) -> tuple[memoryview, ...]:
    """The arrays' bytes copied into one new MLX array (one device copy), and one host view per array into it,
    each of its array's shape and dtype (C-contiguous), the packed array kept alive by them.

    On MLX's CUDA backend an array's first host access converts its buffer to managed memory (an allocation and
    a synchronous copy with the GIL held, per buffer): a plan of many small tensors (a finished row's final
    checkpoint: 2 per layer) pays that once, not once per tensor, and the caches' own arrays, which the RAM tier
    keeps and lends, stay device memory. The copy lives as long as the plan (until the writer is done with it).
    """
    if len({a.dtype for a in arrays}) == 1:  # (the usual plan: one copy, then a free byte view of the whole)
        flat = mx.concatenate([a.reshape(-1) for a in arrays]).view(mx.uint8)
    else:
        flat = mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays])  # (0-d arrays too)
    mx.eval(flat)
    host = np.frombuffer(memoryview(flat), dtype=np.uint8)  # type: ignore[arg-type]  # the one conversion
    out, at = [], 0
    for a in arrays:
        n = a.nbytes
        out.append(memoryview(host[at : at + n].view(numpy_dtype(a)).reshape(a.shape)))
        at += n
    return tuple(out)


def landing(header: FileHeader) -> Landing:
    """MLX arrays for a file's tensors to be read into (engine thread): `read_snapshot(land=...)`.

    Each is allocated and evaluated here; the reader thread then fills its
    memory through the buffer protocol, and `adopt()` takes the arrays as they
    are (bfloat16 lands as uint16 and is viewed back, as in `adopt()`).
    """
    arrays = [mx.zeros(tuple(t.shape), dtype=_MX_DTYPES["uint16" if t.dtype == "bfloat16" else t.dtype])
              for _, t in header.tensors()]
    mx.eval(arrays)
    views = tuple(memoryview(np.array(a, copy=False)).cast("B") for a in arrays)
    return Landing(views, tuple(arrays))


def adopt(loaded: LoadedSnapshot, *, landed: Callable[[Sequence[memoryview]], object] | None = None) -> list[Any]:
    """Build mlx-lm cache objects from loaded bytes (engine thread).

    Bytes read into a host buffer are copied into MLX once; bytes read straight
    into MLX arrays (`landing`) are taken as they are. `landed` gets the new arrays' memory once they hold the bytes (the engine
    passes `device_memory.to_device`: on CUDA the copy left them on the host).
    """
    arrays = iter(zip(loaded.header.tensors(), loaded.buffers, strict=True))
    ready = iter(loaded.landed) if loaded.landed is not None else None
    made: list[mx.array] = []
    raw: list[mx.array] = []

    def take(t: TensorDesc | None) -> mx.array | None:
        if t is None:
            return None
        (_, desc), buf = next(arrays)
        if ready is not None:
            a = next(ready)  # read straight into MLX memory (`landing`): nothing to copy
        else:
            a = mx.array(memoryview(buf))  # type: ignore[arg-type]  # the buffer protocol: much faster than from numpy
        raw.append(a)
        if desc.dtype == "bfloat16":
            a = a.view(mx.bfloat16)
        made.append(a)
        return a

    caches = [_BY_NAME[c.kind].adopt(c, take) for c in loaded.header.caches]
    mx.eval(made)
    if landed is not None:
        landed([memoryview(a) for a in raw])  # type: ignore[arg-type]
    return caches
