"""The cache-owner actor: the RAM prefix cache, the SSD index, and the tier decisions.

It answers lookups (RAM hit, or an SSD file worth restoring), takes
publications from the engine, queues write-behind through the durability
coordinator, and evicts with persist-before-demotion: a RAM victim without a
durable SSD copy stays resident until its write commits. It never blocks on
I/O and never computes on MLX arrays: entries are opaque payloads that the
engine lends out on its own thread.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.prompt_cache import CacheEntry, PromptCache
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.retention import make_policy
from mlxd.kv.ssd_store import SsdStore
from mlxd.kv.tiering import choose_source
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import (
    EntryDurable,
    EntryNotPersisted,
    FindCheckpointTokens,
    ForgetDirty,
    LookupPrefix,
    MarkDirty,
    PrefillMeasured,
    PrefixLookup,
    PublishPrefix,
    QueryCacheStats,
    RestoreMeasured,
)

log = get_logger("mlxd.cache")


@attrs.define
class TierStats:
    restores: int = 0
    restore_ms_last: float | None = None
    demotions: int = 0
    idle_demotions: int = 0
    dropped_unpersisted: int = 0


class CacheOwnerActor:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[Any],
        store: SsdStore | None = None,
        advisor: RestoreAdvisor | None = None,
        governor: WriteGovernor | None = None,
    ) -> None:
        self._config = config
        self._governor = governor  # told when RAM is over its cap waiting for writes
        self._inbox = inbox
        self.cache = PromptCache(max_bytes=config.prompt_cache_bytes, policy=make_policy(config.retention))
        self.store = store
        # Sends to the coordinator never block (its inbox is drained by a task that
        # never waits on us), so the two actors cannot deadlock.
        self._durability: trio.MemorySendChannel[Any] | None = None
        self.advisor = advisor or RestoreAdvisor()
        self._unpersistable: set[tuple[str, Any]] = set()
        self.published = {"boundary": 0, "final": 0, "restore": 0}
        self.tier = TierStats()

    def attach_durability(self, channel: trio.MemorySendChannel[Any]) -> None:
        """Wire the coordinator's inbox (it needs this actor's RAM cache first)."""
        self._durability = channel

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.store is not None and self._config.ssd_demote_idle_s > 0:
                nursery.start_soon(self._demote_idle_forever)
            task_status.started()
            async with self._inbox:
                async for msg in self._inbox:
                    self._handle(msg)
            nursery.cancel_scope.cancel()

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, LookupPrefix):
            msg.reply.send(self._lookup(msg.tokens, msg.namespace))
        elif isinstance(msg, PublishPrefix):
            self._publish(msg)
        elif isinstance(msg, EntryDurable):
            self._durable(msg)
        elif isinstance(msg, EntryNotPersisted):
            self._unpersistable.add((msg.namespace, msg.tokens))
            self._evict()
        elif isinstance(msg, PrefillMeasured):
            self.advisor.observe_prefill(new_tokens=msg.new_tokens, context=msg.context, seconds=msg.seconds)
        elif isinstance(msg, RestoreMeasured):
            self.advisor.observe_restore(nbytes=msg.nbytes, seconds=msg.seconds)
            self.tier.restores += 1
            self.tier.restore_ms_last = round(msg.seconds * 1000, 3)
        elif isinstance(msg, FindCheckpointTokens):
            msg.reply.send(self._checkpoint_tokens(msg.tokens, msg.namespace))
        elif isinstance(msg, QueryCacheStats):
            msg.reply.send(self.stats())

    # --- lookups ------------------------------------------------------------------

    def _lookup(self, tokens: tuple[int, ...], namespace: str) -> PrefixLookup:
        hit = self.cache.take(tokens, namespace)
        if self.store is None:
            return PrefixLookup(hit)
        cold = self.store.find(tokens, namespace)
        warm = hit.usable if hit is not None else 0
        if cold is None or choose_source(warm, cold.usable) != "ssd":
            return PrefixLookup(hit)
        if not self.advisor.should_restore(
            restore_bytes=cold.entry.nbytes, cold_tokens=cold.usable, warm_tokens=warm, prompt_tokens=len(tokens)
        ):
            return PrefixLookup(hit)
        return PrefixLookup(hit, cold)

    def _checkpoint_tokens(self, tokens: tuple[int, ...], namespace: str) -> list[tuple[int, ...]]:
        """The best RAM and SSD checkpoints for `tokens` (token sequences, no accounting)."""
        found: list[tuple[int, ...]] = []
        hit = self.cache.peek(tokens, namespace)
        if hit is not None:
            found.append(tuple(hit.entry.tokens))
        cold = self.store.find(tokens, namespace) if self.store is not None else None
        if cold is not None and tuple(cold.entry.tokens) not in found:
            found.append(tuple(cold.entry.tokens))
        return found

    # --- publications and durability ------------------------------------------------

    def _publish(self, msg: PublishPrefix) -> None:
        outcome = self.cache.put(
            msg.tokens, msg.namespace, payload=msg.payload, nbytes=msg.nbytes, trimmable=msg.trimmable
        )
        self.published[msg.reason] += 1
        entry = outcome.entry
        if entry is not None and self.store is not None:
            if msg.durable or self.store.find_exact(msg.tokens, msg.namespace) is not None:
                entry.durable = True
            elif msg.plan is not None and self._durability is not None:
                self._durability.send_nowait(MarkDirty(msg.namespace, tuple(entry.tokens), msg.plan, msg.trimmable))
        self._evict()

    def _durable(self, msg: EntryDurable) -> None:
        entry = self.cache.find_exact(msg.tokens, msg.namespace)
        if entry is not None:
            entry.durable = True
        self._unpersistable.discard((msg.namespace, msg.tokens))
        self._evict()

    def _may_evict(self, entry: CacheEntry) -> bool:
        if self.store is None or entry.durable:
            return True
        return (entry.namespace, tuple(entry.tokens)) in self._unpersistable

    def _evict(self) -> None:
        eviction = self.cache.evict(may_evict=self._may_evict)
        for entry in eviction.evicted:
            self._evicted(entry)
        if self._governor is not None:
            self._governor.set_urgent("ram", self.cache.bytes > self.cache.max_bytes)

    def _evicted(self, entry: CacheEntry) -> None:
        if self.store is None:
            return
        if entry.durable:
            self.tier.demotions += 1
            return
        key = (entry.namespace, tuple(entry.tokens))
        self._unpersistable.discard(key)
        self.tier.dropped_unpersisted += 1
        if self._durability is not None:
            self._durability.send_nowait(ForgetDirty(*key))

    async def _demote_idle_forever(self) -> None:
        idle = self._config.ssd_demote_idle_s
        while True:
            await trio.sleep(min(idle / 4, 5.0))
            for entry in self.cache.idle_entries(idle_for=idle):
                if entry.durable:
                    self.cache.remove(entry, evicted=True)
                    self.tier.idle_demotions += 1
                    self.tier.demotions += 1

    # --- stats ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        ram = attrs.asdict(self.cache.stats)
        ram.update({f"published_{k}": v for k, v in self.published.items()})
        out: dict[str, Any] = {"ram": ram}
        if self.store is not None:
            s = self.store.stats
            out["ssd"] = {
                "entries": s.entries,
                "bytes": s.bytes,
                "max_bytes": s.max_bytes,
                "restores": self.tier.restores,
                "restore_ms_last": self.tier.restore_ms_last,
                "demotions": self.tier.demotions,
                "idle_demotions": self.tier.idle_demotions,
                "dropped_unpersisted": self.tier.dropped_unpersisted,
                "longest_durable_prefix_tokens": s.longest_durable_prefix_tokens,
                "corrupt_removed": s.corrupt_removed,
                "evictions": s.evictions,
                "write_failures": s.write_failures,
                "disk_full": s.disk_full,
                "restore_decisions": self.advisor.stats(),
            }
        return out
