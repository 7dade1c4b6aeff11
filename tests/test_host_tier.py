"""The host-memory tier (--host-cache-gb): the pure core, the tiers around it, the simulator, the wiring."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import trio
from mlx_lm.models import cache as mlc

from mlxd.actors.cache_owner import CacheOwnerActor
from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.host_tier import HostTier
from mlxd.kv.kv_events import CPU, RAM, BlockRemoved, BlockStored
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.retention import make_policy
from mlxd.kv.tiers import CacheTiers, Demote, Forget, Persist, Promote, SsdRecord
from mlxd.runtime import host_memory
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    EngineBusy,
    LookupPrefix,
    PublishKvEvents,
    PublishPrefix,
    QueryCacheStats,
)
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRequest

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def toks(start: int, n: int = 10) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def tiers_with_host(*, ram: int = 100, host: int = 250, ssd: bool = False) -> CacheTiers:
    clock = Clock()
    return CacheTiers(
        PromptCache(max_bytes=ram, policy=make_policy("lru"), clock=clock),
        ssd=ssd,
        host=HostTier(max_bytes=host, clock=clock),
    )


# --- the pure tier --------------------------------------------------------------------------------


def test_host_tier_keeps_victims_lru_by_bytes_and_refuses_what_never_fits():
    clock = Clock()
    ram = PromptCache(max_bytes=1000, clock=clock)
    host = HostTier(max_bytes=100, clock=clock)
    entries = [ram.put(toks(i * 100), "", payload=f"p{i}", nbytes=40, trimmable=True).entry for i in range(3)]
    kept, dropped = host.admit(entries[0])
    assert kept is not None and kept.payload == "p0" and dropped == []
    host.admit(entries[1])
    _, dropped = host.admit(entries[2])  # 120 > 100: the coldest goes
    assert [e.payload for e in dropped] == ["p0"]
    assert host.find(toks(0) + (1,)) is None
    found = host.find(toks(100) + (7,))
    assert found is not None and found.usable == 10 and found.entry.payload == "p1"
    assert host.find(toks(100) + (7,), longer_than=10) is None
    big = ram.put(toks(900), "", payload="big", nbytes=101, trimmable=True).entry
    assert host.admit(big) == (None, [])
    # Admitted on the device: nothing moved until asked, then the coldest first.
    assert [e.payload for e in host.device_entries()] == ["p1", "p2"] and host.device_bytes == 80
    assert [e.payload for e in host.take_moves(1)] == ["p1"] and host.device_bytes == 40
    assert host.promote(found) == (found.entry, True)  # moved: its pages come back
    p2 = host.find(toks(200) + (1,))
    assert p2 is not None and host.promote(p2) == (p2.entry, False)  # never moved: no copy
    s = host.stats()
    assert (s.entries, s.bytes, s.demotions, s.promotions, s.promoted_tokens, s.evictions, s.too_large) == (
        0, 0, 3, 1, 10, 1, 1,
    )
    assert (s.moves, s.moved_bytes, s.reclaims, s.device_entries, s.device_bytes) == (1, 40, 1, 0, 0)


def test_ram_victims_are_demoted_and_a_longer_host_prefix_is_promoted_back():
    tiers = tiers_with_host()
    effects = []
    for i in range(4):
        effects += tiers.publish(toks(i * 100), payload=f"p{i}", nbytes=60, trimmable=True)
    # RAM holds one 60-byte entry; the three victims went to the host tier instead of leaving,
    # their pages still on the device: no move is asked for until the shell says no row decodes.
    assert effects == [] and tiers.ram.bytes == 60 and tiers.host.bytes == 180 and tiers.host.device_bytes == 180
    effects = tiers.move_to_host()
    assert [type(e) for e in effects] == [Demote, Demote, Demote]
    assert [e.entry.payload for e in effects] == ["p0", "p1", "p2"]
    assert tiers.host.device_bytes == 0 and tiers.move_to_host() == []
    lookup = tiers.lookup(toks(0) + (5,))
    assert lookup.promoted and lookup.hit.usable == 10 and lookup.hit.entry.payload == "p0"
    moved = tiers.take_effects()
    assert [type(e) for e in moved] == [Promote]  # p0 back; p3, which made room for it, stays on the device
    assert moved[0].entry is tiers.ram.find_exact(toks(0), "")
    assert [e.payload for e in tiers.host.device_entries()] == ["p3"]
    assert tiers.take_effects() == []
    # A RAM hit at least as long wins over the host tier: nothing moves.
    lookup = tiers.lookup(toks(0) + (6,))
    assert not lookup.promoted and lookup.hit.entry.payload == "p0" and tiers.take_effects() == []
    stats = tiers.stats()
    assert stats.host is not None and stats.host.promotions == 1 and stats.host.demotions == 4
    # p3 was never moved: taking it back is a plain hit, no copy (not a promotion).
    lookup = tiers.lookup(toks(300) + (1,))
    assert not lookup.promoted and lookup.hit.entry.payload == "p3"
    assert [type(e) for e in tiers.take_effects()] == []  # p0 left RAM for it: on the device too
    host = tiers.stats().host
    assert (host.promotions, host.reclaims, host.moves, host.device_entries) == (1, 1, 3, 1)


def test_the_memory_budget_and_admission_move_host_entries_still_on_the_device_first():
    clock = Clock()
    tiers = CacheTiers(PromptCache(max_bytes=200, clock=clock), host=HostTier(max_bytes=1000, clock=clock),
                       memory_budget=1000)
    for i in range(4):
        tiers.publish(toks(i * 100), payload=f"p{i}", nbytes=100, trimmable=True)
    assert tiers.ram.bytes == 200 and tiers.host.device_bytes == 200  # p0, p1 out of RAM, still on the device
    assert tiers.observe_memory(600) == []  # 200 RAM + 200 host-tier bytes of it: other 200 (no host bytes)
    assert tiers.over_budget_bytes == 200 + 200 + 200 - 1000
    effects = tiers.observe_memory(1150)  # other 750: 150 over, and the device's host-tier bytes count
    assert [e.entry.payload for e in effects if isinstance(e, Demote)] == ["p0", "p1"]  # moved, RAM kept
    assert tiers.ram.bytes == 200 and tiers.over_budget_bytes <= 0
    # Admission: the room it can free includes host-tier bytes on the device, freed first by a move.
    assert tiers.observe_memory(700) == []  # other 300 now
    tiers.publish(toks(900), payload="p9", nbytes=100, trimmable=True)  # p2 out of RAM, on the device
    room = tiers.ram_room()
    assert room.freeable_bytes == 300 and tiers.host.device_bytes == 100
    effects = tiers.free_for_rows(150)  # p2's move first, then one RAM entry, moved at once
    assert [e.entry.payload for e in effects] == ["p2", "p3"] and all(isinstance(e, Demote) for e in effects)
    assert tiers.ram.bytes == 100 and tiers.host.device_bytes == 0


def test_without_an_ssd_tier_the_host_tier_is_where_victims_go_and_the_cap_drops_them():
    tiers = tiers_with_host(host=120)
    for i in range(5):
        tiers.publish(toks(i * 100), payload=f"p{i}", nbytes=60, trimmable=True)
    assert sorted(e.payload for e in tiers.host.entries()) == ["p2", "p3"]
    assert tiers.lookup(toks(0) + (1,)).hit is None  # gone from both
    assert tiers.stats().host.evictions == 2


def test_with_an_ssd_tier_persist_before_demotion_still_holds_and_durable_entries_move_down():
    tiers = tiers_with_host(ssd=True)
    a, b = toks(0), toks(100)
    first = tiers.publish(a, payload="a", nbytes=60, trimmable=True)
    second = tiers.publish(b, payload="b", nbytes=60, trimmable=True)
    assert [type(e) for e in first + second] == [Persist, Persist]  # a waits for its write in RAM
    assert len(tiers.host) == 0 and tiers.ram.bytes == 120
    assert tiers.durable(SsdRecord("", a, 60, 0.0)) == []  # a leaves RAM for the host tier
    effects = tiers.move_to_host()
    assert [type(e) for e in effects] == [Demote] and effects[0].entry.durable
    assert tiers.prefetch_candidate(a + (1,)) is None  # the host tier serves it: no SSD read ahead
    lookup = tiers.lookup(a + (1,))  # host before SSD: no restore, the promoted entry is still durable
    assert lookup.promoted and lookup.restore is None and lookup.hit.entry.durable
    assert [type(e) for e in tiers.take_effects()] == [Promote]  # b cannot leave yet: not durable


def test_an_unpersistable_victim_is_forgotten_for_ssd_but_kept_on_the_host():
    tiers = tiers_with_host(ssd=True)
    a = toks(0)
    tiers.publish(a, payload="a", nbytes=60, trimmable=True)
    tiers.not_persisted("", a)
    effects = tiers.publish(toks(100), payload="b", nbytes=60, trimmable=True)
    assert {type(e) for e in effects} == {Persist, Forget}
    assert tiers.host.find(a + (1,)) is not None


def test_the_memory_budget_does_not_count_host_tier_bytes_as_other_memory():
    clock = Clock()
    tiers = CacheTiers(PromptCache(max_bytes=1000, clock=clock), host=HostTier(max_bytes=1000, clock=clock),
                       memory_budget=500)
    for i in range(3):
        tiers.publish(toks(i * 100), payload=f"p{i}", nbytes=100, trimmable=True)
    effects = tiers.observe_memory(450)  # 300 of it the RAM tier
    assert effects == [] and tiers.stats().memory.other_bytes == 150
    effects = tiers.observe_memory(700)  # 200 over: two entries move to the host tier
    assert [type(e) for e in effects] == [Demote, Demote] and tiers.ram.bytes == 100
    tiers.observe_memory(700)  # the moved entries are still MLX memory: other stays 400, not 600
    assert tiers.stats().memory.other_bytes == 400 and tiers.over_budget_bytes == 0


# --- the simulator ---------------------------------------------------------------------------------


def _conversations(n: int, turns: int, tokens: int) -> list[TraceRequest]:
    """n conversations, interleaved: each turn repeats its conversation's history plus 128 new tokens."""
    reqs = []
    t = 0.0
    for turn in range(turns):
        for c in range(n):
            length = tokens + turn * 128
            ids = tuple(c * 1_000_000 + i for i in range(length))
            reqs.append(TraceRequest(index=len(reqs), t=t, input_length=length, output_tokens=64, tokens=ids))
            t += 100.0
    return reqs


