"""The scheduler actor: admission, request lifecycles, batch slots, cancellation.

The admission queue is the scheduler's bounded inbox: a submit that finds it
full is refused at once (HTTP 503 + Retry-After). The scheduler takes a request
off the queue only when a batch slot is free, asks the cache owner for the
longest usable prefix, starts the generation on the engine, and forwards the
engine's events to the client. A client that goes away cancels its generation
and frees its slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import structlog
import trio

from mlxd.kv.admission import Admit, KvAdmission, RamRoom, Refuse
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.tiers import PrefixLookup, SsdMatch
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.channels import Reply
from mlxd.runtime.kernel.messages import (
    CacheOwnerMessage,
    CancelGeneration,
    DraftPrefix,
    EngineInbox,
    FetchSnapshot,
    FetchTail,
    FindGenerationCheckpoint,
    GenCheckpointMessage,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    GenerationRequest,
    LookupPrefix,
    PrefetcherMessage,
    PromptAccepted,
    ReleaseRam,
    RequestRecord,
    RestoreSnapshot,
    ResumeGeneration,
    SchedulerInbox,
    StartGeneration,
    TailRestore,
    TokenGenerated,
)
from mlxd.runtime.logging import get_logger
from mlxd.runtime.prefill_backlog import PrefillBacklog

if TYPE_CHECKING:
    from mlxd.kv.file_format import LoadedSnapshot

log = get_logger("mlxd.scheduler")


@attrs.define
class SchedulerStats:
    """The scheduler's own counters (admissions are the Runtime's: `runtime/stats.py`)."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    running: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    last_ttft_s: float | None = None


# How long an overlapped split's row waits for its tail's memory at least (seconds): the engine's thread
# allocates it between two steps, so it comes within a step when the engine is idle, as an overlap needs.
PLACE_WAIT_S = 1.0


