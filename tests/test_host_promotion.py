"""The host tier's page moves as serving issues them (runtime/host_memory.promote / demote), on real MLX
arrays with the CUDA runtime calls answered by tests/fake_cuda.py (this CPU has no separate device memory):
a promotion never queues behind a demotion, stops its own entry's demotion, and demotions hold still for
a request's first token and a landing promotion unless device memory is needed now (issue 28)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc
from tests import fake_cuda

from mlxd.kv.host_tier import HostTier
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.retention import make_policy
from mlxd.kv.tiers import CacheTiers, Demote
from mlxd.runtime import host_memory


def _kv(layers: int = 4, n: int = 64) -> list[mlc.KVCache]:
    out = []
    for i in range(layers):
        c = mlc.KVCache()
        c.update_and_fetch(mx.full((1, 2, n, 16), float(i)), mx.full((1, 2, n, 16), -float(i)))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def _bytes(payload: list[mlc.KVCache]) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in payload)


@pytest.fixture
def fake(monkeypatch):
    lib = fake_cuda.FakeCudaLib(to_host_Bps=1e12, to_device_Bps=1e12)
    fake_cuda.install(monkeypatch, lib)
    return lib


def _thread(fn, *args, **kwargs):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn(*args, **kwargs)))
    t.start()
    return t, box


def _until(predicate, timeout: float = 60) -> None:
    """Until `predicate()` holds (a state another thread reaches); `timeout` only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_promotion_is_one_call_per_contiguous_range_in_layer_order_on_its_own_stream(fake):
    payload = _kv(layers=3)
    p = host_memory.promote(payload)
    calls = [c for c in fake.calls if c.op == "prefetch_device"]
    assert p.nbytes == _bytes(payload) and p.calls == len(calls) <= 6 and p.issue_s >= 0
    assert len({c.stream for c in calls}) == 1
    cuda = host_memory._runtime()
    assert calls[0].stream == cuda.promotions.stream.value != cuda.demotions.stream.value
    assert p.wait() >= 0 and p.landed_s is not None and p.bytes_per_s
    # Arrays that follow each other in memory are one range: one call for them.
    a = mx.arange(4096, dtype=mx.float32).reshape(8, 512)
    mx.eval(a)
    halves = [a[:4], a[4:]]
    assert host_memory.promote(halves).calls == 1
    assert host_memory.promote([a[4:], a[:4]]).calls == 2  # layer order first: never reordered to merge


def test_a_promotion_never_waits_behind_a_demotion_in_flight(fake):
    """A migration to the host runs inside its call (the driver's); one in flight must not hold up a
    promotion issued on the trio thread (the H200's 435-508 ms lookups)."""
    other, back = _kv(), _kv()
    fake.gate = threading.Event()
    t, box = _thread(host_memory.demote, other)
    assert fake.entered.wait(60)
    p = host_memory.promote(back)  # returns while the demotion is still inside its first piece
    assert t.is_alive() and p.nbytes == _bytes(back)
    fake.gate.set()
    t.join(60)
    assert box["out"].nbytes == _bytes(other) and not box["out"].cancelled
    device = [c for c in fake.calls if c.op == "prefetch_device"]
    host = [c for c in fake.calls if c.op == "prefetch_host"]
    assert device[-1].issued < host[0].ends  # issued before the demotion's first piece ended
    assert {c.stream for c in device}.isdisjoint({c.stream for c in host})


def test_a_promotion_stops_its_own_entry_s_demotion_between_pieces(fake):
    payload = _kv(layers=4)
    fake.gate = threading.Event()
    piece = payload[0].keys.nbytes // 2
    t, box = _thread(host_memory.demote, payload, piece=piece)
    assert fake.entered.wait(60)
    job = host_memory._demoting[id(payload)]
    pt, pbox = _thread(host_memory.promote, payload)
    _until(lambda: job.cancelled)  # the promotion asked the demotion to stop (and then waits for its lock)
    assert pt.is_alive()  # waits for the piece in flight (its pages then come back with the rest)
    fake.gate.set()
    t.join(60)
    pt.join(60)
    d, p = box["out"], pbox["out"]
    assert d.cancelled and d.pieces == 1 and d.nbytes == piece < _bytes(payload)
    # Back: the one array it had converted (the rest never left the device, and are not converted now).
    assert p.cancelled_demotion and p.nbytes == payload[0].keys.nbytes < _bytes(payload) and p.calls == 1
    first_piece = next(c for c in fake.calls if c.op == "prefetch_host")
    assert all(c.issued >= first_piece.ends for c in fake.calls if c.op == "prefetch_device")
    assert not host_memory._demoting  # nothing left registered