def test_the_simulator_serves_returning_conversations_from_the_host_tier():
    cost = DEFAULT.__class__(**{**DEFAULT.to_json(), "host_bytes_per_s": 50e9})
    reqs = _conversations(4, 3, 2048)
    one_entry = cost.kv_bytes(2048 + 3 * 128)
    plain = replay_mlxd(reqs, policy="lru", cost=cost, ram_bytes=one_entry, granularity="token")
    host = replay_mlxd(reqs, policy="lru", cost=cost, ram_bytes=one_entry, granularity="token",
                       host_bytes=8 * one_entry)
    assert plain.host_hits == 0 and host.host_capacity_bytes == 8 * one_entry
    assert host.host_hits >= 4 and host.host_hit_tokens > 0
    assert host.hit_tokens > plain.hit_tokens
    assert host.ttft_s["p50"] < plain.ttft_s["p50"]
    assert set(host.ttft_by_source_s) >= {"host", "miss"}


# --- the wiring -----------------------------------------------------------------------------------


def _kv(n: int) -> list[mlc.KVCache]:
    c = mlc.KVCache()
    c.update_and_fetch(mx.ones((1, 1, n, 8)), mx.ones((1, 1, n, 8)))
    mx.eval(c.keys, c.values)
    return [c]


async def _ask(channel, make):
    reply: Reply = Reply()
    await channel.send(make(reply))
    return await reply.wait()


