"""The ledgers that mirror rank 0's RAM tier on the follower ranks of a sharded model (kv/shard_mirror.py)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from mlxd.actors.cache_owner import CacheOwnerActor
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.shard_mirror import (
    FollowerShards,
    LeaderMirror,
    MissingShard,
    OwnerMirror,
    PrefixRef,
    ShardRef,
    shard_key,
)
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    CacheStatsSnapshot,
    EngineInbox,
    PublishPrefix,
    QueryCacheStats,
    ShardsDropped,
)


def test_every_rank_computes_the_same_key_from_tokens_and_namespace():
    tokens = (5, 6, 7, 300000)
    assert shard_key("ns", tokens) == shard_key("ns", list(tokens)) == shard_key("ns", np.array(tokens, np.int32))
    assert shard_key("ns", tokens) != shard_key("other", tokens)
    assert shard_key("ns", tokens) != shard_key("ns", tokens[:-1])
    assert shard_key("", (1, 2)) != shard_key("\x00\x01", (2,))


def test_follower_holds_lends_replaces_and_drops():
    shards = FollowerShards()
    key = shards.hold("ns", (1, 2, 3, 4), ["payload"], nbytes=40, trimmable=True)
    assert key == shard_key("ns", (1, 2, 3, 4)) and len(shards) == 1 and shards.nbytes == 40
    hit = shards.lend(PrefixRef(key, 3, 4))  # a trimmed prefix of the entry, as rank 0 lends it
    assert hit.usable == 3 and hit.entry.payload == ["payload"] and tuple(hit.entry.tokens) == (1, 2, 3, 4)
    # A later checkpoint of the same tokens replaces the earlier one (as PromptCache.put does).
    shards.hold("ns", (1, 2, 3, 4), ["newer"], nbytes=50, trimmable=True)
    assert len(shards) == 1 and shards.nbytes == 50 and shards.lend(PrefixRef(key, 4, 4)).entry.payload == ["newer"]
    assert key in shards and shards.drop(key) and not shards.drop(key) and key not in shards
    assert len(shards) == 0 and shards.nbytes == 0
    other = shards.hold("", (8,), ["o"], nbytes=1, trimmable=False)
    shards.drop_all([other, "never held"])
    assert shards.summary() == {"entries": 0, "bytes": 0, "held": 3, "dropped": 2, "hits": 2, "missing": 0}


def test_a_start_from_a_key_the_follower_lacks_is_an_error_not_a_cold_row():
    shards = FollowerShards()
    key = shards.hold("ns", (1, 2, 3, 4), ["p"], nbytes=4, trimmable=True)
    unknown = shard_key("ns", (9, 9))
    refs = [None, PrefixRef(key, 2, 4), PrefixRef(unknown, 1, 2), PrefixRef(key, 2, 7), PrefixRef(key, 0, 4)]
    assert shards.missing_keys(refs) == [unknown, key, key]  # unknown key, another length, nothing lent
    with pytest.raises(MissingShard, match="no shard of cached prefix"):
        shards.lend(PrefixRef(unknown, 1, 2))
    assert shards.missing == 1 and shards.hits == 0


def test_leader_forwards_only_the_drop_of_the_followers_latest_publication():
    mirror = LeaderMirror()
    first = mirror.published("k")
    second = mirror.published("k")  # the same tokens checkpointed again: the followers hold the newer one
    assert mirror.holds("k") and first.seq < second.seq
    assert not mirror.dropped(first)  # a drop that crossed the newer publication: ignored
    assert mirror.holds("k")
    assert mirror.dropped(second) and not mirror.holds("k")
    assert not mirror.dropped(second)  # once
    mirror.published("j")
    mirror.forget("j")
    assert not mirror.holds("j") and len(mirror) == 0


def test_owner_reports_what_left_the_ram_tier_replaced_evicted_or_never_stored():
    ram = PromptCache(max_bytes=100)
    mirror = OwnerMirror()
    a, b = (1, 2, 3, 4), (7, 8, 9)
    ka, kb = shard_key("", a), shard_key("", b)
    first = ram.put(a, payload=["a1"], nbytes=40, trimmable=True).entry
    assert mirror.stored(ShardRef(ka, 1), first) == [] and mirror.sync(ram.entries()) == []
    second = ram.put(a, payload=["a2"], nbytes=40, trimmable=True).entry  # replaces the duplicate
    assert mirror.stored(ShardRef(ka, 2), second) == [ShardRef(ka, 1)]
    ram.put(b, payload=["b"], nbytes=80, trimmable=True)
    assert [e.tokens for e in ram.evict().evicted] == [a]  # over the cap: the older entry goes
    mirror.stored(ShardRef(kb, 3), ram.find_exact(b))
    assert mirror.sync(ram.entries()) == [ShardRef(ka, 2)]
    assert mirror.sync(ram.entries()) == [] and len(mirror) == 1
    assert mirror.stored(ShardRef(ka, 4), None) == [ShardRef(ka, 4)]  # evicted as it was published


async def test_cache_owner_tells_the_engine_which_mirrored_prefixes_left_ram():
    """The actor: replaced, evicted and never-stored publications come back as `ShardsDropped`."""
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](64)
    engine_send, engine = trio.open_memory_channel[EngineInbox](64)
    owner = CacheOwnerActor(RuntimeConfig(prompt_cache_bytes=100), inbox=inbox, engine=engine_send)
    a, b, c = (1, 2, 3, 4), (7, 8, 9), (5, 5)
    ka, kb, kc = (shard_key("", t) for t in (a, b, c))

    def publish(tokens: tuple[int, ...], nbytes: int, seq: int) -> PublishPrefix:
        return PublishPrefix(tokens, "", payload=[seq], nbytes=nbytes, trimmable=True, reason="final",
                             shard=ShardRef(shard_key("", tokens), seq))

    async def dropped() -> list[ShardRef]:
        msg = await engine.receive()
        assert isinstance(msg, ShardsDropped)
        return list(msg.refs)

    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        await inbox_send.send(publish(a, 40, 1))
        await inbox_send.send(publish(a, 40, 2))  # the same tokens again: replaces the first
        assert await dropped() == [ShardRef(ka, 1)]
        await inbox_send.send(publish(b, 80, 3))  # over the cap: a is evicted
        assert await dropped() == [ShardRef(ka, 2)]
        await inbox_send.send(publish(c, 200, 4))  # larger than the cap: b goes, then c itself
        assert sorted(await dropped(), key=lambda r: r.seq) == [ShardRef(kb, 3), ShardRef(kc, 4)]
        stats = await owner_stats(inbox_send)
        assert stats.tiers.ram.entries == 0
        with pytest.raises(trio.WouldBlock):
            engine.receive_nowait()
        nursery.cancel_scope.cancel()


async def owner_stats(inbox: trio.MemorySendChannel[CacheOwnerMessage]) -> CacheStatsSnapshot:
    reply: Reply[CacheStatsSnapshot] = Reply()
    await inbox.send(QueryCacheStats(reply))
    return await reply.wait()