def _reads(monkeypatch) -> list:
    """The arrays whose address is taken from now on (each one's first host read converts it on CUDA)."""
    read: list = []
    range_of = host_memory._range_of
    monkeypatch.setattr(host_memory, "_range_of", lambda a: read.append(a) or range_of(a))
    return read


def test_a_demotion_decided_before_its_thread_runs_is_stopped_by_a_promotion_in_between(fake, monkeypatch):
    payload = _kv()
    read = _reads(monkeypatch)
    ticket = host_memory.begin_demotion(payload)
    p = host_memory.promote(payload)  # the lookup came first
    # Nothing had left the device: the promotion neither converts the arrays nor calls CUDA at all.
    assert p.nbytes == 0 and p.cancelled_demotion and not read and not fake.calls and not fake._events
    d = host_memory.demote(payload, ticket=ticket)
    assert d.cancelled and d.nbytes == 0 and not [c for c in fake.calls if c.op == "prefetch_host"] and not read


def test_a_demotion_converts_one_array_at_a_time_holding_still_between(fake, monkeypatch):
    """Each array's first host read converts it with the GIL held (157-200 ms for a whole 16k-token entry of
    the 1.7B shape at once on an H100): a request that comes mid-demotion waits for one array, not all."""
    payload = _kv(layers=4)
    read = _reads(monkeypatch)
    waiting = threading.Event()
    fake.gate = threading.Event()
    t, box = _thread(host_memory.demote, payload, hold=waiting.is_set, hold_max_s=60)
    assert fake.entered.wait(60)  # the first array converted, its first piece moving
    waiting.set()  # a request now waits for its first token
    fake.gate.set()
    time.sleep(0.1)
    assert t.is_alive() and read == [payload[0].keys]  # held still before converting the next array
    p = host_memory.promote(payload)  # the request is this entry's: it stops the demotion
    t.join(60)
    d = box["out"]
    assert d.cancelled and d.nbytes == payload[0].keys.nbytes and read == [payload[0].keys]
    assert p.nbytes == payload[0].keys.nbytes and p.calls == 1
    assert 0 < d.convert_max_s <= d.ranges_s
    whole = host_memory.demote(_kv(layers=2))
    assert whole.nbytes == _bytes(_kv(layers=2)) and len(read) == 1 + 4  # every array, once each


def test_a_demotion_holds_while_asked_then_goes_and_never_holds_past_its_limit(fake, monkeypatch):
    payload = _kv()
    read = _reads(monkeypatch)  # the first host read of an array converts it on MLX's CUDA backend: that waits too
    waiting, asked = threading.Event(), threading.Event()
    waiting.set()

    def hold() -> bool:
        asked.set()
        return waiting.is_set()

    t, box = _thread(host_memory.demote, payload, hold=hold, hold_max_s=60)
    assert asked.wait(60)  # the demotion is holding still (the thread may start late on a loaded host)
    time.sleep(0.1)
    assert t.is_alive() and not [c for c in fake.calls if c.op == "prefetch_host"]  # held: nothing moved
    assert not read
    waiting.clear()  # the request got its first token
    t.join(60)
    d = box["out"]
    assert d.nbytes == _bytes(payload) and d.holds == 1 and d.held_s > 0
    capped = host_memory.demote(_kv(), hold=lambda: True, hold_max_s=0.05)
    assert capped.nbytes > 0 and capped.held_s >= 0.05 and not capped.cancelled


def test_a_demotion_waits_for_a_promotion_to_land_unless_urgent(monkeypatch):
    back = _kv(layers=2, n=32)
    lib = fake_cuda.FakeCudaLib(to_host_Bps=1e12, to_device_Bps=_bytes(back) / 0.5)  # it lands in 0.5 s
    fake_cuda.install(monkeypatch, lib)
    host_memory.promote(back)
    held = host_memory.demote(_kv(), hold=lambda: False, hold_max_s=30)
    landed = max(c.ends for c in lib.calls if c.op == "prefetch_device")
    moved = [c for c in lib.calls if c.op == "prefetch_host"]
    assert held.holds == 1 and moved[0].starts >= landed
    lib.calls.clear()
    host_memory.promote(back)
    urgent = host_memory.demote(_kv(), hold=None)  # admission: device memory is needed now
    landed = max(c.ends for c in lib.calls if c.op == "prefetch_device")
    assert urgent.holds == 0 and min(c.starts for c in lib.calls if c.op == "prefetch_host") < landed


