"""The paged RAM tier's MLX half (engine thread): cut checkpoints into shared pages, lend from pages.

`PagePool.page(caches, tokens, namespace)` turns a checkpoint of an
attention-only model (every layer a `KVCache` or `QuantizedKVCache` holding
exactly the checkpoint's tokens) into a `PagedCaches` payload: its token
spans (cut as kv/ram_pages.py says) as `Page`s, each page one span of every
layer. A page some earlier entry already holds is taken as it is, so N
conversations over one prefix hold its KV once; a page cut where it stops
sharing with a longer held page is a view of that page's buffer (no copy);
other new pages are copies of the checkpoint's rows (one copy, at
publication), and the checkpoint's contiguous arrays go away with it.

A page lives as long as some payload references it (Python's reference
counts, i.e. the RAM entries that name it, and a lend in flight): the pool
only keeps weak references, so a page the tier evicted from every entry is
freed, and forgotten here, without a message. The cache owner counts the
same pages by name (`PageLedger`), each once.

`PagedCaches.lend(n)` assembles a row's cache: one `mx.concatenate` per
tensor of each layer over the pages it uses (a single page is sliced, no
copy). Every array lent is a new array object, so a borrower's in-place
writes never reach a page (the lending trap of kv/kinds.py).

Other cache classes (rotating windows, recurrent state, lists) keep
contiguous entries: `unpaged_reason` says why, and the engine logs it at load.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.kv import kinds
from mlxd.kv.blocks import ROOT, choose_spans
from mlxd.kv.ram_pages import PageRef, PageStarts

Layer = tuple[str, int, int]  # ("kv", 0, 0) or ("quant", bits, group_size)


@attrs.define(eq=False, weakref_slot=True)
class Page:
    """One token span [start, end) of every layer: each layer's tensors' rows.

    The rows live in the page's own buffer, or (a cut) in the buffer of the page
    named `buffer`, of `buffer_nbytes`.
    """

    name: str
    start: int
    end: int
    layers: tuple[tuple[mx.array, ...], ...]
    nbytes: int  # its rows' KV bytes
    buffer: str = ""
    buffer_nbytes: int = 0

    @property
    def ref(self) -> PageRef:
        if not self.buffer:
            return PageRef(self.name, self.start, self.end, self.nbytes)
        return PageRef(self.name, self.start, self.end, self.buffer_nbytes, self.buffer)


@attrs.frozen(eq=False)
class PagedCaches:
    """A paged RAM entry's payload: its pages in token order and each layer's cache class."""

    pages: tuple[Page, ...]
    layers: tuple[Layer, ...]
    n_tokens: int

    @property
    def refs(self) -> tuple[PageRef, ...]:
        return tuple(p.ref for p in self.pages)

    @property
    def nbytes(self) -> int:
        """The checkpoint's own KV bytes (shared pages included): what a contiguous entry would hold."""
        return sum(p.nbytes for p in self.pages)

    def lend(self, length: int) -> list[Any]:
        """Fresh caches of the first `length` tokens, assembled from the pages (never the pages' own arrays)."""
        if not 0 <= length <= self.n_tokens:
            raise ValueError(f"cannot lend {length} tokens from pages holding {self.n_tokens}")
        used = [p for p in self.pages if p.start < length]
        return [_layer_cache(layer, [p.layers[i] for p in used], length) for i, layer in enumerate(self.layers)]


def _joined(parts: list[mx.array], length: int) -> mx.array:
    whole = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)
    return whole[..., :length, :]  # a new array object, even over one whole page


def _layer_cache(layer: Layer, spans: list[tuple[mx.array, ...]], length: int) -> Any:
    kind, bits, group_size = layer
    cache: Any = KVCache() if kind == "kv" else QuantizedKVCache(group_size=group_size, bits=bits)
    if length == 0:
        return cache
    tensors = [_joined([s[j] for s in spans], length) for j in range(len(spans[0]))]
    if kind == "kv":
        cache.keys, cache.values = tensors
    else:
        cache.keys, cache.values = tuple(tensors[:3]), tuple(tensors[3:])
    cache.offset = length
    return cache


def _layer(cache: Any) -> Layer | None:
    """The layer's class as a page layout knows it; None when it cannot be paged."""
    if type(cache) is KVCache:
        return ("kv", 0, 0)
    if type(cache) is QuantizedKVCache:
        return ("quant", int(cache.bits), int(cache.group_size))
    return None


