"""The RAM tier: whole-prefix cache entries, namespaced, byte-capped.

`take()` finds the entry that serves the longest usable prefix of a prompt
(at most len(prompt) - 1 tokens, so at least one token is forwarded; an entry
longer than the match must be trimmable). `put()` stores a new entry,
replaces an exact duplicate, and drops strict ancestors when the new entry is
trimmable. `put()` never evicts: the owner calls `evict()`, which walks the
retention policy's order and stops at the first victim the owner refuses
(e.g. one without durable SSD coverage yet).

The payload is opaque here (a list of mlx-lm caches when serving, None in the
simulator); nothing in this module touches MLX. An entry with `pages`
(`--ram-pages on`, kv/ram_pages.py) is counted through a `PageLedger`: each
shared page once, and an entry that leaves frees only the pages no other
entry names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from mlxd.kv.prefix_index import PrefixIndex, TokenKey, token_key
from mlxd.kv.ram_pages import PageLedger, PageRef
from mlxd.kv.retention import LruPolicy, RetentionPolicy

Tokens = tuple[int, ...] | np.ndarray  # a tuple, or a read-only 1-D int32 array


def freeze_tokens(tokens: Sequence[int] | np.ndarray) -> Tokens:
    """An immutable copy: arrays stay arrays (read-only int32), anything else becomes a tuple."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == np.int32 and not tokens.flags.writeable:
            return tokens
        frozen = np.array(tokens, dtype=np.int32)
        frozen.flags.writeable = False
        return frozen
    return tuple(tokens)


@attrs.define(eq=False)
class CacheEntry:
    """One cached prefix: the state after exactly `tokens` in `namespace`."""

    namespace: str
    tokens: Tokens
    payload: Any  # list of mlx-lm caches (opaque here); None in the simulator
    nbytes: int
    trimmable: bool
    created_at: float
    last_used: float
    hits: int = 0
    durable: bool = False  # an SSD file covers exactly these tokens (set by the tier)
    pages: tuple[PageRef, ...] = ()  # shared KV pages (--ram-pages on); () = a contiguous entry


@attrs.frozen
class CacheHit:
    """A reusable entry and how many prompt tokens it serves (<= len(prompt) - 1)."""

    entry: CacheEntry
    usable: int

    @property
    def needs_trim(self) -> bool:
        return self.usable < len(self.entry.tokens)


@attrs.frozen
class PutOutcome:
    """What `put` stored and what it dropped to make room for it."""

    entry: CacheEntry | None  # None when the tier is disabled (max_bytes == 0)
    replaced: CacheEntry | None = None  # an exact duplicate (same tokens and namespace)
    superseded: tuple[CacheEntry, ...] = ()  # strict ancestors a trimmable entry now covers

    @property
    def stored(self) -> bool:
        return self.entry is not None


@attrs.frozen
class Eviction:
    """The result of one `evict` call."""

    evicted: tuple[CacheEntry, ...] = ()
    blocked: CacheEntry | None = None  # the victim `may_evict` refused; eviction stopped there
    freed_bytes: int = 0


@attrs.frozen
class PromptCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    namespaces: int
    policy: str
    hits: int
    misses: int
    hit_tokens: int  # prompt tokens served from cache, summed over hits
    lookup_tokens: int  # prompt tokens looked up, summed over take() calls
    inserts: int
    replaced: int
    superseded: int
    evictions: int
    evicted_bytes: int
    blocked: int  # evict() calls that stopped at a refused victim
    pages: int = 0  # unique KV pages held (--ram-pages on)
    page_bytes: int = 0  # their bytes, each page once (part of `bytes`)
    checkpoint_bytes: int = 0  # every entry's own KV bytes: what contiguous entries would hold


@attrs.define
class _Counters:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    inserts: int = 0
    replaced: int = 0
    superseded: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    blocked: int = 0


def _evict_anything(entry: CacheEntry) -> bool:
    return True