def test_on_this_cpu_the_moves_are_no_ops():
    assert not host_memory.separate_host_memory()
    p = host_memory.promote(_kv())
    assert (p.nbytes, p.calls) == (0, 0) and p.wait() >= 0
    assert host_memory.demote(_kv()).nbytes == 0 and host_memory.begin_demotion(_kv()) is None


def test_admission_moves_are_urgent_the_budget_s_are_not_and_only_the_idle_ones_wait_for_decode():
    clock = iter(range(10**6)).__next__
    tiers = CacheTiers(PromptCache(max_bytes=200, policy=make_policy("lru"), clock=clock),
                       host=HostTier(max_bytes=10_000, clock=clock), memory_budget=10_000)
    for i in range(6):
        tiers.publish(tuple(range(i * 100, i * 100 + 10)), payload=f"p{i}", nbytes=100, trimmable=True)
    assert tiers.host is not None and tiers.host.device_bytes == 400
    urgent = tiers.free_for_rows(150)
    assert urgent and all(isinstance(e, Demote) and e.urgent and not e.idle for e in urgent)
    relief = [e for e in tiers.observe_memory(20_000) if isinstance(e, Demote)]  # far over the budget
    assert relief and not any(e.urgent or e.idle for e in relief)
    # (over the budget, every victim is moved as it comes: the idle moves are a server's within its budget)
    calm = CacheTiers(PromptCache(max_bytes=200, policy=make_policy("lru"), clock=clock),
                      host=HostTier(max_bytes=10_000, clock=clock))
    for i in range(4):
        calm.publish(tuple(range(i * 100, i * 100 + 10)), payload=f"q{i}", nbytes=100, trimmable=True)
    idle = [e for e in calm.idle_moves() if isinstance(e, Demote)]
    assert len(idle) == 2 and all(e.idle and not e.urgent for e in idle)


def _settled(host: dict) -> bool:
    """/stats `cache.host`: every move decided is carried out and the last promotion has landed."""
    copies = host["copies"]
    return (host["device_entries"] == 0 and copies["demotions"] + copies["move_failures"] >= host["moves"]
            and (copies["promotions"] == 0 or copies["promote_landed_ms_last"] is not None))


def test_a_served_promotion_reports_its_cost_and_its_copies(tiny_model_dir: Path, monkeypatch):
    """A live runtime on the fake: a conversation pushed out of RAM and off the device comes back by a
    promotion issued on the trio thread on its own stream; its request record carries the promotion
    (issue and landing times) and /stats `cache.host.copies` counts the moves as carried out."""
    import httpx
    from tests.serving import ServerThread, config_for

    lib = fake_cuda.FakeCudaLib(to_host_Bps=1e12, to_device_Bps=1e12)
    cuda = fake_cuda.install(monkeypatch, lib)
    kv_per_token = 2 * 2 * 16 * 2 * 4
    prompts = [" ".join(f"w{c}x{i}" for i in range(120)) for c in range(3)]
    config = config_for(tiny_model_dir, prompt_cache_bytes=int(1.2 * 300 * kv_per_token), host_cache_bytes=1 << 30,
                        memory_budget_bytes=0)  # no budget: every victim moves once the server is idle
    with ServerThread(config) as s:
        assert s.runtime is not None
        records = []
        s.runtime.scheduler.observers.append(records.append)
        def host_stats() -> dict:
            return httpx.get(s.base_url.removesuffix("/v1") + "/stats", timeout=60).json()["cache"]["host"]

        for p in (*prompts, prompts[0] + " again"):
            body = {"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0.0}
            httpx.post(s.base_url + "/completions", json=body, timeout=60).raise_for_status()
            _until(lambda: _settled(host_stats()))  # idle: the moves go, and a promotion lands
        stats = host_stats()
        trio_thread = s._thread.name
    returning = records[-1]
    promotion = returning.promotion
    assert returning.promoted_bytes > 0 and isinstance(promotion, host_memory.Promotion)
    assert promotion.nbytes > 0 and promotion.calls >= 1 and promotion.issue_s >= 0
    promoted = [c for c in lib.calls if c.op == "prefetch_device"]
    assert promoted and trio_thread not in {c.thread for c in promoted}  # issued on a worker thread
    assert {c.stream for c in promoted} == {cuda.promotions.stream.value}
    assert {c.stream for c in lib.calls if c.op == "prefetch_host"} == {cuda.demotions.stream.value}
    copies = stats["copies"]
    assert copies["promotions"] == stats["promotions"] >= 1 and copies["demotions"] >= 1
    assert copies["demoted_bytes"] > 0 and copies["promote_landed_ms_last"] is not None


async def test_many_demotions_at_once_leave_trio_s_worker_threads_to_the_rest_of_the_server(fake):
    """The idle moves can send dozens of host-tier entries down at once; each demotion holds or waits for
    the demote lane in a worker thread. They must not take trio's shared threads (40), which every request's
    JSON parse and tokenization also needs: one demotion's piece stuck in flight, 45 queued behind it, and
    another worker-thread call still runs."""
    import trio

    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.runtime.config import RuntimeConfig
    from mlxd.runtime.kernel.channels import Reply
    from mlxd.runtime.kernel.messages import CacheOwnerMessage

    async def ask(channel, make):
        reply: Reply = Reply()
        await channel.send(make(reply))
        return await reply.wait()

    n = 46
    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=1 << 30)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox, host_tier=True)
    fake.gate = threading.Event()
    await _many_demotions(owner, inbox_send, inbox, n, ask, fake)
    assert not host_memory._demoting


