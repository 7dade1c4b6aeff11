"""The engine actor: a trio shell around `EngineCore` (engine/core.py).

It drains its inbox into one `StepOps` and hands the one MLX thread a run of
steps (`engine/step_loop.py`): the thread steps on by itself while rows decode,
taking what arrives meanwhile (new rows, cancels, stops, drops) from the loop's
inbox between steps, and hands back each `StepResult`, which is delivered here
in order: token events to each request's channel, checkpoints and timings to the
cache owner, generation checkpoints to the checkpointer. Under `--distributed`
rank 0's steps go through `engine.ranks.Leader`, which tells the followers first.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

from mlxd.engine.core import EngineCore
from mlxd.engine.ops import EngineInfo, EngineStats, RowStart, StepOps, StepResult
from mlxd.engine.ranks import Leader
from mlxd.engine.step_loop import StepLoop, merge
from mlxd.kv.file_format import FileHeader, Landing, LoadedSnapshot, SnapshotMeta, SnapshotPlan
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.shard_mirror import ShardRef
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.distributed import MAX_DROPS_PER_STEP
from mlxd.runtime.kernel.messages import (
    CancelGeneration,
    CheckpointGeneration,
    EngineBusy,
    EngineInbox,
    EngineNote,
    GenCheckpointMessage,
    GenerationAbandoned,
    GenerationCompleted,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    ShardsDropped,
    StartGeneration,
    StopGeneration,
    TokenGenerated,
)
from mlxd.runtime.kernel.mlx_thread import MlxThread
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.engine")
T = TypeVar("T")

# Steps the MLX thread runs ahead of their delivery (engine/step_loop.py): 1 lets step n + 1 run
# while step n's tokens go out, so a stop or cancel answering a token still lands a step later.
STEPS_AHEAD = 1
# Resets in a row that fail themselves before the device is taken as lost (EngineActor._reset_failed): one may
# fail for want of memory another process held a moment; a poisoned CUDA context fails every one.
DEVICE_LOST_RESETS = 3
# Seconds an engine waits idle after work before it trims its GPU's memory pool (EngineCore.idle_trim; CUDA with
# a memory budget): past a request's own gaps, so a conversation's next turn does not find its memory given away.
IDLE_TRIM_S = 1.0


class EngineActor:
    """Run generations for the scheduler; publish checkpoints to the cache owner."""

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[EngineInbox],
        publish: trio.MemorySendChannel[EngineNote],
        governor: WriteGovernor,
        checkpoints: trio.MemorySendChannel[GenCheckpointMessage] | None = None,
    ) -> None:
        self._config = config
        self._inbox = inbox
        self._publish = publish
        self._checkpoints = checkpoints  # the generation checkpointer's inbox (--generation-checkpoint N)
        self._governor = governor  # told whether rows are in the batch: write-behind paces itself meanwhile
        self.core = EngineCore(config)  # touched only on the MLX thread, inside `run`
        self._thread: MlxThread | None = None
        self._rows: dict[str, StartGeneration] = {}  # sent to the core, not finished
        self._pending: list[StartGeneration] = []
        self._cancels: set[str] = set()
        self._stops: set[str] = set()
        self._drops: list[ShardRef] = []  # mirrored prefixes the cache owner dropped, for the next steps
        self._reset = False  # the last step failed: the next one resets every rank
        self._failed_steps = 0
        self._failed_resets = 0  # resets in a row that failed themselves (DEVICE_LOST_RESETS: the device is lost)
        self.device_lost: str | None = None  # why the engine stopped stepping for good (the device failed)
        self.lost = trio.Event()  # set with device_lost: the server stops (cli) and /health says why
        self._busy_noted = False  # what the cache owner was last told (EngineBusy)
        self._trim_due = False  # steps ran since the last idle trim of the GPU's memory pool
        self._carry: StepOps | None = None  # ops a run of steps refused as it ended: the next run's first
        self._ending: set[str] = set()  # rows sent a stop or cancel: tokens they still decode are not delivered
        self._runs = 0  # runs of steps handed to the MLX thread (each one trio round trip)
        self._stats = EngineStats()

    @property
    def stats(self) -> EngineStats:
        """The counters as of the last step (a value)."""
        return attrs.evolve(self._stats, batch_rows=len(self._rows), failed_steps=self._failed_steps,
                            step_runs=self._runs)

    # --- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        async with MlxThread("mlxd-engine") as thread:
            self._thread = thread
            leader: Leader | None = None
            try:
                info = await thread.run(self.core.load)
                self._stats = await thread.run(self.core.stats)  # every counter the model has, at zero
                channel = self.core.channel
                if channel is not None and channel.size > 1:
                    leader = Leader(self.core, channel, mirrored=self._config.prompt_cache_bytes > 0)
                log.info("engine.ready", model=info.model_name, max_context=info.max_context,
                         memory_budget_bytes=info.memory_budget_bytes)
                task_status.started(info)
                if self.core.measures_memory:  # weights and buffers, before any request (the channel buffers it)
                    await self._publish.send(await thread.run(self.core.measure_memory, "load"))
                await self._serve(thread, leader.step if leader is not None else self.core.step)
            finally:
                with trio.CancelScope(shield=True):
                    self._fail_all("engine stopped")
                    if leader is not None:
                        try:
                            await thread.run(leader.shutdown)
                        except (RuntimeError, OSError):
                            log.warning("engine.followers_gone")  # a rank already stopped (mlx.launch stops the rest)
                    await thread.run(self.core.close)
                    if self.core.channel is not None:
                        self.core.channel.close()

    async def landing(self, header: FileHeader) -> Landing:
        """MLX arrays for a cold file to be read straight into (`kinds.landing`, on the engine's thread)."""
        assert self._thread is not None, "the engine is not running"
        return await self._thread.run(self.core.landing, header)

    async def plan_checkpoint(self, caches: list[object], length: int, total: int, meta: SnapshotMeta) -> SnapshotPlan:
        """A write plan of a cached checkpoint's first `length` tokens (a session export; engine thread)."""
        assert self._thread is not None, "the engine is not running"
        return await self._thread.run(self.core.plan_checkpoint, caches, length, total, meta)

    async def adopt_checkpoint(self, loaded: LoadedSnapshot) -> tuple[list[object], int, bool]:
        """An imported file's caches, nbytes and trimmability (engine thread); ValueError when they do not fit."""
        assert self._thread is not None, "the engine is not running"
        return await self._thread.run(self.core.adopt_checkpoint, loaded)

    # --- the serving loop -----------------------------------------------------------

    async def _serve(self, thread: MlxThread, step: Callable[[StepOps], StepResult]) -> None:
        while True:
            if self.device_lost is not None:  # from here on no step: every request is refused (never returns)
                self._governor.set_busy(False)
                await self._note_busy(False)
                await self._refuse_all()
            if not (self._rows or self._pending or self._drops or self._reset or self._carry):
                self._governor.set_busy(False)
                await self._note_busy(False)
                self._accept(await self._next_message(thread))
            self._governor.set_busy(True)
            self._trim_due = True
            await self._note_busy(True)
            self._drain_inbox()
            ops = self._next_ops()
            if self._carry is not None and not ops.reset:  # queued for a run of steps that had just ended
                ops, rest = merge([self._carry, ops])
                self._drops[:0] = [d for r in rest for d in r.drops]
            self._carry = None
            if ops.reset:
                await self._step_once(thread, step, ops)
            else:
                await self._run_steps(thread, step, ops)

    async def _next_message(self, thread: MlxThread) -> EngineInbox:
        """The next message for an idle engine. One idle for `IDLE_TRIM_S` after work trims its GPU's memory pool
        meanwhile, once (`EngineCore.idle_trim`), and the cache owner gets the measurement after it."""
        if self._trim_due and self.core.trims_when_idle:
            with trio.move_on_after(IDLE_TRIM_S):
                return await self._inbox.receive()
            self._trim_due = False
            try:
                measured = await thread.run(self.core.idle_trim)
            except Exception as exc:  # a hint for the device's other tenants: never worth failing over
                log.warning("engine.pool_trim_failed", error=repr(exc))
            else:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._publish.send(measured)
        return await self._inbox.receive()

    async def _step_once(self, thread: MlxThread, step: Callable[[StepOps], StepResult], ops: StepOps) -> None:
        """One step with a round trip (after a failure: the reset)."""
        self._runs += 1
        try:
            result: StepResult = await thread.run(step, ops)
        except Exception as exc:  # a model error must not take the server down
            self._step_failed(exc, len(ops.starts))
            if ops.reset:
                self._reset_failed(exc)
            return
        if ops.reset:
            self._failed_resets = 0
        self._governor.stepped()
        await self._deliver(result)

    async def _run_steps(self, thread: MlxThread, step: Callable[[StepOps], StepResult], ops: StepOps) -> None:
        """Let the MLX thread step on by itself until no row is left (engine/step_loop.py): what arrives
        meanwhile goes to its inbox, what it hands back is delivered here, in order."""
        self._runs += 1
        send, receive = trio.open_memory_channel[StepResult](math.inf)  # bounded by the loop's window
        token = trio.lowlevel.current_trio_token()

        def take(result: StepResult) -> None:  # on the trio thread
            try:
                send.send_nowait(result)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the run was cancelled (shutdown): every row gets its answer from _fail_all

        def hand(result: StepResult) -> None:  # on the MLX thread
            self._governor.stepped()  # write-behind's staged copies go a piece per step meanwhile
            try:
                token.run_sync_soon(take, result)
            except trio.RunFinishedError:
                loop.stop()

        loop = StepLoop(step, hand=hand, wait=thread.serve_until, notify=thread.notify, window=STEPS_AHEAD)
        if self._drops:  # past one step's cap: the loop's next steps carry them (it merges at most the cap each)
            loop.put(StepOps(drops=tuple(self._drops)))
            self._drops = []
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver_each, receive, loop)
            feeding = trio.CancelScope()
            nursery.start_soon(self._feed, loop, feeding)
            try:
                await thread.run(loop.run, ops, on_cancel=loop.stop)
            except Exception as exc:  # a model error must not take the server down
                failure = exc
            finally:
                feeding.cancel()
                send.close()  # every result it handed is in the channel: run_sync_soon keeps their order
        if failure is not None:
            for left in [*loop.leftover(), *([self._carry] if self._carry is not None else [])]:
                self._drops[:0] = left.drops  # the rows in them are answered by _fail_all
            self._carry = None
            self._step_failed(failure, len(ops.starts))

    async def _feed(self, loop: StepLoop, scope: trio.CancelScope) -> None:
        """Hand what arrives to the running loop, as the ops of its next step."""
        with scope:
            while True:
                self._accept(await self._inbox.receive())
                self._drain_inbox()  # no checkpoint from here to `put`: a message is never half taken
                if not self._hand_on(loop):
                    return  # the run just ended: the next one starts with what was accepted

    def _hand_on(self, loop: StepLoop) -> bool:
        """Put what was accepted into the loop's inbox; False once the loop has ended (then kept for the next run)."""
        ops = self._next_ops()
        if self._drops:  # past one step's cap: with the loop's next steps, not after the run (a long decode)
            ops = attrs.evolve(ops, drops=(*ops.drops, *self._drops))
            self._drops = []
        if ops.empty or loop.put(ops):
            return True
        ops, rest = merge([self._carry, ops] if self._carry is not None else [ops])
        self._carry = ops
        self._drops[:0] = [d for r in rest for d in r.drops]
        return False

    async def _deliver_each(self, results: trio.MemoryReceiveChannel[StepResult], loop: StepLoop) -> None:
        async with results:
            async for result in results:
                await self._deliver(result)
                if self._cancels:  # a client went away: its row leaves with the next step
                    self._hand_on(loop)
                loop.delivered()

    def _step_failed(self, exc: Exception, starting: int) -> None:
        # The generator's state is unknown now: every row in it, and every row
        # of this step not yet inserted, gets its answer at once; the next step resets.
        log.error("engine.step_failed", rows=len(self._rows), starting=starting, exc_info=exc)
        self._failed_steps += 1
        self._fail_all(f"generation failed: {type(exc).__name__}: {exc}")
        self._reset = True

    def _reset_failed(self, exc: Exception) -> None:
        """A reset (a fresh generator, MLX's cache cleared) failed: after DEVICE_LOST_RESETS in a row the device
        is taken as lost. A CUDA fault (an illegal memory access) poisons the process's context for good: every
        later step, even a cache clear, raises it again (the H100 at 09:30 and 09:53 2026-12-07: 3-4 steps a second,
        every request failing, /health still ok). The engine then stops stepping and answers every request
        with why; `mlxd serve` stops (the SSD tier flushed, what can be) and exits non-zero, for its supervisor
        to start it again."""
        self._failed_resets += 1
        if self._failed_resets < DEVICE_LOST_RESETS:
            return
        self.device_lost = f"the device failed: {type(exc).__name__}: {exc}"
        log.error("engine.device_lost", resets_failed=self._failed_resets, reason=self.device_lost)
        self._reset = False
        self.lost.set()

    async def _refuse_all(self) -> None:
        """After the device was lost: every request that arrives is answered at once with why."""
        while True:
            self._accept(await self._inbox.receive())
            self._drain_inbox()
            self._fail_all(f"{self.device_lost}; this server is stopping")
            self._drops.clear()
            self._carry = None

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._accept(self._inbox.receive_nowait())
            except trio.WouldBlock:
                return

    async def _note_busy(self, busy: bool) -> None:
        """Tell the cache owner when rows start or stop decoding (it moves host-tier pages only while none do)."""
        if busy != self._busy_noted:
            self._busy_noted = busy
            try:
                await self._publish.send(EngineBusy(busy))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the cache owner stopped (shutdown): nothing left to move

    def _next_ops(self) -> StepOps:
        if self._reset:
            self._reset = False
            return StepOps(reset=True)
        now = time.monotonic()
        starts = tuple(
            RowStart(
                request=m.request, hit=m.hit, restore=m.restore, resume=m.resume, checkpoint_key=m.checkpoint_key,
                draft=m.draft, checkpoint_at=m.checkpoint_at, tail=m.tail,
                queued_s=now - m.submitted_at if m.submitted_at else 0.0,
            )
            for m in self._pending
        )
        for m in self._pending:
            self._rows[m.request.request_id] = m
        self._pending = []
        cancels = tuple(rid for rid in self._cancels if rid in self._rows)
        stops = tuple(rid for rid in self._stops if rid in self._rows and rid not in self._cancels)
        self._ending.update(cancels, stops)
        self._cancels.clear()
        self._stops.clear()
        drops, self._drops = tuple(self._drops[:MAX_DROPS_PER_STEP]), self._drops[MAX_DROPS_PER_STEP:]
        return StepOps(starts=starts, cancels=cancels, stops=stops, drops=drops)

    def _accept(self, msg: EngineInbox) -> None:
        if isinstance(msg, StartGeneration):
            self._pending.append(msg)
        elif isinstance(msg, ShardsDropped):
            self._drops.extend(msg.refs)
        elif isinstance(msg, StopGeneration):
            self._stops.add(msg.request_id)
        elif isinstance(msg, CancelGeneration):
            self._cancel(msg.request_id)

    def _cancel(self, request_id: str) -> None:
        for m in self._pending:
            if m.request.request_id == request_id:  # never reached the core: answered here
                self._pending.remove(m)
                _send(m.events, GenerationFinished("cancelled", len(m.request.prompt), 0, 0))
                m.events.close()
                self._abandon(m)
                return
        self._cancels.add(request_id)

    async def _deliver(self, result: StepResult) -> None:
        self._stats = result.stats
        # Checkpoints first: a client that flushes right after its reply must find
        # that reply's checkpoint already with the cache owner.
        # Without a wait where there is room: each awaited send is a schedule point that let the cache owner
        # handle the note (a publication) before this step's tokens went out.
        for note in result.notes:
            if isinstance(note, CheckpointGeneration | GenerationCompleted | GenerationAbandoned):
                if self._checkpoints is not None:
                    await _send_soon(self._checkpoints, note)
            else:
                await _send_soon(self._publish, note)
        for rejected in result.rejected:
            self._ending.discard(rejected.request_id)
            m = self._rows.pop(rejected.request_id, None)
            if m is not None:
                _send(m.events, GenerationFailed(rejected.message))
                m.events.close()
        for emit in result.emits:
            m = self._rows.get(emit.request_id)
            if emit.request_id in self._ending and isinstance(emit.event, TokenGenerated):
                continue  # decoded after its stop or cancel was sent, before the step that ends it
            if m is not None and not _send(m.events, emit.event):
                self._cancels.add(emit.request_id)  # its client is gone
        for rid in result.finished:
            self._ending.discard(rid)
            m = self._rows.pop(rid, None)
            if m is not None:
                m.events.close()

    def _fail_all(self, message: str) -> None:
        """Answer every request the engine holds with an error."""
        for m in [*self._rows.values(), *self._pending]:
            _send(m.events, GenerationFailed(message))
            m.events.close()
            self._abandon(m)
        self._rows.clear()
        self._pending.clear()
        self._ending.clear()

    def _abandon(self, m: StartGeneration) -> None:
        """A request leaves without completing: its checkpoint becomes resumable by a retry."""
        if m.checkpoint_key is not None and self._checkpoints is not None:
            try:
                self._checkpoints.send_nowait(GenerationAbandoned(m.checkpoint_key, m.request.request_id))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the key stays owned until this process ends: no resume, never a wrong one


async def _send_soon(channel: trio.MemorySendChannel[T], item: T) -> None:
    """Send now when the channel has room, else wait for it (the order of sends is kept either way)."""
    try:
        channel.send_nowait(item)
    except trio.WouldBlock:
        await channel.send(item)


def _send(channel: trio.MemorySendChannel[GenerationEvent], event: GenerationEvent) -> bool:
    """Deliver without blocking the engine; False when the receiver is gone."""
    try:
        channel.send_nowait(event)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    except trio.WouldBlock:
        # Buffers are sized for max_tokens; a full one means a stuck consumer.
        return False
