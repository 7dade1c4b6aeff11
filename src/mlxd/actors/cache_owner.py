"""The cache-owner actor: owns the RAM prefix cache and answers lookups and publications.

It never blocks on I/O and never computes on MLX arrays: entries are opaque
payloads that the engine lends out on its own thread.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.retention import make_policy
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import LookupPrefix, PublishPrefix, QueryCacheStats

log = get_logger("mlxd.cache")


class CacheOwnerActor:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[LookupPrefix | PublishPrefix | QueryCacheStats],
    ) -> None:
        self._inbox = inbox
        self.cache = PromptCache(max_bytes=config.prompt_cache_bytes, policy=make_policy(config.retention))
        self.published = {"boundary": 0, "final": 0}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._inbox:
            async for msg in self._inbox:
                self._handle(msg)

    def _handle(self, msg: LookupPrefix | PublishPrefix | QueryCacheStats) -> None:
        if isinstance(msg, LookupPrefix):
            msg.reply.send(self.cache.take(msg.tokens, msg.namespace))
        elif isinstance(msg, PublishPrefix):
            self._publish(msg)
        else:
            msg.reply.send(self.stats())

    def _publish(self, msg: PublishPrefix) -> None:
        self.cache.put(
            msg.tokens, msg.namespace, payload=msg.payload, nbytes=msg.nbytes, trimmable=msg.trimmable
        )
        self.published[msg.reason] += 1
        self.cache.evict()

    def stats(self) -> dict[str, Any]:
        ram = attrs.asdict(self.cache.stats)
        ram["published_boundary"] = self.published["boundary"]
        ram["published_final"] = self.published["final"]
        return {"ram": ram}
