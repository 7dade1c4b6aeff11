"""The engine thread steps on by itself while rows decode (engine/step_loop.py, actors/engine.py).

Counted, not timed: steps and the runs of steps handed to the MLX thread (one trio round
trip each); a stop or cancel sent mid-run ends its row within the steps already in flight,
and no token decoded after it arrived is delivered.
"""

from __future__ import annotations

import math
import threading

import trio

from mlxd import RuntimeConfig
from mlxd.actors.engine import STEPS_AHEAD, EngineActor
from mlxd.engine.ops import EngineStats, RowStart, StepOps, StepResult
from mlxd.engine.step_loop import StepLoop, merge
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.shard_mirror import ShardRef
from mlxd.runtime.distributed import MAX_DROPS_PER_STEP
from mlxd.runtime.kernel.messages import (
    CancelGeneration,
    GenerationFailed,
    GenerationFinished,
    GenerationRequest,
    SamplingParams,
    ShardsDropped,
    StartGeneration,
    StopGeneration,
    TokenGenerated,
)

# --- the loop alone, on a plain thread -------------------------------------------------------


class Rows:
    """A stand-in step: each row decodes until its count runs out; a stop in the ops ends it."""

    def __init__(self, **left: int) -> None:
        self.left = dict(left)
        self.seen: list[StepOps] = []

    def __call__(self, ops: StepOps) -> StepResult:
        self.seen.append(ops)
        for s in ops.starts:
            self.left[s.request.request_id] = 3
        for rid in (*ops.stops, *ops.cancels):
            self.left.pop(rid, None)
        for rid in list(self.left):
            self.left[rid] -= 1
            if not self.left[rid]:
                del self.left[rid]
        return StepResult(stats=EngineStats(batch_rows=len(self.left)))


def loop_over(step, on_hand=None, window: int = 1) -> tuple[StepLoop, list[int]]:
    """A loop whose `wait` plays the delivering side: when the window is full it delivers one result."""
    waits: list[int] = []

    def hand(result: StepResult) -> None:
        if on_hand is not None:
            on_hand(loop, result)

    def wait(ready) -> None:
        while not ready():
            waits.append(loop.steps)
            loop.delivered()

    loop = StepLoop(step, hand=hand, wait=wait, notify=lambda: None, window=window)
    return loop, waits


def test_the_loop_runs_every_step_of_its_rows_in_one_call():
    step = Rows(a=40)
    loop, waits = loop_over(step)
    assert loop.run(StepOps()) == 40
    assert not step.left and len(step.seen) == 40
    # nothing was delivered by anyone but `wait`: it ran at most one step ahead of delivery
    assert waits == list(range(2, 40))


def test_a_stop_put_while_a_step_is_delivered_ends_the_row_at_the_next_step():
    step = Rows(a=100, b=100)

    def on_hand(loop: StepLoop, result: StepResult) -> None:
        if loop.steps == 5:
            assert loop.put(StepOps(stops=("a",)))
        if loop.steps == 7:
            assert loop.put(StepOps(cancels=("b",)))

    loop, _ = loop_over(step, on_hand)
    assert loop.run(StepOps()) == 8
    assert step.seen[5].stops == ("a",) and step.seen[7].cancels == ("b",)
    assert not loop.put(StepOps(stops=("c",)))  # ended: the caller keeps it
    assert loop.leftover() == []


def test_work_put_as_the_last_row_leaves_is_run_not_lost():
    step = Rows(a=1)
    start = RowStart(request=GenerationRequest(request_id="late", prompt=(1, 2)))

    def on_hand(loop: StepLoop, result: StepResult) -> None:
        if loop.steps == 1:
            assert loop.put(StepOps(starts=(start,)))

    loop, _ = loop_over(step, on_hand)
    assert loop.run(StepOps()) == 4  # the late row's three steps after the first
    assert [s.request.request_id for s in step.seen[1].starts] == ["late"]


def test_stop_ends_a_waiting_loop_from_another_thread():
    wake = threading.Condition()
    loop = None

    def wait(ready) -> None:
        with wake:
            wake.wait_for(ready)

    def notify() -> None:
        with wake:
            wake.notify_all()

    loop = StepLoop(Rows(a=1000), hand=lambda r: None, wait=wait, notify=notify, window=1)
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(loop.run(StepOps())))
    runner.start()
    loop.stop()  # nothing is ever delivered: without stop it would wait forever after two steps
    runner.join(timeout=30)
    assert done and done[0] <= 2


