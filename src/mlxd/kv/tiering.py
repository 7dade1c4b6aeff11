"""RAM/SSD tier rules shared by the serving cache owner and the simulator.

Three decisions (seed §4 and §5.1), kept pure so both callers use the same code:

- On lookup, `choose_source`: the SSD candidate wins only with a *strictly*
  longer usable prefix than RAM's (and, with a cost model, only when restoring
  beats recomputing; see `CostModel.should_restore`).
- On RAM eviction, `demotion_action`: persist-before-demotion. A victim without
  a durable SSD copy is written first and stays in RAM until the write
  commits; a victim with a durable copy is demoted (RAM freed, prefix still
  reachable on SSD); without an SSD tier, or when the entry can never fit on
  SSD, the victim is dropped. `may_demote` turns that into the `may_evict`
  predicate of `PromptCache.evict`.
- The SSD tier itself, `SsdIndex`: whole entries, capacity-limited, least
  recently used by mtime (a hit touches the mtime) evicted first at write time.
  The serving SSD store keeps its own files; this is the in-memory index of
  what they hold, and the simulator's whole SSD tier.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import attrs

from mlxd.kv.prefix_index import PrefixIndex, token_key

Source = Literal["ram", "ssd", "miss"]


def choose_source(ram_usable: int, ssd_usable: int) -> Source:
    """Which tier serves a prompt: SSD only when strictly longer than RAM."""
    if ssd_usable > ram_usable:
        return "ssd"
    return "ram" if ram_usable > 0 else "miss"


class Demotion(enum.Enum):
    """What to do with a RAM eviction candidate."""

    DROP = "drop"  # no SSD tier, or it can never fit there: the prefix is lost
    DEMOTE = "demote"  # an SSD copy already covers it: free RAM, prefix stays reachable
    PERSIST = "persist"  # write it to SSD first; evict only once the write commits


def demotion_action(entry: Any, ssd: SsdIndex | None) -> Demotion:
    """Persist-before-demotion for a RAM victim (`entry.durable`, `entry.nbytes`)."""
    if ssd is None:
        return Demotion.DROP
    if entry.durable:
        return Demotion.DEMOTE
    if not ssd.fits(entry.nbytes):
        return Demotion.DROP
    return Demotion.PERSIST


def may_demote(ssd: SsdIndex | None) -> Callable[[Any], bool]:
    """`PromptCache.evict(may_evict=...)`: refuse victims that must be persisted first."""
    return lambda entry: demotion_action(entry, ssd) is not Demotion.PERSIST


@attrs.define(eq=False)
class SsdRecord:
    """One whole entry on SSD."""

    namespace: str
    tokens: Any  # tuple or read-only int32 array
    nbytes: int
    mtime: float
    trimmable: bool = True
    path: str | None = None  # the file, when serving


@attrs.frozen
class SsdMatch:
    record: SsdRecord
    usable: int


@attrs.define
class SsdIndex:
    """Whole entries on SSD: prefix lookups, byte cap, LRU by mtime.

    `max_bytes` None means unlimited. `add` evicts oldest-mtime records to make
    room and returns them, so the caller can clear `durable` on RAM copies.
    """

    max_bytes: int | None = None
    _indexes: dict[str, PrefixIndex] = attrs.field(init=False, factory=dict)
    _lru: OrderedDict[tuple[str, bytes], SsdRecord] = attrs.field(init=False, factory=OrderedDict)
    _bytes: int = attrs.field(init=False, default=0)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def fits(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def find(self, tokens, namespace: str = "", *, limit: int | None = None) -> SsdMatch | None:
        """The record serving the longest usable prefix (at most len(tokens) - 1); no touch."""
        index = self._indexes.get(namespace)
        if index is None:
            return None
        key = token_key(tokens)
        cap = key.num_tokens - 1 if limit is None else min(limit, key.num_tokens - 1)
        match = index.longest_usable(key, limit=cap)
        return None if match is None else SsdMatch(match.value, match.usable)

    def get(self, tokens, namespace: str = "") -> SsdRecord | None:
        """The record stored under exactly these tokens (a RAM entry it makes durable)."""
        return self._lru.get((namespace, token_key(tokens)))

    def touch(self, record: SsdRecord, now: float) -> None:
        """A hit refreshes the record's mtime."""
        record.mtime = now
        self._lru.move_to_end((record.namespace, token_key(record.tokens)))

    def add(
        self, tokens, namespace: str, *, nbytes: int, now: float, trimmable: bool = True
    ) -> list[SsdRecord]:
        """Store a record (replacing an exact duplicate); returns the records evicted for room."""
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes never fit in an SSD tier of {self.max_bytes}")
        key = token_key(tokens)
        old = self._lru.pop((namespace, key), None)
        if old is not None:
            self._bytes -= old.nbytes
        record = SsdRecord(namespace, tokens, int(nbytes), now, trimmable)
        self._indexes.setdefault(namespace, PrefixIndex()).insert(key, record, trimmable=trimmable)
        self._lru[(namespace, key)] = record
        self._bytes += record.nbytes
        return self._evict_to_fit(keep=record)

    def _evict_to_fit(self, *, keep: SsdRecord) -> list[SsdRecord]:
        dropped = []
        while self.max_bytes is not None and self._bytes > self.max_bytes:
            (ns, key), record = next(iter(self._lru.items()))
            if record is keep:
                break
            self.remove(record)
            dropped.append(record)
        return dropped

    def remove(self, record: SsdRecord) -> None:
        key = token_key(record.tokens)
        if self._lru.pop((record.namespace, key), None) is None:
            return
        self._bytes -= record.nbytes
        index = self._indexes[record.namespace]
        index.remove(key)
        if not len(index):
            del self._indexes[record.namespace]