async def test_the_cache_owner_demotes_promotes_reports_and_announces_cpu_blocks():
    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=10_000, kv_events_block_size=4)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    events_send, events = trio.open_memory_channel[PublishKvEvents](math.inf)
    owner = CacheOwnerActor(config, inbox=inbox, kv_events=events_send, host_tier=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        a, b = toks(0, 8), toks(100, 8)
        payload = _kv(8)
        for t in (a, b):
            await inbox_send.send(PublishPrefix(t, "", payload=payload, nbytes=512, trimmable=True, reason="final"))
        stats = await _ask(inbox_send, QueryCacheStats)
        host = stats.as_dict()["host"]
        assert host["enabled"] and host["entries"] == 1 and host["demotions"] == 1
        lookup = await _ask(inbox_send, lambda r: LookupPrefix(a + (1,), "", r))
        assert lookup.promoted and lookup.hit.usable == 8 and lookup.hit.entry.payload is payload
        stats = (await _ask(inbox_send, QueryCacheStats)).as_dict()
        assert stats["host"]["promotions"] == 1 and stats["ram"]["entries"] == 1
        nursery.cancel_scope.cancel()
    seen = []
    while True:
        try:
            seen += events.receive_nowait().events
        except trio.WouldBlock:
            break
    stored_cpu = [e for e in seen if isinstance(e, BlockStored) and e.medium == CPU]
    removed_cpu = [e for e in seen if isinstance(e, BlockRemoved) and e.medium == CPU]
    assert len(stored_cpu) >= 2 and len(removed_cpu) >= 1  # a went down, came back up, b went down
    assert any(isinstance(e, BlockStored) and e.medium == RAM for e in seen)


def _drain(events) -> list:
    seen = []
    while True:
        try:
            seen += events.receive_nowait().events
        except trio.WouldBlock:
            return seen


async def test_while_rows_decode_victims_keep_their_device_pages_until_the_engine_is_idle():
    """Demotion under pressure only: a victim's move waits until no row decodes and no request waits for
    its first token; taking it back before then is a plain hit (no copy); /stats and the KV events say
    where its bytes are."""
    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=10_000, kv_events_block_size=4)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    events_send, events = trio.open_memory_channel[PublishKvEvents](math.inf)
    governor = WriteGovernor(busy_rate_bytes_per_s=MB)
    owner = CacheOwnerActor(config, inbox=inbox, kv_events=events_send, host_tier=True, governor=governor)
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        await inbox_send.send(EngineBusy(True))
        a, b, c = toks(0, 8), toks(100, 8), toks(200, 8)
        for t in (a, b):
            await inbox_send.send(PublishPrefix(t, "", payload=_kv(8), nbytes=512, trimmable=True, reason="final"))
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["entries"], host["device_entries"], host["device_bytes"], host["moves"]) == (1, 1, 512, 0)
        seen = _drain(events)
        assert not any(e.medium == CPU for e in seen if isinstance(e, BlockStored | BlockRemoved))
        assert not any(isinstance(e, BlockRemoved) for e in seen)  # a is still device memory: still "RAM"
        lookup = await _ask(inbox_send, lambda r: LookupPrefix(a + (1,), "", r))
        assert lookup.hit.usable == 8 and not lookup.promoted  # no copy: its pages never left
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["reclaims"], host["promotions"], host["device_entries"]) == (1, 0, 1)  # b made room for a
        await inbox_send.send(PublishPrefix(c, "", payload=_kv(8), nbytes=512, trimmable=True, reason="final"))
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["device_entries"], host["moves"]) == (2, 0)
        governor.set_prefilling(True)  # a request waits for its first token: still no move
        await inbox_send.send(EngineBusy(False))
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["device_entries"], host["moves"]) == (2, 0)
        governor.set_prefilling(False)  # no row decodes, none waits: the moves go after the next message
        await _ask(inbox_send, QueryCacheStats)
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["device_entries"], host["moves"], host["moved_bytes"]) == (0, 2, 1024)
        seen = _drain(events)
        assert len([e for e in seen if isinstance(e, BlockStored) and e.medium == CPU]) >= 2
        assert any(isinstance(e, BlockRemoved) and e.medium == RAM for e in seen)
        lookup = await _ask(inbox_send, lambda r: LookupPrefix(b + (1,), "", r))
        assert lookup.promoted  # moved: its pages come back
        nursery.cancel_scope.cancel()