def test_merge_keeps_order_and_caps_drops():
    refs = [ShardRef(key=f"k{i}", seq=i) for i in range(MAX_DROPS_PER_STEP + 3)]
    a = StepOps(stops=("x", "y"), drops=tuple(refs[:10]))
    b = StepOps(cancels=("y",), drops=tuple(refs[10:]))
    ops, rest = merge([a, b])
    assert ops.stops == ("x",) and ops.cancels == ("y",)  # a cancel wins over a stop of the same row
    assert len(ops.drops) == MAX_DROPS_PER_STEP and rest[0].drops == tuple(refs[MAX_DROPS_PER_STEP:])


# --- the engine actor over the tiny model -----------------------------------------------------


def no_eos(eos: frozenset[int], max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, logit_bias=tuple((t, -100.0) for t in eos))


async def engine(nursery: trio.Nursery, model_dir) -> tuple[EngineActor, trio.MemorySendChannel, frozenset[int]]:
    config = RuntimeConfig(model=str(model_dir), model_name="tiny", prompt_cache_bytes=0, device_probe="off")
    inbox_send, inbox = trio.open_memory_channel(16)
    publish, _notes = trio.open_memory_channel(math.inf)
    actor = EngineActor(config, inbox=inbox, publish=publish, governor=WriteGovernor(busy_rate_bytes_per_s=None))
    info = await nursery.start(actor.run)
    return actor, inbox_send, info.eos_token_ids


def start(rid: str, sampling: SamplingParams, buffer: int = 1000):
    events_send, events = trio.open_memory_channel(buffer)
    request = GenerationRequest(request_id=rid, prompt=(5, 6, 7, 8, 9), sampling=sampling)
    return StartGeneration(request, None, events_send), events


async def test_the_engine_thread_runs_k_steps_without_a_round_trip(tiny_model_dir):
    async with trio.open_nursery() as nursery:
        actor, inbox, eos = await engine(nursery, tiny_model_dir)
        before = actor.stats
        msg, events = start("a", no_eos(eos, 40))
        await inbox.send(msg)
        with trio.fail_after(60):
            tokens = [e async for e in events if isinstance(e, TokenGenerated)]
        assert len(tokens) == 40
        after = actor.stats
        assert after.steps - before.steps >= 40
        assert after.step_runs - before.step_runs == 1  # 40 steps, one hand-off from trio
        # a row joining mid-run joins the running loop: still one hand-off for both
        msg, events = start("b", no_eos(eos, 200))
        await inbox.send(msg)
        with trio.fail_after(60):
            async for e in events:
                if isinstance(e, TokenGenerated):
                    break
            joining, late = start("c", no_eos(eos, 10))
            await inbox.send(joining)
            late_tokens = [e async for e in late if isinstance(e, TokenGenerated)]
            rest = [e async for e in events if isinstance(e, TokenGenerated)]
        assert len(late_tokens) == 10 and len(rest) == 199
        # (0 when "b" arrived before the first run had seen that "a" was its last row: it ran on)
        assert actor.stats.step_runs - after.step_runs <= 1
        nursery.cancel_scope.cancel()


async def ended_mid_run(tiny_model_dir, message) -> tuple[int, int, int, GenerationFinished]:
    """An endless row read for 5 tokens, then `message(rid)`: (tokens already buffered when it was sent,
    tokens delivered after, runs of steps, its end)."""
    async with trio.open_nursery() as nursery:
        actor, inbox, eos = await engine(nursery, tiny_model_dir)
        runs = actor.stats.step_runs
        msg, events = start("a", no_eos(eos, 2000))
        await inbox.send(msg)
        with trio.fail_after(60):
            seen = 0
            async for e in events:
                seen += isinstance(e, TokenGenerated)
                if seen == 5:
                    break
            buffered = events.statistics().current_buffer_used
            await inbox.send(message("a"))
            rest = [e async for e in events]
        nursery.cancel_scope.cancel()
    after = [e for e in rest if isinstance(e, TokenGenerated)]
    assert rest and isinstance(rest[-1], GenerationFinished)
    return buffered, len(after), actor.stats.step_runs - runs, rest[-1]


