"""Retention policies: which cache entry to evict first.

Shared by the serving cache and the simulator. A policy only orders entries;
the cache decides when to evict. Entries are any hashable objects with
`tokens` and `nbytes` (a `CacheEntry` in practice).

All three policies are a binary heap of (priority, sequence, cell) with lazy
deletion: a hit or removal only changes a dict and empties the entry's old
cell, the stale heap item is skipped when it surfaces, and the heap is
rebuilt once stale items outnumber live ones. A stale item holds an empty
cell, never the entry: a removed entry (and the MLX arrays it carries) is
released at once, not when the heap is next rebuilt. Insert, hit and remove are O(log n); yielding each victim is
O(log n) amortised.

- `LruPolicy`: least recently inserted-or-hit first.
- `LfuPolicy`: fewest uses (insert counts as one) first; ties by recency.
- `CostPolicy`: GreedyDual-Size-Frequency. priority = clock + uses * cost / nbytes,
  where cost is the prefill work a hit saves, taken as the entry's token
  count (linear prefill; attention's quadratic term is ignored). Evicting an
  entry raises the clock to its priority, so entries that stop being hit age
  out. Because bytes grow linearly with tokens, cost / nbytes is roughly the
  inverse of bytes-per-token: at equal use, entries that are cheap to keep per
  saved token (quantized KV) outlive dense ones. Pass `cost=` to plug in a
  better estimate (e.g. from the cost model).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

PolicyName = Literal["lru", "lfu", "cost"]


@runtime_checkable
class RetentionPolicy(Protocol):
    """Orders cache entries for eviction; the cache calls the hooks."""

    name: str

    def on_insert(self, entry: Any, now: float) -> None: ...

    def on_hit(self, entry: Any, now: float) -> None: ...

    def on_remove(self, entry: Any, *, evicted: bool = False) -> None: ...

    def victims(self) -> Iterator[Any]:
        """Eviction order, coldest first. The caller may remove each yielded entry
        before asking for the next; stopping early leaves the policy unchanged."""
        ...


@attrs.define
class _HeapPolicy:
    """Shared lazy-deletion heap; subclasses give `_priority`."""

    name: str = attrs.field(init=False, default="")
    _heap: list[tuple[float, int, list[Any]]] = attrs.field(init=False, factory=list)
    # entry -> its live heap item; the cell ([entry]) is emptied when the item goes stale
    _live: dict[Hashable, tuple[float, int, list[Any]]] = attrs.field(init=False, factory=dict)
    _uses: dict[Hashable, int] = attrs.field(init=False, factory=dict)
    _seq: Iterator[int] = attrs.field(init=False, factory=itertools.count)
    _iterating: int = attrs.field(init=False, default=0)  # open victims() generators

    def __len__(self) -> int:
        return len(self._live)

    def _priority(self, entry: Any, uses: int) -> float:
        raise NotImplementedError

    def _push(self, entry: Any) -> None:
        old = self._live.get(entry)
        if old is not None:
            old[2].clear()  # the superseded item lets go of the entry
        item = (self._priority(entry, self._uses[entry]), next(self._seq), [entry])
        self._live[entry] = item
        heapq.heappush(self._heap, item)
        if not self._iterating and len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)

    def on_insert(self, entry: Any, now: float) -> None:
        # An entry may inherit the uses of the checkpoints it replaces (a continuing conversation).
        self._uses[entry] = 1 + int(getattr(entry, "hits", 0))
        self._push(entry)

    def on_hit(self, entry: Any, now: float) -> None:
        if entry not in self._live:
            return
        self._uses[entry] += 1
        self._push(entry)

    def on_remove(self, entry: Any, *, evicted: bool = False) -> None:
        item = self._live.pop(entry, None)
        self._uses.pop(entry, None)
        if item is not None:
            item[2].clear()
            if evicted:
                self._on_evicted(item[0])

    def _on_evicted(self, priority: float) -> None:
        """Hook for aging policies."""

    def _is_live(self, item: tuple[float, int, list[Any]]) -> bool:
        return bool(item[2])  # emptied when removed or re-keyed

    def victims(self) -> Iterator[Any]:
        taken: list[tuple[float, int, list[Any]]] = []
        self._iterating += 1
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                if self._is_live(item):
                    taken.append(item)
                    yield item[2][0]
        finally:
            # put back what was yielded but not removed (or re-keyed) meanwhile
            self._iterating -= 1
            for item in taken:
                if self._is_live(item):
                    heapq.heappush(self._heap, item)


@attrs.define
class LruPolicy(_HeapPolicy):
    name: str = attrs.field(init=False, default="lru")

    def _priority(self, entry: Any, uses: int) -> float:
        return 0.0  # the sequence number alone orders by recency


@attrs.define
class LfuPolicy(_HeapPolicy):
    name: str = attrs.field(init=False, default="lfu")

    def _priority(self, entry: Any, uses: int) -> float:
        return float(uses)


def tokens_saved(entry: Any) -> float:
    """Default saved-prefill cost of a hit: the entry's token count."""
    return float(len(entry.tokens))


@attrs.define
class CostPolicy(_HeapPolicy):
    name: str = attrs.field(init=False, default="cost")
    cost: Callable[[Any], float] = attrs.field(default=tokens_saved, kw_only=True)
    clock: float = attrs.field(init=False, default=0.0)  # GDSF inflation value L

    def _priority(self, entry: Any, uses: int) -> float:
        return self.clock + uses * self.cost(entry) / max(int(entry.nbytes), 1)

    def _on_evicted(self, priority: float) -> None:
        self.clock = max(self.clock, priority)


_POLICIES: dict[str, type[_HeapPolicy]] = {
    "lru": LruPolicy,
    "lfu": LfuPolicy,
    "cost": CostPolicy,
}


def make_policy(name: PolicyName | str) -> RetentionPolicy:
    """A fresh policy by name: "lru", "lfu" or "cost"."""
    try:
        return _POLICIES[name]()  # type: ignore[index]
    except KeyError:
        raise ValueError(
            f"unknown retention policy {name!r}; expected one of {sorted(_POLICIES)}"
        ) from None