async def test_on_unified_memory_the_flag_is_a_reported_no_op(tmp_path: Path):
    assert not host_memory.separate_host_memory()  # this CPU: host memory is the RAM tier's memory
    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=2**30)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox)
    assert owner.tiers.host is None
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert host["enabled"] is False and host["requested_bytes"] == 2**30 and "unified" in host["reason"]
        nursery.cancel_scope.cancel()


def test_host_copies_round_trip_through_a_landing_on_this_backend():
    """The bulk copies the host tier and the SSD writer's staging use (numpy here, DMA on CUDA)."""
    src = mx.arange(2 * 3 * 16 * 4, dtype=mx.float32).reshape(2, 3, 16, 4)
    strided = src[:, :, :10, :]  # a cache sliced to its offset: not contiguous
    mx.eval(strided)
    view = np.asarray(memoryview(strided))
    host, arrays = host_memory.to_host([view])
    assert host.nbytes == view.nbytes and np.array_equal(arrays[0], view)
    dest = np.zeros(view.nbytes, dtype=np.uint8)
    assert host_memory.from_host([memoryview(dest)], arrays) == view.nbytes
    assert np.array_equal(dest.view(np.float32).reshape(view.shape), view)
    assert host_memory.move_pages(_kv(4), to_host=True) == 0  # nothing to move on unified memory


