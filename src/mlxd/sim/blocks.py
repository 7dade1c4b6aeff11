"""The `blocks` cache model: the Mooncake papers' global block cache.

Defined exactly so that published numbers can be checked:

- a request's hit is the longest run of its leading `hash_ids` that are all
  resident; hit tokens = min(hit blocks x 512, input_length);
- after the lookup every block of the request, in order, becomes most recently
  used (a resident block counts a hit, a missing one is inserted);
- capacity counts blocks; when over capacity the retention policy evicts
  (LRU: the least recently used block).

The three retention policies are `mlxd.kv.retention`'s own classes, applied to
blocks instead of prefix entries. Every block has the same size and token
count, so `cost` (GDSF) degenerates to frequency with aging.

It is a plain synchronous loop. Timing (queueing delay, TTFT) comes from the
cost model with `slots` engine slots served first come, first served, each
request holding a slot for its prefill and decode.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import attrs

from mlxd.kv.cost_model import BLOCK_TOKENS, CostModel
from mlxd.kv.retention import RetentionPolicy, make_policy
from mlxd.sim.results import RunResult, Tally
from mlxd.sim.trace import TraceRequest

_BLOCK_RANGE = range(BLOCK_TOKENS)


class _Block:
    """A resident block as the retention policy sees it."""

    __slots__ = ("hash_id", "nbytes")
    tokens = _BLOCK_RANGE  # len() = 512 tokens, for the cost policy

    def __init__(self, hash_id: int, nbytes: int) -> None:
        self.hash_id = hash_id
        self.nbytes = nbytes


@attrs.define
class BlockCache:
    """Resident blocks keyed by hash id, evicted by a retention policy."""

    capacity: int | None  # blocks; None = unlimited
    policy_name: str = "lru"
    block_bytes: int = 1
    evictions: int = 0
    _blocks: dict[int, _Block] = attrs.field(init=False, factory=dict)
    _policy: RetentionPolicy = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._policy = make_policy(self.policy_name)

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, hash_ids: Sequence[int]) -> int:
        """Leading resident blocks of the request (no state change)."""
        n = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            n += 1
        return n

    def touch(self, hash_ids: Sequence[int], now: float) -> None:
        """Make every block of the request most recently used, inserting missing ones."""
        policy = self._policy
        for h in hash_ids:
            block = self._blocks.get(h)
            if block is None:
                block = self._blocks[h] = _Block(h, self.block_bytes)
                policy.on_insert(block, now)
            else:
                policy.on_hit(block, now)
        self._evict_to_capacity()

    def _evict_to_capacity(self) -> None:
        if self.capacity is None or len(self._blocks) <= self.capacity:
            return
        excess = len(self._blocks) - self.capacity
        for block in self._policy.victims():
            del self._blocks[block.hash_id]
            self._policy.on_remove(block, evicted=True)
            self.evictions += 1
            excess -= 1
            if excess == 0:
                break


def replay_blocks(
    reqs: Sequence[TraceRequest],
    *,
    capacity: int | None,
    policy: str,
    cost: CostModel,
    slots: int = 4,
) -> RunResult:
    """Replay a Mooncake trace against the block cache; one RunResult."""
    cache = BlockCache(capacity, policy, block_bytes=cost.kv_bytes(BLOCK_TOKENS))
    tally = Tally()
    free_at = [0.0] * slots  # when each engine slot frees up (a heap)
    for r in reqs:
        ids = r.hash_ids or ()
        hit = min(cache.lookup(ids) * BLOCK_TOKENS, r.input_length)
        cache.touch(ids, r.t)
        start = max(r.t, heapq.heappop(free_at))
        prefill = cost.prefill_seconds(r.input_length - hit, hit)
        decode = cost.decode_seconds(r.output_tokens, r.input_length)
        heapq.heappush(free_at, start + prefill + decode)
        tally.add_request(r.input_length, hit, source="ram" if hit else "miss")
        tally.add_timing(queue=start - r.t, ttft=start - r.t + prefill)
    tally.evictions = cache.evictions
    return tally.result(
        cache_model="blocks",
        policy=policy,
        capacity_blocks=capacity,
        capacity_bytes=None if capacity is None else capacity * cache.block_bytes,
        ssd_capacity_bytes=None,
    )
