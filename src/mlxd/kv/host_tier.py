"""The host-memory tier: entries demoted from the device-resident RAM tier (issue 28).

On a GPU with its own memory (CUDA), an entry the RAM tier lets go of is
worth keeping in host memory: bringing a 16k-token prefix back from there is
one bulk copy, several times faster than recomputing it, where the SSD is
slower than recompute (docs/benchmarks.md, H200). So `CacheTiers` admits
every RAM victim here (`--host-cache-gb`), and a lookup whose longest usable
prefix lives here promotes it back to RAM.

Demotion is lazy: an admitted victim keeps its device pages (it is still a
RAM-speed hit, and taking it back costs no copy) until device memory is
needed (the memory budget, admission) or no row is decoding (and, serving, no
request waits for its first token) and the budget's idle headroom is short
(`CacheTiers.idle_moves`); only then does the shell move its pages
(`take_moves`). With room on the device an entry stays there: taking it back
is then a hit with no copy. Moving 1.88 GB while another row
decoded cost that row 71-77% of its speed on an H200 (docs/benchmarks.md), so
a move that buys nothing is not made while rows decode.

This module is the pure half: a byte-capped LRU of `CacheEntry`s (the RAM
tier's own `PromptCache`, with its prefix index and namespaces) plus the
counters. What "host memory" is belongs to the shell (the cache owner moves
the entry's pages, `runtime/device_memory.py`); the simulator charges a
promotion at the host bandwidth of its cost model. No trio, no MLX.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import attrs

from mlxd.kv.prompt_cache import CacheEntry, CacheHit, PromptCache, Tokens
from mlxd.kv.retention import make_policy


@attrs.frozen
class HostTierStats:
    """A snapshot of the host tier (travels in replies)."""

    entries: int
    bytes: int
    max_bytes: int
    demotions: int  # RAM victims admitted
    promotions: int  # moved entries brought back to RAM by a lookup (their pages copied back)
    promoted_tokens: int  # usable tokens those lookups served
    promoted_bytes: int
    device_entries: int  # admitted, pages still on the device: their move is not issued yet
    device_bytes: int
    moves: int  # entries whose pages were sent to host memory
    moved_bytes: int
    reclaims: int  # entries taken back to RAM before their move: a plain hit, no copy
    evictions: int  # entries dropped for the cap (gone from both tiers unless on SSD)
    too_large: int  # victims larger than the whole tier, never admitted


@attrs.define
class _Counters:
    demotions: int = 0
    promotions: int = 0
    promoted_tokens: int = 0
    promoted_bytes: int = 0
    moves: int = 0
    moved_bytes: int = 0
    reclaims: int = 0
    evictions: int = 0
    too_large: int = 0


@attrs.define
class HostTier:
    """Byte-capped LRU of demoted entries; see the module docstring."""

    max_bytes: int
    clock: Callable[[], float] = time.monotonic
    _cache: PromptCache = attrs.field(init=False)
    _count: _Counters = attrs.field(init=False, factory=_Counters)
    _device: set[CacheEntry] = attrs.field(init=False, factory=set)  # admitted, not moved yet (all held)

    def __attrs_post_init__(self) -> None:
        self._cache = PromptCache(max_bytes=self.max_bytes, policy=make_policy("lru"), clock=self.clock)

    @property
    def bytes(self) -> int:
        return self._cache.bytes

    def __len__(self) -> int:
        return len(self._cache)

    def entries(self) -> Iterator[CacheEntry]:
        return self._cache.entries()

    def on_device(self, entry: CacheEntry) -> bool:
        """Is this entry's memory still on the device (its move not issued yet)?"""
        return entry in self._device

    def device_entries(self) -> list[CacheEntry]:
        """Entries whose move is not issued yet, coldest first."""
        return sorted(self._device, key=lambda e: e.last_used)

    def moved_entries(self) -> list[CacheEntry]:
        """Entries whose pages were sent to host memory."""
        return [e for e in self._cache.entries() if e not in self._device]

    @property
    def device_bytes(self) -> int:
        return sum(e.nbytes for e in self._device)

    def take_moves(self, nbytes: int | None = None) -> list[CacheEntry]:
        """Entries to move to host memory now, coldest first: at least `nbytes` of them (None: all)."""
        moves: list[CacheEntry] = []
        freed = 0
        for entry in self.device_entries():
            if nbytes is not None and freed >= nbytes:
                break
            self._device.discard(entry)
            moves.append(entry)
            freed += entry.nbytes
        self._count.moves += len(moves)
        self._count.moved_bytes += freed
        return moves

    def admit(self, entry: CacheEntry) -> tuple[CacheEntry | None, list[CacheEntry]]:
        """Keep a RAM victim: (the host entry, or None when it can never fit; entries dropped for room).

        The entry is admitted on the device (`take_moves` sends it to host
        memory later). The host entry carries the victim's payload, `durable` flag and hit
        count; exact duplicates and (for a trimmable entry) strict ancestors
        are superseded as in RAM.
        """
        if entry.nbytes > self.max_bytes:
            self._count.too_large += 1
            return None, []
        outcome = self._cache.put(entry.tokens, entry.namespace, payload=entry.payload, nbytes=entry.nbytes,
                                  trimmable=entry.trimmable, pages=entry.pages)
        kept = outcome.entry
        if kept is None:
            return None, []
        self._device.difference_update((outcome.replaced, *outcome.superseded))
        kept.durable, kept.hits = entry.durable, entry.hits
        self._device.add(kept)
        self._count.demotions += 1
        eviction = self._cache.evict(may_evict=lambda e: e is not kept)
        self._count.evictions += len(eviction.evicted)
        self._device.difference_update(eviction.evicted)
        return kept, list(eviction.evicted)

    def find(self, tokens: Tokens, namespace: str = "", *, longer_than: int = 0) -> CacheHit | None:
        """The entry serving the longest usable prefix, if longer than `longer_than` tokens (no accounting)."""
        hit = self._cache.peek(tokens, namespace)
        return hit if hit is not None and hit.usable > longer_than else None

    def promote(self, hit: CacheHit) -> tuple[CacheEntry, bool]:
        """Take a found entry out of the tier (it goes back to RAM): (the entry, whether its pages must
        come back from host memory). One not moved yet is a reclaim (no copy), otherwise a promotion."""
        self._cache.remove(hit.entry)
        if hit.entry in self._device:
            self._device.discard(hit.entry)
            self._count.reclaims += 1
            return hit.entry, False
        self._count.promotions += 1
        self._count.promoted_tokens += hit.usable
        self._count.promoted_bytes += hit.entry.nbytes
        return hit.entry, True

    def forget(self, entry: CacheEntry) -> None:
        """Drop an entry (e.g. its namespace or session went away)."""
        if self._cache.find_exact(entry.tokens, entry.namespace) is entry:
            self._cache.remove(entry)
        self._device.discard(entry)

    def stats(self) -> HostTierStats:
        c = self._count
        return HostTierStats(
            entries=len(self._cache),
            bytes=self._cache.bytes,
            max_bytes=self.max_bytes,
            demotions=c.demotions,
            promotions=c.promotions,
            promoted_tokens=c.promoted_tokens,
            promoted_bytes=c.promoted_bytes,
            device_entries=len(self._device),
            device_bytes=self.device_bytes,
            moves=c.moves,
            moved_bytes=c.moved_bytes,
            reclaims=c.reclaims,
            evictions=c.evictions,
            too_large=c.too_large,
        )