def _tensors(cache: Any) -> tuple[mx.array, ...]:
    if type(cache) is KVCache:
        return (cache.keys, cache.values)
    return (*cache.keys, *cache.values)


def unpaged_reason(caches: Sequence[Any]) -> str | None:
    """Why a model's caches (its `make_cache()`, under the KV scheme) keep contiguous entries; None: paged."""
    others = sorted({type(c).__name__ for c in caches if not isinstance(c, KVCache | QuantizedKVCache)})
    if others:
        return (f"only attention KV caches (KVCache, QuantizedKVCache) are paged; this model has "
                f"{', '.join(others)} layers (their state is not cut by tokens), so its entries stay contiguous")
    return None


@attrs.define
class PagePool:
    """The pages alive now, by name (weak references), and where a new page should end."""

    fingerprint: str
    page_tokens: int
    _live: weakref.WeakValueDictionary[str, Page] = attrs.field(init=False, factory=weakref.WeakValueDictionary)
    _starts: PageStarts = attrs.field(init=False, factory=PageStarts)
    _dead: collections.deque[str] = attrs.field(init=False, factory=collections.deque)  # appended by finalizers
    made: int = attrs.field(init=False, default=0)  # pages copied
    views: int = attrs.field(init=False, default=0)  # pages cut from a held page's buffer
    reused: int = attrs.field(init=False, default=0)  # pages an entry took as they were

    def __len__(self) -> int:
        return len(self._live)

    def page(self, caches: Sequence[Any], tokens: Sequence[int], namespace: str) -> PagedCaches | None:
        """The checkpoint as pages (shared where held already); None when it cannot be paged."""
        layers = [_layer(c) for c in caches]
        n = len(tokens)
        if n == 0 or not layers or any(x is None for x in layers):
            return None
        if any(c.keys is None or c.offset != n for c in caches):
            return None
        self._forget_dead()
        spans = choose_spans(
            tokens, namespace=namespace, fingerprint=self.fingerprint, exists=self._held,
            block_tokens=self.page_tokens, starts=self._starts,
        )
        pages: list[Page] = []
        fresh: list[mx.array] = []
        parent = ROOT
        for span in spans:
            page = self._live.get(span.name)
            if page is None or (page.start, page.end) != (span.start, span.end):
                page = self._new_page(caches, tokens, span.name, span.start, span.end, parent)
                fresh += [a for layer in page.layers for a in layer]
                self._live[span.name] = page
                weakref.finalize(page, self._dead.append, span.name)
            else:
                self.reused += 1
            pages.append(page)
            parent = span.name
        mx.eval(fresh)
        paged = PagedCaches(tuple(pages), tuple(x for x in layers if x is not None), n)
        self._starts.add_pages(tokens, paged.refs)
        return paged

    def _new_page(self, caches: Sequence[Any], tokens: Sequence[int], name: str, start: int, end: int,
                  parent: str) -> Page:
        """A view of the held page these tokens begin (it was cut where sharing stops), else a copy of the rows."""
        cut = self._starts.holder(parent, tokens[start:end])
        source = self._live.get(cut) if cut is not None else None
        if source is not None and source.start == start:
            n = end - start
            rows = tuple(tuple(a[..., :n, :] for a in layer) for layer in source.layers)
            self.views += 1
            return Page(name, start, end, rows, sum(a.nbytes for layer in rows for a in layer),
                        buffer=source.buffer or source.name, buffer_nbytes=source.buffer_nbytes or source.nbytes)
        rows = tuple(tuple(mx.contiguous(t[..., start:end, :]) for t in _tensors(c)) for c in caches)
        self.made += 1
        return Page(name, start, end, rows, sum(a.nbytes for layer in rows for a in layer))

    def _held(self, name: str) -> bool:
        return name in self._live

    def _forget_dead(self) -> None:
        """Pages freed since the last call (their last entry left) stop steering new cuts."""
        gone = []
        while self._dead:
            name = self._dead.popleft()
            if name not in self._live:
                gone.append(name)
        self._starts.discard(gone)


def lend(payload: Any, length: int, *, total: int) -> list[Any]:
    """A row's caches of the first `length` tokens of a RAM entry's payload, paged or contiguous."""
    if isinstance(payload, PagedCaches):
        return payload.lend(length)
    return kinds.lend(payload, length, total=total)
