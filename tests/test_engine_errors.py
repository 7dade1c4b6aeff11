"""Errors as values: a failed step, request or checkpoint answers its requests at once and serving goes on."""

from __future__ import annotations

import json
import math

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
import trio
from tests.serving import ServerThread, config_for

from mlxd import GenerationError, RuntimeConfig, SamplingParams, TokenGenerated, open_runtime
from mlxd.actors.scheduler import SchedulerActor
from mlxd.kv.ssd_store import StoreIdentity
from mlxd.runtime.kernel.messages import (
    EngineInbox,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    GenerationRequest,
    LookupPrefix,
    PrefixLookup,
    PromptAccepted,
    StartGeneration,
    SubmitGeneration,
)

POISON = 7  # a prompt holding this token id makes the model's forward raise


class PoisonedEmbedding(nn.Module):
    """The model's own embedding, but its forward raises on the poison token (a model bug)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        if mx.any(x == POISON).item():
            raise RuntimeError("poisoned forward")
        return self.inner(x)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.inner.as_linear(x)


def poison(rt) -> None:
    inner = rt.engine.core.model.model
    inner.embed_tokens = PoisonedEmbedding(inner.embed_tokens)


def config(model_dir, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model_dir), model_name="tiny", **{"snapshot_min_tokens": 16, **kw})


def endless(rt, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, logit_bias=tuple((t, -100.0) for t in rt.info.eos_token_ids))


async def test_a_request_mlx_lm_refuses_fails_alone_and_at_once(tiny_model_dir):
    """mlx-lm refuses a negative repetition penalty: that request fails at once, its neighbours go on."""
    async with open_runtime(config(tiny_model_dir)) as rt:
        good = rt.submit(rt.request(rt.encode("once upon a time"), sampling=endless(rt, 40)))
        bad = rt.submit(rt.request(rt.encode("hello there"), sampling=SamplingParams(repetition_penalty=-1.0)))
        with trio.fail_after(60):  # before the fix: no answer at all
            with pytest.raises(GenerationError, match="penalty"):
                await bad.tokens()
            assert len(await good.tokens()) == 40  # the batch it would have joined is untouched
        assert rt.scheduler.stats.failed == 1
        async with rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=3))) as again:
            assert len(await again.tokens()) == 3


async def test_a_failing_forward_answers_every_row_and_keeps_serving(tiny_model_dir):
    # Whole prefill steps: with time slices a short newcomer may be prefilled on its own first
    # (engine/prefill_slices.py), where a failing forward fails that row alone, not the batch's step.
    async with open_runtime(config(tiny_model_dir, prefill_slice_s=0)) as rt:
        poison(rt)
        running = rt.submit(rt.request(rt.encode("once upon a time"), sampling=endless(rt)))
        async for event in running:
            if isinstance(event, TokenGenerated):
                break
        # Two rows join in one step: a healthy one and the poisoned one.
        healthy = rt.submit(rt.request(rt.encode("a healthy prompt"), sampling=endless(rt)))
        poisoned = rt.submit(rt.request([5, 6, POISON, 8], sampling=SamplingParams(max_tokens=4)))
        with trio.fail_after(60):
            for stream in (running, healthy, poisoned):
                with pytest.raises(GenerationError, match="poisoned forward"):
                    await stream.tokens()
        assert rt.engine.stats.failed_steps >= 1
        async with rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=3))) as again:
            assert len(await again.tokens()) == 3


class _RefusingIdentity(StoreIdentity):
    def meta(self, tokens, namespace):  # type: ignore[override]
        raise OSError(28, "No space left on device (injected)")


async def test_a_failing_checkpoint_is_skipped_and_its_row_continues(tiny_model_dir, tmp_path):
    async with open_runtime(config(tiny_model_dir, ssd_cache_dir=str(tmp_path / "ssd"))) as rt:
        ident = rt.engine.core.store_identity
        rt.engine.core.store_identity = _RefusingIdentity(ident.model_id, ident.fingerprint, ident.tokenizer_hash)
        prompt = rt.encode("Be brief. " * 20 + "Hi")
        with trio.fail_after(60):
            async with rt.submit(rt.request(prompt, sampling=endless(rt, 12))) as stream:
                tokens = await stream.tokens()
        assert len(tokens) == 12 and stream.finished.reason == "length"
        assert rt.engine.stats.checkpoints_skipped >= 2  # the prompt boundary and the final one
        assert rt.engine.stats.failed_steps == 0


def test_http_answers_a_failed_step_with_500_json_and_an_sse_error(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as server, httpx.Client(timeout=30) as client:
        poison(server.runtime)
        url = f"{server.base_url}/completions"
        r = client.post(url, json={"model": "tiny", "prompt": [5, 6, POISON], "max_tokens": 4})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "poisoned forward" in r.json()["error"]["message"]

        with client.stream("POST", url, json={"prompt": [5, POISON], "max_tokens": 4, "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"

        r = client.post(url, json={"prompt": [5, 6, 8], "max_tokens": 3})  # and it keeps serving
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


async def test_an_exception_in_one_lifecycle_fails_that_request_only():
    """A cache owner answering one lookup with an error fails that request; the scheduler serves on."""
    cfg = RuntimeConfig(max_batch=2)
    submit_send, submit_receive = trio.open_memory_channel[SubmitGeneration](4)
    engine_send, engine_receive = trio.open_memory_channel[EngineInbox](4)
    cache_send, cache_receive = trio.open_memory_channel[LookupPrefix](4)
    scheduler = SchedulerActor(cfg, inbox=submit_receive, engine=engine_send, cache=cache_send)

    async def cache_owner() -> None:
        async for msg in cache_receive:
            if msg.tokens[0] == POISON:
                msg.reply.fail(OSError(5, "Input/output error"))
            else:
                msg.reply.send(PrefixLookup(hit=None))

    async def engine() -> None:
        async for msg in engine_receive:
            if isinstance(msg, StartGeneration):
                n = len(msg.request.prompt)
                for event in (PromptAccepted(n, 0, "none", 0.0), TokenGenerated(1), GenerationFinished("stop", n, 0, 1)):
                    msg.events.send_nowait(event)
                msg.events.close()

    async def ask(prompt: tuple[int, ...]) -> list[GenerationEvent]:
        send, receive = trio.open_memory_channel[GenerationEvent](math.inf)
        await submit_send.send(SubmitGeneration(GenerationRequest(request_id=str(prompt), prompt=prompt), send, 0.0))
        return [e async for e in receive]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cache_owner)
        nursery.start_soon(engine)
        await nursery.start(scheduler.run)
        with trio.fail_after(60):  # only a hang: the fakes answer at once
            failed = await ask((POISON, 1, 2))
            served = await ask((1, 2, 3))
        assert isinstance(failed[-1], GenerationFailed) and "Input/output error" in failed[-1].message
        assert isinstance(served[-1], GenerationFinished)
        assert scheduler.stats.failed == 1 and scheduler.stats.completed == 1
        nursery.cancel_scope.cancel()


async def test_a_flush_right_after_a_reply_covers_that_reply(tiny_model_dir, tmp_path):
    """The engine publishes a row's final checkpoint before the client sees it finish,
    and a flush first drains what the cache owner already holds: the flush that follows
    a reply makes that reply's checkpoint durable (the crash loop's promise)."""
    from ssd_files import checkpoint_tokens

    ssd = tmp_path / "ssd"
    async with open_runtime(config(tiny_model_dir, ssd_cache_dir=str(ssd), snapshot_min_tokens=10**6)) as rt:
        for i in range(12):
            prompt = rt.encode(f"Conversation {i}. You are an expert on gardens. " * 4)
            async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=2))) as stream:
                await stream.tokens()
            report = await rt.flush()
            assert report["durable"] is True
            covered = checkpoint_tokens(ssd)
            assert any(tuple(t[: len(prompt)]) == tuple(prompt) for t in covered), f"reply {i} is not durable"