@attrs.define(kw_only=True)
class PromptCache:
    """Byte-capped, namespaced RAM cache of prefix entries."""

    max_bytes: int
    policy: RetentionPolicy = attrs.field(factory=LruPolicy)
    clock: Callable[[], float] = time.monotonic
    _indexes: dict[str, PrefixIndex] = attrs.field(init=False, factory=dict)
    _bytes: int = attrs.field(init=False, default=0)  # contiguous entries; pages are in `_pages`
    _pages: PageLedger = attrs.field(init=False, factory=PageLedger)
    _count: _Counters = attrs.field(init=False, factory=_Counters)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        """What the entries hold: contiguous entries' bytes plus every page once."""
        return self._bytes + self._pages.bytes

    @property
    def pages(self) -> PageLedger:
        """The pages entries hold (read it; `put` and removals keep it)."""
        return self._pages

    def __len__(self) -> int:
        return sum(len(index) for index in self._indexes.values())

    def peek(self, tokens, namespace: str = "", *, limit: int | None = None) -> CacheHit | None:
        """The best entry for this prompt, without touching stats or the policy.

        `limit` caps the usable length (default and maximum: len(tokens) - 1).
        """
        return self._lookup(token_key(tokens), namespace, limit)

    def take(self, tokens, namespace: str = "", *, limit: int | None = None) -> CacheHit | None:
        """`peek`, and count the hit or miss; a hit refreshes the entry in the policy."""
        key = token_key(tokens)
        hit = self._lookup(key, namespace, limit)
        return self._account(hit, key.num_tokens)

    def take_exact(self, tokens, namespace: str, *, prompt_tokens: int) -> CacheHit | None:
        """The entry of exactly `tokens` serving a prompt it prefixes (no scan), counted like `take`.

        The caller checked that `tokens` is a prefix of the prompt, shorter than it.
        """
        entry = self.find_exact(tokens, namespace)
        hit = None if entry is None else CacheHit(entry, token_key(tokens).num_tokens)
        return self._account(hit, prompt_tokens) if hit is not None else None

    def _account(self, hit: CacheHit | None, prompt_tokens: int) -> CacheHit | None:
        self._count.lookup_tokens += prompt_tokens
        if hit is None:
            self._count.misses += 1
            return None
        now = self.clock()
        hit.entry.hits += 1
        hit.entry.last_used = now
        self.policy.on_hit(hit.entry, now)
        self._count.hits += 1
        self._count.hit_tokens += hit.usable
        return hit

    def _lookup(self, key: TokenKey, namespace: str, limit: int | None) -> CacheHit | None:
        index = self._indexes.get(namespace)
        if index is None:
            return None
        cap = key.num_tokens - 1
        match = index.longest_usable(key, limit=cap if limit is None else min(limit, cap))
        return None if match is None else CacheHit(match.value, match.usable)

    def put(
        self, tokens, namespace: str = "", *, payload: Any, nbytes: int, trimmable: bool,
        pages: tuple[PageRef, ...] = (),
    ) -> PutOutcome:
        """Store the state after `tokens`. Does not evict: call `evict()` next.

        With `pages` the entry is paged: it costs only the pages no entry holds yet.
        """
        if not self.enabled:
            return PutOutcome(None)
        now = self.clock()
        entry = CacheEntry(
            namespace, freeze_tokens(tokens), payload, int(nbytes), trimmable, now, now, pages=tuple(pages)
        )
        if entry.pages:  # referenced before a replaced or superseded entry lets go of the pages they share
            self._pages.add(entry.tokens, entry.pages)
        key = token_key(entry.tokens)
        index = self._indexes.setdefault(namespace, PrefixIndex())
        replaced = index.insert(key, entry, trimmable=trimmable)
        if replaced is not None:
            self._forget(replaced)
            self._count.replaced += 1
        # a trimmable entry can serve any of its prefixes, so shorter entries are redundant
        superseded = tuple(index.strict_ancestors(key)) if trimmable else ()
        for old in superseded:
            index.remove(old.tokens)
            self._forget(old)
        self._count.superseded += len(superseded)
        # A conversation's next checkpoint keeps its reuse history, so frequency-based
        # policies see the conversation, not a brand-new entry each turn.
        entry.hits = max((e.hits for e in (replaced, *superseded) if e is not None), default=0)
        if not entry.pages:
            self._bytes += entry.nbytes
        self._count.inserts += 1
        self.policy.on_insert(entry, now)
        return PutOutcome(entry, replaced, superseded)

    def _forget(self, entry: CacheEntry, *, evicted: bool = False) -> int:
        """Drop an entry already taken out of its index from the policy and byte count; the bytes freed."""
        if entry.pages:
            freed = self._pages.remove(entry.pages)
        else:
            freed = entry.nbytes
            self._bytes -= entry.nbytes
        self.policy.on_remove(entry, evicted=evicted)
        return freed

    def remove(self, entry: CacheEntry, *, evicted: bool = False) -> int:
        """Drop this exact entry (a no-op if it was already replaced or removed); the bytes freed."""
        index = self._indexes.get(entry.namespace)
        if index is None:
            return 0
        key = token_key(entry.tokens)
        if index.get(key) is not entry:
            return 0
        index.remove(key)
        freed = self._forget(entry, evicted=evicted)
        if not len(index):
            del self._indexes[entry.namespace]
        return freed

    def evict(
        self,
        *,
        may_evict: Callable[[CacheEntry], bool] = _evict_anything,
        prefer: Callable[[CacheEntry], bool] | None = None,
        keep: Callable[[CacheEntry], bool] | None = None,
    ) -> Eviction:
        """Evict coldest-first until within max_bytes; stop at the first refused victim.

        With `prefer`, a first pass considers only preferred victims (in policy
        order, e.g. entries no session references), and the rest only if that
        was not enough: a preference, not a pin. `keep` is a pin: those entries
        are passed over (not a stop), whatever the pressure.
        """
        evicted: list[CacheEntry] = []
        blocked = None
        before = self.bytes
        for only in ((prefer, None) if prefer is not None else (None,)):
            blocked = self._evict_pass(may_evict, only, evicted, keep)
            if self.bytes <= self.max_bytes:
                break
        freed = before - self.bytes
        self._count.evictions += len(evicted)
        self._count.evicted_bytes += freed
        self._count.blocked += blocked is not None
        return Eviction(tuple(evicted), blocked, freed)

    def _evict_pass(
        self, may_evict: Callable[[CacheEntry], bool], only: Callable[[CacheEntry], bool] | None,
        evicted: list[CacheEntry], keep: Callable[[CacheEntry], bool] | None = None,
    ) -> CacheEntry | None:
        """Evict victims (those `only` accepts) until within max_bytes; the refused victim, if any."""
        victims = self.policy.victims()
        try:
            while self.bytes > self.max_bytes:
                victim = next(victims, None)
                if victim is None:
                    return None
                if (only is not None and not only(victim)) or (keep is not None and keep(victim)):
                    continue
                if not may_evict(victim):
                    return victim
                self.remove(victim, evicted=True)
                evicted.append(victim)
        finally:
            getattr(victims, "close", lambda: None)()  # hand unevicted victims back
        return None

    def release(
        self,
        nbytes: int,
        *,
        may_evict: Callable[[CacheEntry], bool] = _evict_anything,
        prefer: Callable[[CacheEntry], bool] | None = None,
        keep: Callable[[CacheEntry], bool] | None = None,
    ) -> Eviction:
        """Evict at least `nbytes`, coldest first, whatever the cap (memory pressure).

        Unlike `evict`, a refused victim is skipped, not a stop: the next one in
        policy order may go instead. With `prefer`, preferred victims go first;
        `keep` (pinned) entries never go.
        `blocked` is the first refused victim, if any.
        """
        evicted: list[CacheEntry] = []
        blocked: CacheEntry | None = None
        freed = 0
        for only in ((prefer, None) if prefer is not None else (None,)):
            victims = self.policy.victims()
            try:
                while freed < nbytes:
                    victim = next(victims, None)
                    if victim is None:
                        break
                    if (only is not None and not only(victim)) or (keep is not None and keep(victim)):
                        continue
                    if not may_evict(victim):
                        blocked = blocked or victim
                        continue
                    freed += self.remove(victim, evicted=True)
                    evicted.append(victim)
            finally:
                getattr(victims, "close", lambda: None)()
            if freed >= nbytes:
                break
        self._count.evictions += len(evicted)
        self._count.evicted_bytes += freed
        return Eviction(tuple(evicted), blocked, freed)

    def find_exact(self, tokens, namespace: str = "") -> CacheEntry | None:
        index = self._indexes.get(namespace)
        return None if index is None else index.get(tokens)

    def covering(self, tokens, namespace: str = "") -> CacheEntry | None:
        """The entry that holds exactly `tokens`: itself, or a trimmable descendant (no accounting)."""
        index = self._indexes.get(namespace)
        if index is None:
            return None
        key = token_key(tokens)
        match = index.longest_usable(key, limit=key.num_tokens)
        return match.value if match is not None and match.usable == key.num_tokens else None

    def diverging(self, tokens, namespace: str = "") -> list[CacheEntry]:
        """Entries that part from `tokens` where `tokens` leaves the index (realignment candidates)."""
        index = self._indexes.get(namespace)
        return [] if index is None else index.diverging(tokens)

    def strict_ancestors(self, tokens, namespace: str = "") -> list[CacheEntry]:
        """Entries whose tokens are a strict prefix of `tokens`, shortest first."""
        index = self._indexes.get(namespace)
        return [] if index is None else index.strict_ancestors(tokens)

    def idle_entries(self, *, idle_for: float) -> list[CacheEntry]:
        """Entries unused for at least `idle_for` seconds, least recently used first."""
        cutoff = self.clock() - idle_for
        idle = [e for e in self.entries() if e.last_used <= cutoff]
        return sorted(idle, key=lambda e: e.last_used)

    def entries(self) -> Iterator[CacheEntry]:
        """A snapshot of every entry (safe to remove entries while iterating)."""
        return iter([e for index in self._indexes.values() for e in index.values()])

    def namespaces(self) -> list[str]:
        return list(self._indexes)

    @property
    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(
            entries=len(self),
            bytes=self.bytes,
            max_bytes=self.max_bytes,
            namespaces=len(self._indexes),
            policy=self.policy.name,
            **attrs.asdict(self._count),
            pages=len(self._pages),
            page_bytes=self._pages.bytes,
            checkpoint_bytes=sum(e.nbytes for e in self.entries()),
        )