async def _many_demotions(owner, inbox_send, inbox, n, ask, fake) -> None:
    import trio

    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        try:
            await _many_demotions_go(inbox_send, n, ask, fake)
        finally:
            fake.gate.set()  # before the nursery waits for the worker threads
        nursery.cancel_scope.cancel()


async def _many_demotions_go(inbox_send, n, ask, fake) -> None:
    import trio

    from mlxd.runtime.kernel.messages import EngineBusy, PublishPrefix, QueryCacheStats

    await inbox_send.send(EngineBusy(True))  # the victims keep their device pages for now
    for i in range(n + 1):
        await inbox_send.send(PublishPrefix(tuple(range(i * 100, i * 100 + 8)), "", payload=_kv(layers=1, n=8),
                                            nbytes=512, trimmable=True, reason="final"))
    await inbox_send.send(EngineBusy(False))  # idle: every one of them moves now
    host = (await ask(inbox_send, QueryCacheStats)).as_dict()["host"]
    assert host["moves"] == n
    for _ in range(3000):  # the first piece is in flight, stuck
        if fake.entered.is_set():
            break
        await trio.sleep(0.01)
    assert fake.entered.is_set()
    with trio.fail_after(30):  # (a hang, not a timing: without the fix this never returns)
        assert await trio.to_thread.run_sync(lambda: "ran") == "ran"
    fake.gate.set()
    for _ in range(6000):
        if (await ask(inbox_send, QueryCacheStats)).as_dict()["host"]["copies"]["demotions"] >= n:
            break
        await trio.sleep(0.01)
    copies = (await ask(inbox_send, QueryCacheStats)).as_dict()["host"]["copies"]
    assert copies["demotions"] == n and copies["demotions_stopped"] == 0


def test_a_demotion_that_waited_for_its_worker_counts_that_wait_against_its_hold(fake):
    """Demotions run one at a time: one decided long ago does not hold still for a whole hold more."""
    payload = _kv()
    ticket = host_memory.begin_demotion(payload)
    assert ticket is not None
    ticket.decided -= 10  # it waited behind others for 10 s
    d = host_memory.demote(payload, hold=lambda: True, hold_max_s=2, ticket=ticket)
    assert d.holds == 0 and d.nbytes == _bytes(payload)
    other = _kv()
    fresh = host_memory.demote(other, hold=lambda: True, hold_max_s=0.05, ticket=host_memory.begin_demotion(other))
    assert fresh.holds == 1 and not host_memory._demoting


