"""The RAM tier of a sharded model, mirrored on the follower ranks (runtime/distributed.py).

Under `--distributed` every rank holds its own shard of each cached prefix's
KV (tensor parallelism splits the attention heads). Rank 0 alone decides what
is cached: its cache owner and `CacheTiers` see every publication, lookup and
eviction. The followers keep, under the same key, their shard of every prefix
rank 0 holds, and lend it when rank 0 says a row starts from it.

A follower needs no message to learn what to keep: it replays rank 0's steps,
so its engine produces the same checkpoints (`PublishPrefix`) in the same
steps, and it keeps each under `shard_key(namespace, tokens)`, the key rank 0
computes from the same tokens. A later checkpoint of the same tokens replaces
the earlier one on both sides, as `PromptCache.put` does.

Three small ledgers keep the ranks in step:

- `OwnerMirror` (rank 0's cache owner): which mirrored publications are still
  RAM entries; the ones that left (evicted, superseded, replaced, never
  stored) are reported to the engine as `ShardRef`s.
- `LeaderMirror` (rank 0's engine): which keys the followers hold. A row whose
  RAM hit is not held there starts cold on every rank (a cache miss, never a
  wrong prefix); a drop is forwarded only when it names the followers' latest
  publication of that key, so a drop that crossed a newer publication of the
  same tokens is ignored.
- `FollowerShards` (a follower's engine): the shards themselves, and the
  explicit error for a start from a key it does not hold (`missing`).

Nothing here imports trio or touches MLX: payloads are opaque.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from mlxd.kv.prompt_cache import CacheEntry, CacheHit, Tokens, freeze_tokens


def shard_key(namespace: str, tokens: Tokens | Sequence[int]) -> str:
    """The key every rank gives the prefix of exactly `tokens` in `namespace` (128-bit, hex)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace.encode())
    h.update(b"\0")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


@attrs.frozen
class ShardRef:
    """One mirrored publication: its key and rank 0's sequence number for it."""

    key: str
    seq: int


@attrs.frozen
class PrefixRef:
    """A row starts from `usable` tokens of the cached prefix `key`, which holds `total` tokens."""

    key: str
    usable: int
    total: int


class MissingShard(LookupError):
    """A follower was told to start a row from a prefix it does not hold."""


class LeaderMirror:
    """Rank 0's engine: which prefix keys every follower holds (engine thread only)."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}  # key -> seq of the followers' latest publication of it
        self._seq = 0

    def __len__(self) -> int:
        return len(self._held)

    def published(self, key: str) -> ShardRef:
        """A checkpoint every rank produced in this step: the followers now hold it."""
        self._seq += 1
        self._held[key] = self._seq
        return ShardRef(key, self._seq)

    def holds(self, key: str) -> bool:
        return key in self._held

    def dropped(self, ref: ShardRef) -> bool:
        """The cache owner no longer holds `ref`: True if the followers must drop its key now."""
        if self._held.get(ref.key) != ref.seq:
            return False  # a newer publication of the same tokens is the one held (or it is gone)
        del self._held[ref.key]
        return True

    def forget(self, key: str) -> None:
        """Stop lending `key` (a follower reported it missing): its hits start cold from now on."""
        self._held.pop(key, None)


class OwnerMirror:
    """Rank 0's cache owner: the mirrored publications that are still RAM entries.

    Entries are compared by identity: a replaced duplicate is a new entry, and
    the replaced one has left.
    """

    def __init__(self) -> None:
        self._alive: dict[str, tuple[object, int]] = {}  # key -> (its RAM entry, seq)

    def __len__(self) -> int:
        return len(self._alive)

    def stored(self, ref: ShardRef, entry: object | None) -> list[ShardRef]:
        """`ref`'s publication became `entry` (None: not stored, or already evicted): what left."""
        if entry is None:
            return [ref]
        previous = self._alive.get(ref.key)
        self._alive[ref.key] = (entry, ref.seq)
        return [] if previous is None or previous[0] is entry else [ShardRef(ref.key, previous[1])]

    def sync(self, entries: Iterable[object]) -> list[ShardRef]:
        """Every tracked publication whose entry is no longer among `entries` (the RAM tier's)."""
        if not self._alive:
            return []
        alive = {id(e) for e in entries}
        gone = [key for key, (entry, _) in self._alive.items() if id(entry) not in alive]
        return [ShardRef(key, self._alive.pop(key)[1]) for key in gone]


@attrs.define
class FollowerShards:
    """A follower's shards of the prefixes rank 0 caches, by `shard_key`."""

    _entries: dict[str, CacheEntry] = attrs.field(factory=dict)
    nbytes: int = 0
    held: int = 0  # publications kept (replacements included)
    dropped: int = 0
    hits: int = 0  # rows started from a held shard
    missing: int = 0  # starts from a key not held (each failed its step)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def hold(self, namespace: str, tokens: Tokens | Sequence[int], payload: object, *,
             nbytes: int, trimmable: bool) -> str:
        """Keep this rank's shard of a checkpoint this step produced; returns its key."""
        key = shard_key(namespace, tokens)
        self.drop(key, count=False)
        self._entries[key] = CacheEntry(namespace, freeze_tokens(tokens), payload, int(nbytes), trimmable, 0.0, 0.0)
        self.nbytes += int(nbytes)
        self.held += 1
        return key

    def drop(self, key: str, *, count: bool = True) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        self.dropped += count
        return True

    def drop_all(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.drop(key)

    def missing_keys(self, prefixes: Iterable[PrefixRef | None]) -> list[str]:
        """The prefixes a step starts from that this rank cannot lend (unknown key or another length)."""
        out = []
        for ref in prefixes:
            if ref is None:
                continue
            entry = self._entries.get(ref.key)
            if entry is None or len(entry.tokens) != ref.total or not 0 < ref.usable <= ref.total:
                out.append(ref.key)
        return out

    def lend(self, ref: PrefixRef) -> CacheHit:
        """The hit a row starts from, as rank 0's cache owner gave it; raises `MissingShard`."""
        if self.missing_keys([ref]):
            self.missing += 1
            raise MissingShard(f"no shard of cached prefix {ref.key} ({ref.total} tokens) on this rank")
        self.hits += 1
        return CacheHit(self._entries[ref.key], ref.usable)

    def summary(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.nbytes, "held": self.held,
                "dropped": self.dropped, "hits": self.hits, "missing": self.missing}