def test_a_staged_checkpoint_writes_the_same_file(tmp_path: Path):
    """The SSD writer's staging on CUDA (one bulk copy to host memory, then the write): same bytes."""
    from mlxd.kv import file_format as ff
    from mlxd.kv import kinds

    caches = _kv(12)
    caches[0].keys = caches[0].keys * mx.arange(8, dtype=mx.float32)  # not all ones
    plan = kinds.plan_snapshot(caches, meta=ff.SnapshotMeta(
        model_id="m", config_fingerprint="f", namespace="", tokenizer_hash="t", tokens=range(12)))
    staging = host_memory.Staging()
    staged = staging.stage(plan)
    assert staged.caches == plan.caches and all(
        bytes(a) == bytes(b) for a, b in zip(staged.buffers, plan.buffers, strict=True))
    again = staging.stage(plan)  # the buffer is reused
    assert staging.staged == 2 and staging.staged_bytes == 2 * plan.nbytes and again.nbytes == plan.nbytes
    a = ff.read_snapshot(ff.write_snapshot(plan, tmp_path / "a.mlxkv").path)
    b = ff.read_snapshot(ff.write_snapshot(staged, tmp_path / "b.mlxkv").path)  # verified (CRC-32) on read
    assert a.header.caches == b.header.caches
    assert all(np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers, strict=True))
    assert np.array_equal(b.buffers[0].reshape(-1).view(np.uint8), np.frombuffer(plan.buffers[0], np.uint8))


def test_the_flag_reaches_a_live_server_whose_stats_report_the_no_op(tiny_model_dir: Path):
    import httpx
    from tests.serving import ServerThread, config_for

    from mlxd.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "--host-cache-gb", "4"])
    assert serve_config(args).host_cache_bytes == 4 * 2**30
    with ServerThread(config_for(tiny_model_dir, host_cache_bytes=serve_config(args).host_cache_bytes)) as s:
        stats = httpx.get(s.base_url.removesuffix("/v1") + "/stats", timeout=60).json()
    host = stats["cache"]["host"]
    assert host["enabled"] is False and host["requested_bytes"] == serve_config(args).host_cache_bytes


def test_while_idle_with_a_measured_budget_only_the_headroom_short_of_it_moves():
    """Idle moves: with device room under the budget a demoted entry stays on the device (taking it back is
    a reclaim, no copy); as the budget's headroom (the largest entry) runs short, the coldest move first;
    with no budget, or none measured yet, every entry still on the device moves."""
    clock = Clock()
    tiers = CacheTiers(PromptCache(max_bytes=200, clock=clock), host=HostTier(max_bytes=1000, clock=clock),
                       memory_budget=2000)
    for i in range(4):
        tiers.publish(toks(i * 100), payload=f"p{i}", nbytes=100, trimmable=True)
    assert tiers.host.device_bytes == 200 and tiers.idle_headroom_bytes() == 100
    assert tiers.observe_memory(1000) == []  # other 600 + 200 RAM + 200 host-tier: 1000 of 2000
    assert tiers.idle_moves() == []  # room for the headroom: p0, p1 stay on the device
    lookup = tiers.lookup(toks(0) + (7,))
    assert lookup.hit is not None and lookup.hit.entry.payload == "p0" and not lookup.promoted
    assert tiers.stats().host.reclaims == 1
    tiers.take_effects()
    assert tiers.observe_memory(1950) == []  # other 1550: 1950 of 2000, 50 short of the headroom
    moves = tiers.idle_moves()
    assert [e.entry.payload for e in moves] == ["p1"] and all(isinstance(e, Demote) for e in moves)
    assert tiers.idle_moves() == []  # the headroom is free again
    unmeasured = tiers_with_host()
    for i in range(4):
        unmeasured.publish(toks(i * 100), payload=f"q{i}", nbytes=50, trimmable=True)
    assert [e.entry.payload for e in unmeasured.idle_moves()] == ["q0", "q1"]  # no budget: all of them