async def test_a_stop_mid_run_ends_the_row_and_delivers_nothing_decoded_after_it(tiny_model_dir):
    buffered, after, runs, end = await ended_mid_run(tiny_model_dir, StopGeneration)
    assert end.reason == "stop" and runs == 1
    # Delivered after the stop: what was already waiting for the reader, plus at most the one
    # result the delivering task may hand over before the stop is read (it was decoded before).
    assert after <= buffered + 1
    # Decoded: those, the steps in flight (STEPS_AHEAD + the running one), then the row ends.
    assert end.completion_tokens <= 5 + buffered + 1 + STEPS_AHEAD + 1


async def test_a_cancel_mid_run_ends_the_row_and_delivers_nothing_decoded_after_it(tiny_model_dir):
    buffered, after, runs, end = await ended_mid_run(tiny_model_dir, CancelGeneration)
    assert end.reason == "cancelled" and runs == 1
    assert after <= buffered + 1
    assert end.completion_tokens <= 5 + buffered + 1 + STEPS_AHEAD + 1


async def test_drops_past_one_steps_cap_go_with_the_next_steps_of_a_running_decode(tiny_model_dir):
    # `--distributed`: a follower frees a dropped prefix's shard only when a step carries its key.
    # More than one step's worth arriving mid-run must not wait for the run to end (a long decode).
    async with trio.open_nursery() as nursery:
        config = RuntimeConfig(model=str(tiny_model_dir), model_name="tiny", prompt_cache_bytes=0, device_probe="off")
        inbox, receive = trio.open_memory_channel(16)
        publish, _notes = trio.open_memory_channel(math.inf)
        actor = EngineActor(config, inbox=receive, publish=publish, governor=WriteGovernor(busy_rate_bytes_per_s=None))
        seen: list[StepOps] = []
        core_step = actor.core.step

        def step(ops: StepOps) -> StepResult:
            seen.append(ops)
            return core_step(ops)

        actor.core.step = step  # what the engine thread runs (no leader in one process)
        info = await nursery.start(actor.run)
        msg, events = start("a", no_eos(info.eos_token_ids, 400))
        await inbox.send(msg)
        refs = tuple(ShardRef(key=f"k{i}", seq=i) for i in range(2 * MAX_DROPS_PER_STEP + 5))
        with trio.fail_after(60):
            async for e in events:
                if isinstance(e, TokenGenerated):
                    break
            await inbox.send(ShardsDropped(refs))
            rest = [e async for e in events]
        nursery.cancel_scope.cancel()
    assert isinstance(rest[-1], GenerationFinished) and rest[-1].completion_tokens == 400
    carried = [i for i, ops in enumerate(seen) for _ in ops.drops]
    assert len(carried) == len(refs) and all(len(ops.drops) <= MAX_DROPS_PER_STEP for ops in seen)
    # every key went out while the row still decoded: within a few steps of arriving, not after its 400th
    assert max(carried) < 100, (min(carried), max(carried), len(seen))


async def test_other_engine_thread_jobs_run_between_the_steps_of_a_long_decode(tiny_model_dir):
    # Restores landing in MLX memory and session export/import run on the engine thread: a running
    # decode must take them between its steps (MlxThread.serve_until), not after its last row.
    async with trio.open_nursery() as nursery:
        actor, inbox, eos = await engine(nursery, tiny_model_dir)
        msg, events = start("a", no_eos(eos, 400))
        await inbox.send(msg)
        with trio.fail_after(60):
            async for e in events:
                if isinstance(e, TokenGenerated):
                    break
            assert actor._thread is not None
            at = await actor._thread.run(lambda: (threading.current_thread().name, actor.core.counters.steps))
            rest = [e async for e in events]
        nursery.cancel_scope.cancel()
    assert at[0] == "mlxd-engine" and at[1] < 100  # within a few steps, not after the row's 400th
    assert sum(isinstance(e, TokenGenerated) for e in rest) == 399 and actor.stats.step_runs == 1


async def test_a_shutdown_mid_decode_answers_the_row_and_joins_the_engine_thread(tiny_model_dir):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            actor, inbox, eos = await engine(nursery, tiny_model_dir)
            msg, events = start("a", no_eos(eos, 100_000))
            await inbox.send(msg)
            async for e in events:
                if isinstance(e, TokenGenerated):
                    break
            nursery.cancel_scope.cancel()  # the actor's run returns only once its thread has joined
        rest = [e async for e in events]
    assert actor._thread is not None and not actor._thread._thread.is_alive()
    assert rest and isinstance(rest[-1], GenerationFailed) and "engine stopped" in rest[-1].message