class SchedulerActor:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[SchedulerInbox],
        engine: trio.MemorySendChannel[EngineInbox],
        cache: trio.MemorySendChannel[CacheOwnerMessage],
        prefetcher: trio.MemorySendChannel[PrefetcherMessage] | None = None,
        checkpoints: trio.MemorySendChannel[GenCheckpointMessage] | None = None,
        kv_admission: KvAdmission | None = None,
        draft_tag: str | None = None,
        governor: WriteGovernor | None = None,
    ) -> None:
        """`kv_admission` (--kv-admission): the head of the queue waits until its KV fits the budget.
        `draft_tag` (--draft-model): the draft's cache entries are looked up too, in their own namespace.
        `governor`: told while admitted requests wait for their first token, so write-behind holds still
        meanwhile (kv/pacing.py)."""
        self._governor = governor
        self._awaiting_first: set[str] = set()  # admitted, no first token yet
        self._draft_tag = draft_tag
        self._config = config
        self.kv_admission = kv_admission if kv_admission is not None and kv_admission.enabled else None
        self._kv_room = trio.Event()  # set (and replaced) whenever an admitted row leaves or ends its prefill
        self._kv_waited: set[str] = set()  # admitted after waiting for memory (RequestRecord.kv_waited)
        self._prefetcher = prefetcher
        self._checkpoints = checkpoints  # the generation checkpointer (--generation-checkpoint)
        self._inbox = inbox
        self._engine = engine
        self._cache = cache
        self._slots = trio.Semaphore(config.max_batch)
        # Requests the engine holds, or will as soon as their lookup's answer is in hand (not while a whole
        # restore is read): while any, a lookup weighs no overlapped split (the engine would decline it)
        self._engine_rows: set[str] = set()
        # Prompt work admitted and not yet at its first token: a request that would wait past
        # --queue-timeout for it is refused at once (`Runtime.submit`, runtime/prefill_backlog.py).
        self.backlog = PrefillBacklog(config.queue_timeout_s)
        self.stats = SchedulerStats()
        # Called with each finished RequestRecord (metrics, trace recording); must not block.
        self.observers: list[Callable[[RequestRecord], None]] = []
        self._idle = trio.Event()
        self._idle.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            async with self._inbox:
                while True:
                    await self._slots.acquire()
                    try:
                        submit = await self._inbox.receive()
                    except trio.EndOfChannel:
                        self._slots.release()
                        return
                    if self.kv_admission is not None and not await self._admit_kv(submit):
                        self._slots.release()
                        continue
                    self._start(nursery, submit)

    async def _admit_kv(self, submit: SchedulerInbox) -> bool:
        """Wait (first in the queue: later requests wait behind it) until the request's KV fits the
        memory budget beside what the RAM tier cannot free, asking the cache owner first to free the RAM
        it can that stands in the way; False when it never can (it fails at once; `Runtime.request`
        refuses most)."""
        assert self.kv_admission is not None
        request, waited = submit.request, False
        while True:
            room = self._kv_room
            ram = await self._release_ram(0)
            decision = self.kv_admission.decide(len(request.prompt), request.sampling.max_tokens, ram=ram)
            if isinstance(decision, Admit) and decision.free_ram_bytes > 0:
                after = await self._release_ram(decision.free_ram_bytes)
                log.info("request.kv_free_ram", request_id=request.request_id, asked_bytes=decision.free_ram_bytes,
                         freed_bytes=ram.freeable_bytes - after.freeable_bytes)
            if isinstance(decision, Admit):
                self.kv_admission.admit(request.request_id, decision.nbytes, waited=waited,
                                        prefill_bytes=self.kv_admission.prefill_bytes(len(request.prompt)))
                if waited:
                    self._kv_waited.add(request.request_id)
                return True
            if isinstance(decision, Refuse):
                self.kv_admission.refused += 1
                try:
                    submit.events.send_nowait(GenerationFailed(decision.message))
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                    pass
                submit.events.close()
                return False
            if not waited:
                log.info("request.kv_wait", request_id=request.request_id, need_bytes=decision.nbytes,
                         free_bytes=decision.free_bytes)
            waited = True
            await room.wait()

    def _kv_room_freed(self) -> None:
        room, self._kv_room = self._kv_room, trio.Event()
        room.set()

    def _prefilling(self, request_id: str, waiting: bool) -> None:
        """A request starts or stops waiting for its first token: the governor holds write-behind
        while any does."""
        if waiting:
            self._awaiting_first.add(request_id)
        else:
            self._awaiting_first.discard(request_id)
        if self._governor is not None:
            self._governor.set_prefilling(bool(self._awaiting_first))

    def _start(self, nursery: trio.Nursery, submit: SchedulerInbox) -> None:
        self.stats.running += 1
        self._prefilling(submit.request.request_id, True)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        nursery.start_soon(self._lifecycle, submit)

    async def wait_idle(self) -> None:
        """Return when no admitted request is running."""
        if self.stats.running == 0:
            return
        await self._idle.wait()

    async def _release_ram(self, nbytes: int) -> RamRoom:
        """What the RAM tier holds once the cache owner freed `nbytes` of what it can (0: nothing)."""
        reply: Reply[RamRoom] = Reply()
        await self._cache.send(ReleaseRam(nbytes, reply))
        return await reply.wait()

    async def _lifecycle(self, submit: SchedulerInbox) -> None:
        request = submit.request
        record = RequestRecord(request.request_id, request.namespace, request.prompt, submit.submitted_at)
        record.session = request.session
        if request.request_id in self._kv_waited:
            self._kv_waited.discard(request.request_id)
            record.kv_waited = True
        record.started_at = time.monotonic()
        with structlog.contextvars.bound_contextvars(request_id=request.request_id):
            try:
                await self._serve(submit, record)
            except Exception as exc:  # fails this request only, never the scheduler
                log.exception("request.failed")
                self.stats.failed += 1
                record.reason = "failed"
                try:
                    submit.events.send_nowait(GenerationFailed(f"request failed: {type(exc).__name__}: {exc}"))
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                    pass  # the client is gone, or its buffer is full; closing below ends its stream
                with trio.CancelScope(shield=True):  # the engine may still hold a row for it
                    await self._engine.send(CancelGeneration(request.request_id))
            finally:
                submit.events.close()
                self._prefilling(request.request_id, False)
                self.backlog.drop(request.request_id, time.monotonic())
                if self.kv_admission is not None:
                    self.kv_admission.release(request.request_id)
                    self._kv_room_freed()
                self._slots.release()
                self._engine_rows.discard(request.request_id)
                self.stats.running -= 1
                if self.stats.running == 0:
                    self._idle.set()
                record.finished_at = time.monotonic()
                self._report(record)

    def _report(self, record: RequestRecord) -> None:
        log.info(
            "request.done",
            reason=record.reason,
            prompt_tokens=len(record.prompt),
            cached_tokens=record.cached_tokens,
            cache_tier=record.cache_tier,
            completion_tokens=record.completion_tokens,
            queued_ms=_ms(record.queued_s),
            ttft_ms=_ms(record.ttft_s),
            lookup_ms=_ms(record.lookup_s),
            promoted_bytes=record.promoted_bytes,
            # the promotion's cost: its issue in the lookup, and from issue until its pages were all back
            # (None while still landing, or off CUDA where nothing moves)
            promote_ms=_ms(getattr(record.promotion, "issue_s", None)),
            promote_landed_ms=_ms(getattr(record.promotion, "landed_s", None)),
            total_ms=_ms(record.total_s),
            first_token_ms=first_token_split(record),
            # the engine's time leaving the row in its last step (its final checkpoint), before that step's
            # tokens went out (GenerationFinished.leave_s)
            leave_ms=_ms(record.leave_s),
        )
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # an observer must never break serving
                log.exception("request.observer_failed")

    async def _serve(self, submit: SchedulerInbox, record: RequestRecord) -> None:
        request = submit.request
        if submit.events.statistics().open_receive_channels == 0:
            self.stats.cancelled += 1  # the client left while queued
            record.reason = "client_gone"
            return
        key = self._checkpoint_key(request)
        resume = await self._find_checkpoint(request, key) if key is not None else None
        hit = restore = draft = tail = None
        cuts: tuple[int, ...] = ()
        if resume is None:
            reply: Reply[PrefixLookup] = Reply()
            asked = time.monotonic()
            overlap = not self._engine_rows
            # counted from its lookup: a lookup made meanwhile (a burst of returning conversations) weighs no
            # overlap either, where it would have reached the engine behind this row and been declined
            self._engine_rows.add(request.request_id)
            await self._cache.send(LookupPrefix(request.prompt, request.namespace, reply, session=request.session,
                                                overlap=overlap))
            lookup = await reply.wait()
            record.lookup_s = time.monotonic() - asked
            record.resident = lookup.resident
            if lookup.promoted and lookup.hit is not None:
                record.promoted_bytes = lookup.hit.entry.nbytes
                record.promotion = lookup.promotion
            hit, cuts = lookup.hit, tuple(sorted({*lookup.checkpoint_at, *request.checkpoint_at}))
            if lookup.restore is not None and lookup.restore.read_from and not request.media:
                expect = lookup.plan.read_seconds if lookup.plan is not None else 0.0
                tail = await self._fetch_tail(lookup.restore, expect)  # read while the engine recomputes the head
            elif lookup.restore is not None:
                self._engine_rows.discard(request.request_id)  # not while its whole restore is read
                asked = time.monotonic()
                restore = await self._fetch(lookup.restore)
                record.fetch_s = time.monotonic() - asked
                if restore is not None:
                    loaded = restore.loaded
                    record.read_s, record.land_s, record.verify_s = loaded.seconds, loaded.land_s, loaded.verify_s
        if self._draft_tag is not None:  # a resumed generation's draft looks up the checkpoint's tokens
            draft = await self._draft_prefix(
                request, request.prompt + tuple(resume.record.emitted) if resume is not None else request.prompt
            )
        size = request.sampling.max_tokens + 8
        send, receive = trio.open_memory_channel[GenerationEvent](size)
        record.engine_sent_at = time.monotonic()
        self._engine_rows.add(request.request_id)  # until it answers (`_lifecycle`)
        await self._engine.send(
            StartGeneration(request, hit, send, submit.submitted_at, restore, checkpoint_key=key, resume=resume,
                            draft=draft, checkpoint_at=cuts, tail=tail)
        )
        client_gone = answered = False
        first_token_at: float | None = None

        async def cancel_when_left() -> None:
            # A client that leaves mid-prefill is told by its stream's close: no event fails to send then.
            nonlocal client_gone
            await submit.client_left.wait()
            if not client_gone and not answered:
                client_gone = True
                record.reason = "client_gone"
                log.info("request.client_gone", why="closed")
                with trio.CancelScope(shield=True):
                    await self._engine.send(CancelGeneration(request.request_id))

        async with receive, trio.open_nursery() as watch:
            watch.start_soon(cancel_when_left)
            async for event in receive:
                if isinstance(event, TokenGenerated) and first_token_at is None:
                    first_token_at = record.first_token_at = time.monotonic()
                    record.engine_stages = event.stages
                    self._prefilling(request.request_id, False)  # write-behind may resume
                    self.stats.last_ttft_s = first_token_at - submit.submitted_at
                    self.backlog.done(request.request_id, first_token_at)
                    if self.kv_admission is not None and self.kv_admission.prefilled(request.request_id):
                        self._kv_room_freed()  # its prefill's working memory is free again
                elif isinstance(event, PromptAccepted):
                    self.backlog.accepted(request.request_id, event.cached_tokens)
                self._count(event)
                _note(record, event)
                answered = answered or isinstance(event, (GenerationFinished, GenerationFailed))
                if client_gone:
                    continue
                try:
                    submit.events.send_nowait(event)
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock) as exc:
                    client_gone = True
                    record.reason = "client_gone"
                    log.info("request.client_gone", why=type(exc).__name__)
                    with trio.CancelScope(shield=True):
                        await self._engine.send(CancelGeneration(request.request_id))
            watch.cancel_scope.cancel()

    def _checkpoint_key(self, request: GenerationRequest) -> str | None:
        """The request key when this request is checkpointed (kv/gen_checkpoint.py), else None."""
        from mlxd.kv import gen_checkpoint

        if self._checkpoints is None or not gen_checkpoint.checkpointable(request.sampling):
            return None
        return gen_checkpoint.request_key(request.prompt, request.namespace, request.sampling)

    async def _find_checkpoint(self, request: GenerationRequest, key: str) -> ResumeGeneration | None:
        """An in-flight checkpoint of this exact request left by an earlier attempt, or None."""
        assert self._checkpoints is not None
        reply: Reply[ResumeGeneration | None] = Reply()
        await self._checkpoints.send(
            FindGenerationCheckpoint(key, request.request_id, request.prompt, request.namespace, reply)
        )
        return await reply.wait()

    async def _draft_prefix(self, request: GenerationRequest, tokens: tuple[int, ...]) -> DraftPrefix:
        """--draft-model: the draft's own checkpoints, looked up with the row's tokens (its prompt, or a
        resumed generation's prompt and emitted tokens) in its namespace."""
        from mlxd.engine.speculative import draft_namespace

        assert self._draft_tag is not None
        namespace = draft_namespace(request.namespace, self._draft_tag)
        reply: Reply[PrefixLookup] = Reply()
        await self._cache.send(LookupPrefix(tokens, namespace, reply, session=request.session))
        lookup = await reply.wait()
        restore = await self._fetch(lookup.restore) if lookup.restore is not None else None
        return DraftPrefix(namespace, lookup.hit, restore)

    async def _fetch_tail(self, match: SsdMatch, expect_s: float) -> TailRestore | None:
        """Start reading an overlapped split's tail (kv/restore_decision.py OVERLAP; `expect_s` its predicted
        read); the engine takes it when it lands. Returns once the read has its memory (`TailSlot.placed`:
        MLX arrays the engine's thread allocates before it recomputes the head), or after its predicted read
        or `PLACE_WAIT_S`, whichever is longer (a read still waiting for a reader thread or a long engine
        step; the engine then never waits for it, its landing queued behind the head). None without a prefetcher
        (the engine recomputes it all)."""
        if self._prefetcher is None:
            return None
        tail = TailRestore(match.record, match.read_from, match.usable, expect_s=expect_s, asked_at=time.monotonic())
        await self._prefetcher.send(FetchTail(match.record, match.read_from, tail.slot, upto=match.read_tokens))
        with trio.move_on_after(max(expect_s, PLACE_WAIT_S)):  # else the engine recomputes it all (engine/overlap.py)
            await tail.slot.wait_placed()
        return tail

    async def _fetch(self, match: SsdMatch) -> RestoreSnapshot | None:
        """The cold file's bytes (read ahead by the prefetcher when it could); None = a miss."""
        if self._prefetcher is None:
            return None
        reply: Reply[LoadedSnapshot | None] = Reply()
        await self._prefetcher.send(FetchSnapshot(match.record, reply, upto=match.read_tokens))
        loaded = await reply.wait()
        return RestoreSnapshot(match.record, match.usable, loaded) if loaded is not None else None

    def _count(self, event: GenerationEvent) -> None:
        s = self.stats
        if isinstance(event, PromptAccepted):
            s.prompt_tokens += event.prompt_tokens
            s.cached_tokens += event.cached_tokens
        elif isinstance(event, TokenGenerated):
            s.generated_tokens += 1
        elif isinstance(event, GenerationFinished):
            if event.reason == "cancelled":
                s.cancelled += 1
            else:
                s.completed += 1
        elif isinstance(event, GenerationFailed):
            s.failed += 1


