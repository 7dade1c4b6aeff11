"""Embedding the runtime in a trio program: no HTTP, no signal handlers."""

from __future__ import annotations

import signal

import pytest
import trio

import mlxd
from mlxd import RuntimeConfig, SamplingParams, TokenGenerated, open_runtime


def config(model_dir, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=str(model_dir), model_name="tiny", snapshot_min_tokens=16, **kw)


async def test_stream_tokens_and_reuse_prefix(tiny_model_dir):
    handlers_before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    async with open_runtime(config(tiny_model_dir)) as rt:
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers_before
        messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "Hi"}]
        prompt = await rt.render_chat(messages)
        greedy = SamplingParams(max_tokens=6, logprobs=True)
        async with rt.submit(rt.request(prompt, sampling=greedy)) as stream:
            events = [e async for e in stream]
        assert stream.accepted is not None and stream.accepted.cached_tokens == 0
        assert stream.finished is not None and stream.finished.completion_tokens == 6
        first = [e for e in events if isinstance(e, TokenGenerated)]
        assert len(first) == 6

        # The same prompt again: all but its last token come from the RAM tier,
        # and the continuation (tokens and logprobs) is the same.
        async with rt.submit(rt.request(prompt, sampling=greedy)) as stream:
            again = [e for e in [e async for e in stream] if isinstance(e, TokenGenerated)]
        assert stream.accepted.cached_tokens == len(prompt) - 1
        assert stream.accepted.cache_tier == "ram"
        assert [e.token for e in again] == [e.token for e in first]
        assert [e.logprob for e in again] == pytest.approx([e.logprob for e in first], abs=1e-4)

        stats = await rt.stats()
        assert stats.cache.tiers.ram.hits >= 1
        assert stats.channels["submit"].capacity == rt.config.max_queue


async def test_leaving_the_stream_early_cancels(tiny_model_dir):
    async with open_runtime(config(tiny_model_dir, max_batch=1)) as rt:
        no_eos = tuple((t, -100.0) for t in rt.info.eos_token_ids)
        sampling = SamplingParams(max_tokens=2000, logit_bias=no_eos)
        stream = rt.submit(rt.request(rt.encode("once upon a time"), sampling=sampling))
        async with stream:
            async for event in stream:
                if isinstance(event, TokenGenerated):
                    break
        with trio.fail_after(60):
            await rt.scheduler.wait_idle()
        assert rt.scheduler.stats.cancelled == 1
        assert rt.scheduler.stats.generated_tokens < 2000


async def test_invalid_requests_raise(tiny_model_dir):
    async with open_runtime(config(tiny_model_dir, max_context=256)) as rt:
        with pytest.raises(mlxd.InvalidRequest, match="empty"):
            rt.request([])
        with pytest.raises(mlxd.InvalidRequest, match="context"):
            rt.request([5] * 250, sampling=SamplingParams(max_tokens=10))
        with pytest.raises(mlxd.InvalidRequest, match="token ids"):
            rt.request([10**9])
        rt.stop_admission()
        with pytest.raises(mlxd.ShuttingDown):
            rt.submit(rt.request([5, 6, 7]))


async def test_serve_runtime_is_a_service(tiny_model_dir):
    """`await nursery.start(serve_runtime, config)` returns a ready Runtime; cancelling stops it."""
    async with trio.open_nursery() as nursery:
        rt = await nursery.start(mlxd.serve_runtime, config(tiny_model_dir))
        assert isinstance(rt, mlxd.Runtime)
        async with rt.submit(rt.request(rt.encode("hello"), sampling=SamplingParams(max_tokens=3))) as stream:
            assert len(await stream.tokens()) == 3
        nursery.cancel_scope.cancel()
    with pytest.raises(trio.BrokenResourceError):  # the actors are gone: nobody reads the admission queue
        rt.submit(rt.request(rt.encode("hello")))
