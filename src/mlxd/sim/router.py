"""Request routers for fleet simulation (`mlxd simulate --replicas N --router NAME`).

A request reaches the router as its *block keys*: one key per block of its
prompt, each naming the block and everything before it (Mooncake `hash_ids`,
or `kv.kv_events.block_hashes` of a token trace), so two prompts share a
prefix of k blocks exactly when their first k keys are equal.

- `round_robin`: replica k mod N, whatever the request.
- `session`: a stable hash of the session (the trace's `session`, else the
  prompt's first `session_blocks` keys) picks the replica: sticky, load-blind.
- `cache_aware`: SMG's cache-aware policy (the gateway mlxd runs behind, see
  docs/fleet.md), modelled on what SMG does with HTTP workers: it remembers the
  prefixes it routed to each replica (not what the replicas actually still
  hold); when the in-flight loads are imbalanced past both thresholds it sends
  the request to the least-loaded replica; otherwise to the replica with the
  longest remembered prefix if that covers more than `cache_threshold` of the
  prompt, else to the replica with the fewest remembered blocks.

Pure: no trio, no clock. `loads[i]` is replica i's in-flight request count.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import attrs

ROUTERS = ("round_robin", "session", "cache_aware")


@attrs.define
class RoundRobin:
    replicas: int
    name: str = "round_robin"
    _next: int = 0

    def pick(self, keys: Sequence[int], session: Hashable | None, loads: Sequence[int]) -> int:
        i = self._next % self.replicas
        self._next += 1
        return i


@attrs.define
class SessionAffinity:
    replicas: int
    session_blocks: int = 2
    name: str = "session"

    def pick(self, keys: Sequence[int], session: Hashable | None, loads: Sequence[int]) -> int:
        key = session if session is not None else tuple(keys[: self.session_blocks])
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.replicas


@attrs.define
class CacheAware:
    """SMG's `cache_aware` defaults: cache_threshold 0.3, balance_abs 64, balance_rel 1.5."""

    replicas: int
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    max_blocks: int | None = None  # per replica; None = remember everything (oldest forgotten first)
    name: str = "cache_aware"
    _seen: list[OrderedDict[int, None]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._seen = [OrderedDict() for _ in range(self.replicas)]

    def matched(self, replica: int, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` this router has sent to `replica`."""
        seen = self._seen[replica]
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        return n

    def pick(self, keys: Sequence[int], session: Hashable | None, loads: Sequence[int]) -> int:
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            choice = loads.index(lo)
        else:
            best = max(range(self.replicas), key=lambda i: (self.matched(i, keys), -loads[i], -i))
            if keys and self.matched(best, keys) / len(keys) > self.cache_threshold:
                choice = best
            else:
                choice = min(range(self.replicas), key=lambda i: (len(self._seen[i]), loads[i], i))
        self._remember(choice, keys)
        return choice

    def _remember(self, replica: int, keys: Sequence[int]) -> None:
        seen = self._seen[replica]
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        if self.max_blocks is not None:
            while len(seen) > self.max_blocks:
                seen.popitem(last=False)


Router = RoundRobin | SessionAffinity | CacheAware


def make_router(name: str, replicas: int) -> Router:
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if name == "round_robin":
        return RoundRobin(replicas)
    if name == "session":
        return SessionAffinity(replicas)
    if name == "cache_aware":
        return CacheAware(replicas)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
