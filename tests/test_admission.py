"""Admission by KV bytes (`--kv-admission`, kv/admission.py): pure rule, a live runtime, HTTP."""

from __future__ import annotations

import math

import httpx
import pytest
import trio
import trio.testing

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.kv.admission import Admit, KvAdmission, RamRoom, Refuse, Wait, weights_bytes
from mlxd.runtime.supervisor import InvalidRequest

from serving import ServerThread, config_for

MIB = 1024 * 1024


def test_the_rule_admits_waits_and_refuses_with_the_numbers():
    kv = KvAdmission(budget_bytes=100 * MIB, kv_bytes_per_token=MIB // 16, fixed_bytes=40 * MIB)
    assert kv.kv_bytes(600, 40) == 40 * MIB
    assert kv.decide(600, 40) == Admit(40 * MIB)
    kv.admit("a", 40 * MIB)
    # 20 MiB left: a second 40 MiB request waits, a 20 MiB one fits.
    assert kv.decide(600, 40) == Wait(40 * MIB, 20 * MIB)
    assert kv.decide(300, 20) == Admit(20 * MIB)
    # Bytes the tiers cannot free yet (entries waiting for their SSD write) count too.
    assert isinstance(kv.decide(300, 20, ram=RamRoom(unfreeable_bytes=MIB)), Wait)
    kv.release("a")
    assert kv.decide(600, 40) == Admit(40 * MIB) and kv.reserved_bytes == 0
    # More than the budget leaves beside the model: never, whatever runs.
    refused = kv.decide(900, 100)
    assert isinstance(refused, Refuse) and refused.nbytes == 62.5 * MIB
    assert "1000" not in refused.message and "prompt (900 tokens) + max_tokens (100)" in refused.message
    assert "62.5 MiB" in refused.message and "60.0 MiB" in refused.message and "100.0 MiB" in refused.message
    assert kv.never_fits(600, 40) is None
    # Alone it always runs if it can ever fit (nothing to wait for).
    big = KvAdmission(budget_bytes=100 * MIB, kv_bytes_per_token=MIB, fixed_bytes=0)
    big.admit("x", 99 * MIB)
    assert isinstance(big.decide(2, 0), Wait)
    big.release("x")
    assert isinstance(big.decide(99, 1), Admit)
    # No budget: everything is admitted and nothing reserved.
    off = KvAdmission(budget_bytes=0, kv_bytes_per_token=MIB)
    assert not off.enabled and off.decide(10**6, 10**6) == Admit(0) and off.never_fits(10**6, 1) is None


async def test_a_burst_waits_for_room_and_none_fails(tiny_model_dir):
    probe = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=0, kv_admission=True)
    sampling = SamplingParams(max_tokens=8)
    async with open_runtime(probe) as rt:
        kv = rt.scheduler.kv_admission
        assert kv is not None and rt.info.own_memory is not None
        fixed = kv.fixed_bytes
        prompt = await rt.render_chat([{"role": "user", "content": "Tell me everything about rivers. " * 6}])
        need = kv.need_bytes(len(prompt), sampling.max_tokens)
        # The KV in mlx-lm's 256-token steps, and the prefill's working memory measured at load.
        assert need > kv.kv_bytes(len(prompt), sampling.max_tokens) >= (len(prompt) + 8) * kv.kv_bytes_per_token
    # Room for one request at a time (and a half): the other three of a burst of four wait. Each runtime
    # measures its own memory at load (one measured 0.77 MB, the next 0.56 MB in one CI worker), so the
    # budget is set from this runtime's own numbers once it is open, before anything is submitted.
    config = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=0, kv_admission=True,
                           memory_budget_bytes=fixed + fixed // 10 + need * 3 // 2)
    async with open_runtime(config) as rt:
        kv = rt.scheduler.kv_admission
        assert kv is not None and kv.fixed_bytes >= weights_bytes(tiny_model_dir) > 0
        need = kv.need_bytes(len(prompt), sampling.max_tokens)
        kv.budget_bytes = kv.fixed_bytes + need * 3 // 2
        assert kv.never_fits(len(prompt), sampling.max_tokens) is None and 2 * need > kv.budget_bytes - kv.fixed_bytes
        outputs: list[list[int]] = []

        async def one(i: int) -> None:
            async with rt.submit(rt.request(prompt, sampling=sampling, request_id=f"r{i}")) as stream:
                outputs.append([e.token async for e in stream if hasattr(e, "logprob")])

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        assert len(outputs) == 4 and all(len(o) == sampling.max_tokens for o in outputs)
        assert kv.admitted == 4 and kv.waited >= 3 and kv.refused == 0
        # Never two prefills at once: a row's prefill working memory leaves at its first token, its KV stays.
        assert kv.peak_reserved_bytes <= kv.budget_bytes - kv.fixed_bytes
        # (How many decode at once depends on how far the first rows got meanwhile: not asserted.)
        assert kv.peak_prefilling == 1
        assert kv.reserved_bytes == 0
        # A request that can never fit is refused before it is queued, naming the numbers.
        with pytest.raises(InvalidRequest, match=r"need .* MiB of KV") as refused:
            rt.request(prompt, sampling=SamplingParams(max_tokens=need // kv.kv_bytes_per_token * 2))
        assert refused.value.param == "max_tokens" and kv.refused == 1


def test_http_answers_400_for_a_request_that_never_fits(tiny_model_dir):
    config = config_for(tiny_model_dir, kv_admission=True, memory_budget_bytes=weights_bytes(tiny_model_dir) + 4096)
    with ServerThread(config) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 64}
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
        assert "MiB of KV" in error["message"] and "memory budget" in error["message"]


async def test_own_memory_is_this_runtime_s_and_counts_the_draft(tiny_model_dir):
    """The fixed memory is measured per runtime (a delta on its engine thread): a second runtime in the
    process does not count the first one's; a --draft-model's KV per token joins the target's."""
    import attrs
    import mlx.core as mx

    config = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=0, kv_admission=True,
                           memory_budget_bytes=1 << 30)
    async with open_runtime(config) as first:
        one = first.scheduler.kv_admission
        own = first.info.own_memory
        assert one is not None and own is not None
        assert one.fixed_bytes >= weights_bytes(tiny_model_dir) and own.resident_bytes > 0
        # The fit's two terms share two measured peaks: either may floor at 0 (the linear one did once in a
        # full run); a chunk's transient bytes are what admission uses.
        assert own.prefill.chunk_bytes(128, 128) > 0 and one.prefill_bytes(100) > 0
        assert own.draft_kv_bytes_per_token == 0
        async with open_runtime(config) as second:
            two = second.scheduler.kv_admission
            assert two is not None and second.info.own_memory is not None
            # both are held ...
            assert mx.get_active_memory() >= own.resident_bytes + second.info.own_memory.resident_bytes
            assert two.fixed_bytes < 1.5 * one.fixed_bytes  # ... and each counts its own
        drafted = attrs.evolve(config, speculative="draft", draft_model=str(tiny_model_dir))
        async with open_runtime(drafted) as third:
            three = third.scheduler.kv_admission
            assert three is not None and third.info.own_memory is not None
            assert third.info.own_memory.draft_kv_bytes_per_token == third.info.kv_bytes_per_token
            assert three.kv_bytes_per_token == 2 * third.info.kv_bytes_per_token
            assert three.fixed_bytes > one.fixed_bytes  # the draft model's weights