async def test_the_cache_owner_keeps_an_idle_demoted_entry_on_the_device_under_its_budget():
    """The shell applies the idle rule: once the engine measured memory far under the budget, an entry the
    RAM cap let go of keeps its pages on the device while idle, and the returning lookup is a reclaim."""
    from mlxd.runtime.kernel.messages import MemoryMeasured

    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=10_000)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox, host_tier=True, memory_budget=1 << 30)
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        await inbox_send.send(MemoryMeasured(64 * MB, 64 * MB, "prefill"))
        a, b = toks(0, 8), toks(100, 8)
        for t in (a, b):
            await inbox_send.send(PublishPrefix(t, "", payload=_kv(8), nbytes=512, trimmable=True, reason="final"))
        await inbox_send.send(EngineBusy(False))
        await _ask(inbox_send, QueryCacheStats)
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["device_entries"], host["moves"]) == (1, 0)  # idle, but the device has room
        lookup = await _ask(inbox_send, lambda r: LookupPrefix(a + (1,), "", r))
        assert lookup.hit.usable == 8 and not lookup.promoted
        host = (await _ask(inbox_send, QueryCacheStats)).as_dict()["host"]
        assert (host["reclaims"], host["promotions"]) == (1, 0)
        nursery.cancel_scope.cancel()


def test_a_served_promotion_is_in_the_request_record_and_an_idle_entry_under_the_budget_is_reclaimed(
        tiny_model_dir: Path, monkeypatch):
    """A live runtime with the host tier forced on (this CPU shares one memory, so the page moves are
    no-ops): a conversation pushed out of RAM by two others comes back from the host tier, and its
    request record (the request.done line) says so (promoted_bytes, lookup time). With a memory budget
    the engine measured far above what the cache holds, the idle server keeps the entry on the device:
    the same return is a reclaim, no promotion."""
    import httpx
    from tests.serving import ServerThread, config_for

    monkeypatch.setattr(host_memory, "separate_host_memory", lambda: True)
    kv_per_token = 2 * 2 * 16 * 2 * 4  # the "test" preset: layers x kv heads x head dim x (K, V) x fp32
    prompts = [" ".join(f"w{c}x{i}" for i in range(120)) for c in range(3)]
    outcomes = []
    for budget in (0, 1 << 34):
        config = config_for(tiny_model_dir, prompt_cache_bytes=int(1.2 * 300 * kv_per_token),
                            host_cache_bytes=1 << 30, memory_budget_bytes=budget)
        with ServerThread(config) as s:
            assert s.runtime is not None
            records = []
            s.runtime.scheduler.observers.append(records.append)
            for p in (*prompts, prompts[0] + " again"):
                body = {"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0.0}
                httpx.post(s.base_url + "/completions", json=body, timeout=60).raise_for_status()
            stats = httpx.get(s.base_url.removesuffix("/v1") + "/stats", timeout=60).json()["cache"]["host"]
        returning = records[-1]
        assert returning.cached_tokens > 100 and returning.lookup_s > 0
        outcomes.append((returning.promoted_bytes > 0, stats["promotions"], stats["reclaims"] > 0))
    assert outcomes[0][0] and outcomes[0][1] >= 1  # no budget: moved while idle, promoted back (bytes recorded)
    assert outcomes[1] == (False, 0, True)  # room under the budget: still on the device, a reclaim
