"""The host-memory tier: entries demoted from the device-resident RAM tier (issue 28).

On a GPU with its own memory (CUDA), an entry the RAM tier lets go of is
worth keeping in host memory: bringing a 16k-token prefix back from there is
one bulk copy, several times faster than recomputing it, where the SSD is
slower than recompute (docs/benchmarks.md, H200). So `CacheTiers` admits
every RAM victim here (`--host-cache-gb`), and a lookup whose longest usable
prefix lives here promotes it back to RAM.

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
    promotions: int  # entries brought back to RAM by a lookup
    promoted_tokens: int  # usable tokens those lookups served
    promoted_bytes: int
    evictions: int  # entries dropped for the cap (gone from both tiers unless on SSD)
    too_large: int  # victims larger than the whole tier, never admitted


@attrs.define
class _Counters:
    demotions: int = 0
    promotions: int = 0
    promoted_tokens: int = 0
    promoted_bytes: int = 0
    evictions: int = 0
    too_large: int = 0


@attrs.define
class HostTier:
    """Byte-capped LRU of demoted entries; see the module docstring."""

    max_bytes: int
    clock: Callable[[], float] = time.monotonic
    _cache: PromptCache = attrs.field(init=False)
    _count: _Counters = attrs.field(init=False, factory=_Counters)

    def __attrs_post_init__(self) -> None:
        self._cache = PromptCache(max_bytes=self.max_bytes, policy=make_policy("lru"), clock=self.clock)

    @property
    def bytes(self) -> int:
        return self._cache.bytes

    def __len__(self) -> int:
        return len(self._cache)

    def entries(self) -> Iterator[CacheEntry]:
        return self._cache.entries()

    def admit(self, entry: CacheEntry) -> tuple[CacheEntry | None, list[CacheEntry]]:
        """Keep a RAM victim: (the host entry, or None when it can never fit; entries dropped for room).

        The host entry carries the victim's payload, `durable` flag and hit
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
        kept.durable, kept.hits = entry.durable, entry.hits
        self._count.demotions += 1
        eviction = self._cache.evict(may_evict=lambda e: e is not kept)
        self._count.evictions += len(eviction.evicted)
        return kept, list(eviction.evicted)

    def find(self, tokens: Tokens, namespace: str = "", *, longer_than: int = 0) -> CacheHit | None:
        """The entry serving the longest usable prefix, if longer than `longer_than` tokens (no accounting)."""
        hit = self._cache.peek(tokens, namespace)
        return hit if hit is not None and hit.usable > longer_than else None

    def promote(self, hit: CacheHit) -> CacheEntry:
        """Take a found entry out of the tier (it goes back to RAM); counts the promotion."""
        self._cache.remove(hit.entry)
        self._count.promotions += 1
        self._count.promoted_tokens += hit.usable
        self._count.promoted_bytes += hit.entry.nbytes
        return hit.entry

    def forget(self, entry: CacheEntry) -> None:
        """Drop an entry (e.g. its namespace or session went away)."""
        if self._cache.find_exact(entry.tokens, entry.namespace) is entry:
            self._cache.remove(entry)

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
            evictions=c.evictions,
            too_large=c.too_large,
        )