def test_the_ram_bytes_the_tiers_cannot_free_are_held_against_the_room():
    """RAM entries count against admission only where the budget cannot free them now: pinned ones, and with
    an SSD tier those still waiting for their write (CacheTiers.unfreeable_bytes)."""
    from mlxd.kv.prompt_cache import PromptCache
    from mlxd.kv.tiers import CacheTiers

    def publish(tiers: CacheTiers, start: int, nbytes: int, session: str | None = None) -> None:
        tiers.publish(tuple(range(start, start + 10)), "", payload=None, nbytes=nbytes, trimmable=True,
                      session=session)

    ram_only = CacheTiers(PromptCache(max_bytes=10 * MIB, clock=lambda: 0.0))
    publish(ram_only, 0, MIB)
    assert ram_only.unfreeable_bytes() == 0  # evicted as rows need the room
    assert ram_only.pin_session("s", 60)
    publish(ram_only, 100, 2 * MIB, session="s")
    assert ram_only.unfreeable_bytes() == 2 * MIB  # pinned
    with_ssd = CacheTiers(PromptCache(max_bytes=10 * MIB, clock=lambda: 0.0), ssd=True)
    publish(with_ssd, 0, 3 * MIB)
    assert with_ssd.unfreeable_bytes() == 3 * MIB  # not written yet: it may not be demoted
    assert with_ssd.ram_room() == RamRoom(unfreeable_bytes=3 * MIB, freeable_bytes=0)
    assert ram_only.ram_room() == RamRoom(unfreeable_bytes=2 * MIB, freeable_bytes=MIB)
    kv = KvAdmission(budget_bytes=10 * MIB, kv_bytes_per_token=MIB // 16, fixed_bytes=2 * MIB)
    kv.admit("a", 4 * MIB)
    assert kv.decide(48, 16) == Admit(4 * MIB)
    assert kv.decide(48, 16, ram=with_ssd.ram_room()) == Wait(4 * MIB, MIB)
    # Freeable RAM in the way is freed first: what stands in the way, never more than there is.
    assert kv.decide(48, 16, ram=RamRoom(freeable_bytes=MIB)) == Admit(4 * MIB, free_ram_bytes=MIB)
    assert kv.decide(48, 16, ram=RamRoom(freeable_bytes=3 * MIB)) == Admit(4 * MIB, free_ram_bytes=3 * MIB)
    assert kv.decide(32, 16, ram=RamRoom(unfreeable_bytes=MIB, freeable_bytes=MIB)) == Admit(
        3 * MIB, free_ram_bytes=MIB)
    assert kv.decide(32, 16, ram=RamRoom(freeable_bytes=MIB)) == Admit(3 * MIB)  # fits beside it
    # Alone, a request runs whatever the RAM tier holds, once all it can free is freed.
    kv.release("a")
    assert kv.decide(48, 16, ram=RamRoom(unfreeable_bytes=7 * MIB, freeable_bytes=MIB)) == Admit(
        4 * MIB, free_ram_bytes=MIB)
    # The tiers free what can go, coldest first, never pinned entries.
    assert ram_only.free_for_rows(MIB) == [] and ram_only.ram_room() == RamRoom(2 * MIB, 0)
    assert ram_only.free_for_rows(MIB) == [] and ram_only.ram.bytes == 2 * MIB


async def test_the_scheduler_asks_the_cache_owner_to_free_ram_before_it_admits():
    """The scheduler learns what the RAM tier holds by message (`ReleaseRam`), and has the cache owner
    free the freeable RAM that stands in a request's way before it starts; a request that does not fit
    beside the running ones and the unfreeable RAM waits, and frees nothing."""
    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.actors.scheduler import SchedulerActor
    from mlxd.runtime.kernel.messages import (
        GenerationEvent,
        GenerationFinished,
        GenerationRequest,
        PinSession,
        PromptAccepted,
        PublishPrefix,
        StartGeneration,
        SubmitGeneration,
        TokenGenerated,
    )

    config = RuntimeConfig(max_batch=4, prompt_cache_bytes=64 * MIB)
    cache_send, cache_receive = trio.open_memory_channel(8)
    owner = CacheOwnerActor(config, inbox=cache_receive, clock=lambda: 0.0, memory_budget=10 * MIB)
    # 64 KiB of KV per token: a 64-token prompt with 16 to generate needs 5 MiB.
    kv = KvAdmission(budget_bytes=10 * MIB, kv_bytes_per_token=MIB // 16, fixed_bytes=2 * MIB)
    submit_send, submit_receive = trio.open_memory_channel[SubmitGeneration](8)
    engine_send, engine_receive = trio.open_memory_channel(8)
    scheduler = SchedulerActor(config, inbox=submit_receive, engine=engine_send, cache=cache_send.clone(),
                               kv_admission=kv)
    started: list[str] = []
    rows: dict[str, trio.MemorySendChannel[GenerationEvent]] = {}
    one_started = trio.Event()

    async def engine() -> None:  # scripted: a row holds its reservation until the test finishes it
        async for msg in engine_receive:
            if isinstance(msg, StartGeneration):
                started.append(msg.request.request_id)
                n = len(msg.request.prompt)
                msg.events.send_nowait(PromptAccepted(n, 0, "none", 0.0))
                msg.events.send_nowait(TokenGenerated(1))
                rows[msg.request.request_id] = msg.events
                one_started.set()

    def finish(request_id: str) -> None:
        events = rows.pop(request_id)
        events.send_nowait(GenerationFinished("length", 64, 0, 1))
        events.close()

    async def ask(request_id: str, prompt_start: int) -> None:
        send, receive = trio.open_memory_channel[GenerationEvent](math.inf)
        request = GenerationRequest(request_id=request_id, prompt=tuple(range(prompt_start, prompt_start + 64)),
                                    sampling=SamplingParams(max_tokens=16))
        await submit_send.send(SubmitGeneration(request, send, 0.0))
        async with receive:
            async for _ in receive:
                pass

    async with trio.open_nursery() as nursery:
        await nursery.start(owner.run)
        nursery.start_soon(engine)
        await nursery.start(scheduler.run)
        # The RAM tier: 3 MiB the tiers can free (no SSD tier: evicted), 1 MiB pinned.
        await cache_send.send(PinSession("s", 600))
        for start, nbytes, session in ((1000, 3 * MIB, None), (2000, MIB, "s")):
            await cache_send.send(PublishPrefix(tuple(range(start, start + 10)), "", [], nbytes, True, "final",
                                                session=session))
        # 10 - 2 fixed - 1 pinned leaves 7 MiB, 4 beside the freeable 3: the first request needs 5.
        nursery.start_soon(ask, "a", 0)
        await one_started.wait()
        assert started == ["a"] and kv.reserved_bytes == 5 * MIB
        assert owner.cache.bytes == MIB  # the 3 MiB entry left before "a" started; the pinned one stays
        memory = owner.stats().tiers.memory
        assert memory is not None and memory.admission_freed_bytes == 3 * MIB and memory.admission_frees == 1
        # A free entry again, and a second request: 10 - 2 - 5 - 1 leaves 2 MiB, it needs 5: it waits,
        # and nothing is freed for it yet.
        await cache_send.send(PublishPrefix(tuple(range(3000, 3010)), "", [], 3 * MIB, True, "final"))
        one_started = trio.Event()
        nursery.start_soon(ask, "b", 100)
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["a"] and owner.cache.bytes == 4 * MIB
        # "a" ends: "b" fits once the free entry goes (7 MiB beside the pinned one, 4 beside both).
        finish("a")
        await one_started.wait()
        assert started == ["a", "b"] and owner.cache.bytes == MIB
        assert owner.stats().tiers.memory.admission_freed_bytes == 6 * MIB  # type: ignore[union-attr]
        finish("b")
        await trio.testing.wait_all_tasks_blocked()
        assert kv.admitted == 2 and kv.waited == 1 and kv.reserved_bytes == 0
        nursery.cancel_scope.cancel()


def test_prefill_working_memory_is_reserved_until_the_first_token():
    kv = KvAdmission(budget_bytes=100 * MIB, kv_bytes_per_token=1024, kv_step=256, prefill_step=512,
                     prefill_per_token=1024, prefill_per_token_context=16)
    assert kv.kv_bytes(300, 10) == 512 * 1024  # two 256-token steps
    # The largest chunk: 512 new tokens attending to all 1,000.
    assert kv.prefill_bytes(1000) == 512 * 1024 + 16 * 512 * 1000
    need = kv.need_bytes(1000, 24)
    kv.admit("a", need, prefill_bytes=kv.prefill_bytes(1000))
    assert kv.reserved_bytes == need and kv.prefilled("a") and not kv.prefilled("a")
    assert kv.reserved_bytes == kv.kv_bytes(1000, 24)
    kv.release("a")
    assert kv.reserved_bytes == 0 and kv.peak_reserved_bytes == need and kv.peak_running == 1
    # Never fits: the message names the prefill's share too.
    why = KvAdmission(budget_bytes=20 * MIB, kv_bytes_per_token=1024, prefill_per_token_context=32).never_fits(
        1000, 24)
    assert why is not None and "MiB of prefill working memory" in why