def _note(record: RequestRecord, event: GenerationEvent) -> None:
    if isinstance(event, PromptAccepted):
        record.cached_tokens = event.cached_tokens
        record.cache_tier = event.cache_tier
    elif isinstance(event, TokenGenerated):
        record.completion_tokens += 1
        record.output_ids.append(event.token)
    elif isinstance(event, GenerationFinished):
        if record.reason != "client_gone":
            record.reason = event.reason
        record.leave_s = event.leave_s
    elif isinstance(event, GenerationFailed):
        record.reason = "failed"


# A stage that closes a span of `first_token_split`: the stamp that opened it, and the span's name.
_CLOSES = {"stepped": ("step", "forward"), "checkpointed": ("checkpoint", "checkpoint")}


def first_token_split(record: RequestRecord) -> dict[str, Any] | None:
    """Where the time from the scheduler's hand-off to the engine until the first token went (ms).

    to_engine: the engine took the row (its inbox; a run of steps under way); lend: the cached prefix
    lent (or restored; an overlapped split's whole engine half, split into overlap_head: the head
    recomputed, overlap_wait: waiting for the tail, overlap_rest: recomputing on while it was out and
    appending it); join: the row inserted, its part prefilled apart among it (apart: a short prompt beside
    other prefills at once, a lone long one a slice a step); wait: until its first step; forward: in the
    generator's steps (`steps` of them); checkpoint: its prompt's checkpoint; other: the rest of those steps;
    deliver: the token back in the scheduler; step_ms: each step's time (the first 8).
    """
    stamps, sent, got = record.engine_stages, record.engine_sent_at, record.first_token_at
    if not stamps or sent is None or got is None:
        return None
    at = dict(stamps)  # the first of each name is enough for the single stages
    spans: dict[str, float] = {"forward": 0.0, "checkpoint": 0.0}
    steps, opened, each = 0, {}, []
    for name, t in stamps:
        if name in ("step", "checkpoint"):
            opened[name] = t
            steps += name == "step"
        elif name in _CLOSES:
            opener, key = _CLOSES[name]
            begun = opened.pop(opener, None)
            if begun is not None:
                spans[key] += t - begun
                if key == "forward":
                    each.append(round((t - begun) * 1000, 2))
    joined, lent = at.get("joined", sent), at.get("lent", sent)
    admitted, first = at.get("admitted", lent), at.get("first_token", got)
    first_step = next((t for name, t in stamps if name == "step"), admitted)
    out: dict[str, float | int] = {
        "to_engine": joined - sent, "lend": lent - joined, "join": admitted - lent, "wait": first_step - admitted,
        **spans, "other": first - first_step - spans["forward"] - spans["checkpoint"], "deliver": got - first,
    }
    if "prefilled_apart" in at:
        out["apart"] = at["prefilled_apart"] - lent
    if "overlap_head" in at and "overlap_wait" in at:
        out |= {"overlap_head": at["overlap_head"] - joined, "overlap_wait": at["overlap_wait"] - at["overlap_head"],
                "overlap_rest": lent - at["overlap_wait"]}
    return {k: round(v * 1000, 2) for k, v in out.items()} | {"steps": steps, "step_ms": each[:8]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