async def test_demotions_still_queued_when_the_cache_owner_stops_leave_nothing_registered(fake):
    """A demotion decided (registered by `begin_demotion`) whose worker never ran because the actor stopped
    must not stay registered: a later payload at the same address would read as a stopped demotion."""
    import trio

    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.runtime.config import RuntimeConfig
    from mlxd.runtime.kernel.channels import Reply
    from mlxd.runtime.kernel.messages import (
        CacheOwnerMessage,
        EngineBusy,
        PublishPrefix,
        QueryCacheStats,
    )

    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=1 << 30)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox, host_tier=True)
    fake.gate = threading.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        try:
            await inbox_send.send(EngineBusy(True))
            for i in range(5):
                await inbox_send.send(PublishPrefix(tuple(range(i * 100, i * 100 + 8)), "",
                                                    payload=_kv(layers=1, n=8), nbytes=512, trimmable=True,
                                                    reason="final"))
            await inbox_send.send(EngineBusy(False))
            reply: Reply = Reply()
            await inbox_send.send(QueryCacheStats(reply))
            assert (await reply.wait()).as_dict()["host"]["moves"] == 4
            for _ in range(3000):
                if fake.entered.is_set():
                    break
                await trio.sleep(0.01)
            assert fake.entered.is_set() and len(host_memory._demoting) == 4  # one moving, three queued
        finally:
            nursery.cancel_scope.cancel()
            fake.gate.set()
    assert not host_memory._demoting


def test_a_promotion_with_nothing_to_move_keeps_no_cuda_events(fake):
    """Serving waits (and frees the events) only for a promotion that moved bytes: one with none must not
    leave its two events behind."""
    p = host_memory.promote([])
    assert p.nbytes == 0 and p.events is None and not fake._events
    q = host_memory.promote(_kv(layers=1))
    assert q.events is not None and len(fake._events) == 2
    q.wait()
    assert not fake._events


async def _with_the_first_on_the_host(copies_key: str, body) -> None:
    """A cache owner (host tier on, its RAM tier room for one entry) given two entries: the first goes to the
    host tier, its move issued once the owner is idle. Once `/stats`' host copies count `copies_key` >= 1,
    `await body(ask, tokens of the first, nursery)`; then the owner stops, leaving no demotion registered."""
    import trio

    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.runtime.config import RuntimeConfig
    from mlxd.runtime.kernel.channels import Reply
    from mlxd.runtime.kernel.messages import CacheOwnerMessage, PublishPrefix, QueryCacheStats

    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=1 << 30)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox, host_tier=True)

    async def ask(make):
        reply: Reply = Reply()
        await inbox_send.send(make(reply))
        return await reply.wait()

    a, b = tuple(range(8)), tuple(range(100, 108))
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        for t in (a, b):
            await inbox_send.send(PublishPrefix(t, "", payload=_kv(layers=1, n=8), nbytes=512, trimmable=True,
                                                reason="final"))
        for _ in range(3000):
            if (await ask(QueryCacheStats)).as_dict()["host"]["copies"][copies_key] >= 1:
                break
            await trio.sleep(0.01)
        await body(ask, a, nursery)
        nursery.cancel_scope.cancel()
    assert not host_memory._demoting


async def test_a_move_that_raises_is_counted_and_the_cache_owner_serves_on(fake, monkeypatch):
    """A promotion or demotion (worker threads both) that raises, e.g. out of memory converting an array on
    MLX's CUDA backend under the very pressure that demotes, must not take the cache owner down."""
    from mlxd.runtime.kernel.messages import LookupPrefix, QueryCacheStats

    def boom(payload):
        raise RuntimeError("[malloc] out of memory")

    async def body(ask, a, nursery) -> None:
        lookup = await ask(lambda r: LookupPrefix(a + (1,), "", r))  # its promotion raises
        assert lookup.hit is not None and lookup.hit.usable == 8
        copies = (await ask(QueryCacheStats)).as_dict()["host"]["copies"]
        assert copies["move_failures"] == 2 and copies["demotions"] == 0

    monkeypatch.setattr(host_memory, "_range_of", boom)  # the first's demotion raises
    await _with_the_first_on_the_host("move_failures", body)


async def test_a_promotion_waiting_in_the_driver_leaves_the_event_loop_serving(fake):
    """A promotion's runtime calls can wait in the driver for another thread's migration (299 ms on an H100).
    Issued on the event loop, that stopped every request's stream; now the lookup's reply waits for it, and the
    rest of the server runs meanwhile."""
    import trio

    from mlxd.runtime.kernel.messages import LookupPrefix, QueryCacheStats

    async def body(ask, a, nursery) -> None:
        gate = fake.device_gate = threading.Event()
        # Released from the event loop once it has run a few times while the call waits; a timer releases it
        # otherwise (before, the event loop itself waited in the call, and nothing of ours could run).
        fallback = threading.Timer(30.0, gate.set)
        fallback.start()
        answered, waiting_ticks = trio.Event(), 0

        async def lookup() -> None:
            hit = await ask(lambda r: LookupPrefix(a + (1,), "", r))
            assert hit.hit is not None and hit.hit.usable == 8 and hit.promotion is not None
            answered.set()

        nursery.start_soon(lookup)
        while not answered.is_set():
            await trio.sleep(0.01)
            if fake.entered_device.is_set() and not gate.is_set():
                waiting_ticks += 1  # the event loop ran while the promotion waited in the driver
                if waiting_ticks >= 5:
                    gate.set()
        fallback.cancel()
        assert waiting_ticks >= 5  # (before: 0, then the timer)
        assert [c for c in fake.calls if c.op == "prefetch_device"]
        copies = (await ask(QueryCacheStats)).as_dict()["host"]["copies"]
        assert copies["promotions"] == 1 and copies["promote_issue_ms_last"] > 0

    await _with_the_first_on_the_host("demotions", body)


async def test_a_demotion_begun_while_idle_holds_still_once_rows_decode(fake, monkeypatch):
    """Idle moves go while no row decodes, but a returning conversation's decode often starts before they end
    (decodeil on the H200: the fresh prompt's victims moved right after it, the decode came right after): the
    rest of the move waits until the engine is idle again (up to the hold limit, here made long so that a
    slow host cannot end the hold first), not beside the decode."""
    import trio

    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.runtime.config import RuntimeConfig
    from mlxd.runtime.kernel.channels import Reply
    from mlxd.runtime.kernel.messages import (
        CacheOwnerMessage,
        EngineBusy,
        PublishPrefix,
        QueryCacheStats,
    )

    monkeypatch.setattr(host_memory, "DEMOTE_HOLD_S", 60.0)
    config = RuntimeConfig(prompt_cache_bytes=600, host_cache_bytes=1 << 30)
    inbox_send, inbox = trio.open_memory_channel[CacheOwnerMessage](16)
    owner = CacheOwnerActor(config, inbox=inbox, host_tier=True)
    victim = _kv(layers=4, n=8)  # 8 arrays: 8 pieces

    async def copies() -> dict:
        reply: Reply = Reply()
        await inbox_send.send(QueryCacheStats(reply))
        return (await reply.wait()).as_dict()["host"]["copies"]

    def moved() -> int:
        return sum(1 for c in fake.calls if c.op == "prefetch_host")

    fake.gate = threading.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        try:
            await inbox_send.send(EngineBusy(True))
            for i, payload in enumerate((victim, _kv(layers=1, n=8))):  # the second pushes the first out of RAM
                await inbox_send.send(PublishPrefix(tuple(range(i * 100, i * 100 + 8)), "", payload=payload,
                                                    nbytes=512, trimmable=True, reason="final"))
            await inbox_send.send(EngineBusy(False))  # idle: the victim's move is issued
            for _ in range(6000):  # its first piece is in flight
                if fake.entered.is_set():
                    break
                await trio.sleep(0.01)
            assert fake.entered.is_set()
            await inbox_send.send(EngineBusy(True))  # a decode starts before the move ends
            await copies()  # (the owner has taken the message)
            fake.gate.set()
            for _ in range(6000):  # the piece in flight lands (its thread may wake late on a loaded host)
                if moved() >= 1:
                    break
                await trio.sleep(0.01)
            await trio.sleep(0.3)  # then the decode goes on: nothing more may move
            assert moved() == 1, "the move went on beside the decode"
            await inbox_send.send(EngineBusy(False))
            for _ in range(6000):
                if (await copies())["demotions"] >= 1:
                    break
                await trio.sleep(0.01)
            done = await copies()
            # (held_s from when its thread looked again after the piece, which a loaded host may delay)
            assert moved() == 2 * 4 and done["demote_holds"] == 1 and done["demote_held_s"] > 0
            assert done["demote_ranges_ms_max"] > 0  # the first host read's time (on CUDA: GIL held), measured
        finally:
            fake.gate.set()
        nursery.cancel_scope.cancel()
