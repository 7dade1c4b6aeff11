"""The supervisor: starts the actors in one nursery and hands out a `Runtime`.

    async with mlxd.open_runtime(RuntimeConfig()) as rt:
        prompt = await rt.render_chat([{"role": "user", "content": "hi"}])
        async with rt.submit(rt.request(prompt)) as stream:
            async for event in stream:
                ...

or, as a service in a nursery you already have:

    rt = await nursery.start(mlxd.serve_runtime, RuntimeConfig())

No signal handlers are installed here; the CLI adds them. Shutdown is
cancellation: leaving the `async with` (or having it cancelled) makes the RAM
tier durable on SSD, shielded and within `config.shutdown_flush_s`, then
cancels every actor. An exception from the caller's block comes out as itself.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.lowlevel

from mlxd.actors.cache_owner import CacheOwnerActor
from mlxd.actors.device_probe import lands_in_mlx
from mlxd.actors.durability import DurabilityCoordinator
from mlxd.actors.engine import EngineActor
from mlxd.actors.gen_checkpointer import GenerationCheckpointer, checkpoint_dir
from mlxd.actors.page_cache_warmer import PageCacheWarmerActor
from mlxd.actors.prefetcher import PrefetcherActor
from mlxd.actors.scheduler import SchedulerActor
from mlxd.actors.ssd_writer import SsdWriterActor
from mlxd.engine.ops import EngineInfo
from mlxd.kv import advisor_file
from mlxd.kv import pins as pin_file
from mlxd.kv.admission import KvAdmission, weights_bytes
from mlxd.kv.blocks import span_for
from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.file_format import FileHeader, Landing
from mlxd.kv.kv_events import PublishAddress
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.ssd_store import Scan, SsdStore
from mlxd.kv.tiers import SessionCheckpoint, SsdRecord
from mlxd.runtime import session_files
from mlxd.runtime.chat.prompt_tokens import PieceEncoder
from mlxd.runtime.chat.stable_prefix import ProbedPrefixes, cut_for, template_identity
from mlxd.runtime.chat.token_history import (
    GeneratedHistory,
    best_realignment,
    encode_chat,
    needs_realignment,
    render,
)
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.channels import ChannelStats, Reply
from mlxd.runtime.kernel.messages import (
    AdoptCheckpoint,
    CacheOwnerMessage,
    CacheStatsSnapshot,
    CloseSession,
    DurabilityMessage,
    DurabilitySnapshot,
    DurabilityStats,
    EngineInbox,
    FindCheckpointTokens,
    FindSessionCheckpoint,
    FlushReport,
    FlushRequest,
    FlushThrough,
    GenCheckpointMessage,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    GenerationRequest,
    PinPrefix,
    PinSession,
    PrefetcherMessage,
    PrefetchHint,
    PrefetchSnapshot,
    PrefetchStats,
    PromptAccepted,
    QueryCacheStats,
    RecordLost,
    SamplingParams,
    SchedulerInbox,
    SettleCheckpoints,
    StopGeneration,
    SubmitGeneration,
    TokenGenerated,
    WriteSnapshot,
)
from mlxd.runtime.logging import get_logger
from mlxd.runtime.stats import RuntimeStats, SchedulerView, SsdTierStats
from mlxd.vision.encoder import vision_identity

log = get_logger("mlxd.runtime")


GEN_SETTLE_S = 30.0  # longest a flush waits for queued generation checkpoints


class QueueFull(Exception):
    """The admission queue is full; retry later (HTTP 503 + Retry-After)."""


class ShuttingDown(Exception):
    """The runtime stopped admitting requests (HTTP 503)."""


class InvalidRequest(ValueError):
    """The request cannot be served as given (HTTP 400); `param` names the bad field, `code` the
    OpenAI error code where one fits (`context_length_exceeded`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class GenerationError(RuntimeError):
    """The engine failed while generating this request (HTTP 500)."""


class GenerationStream:
    """The events of one generation; leaving early cancels it and frees its slot."""

    def __init__(
        self, receive: trio.MemoryReceiveChannel[GenerationEvent], request: GenerationRequest, left: trio.Event,
    ) -> None:
        self._receive = receive
        self._left = left  # SubmitGeneration.client_left: set on close, so the scheduler knows mid-prefill
        self.request = request
        self.accepted: PromptAccepted | None = None
        self.finished: GenerationFinished | None = None

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[GenerationEvent]:
        async for event in self._receive:
            if isinstance(event, PromptAccepted):
                self.accepted = event
            elif isinstance(event, GenerationFinished):
                self.finished = event
            elif isinstance(event, GenerationFailed):
                raise GenerationError(event.message)
            yield event
        if self.finished is None:  # every generation ends with an answer, never with silence
            raise GenerationError("the generation ended without a result")

    async def tokens(self) -> list[int]:
        """Drain the stream and return the generated token ids."""
        return [e.token async for e in self if isinstance(e, TokenGenerated)]

    async def aclose(self) -> None:
        await self._receive.aclose()
        self._left.set()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Runtime:
    """A running mlxd: submit generations, read stats, drain."""

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        info: EngineInfo,
        submit: trio.MemorySendChannel[SchedulerInbox],
        cache: trio.MemorySendChannel[CacheOwnerMessage],
        scheduler: SchedulerActor,
        engine: EngineActor,
        engine_inbox: trio.MemorySendChannel[EngineInbox],
        cache_owner: CacheOwnerActor,
        cold: ColdTier | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self._submit = submit
        self._cache = cache
        self.scheduler = scheduler
        self.engine = engine
        self._engine_inbox = engine_inbox
        self.cache_owner = cache_owner
        self.cold = cold
        self.history = GeneratedHistory()
        self.prompt_tokens = PieceEncoder(info.tokenizer)  # chat prompts: reuse the ids of pieces seen before
        # Stable prefixes of conversations already probed: one sent again skips its probe renders.
        self.probed = ProbedPrefixes(template_identity(info.tokenizer))
        self.admitting = True
        self.started_at = time.time()
        # Admission is the Runtime's: it counts what it admitted and what a full queue refused.
        self._submitted = 0
        self._rejected = 0
        self._ids = itertools.count()
        # Called with each flush report (metrics); must not block.
        self.flush_observers: list[Callable[[dict[str, Any]], None]] = []

    @property
    def ssd_block_tokens(self) -> int | None:
        """The span of the SSD tier's blocks (None without an SSD tier)."""
        return None if self.cold is None else self.cold.store.block_tokens

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def channels(self) -> dict[str, Any]:
        """The actors' inboxes by name; each has `.statistics()` (trio memory channels)."""
        out = {"submit": self._submit, "cache": self._cache}
        if self.cold is not None:
            out["durability"] = self.cold.durability_inbox
            out["prefetch"] = self.cold.prefetch_inbox
        return out

    # --- building requests -----------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:12]}"

    async def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        namespace: str = "",
        tools: Sequence[dict[str, Any]] = (),
        template_kwargs: dict[str, Any] | None = None,
        realign: bool = True,
    ) -> tuple[int, ...]:
        """Apply the model's chat template (with the generation prompt) and tokenize (`render_chat_cut`)."""
        ids, _ = await self.render_chat_cut(messages, namespace=namespace, tools=tools,
                                            template_kwargs=template_kwargs, realign=realign, probe=False)
        return ids

    def needs_template_cuts(self) -> bool:
        """Whether chat prompts get a checkpoint at their template's stable prefix: only where the
        cache cannot be cut back to a common prefix (runtime/chat/stable_prefix.py)."""
        return not self.info.trimmable and self.config.prompt_cache_bytes > 0

    async def render_chat_cut(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        namespace: str = "",
        tools: Sequence[dict[str, Any]] = (),
        template_kwargs: dict[str, Any] | None = None,
        realign: bool = True,
        probe: bool = True,
    ) -> tuple[tuple[int, ...], int | None]:
        """Apply the model's chat template (with the generation prompt) and tokenize; with `probe` on an
        untrimmable cache, also the position to checkpoint at where the template's rendering stops
        being stable under continuation (runtime/chat/stable_prefix.py), or None.

        `tools` (OpenAI function specs) and `template_kwargs` (e.g. `enable_thinking`)
        are passed to the template.

        Generated replies keep their original token ids (see `token_history`):
        from this process's history, or else from the cached checkpoint (RAM or
        SSD, so also after a restart) that spells the conversation so far. A
        returning conversation thus hits its checkpoint instead of diverging
        where a re-tokenized reply begins.
        """
        try:
            # Rendering and tokenizing a long conversation is CPU work: off the event loop.
            kwargs = dict(template_kwargs or {})
            if tools:
                kwargs["tools"] = list(tools)
            probing = probe and self.needs_template_cuts()
            replies = {m["content"]: self.history.get(m["content"]) for m in messages
                       if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]}
            # One worker-thread hop for the rendering and the replies' ids (each hop a GIL hand-off each way).
            text, plain, stable, ids = await trio.to_thread.run_sync(
                partial(_render_chat, self.tokenizer, messages, self.prompt_tokens.encode, kwargs,
                        self.probed if probing else None, replies, self.info.eos_token_ids)
            )
        except Exception as exc:
            raise InvalidRequest(f"could not apply the chat template: {exc}") from exc
        if realign and any(m.get("role") == "assistant" for m in messages):
            # (not for images: cached keys spell them with media ids, which do not decode)
            # Each round can move the alignment past one more re-tokenized reply.
            for _ in range(8):
                reply: Reply[list[tuple[int, ...]]] = Reply()
                await self._cache.send(FindCheckpointTokens(ids, namespace, reply))
                checkpoints = await reply.wait()
                if not needs_realignment(ids, checkpoints):  # a next turn: its checkpoints are prefixes of it
                    break
                better = await trio.to_thread.run_sync(best_realignment, self.tokenizer, text, ids, checkpoints)
                if better == ids:
                    break
                ids = better
        ids = tuple(map(int, ids))
        return ids, (cut_for(stable, plain, ids) if stable is not None else None)

    def remember_reply(self, text: str, ids: Sequence[int]) -> None:
        """Record a generated reply's exact ids (if they decode to exactly `text`)."""
        body = [t for t in ids if t not in self.info.eos_token_ids]
        if text and self.tokenizer.decode(body) == text:
            self.history.record(text, ids)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text))

    def request(
        self,
        prompt: Sequence[int],
        *,
        sampling: SamplingParams | None = None,
        namespace: str = "",
        request_id: str | None = None,
        session: str | None = None,
        media: Sequence[Any] = (),
        checkpoint_at: Sequence[int] = (),
    ) -> GenerationRequest:
        """Validate and build a request for exact prompt token ids (`session`: seed §5.12).

        `media`: the prompt's images (vision/encoder.ImageInput); their spans hold media key ids (kv/media.py).
        `checkpoint_at`: prompt lengths to checkpoint at (the chat template's stable prefix, `render_chat_cut`).
        """
        prompt = tuple(map(int, prompt))
        if sampling is None:
            room = self.info.max_context - len(prompt)
            sampling = SamplingParams(max_tokens=max(1, min(self.config.default_max_tokens, room)))
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        if sampling.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens {sampling.max_tokens} exceeds this server's limit of {self.config.max_tokens_limit}"
            )
        limit = self.info.max_context
        if len(prompt) + sampling.max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"model's context length of {limit} tokens", code="context_length_exceeded"
            )
        kv = self.scheduler.kv_admission  # --kv-admission: a request whose KV never fits is refused now
        why = kv.never_fits(len(prompt), sampling.max_tokens) if kv is not None else None
        if why is not None:
            kv.refused += 1  # type: ignore[union-attr]
            raise InvalidRequest(why, param="max_tokens")
        vocab = self.info.vocab_size
        if media:
            from mlxd.kv.media import check_spans

            why = check_spans(prompt, [m.span for m in media], vocab)
            if why is not None:
                raise InvalidRequest(why, param="messages")
        elif prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        # Ids reach MLX indexing unchecked: an out-of-range one would write out of bounds.
        if any(not 0 <= t < vocab for t, _ in sampling.logit_bias):
            raise InvalidRequest(f"'logit_bias' token ids must be in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in sampling.stop_token_ids):
            raise InvalidRequest(f"stop token ids must be in [0, {vocab})", param="stop")
        if sampling.top_k >= vocab:
            sampling = attrs.evolve(sampling, top_k=0)  # covering the vocabulary = no top-k
        return GenerationRequest(
            request_id=request_id or self.new_request_id(), prompt=prompt, sampling=sampling, namespace=namespace,
            session=session, media=tuple(media),
            checkpoint_at=tuple(sorted({int(c) for c in checkpoint_at if 0 < int(c) < len(prompt)})),
        )

    # --- submitting --------------------------------------------------------------

    def check_admission(self, tokens: int = 0) -> None:
        """Raise now what `submit(within_queue_timeout=True)` would (ShuttingDown, QueueFull): before a
        prompt is tokenized for nothing.

        `tokens`: the fewest tokens the prompt can have (from its characters), for the prefill backlog.
        """
        if not self.admitting:
            raise ShuttingDown("the server is shutting down")
        queue = self._submit.statistics()
        if queue.current_buffer_used >= queue.max_buffer_size and queue.tasks_waiting_receive == 0:
            self._rejected += 1
            raise QueueFull(f"the admission queue is full ({self.config.max_queue} waiting)")
        self._check_backlog(tokens)

    def _check_backlog(self, tokens: int) -> None:
        """QueueFull when the prompts ahead would hold this one past --queue-timeout (runtime/prefill_backlog.py)."""
        why = self.scheduler.backlog.refusal(tokens, time.monotonic())
        if why is not None:
            self._rejected += 1
            raise QueueFull(why)

    def submit(
        self, request: GenerationRequest, *, follows: bool = False, within_queue_timeout: bool = False
    ) -> GenerationStream:
        """Queue a generation; raises QueueFull/ShuttingDown at once instead of waiting.

        `within_queue_timeout`: also QueueFull when the prompt work ahead would hold this request past
        --queue-timeout at the measured prefill rate (runtime/prefill_backlog.py; the HTTP routes ask
        for it). Off by default: an embedder's request waits its turn, whatever this machine's speed.
        `follows`: a further choice (n > 1) of a request whose first choice has its first token, so its
        prompt is cached: it adds no prompt work, and the prompt work ahead never refuses it.
        """
        if not self.admitting:
            raise ShuttingDown("the server is shutting down")
        if within_queue_timeout and not follows:
            self._check_backlog(len(request.prompt))
        send, receive = trio.open_memory_channel[GenerationEvent](request.sampling.max_tokens + 8)
        submission = SubmitGeneration(request, send, time.monotonic())
        try:
            self._submit.send_nowait(submission)
        except trio.WouldBlock:
            self._rejected += 1
            send.close()
            receive.close()
            raise QueueFull(f"the admission queue is full ({self.config.max_queue} waiting)") from None
        self._submitted += 1
        self.scheduler.backlog.add(request.request_id, len(request.prompt), time.monotonic(),
                                   alive=lambda: send.statistics().open_receive_channels > 0)
        if self.cold is not None:
            try:  # a hint: the cache owner tells the prefetcher what to read; dropped when busy
                self._cache.send_nowait(PrefetchHint(request.prompt, request.namespace))
                if self.info.draft_tag is not None:  # --draft-model: its own checkpoints too
                    from mlxd.engine.speculative import draft_namespace

                    self._cache.send_nowait(
                        PrefetchHint(request.prompt, draft_namespace(request.namespace, self.info.draft_tag))
                    )
            except trio.WouldBlock:
                pass
        return GenerationStream(receive, request, submission.client_left)

    async def stop_generation(self, request_id: str) -> None:
        """End a decoding generation as a normal stop (its client matched a stop string).

        With the engine's next step the row leaves the batch with reason "stop" and
        its checkpoint is published, as for an end token.
        """
        await self._engine_inbox.send(StopGeneration(request_id))

    # --- observing and stopping ------------------------------------------------

    async def close_session(self, session: str) -> bool:
        """Drop a session's cache references (its cached state stays); False if it is unknown."""
        reply: Reply[bool] = Reply()
        await self._cache.send(CloseSession(session, reply))
        return await reply.wait()

    async def pin_session(self, session: str, ttl_s: float) -> None:
        """Keep the session's latest checkpoints in RAM for `ttl_s` seconds (send before its request)."""
        await self._cache.send(PinSession(session, ttl_s))

    # --- a session's KV as a file (runtime/session_files.py) ----------------------------

    @property
    def transfer_dir(self) -> Path:
        """Where session exports are written and uploads received."""
        return session_files.transfer_dir(self.cold.store if self.cold is not None else None)

    async def export_session(self, session: str, namespace: str = "") -> Path | None:
        """The session's latest checkpoint written as a `.mlxkv` file (the caller removes it); None if no tier
        holds one."""
        reply: Reply[SessionCheckpoint | None] = Reply()
        await self._cache.send(FindSessionCheckpoint(session, namespace, reply))
        found = await reply.wait()
        if found is None:
            return None

        async def lost(record: SsdRecord) -> None:
            await self._cache.send(RecordLost(record))

        return await session_files.export_checkpoint(
            found, namespace, engine=self.engine, store=self.cold.store if self.cold is not None else None,
            identity=self.info.store_identity, directory=self.transfer_dir, lost=lost,
        )

    async def import_session(self, session: str, path: Path) -> session_files.Imported:
        """Verify an uploaded `.mlxkv` file and adopt it as the session's checkpoint (ImportRefused otherwise)."""

        async def adopt(header: FileHeader, caches: list[object], nbytes: int, trimmable: bool,
                        record: SsdRecord | None) -> bool:
            reply: Reply[bool] = Reply()
            await self._cache.send(AdoptCheckpoint(tuple(header.tokens), header.namespace, caches, nbytes, trimmable,
                                                   record, session, reply))
            return await reply.wait()

        return await session_files.import_file(
            path, session, engine=self.engine, store=self.cold.store if self.cold is not None else None,
            identity=self.info.store_identity, vocab=self.info.vocab_size, max_context=self.info.max_context,
            adopt=adopt, namespaces=frozenset({"", *(a.namespace for a in self.info.adapters)}),
        )

    async def pin_prefix(self, session: str, namespace: str, tokens: Sequence[int], ttl_s: float) -> None:
        """Keep the RAM entry holding exactly `tokens` for `ttl_s` seconds (a breakpoint); released with `session`."""
        await self._cache.send(PinPrefix(session, namespace, tuple(int(t) for t in tokens), ttl_s))

    async def cache_stats(self) -> dict[str, Any]:
        return (await self._cache_snapshot()).as_dict()

    async def _cache_snapshot(self) -> CacheStatsSnapshot:
        reply: Reply[CacheStatsSnapshot] = Reply()
        await self._cache.send(QueryCacheStats(reply))
        return await reply.wait()

    async def stats(self) -> RuntimeStats:
        """A snapshot of every actor's counters; `.as_dict()` is the `/stats` body."""
        from mlxd import _blas

        cache = await self._cache_snapshot()
        scheduler = SchedulerView.of(
            self.scheduler.stats, submitted=self._submitted, rejected=self._rejected,
            queued=ChannelStats.of(self._submit).queued, max_queue=self.config.max_queue,
            max_batch=self.config.max_batch,
        )
        checkpointer = self.cold.checkpointer if self.cold is not None else None
        return RuntimeStats(
            model=self.info.model_name,
            uptime_s=round(time.time() - self.started_at, 3),
            admitting=self.admitting,
            scheduler=scheduler,
            engine=self.engine.stats,
            cache=cache,
            channels={name: ChannelStats.of(ch) for name, ch in self.channels.items()},
            blas=dict(_blas.status),
            prompt_tokens=self.prompt_tokens.stats(),
            template_probes=self.probed.stats(),
            device_probe=self.info.probe,
            ssd=await self._ssd_stats(cache) if self.cold is not None else None,
            generation_checkpoints=checkpointer.snapshot_stats() if checkpointer is not None else None,
        )

    async def ssd_stats(self) -> SsdTierStats | None:
        """The SSD tier's counters (seed §5.6 names), or None without a cold tier."""
        if self.cold is None:
            return None
        return await self._ssd_stats(await self._cache_snapshot())

    async def _ssd_stats(self, cache: CacheStatsSnapshot) -> SsdTierStats:
        assert self.cold is not None
        reply: Reply[DurabilitySnapshot] = Reply()
        self.cold.durability_inbox.send_nowait(DurabilityStats(reply))
        durability = await reply.wait()
        prefetch: Reply[PrefetchSnapshot] = Reply()
        await self.cold.prefetch_inbox.send(PrefetchStats(prefetch))
        store = self.cold.store
        return SsdTierStats.of(
            cache, durability, await prefetch.wait(),
            pacing=self.cold.governor.as_dict(), layout=store.layout, block_tokens=store.block_tokens,
        )

    async def flush(self) -> dict[str, Any]:
        """Wait until every checkpoint in RAM is durable on SSD; report the evidence."""
        report = await self._flush()
        for observe in self.flush_observers:
            observe(report)
        return report

    async def _flush(self) -> dict[str, Any]:
        if self.cold is None:
            return {"durable": False, "reason": "no SSD tier (start with --ssd-cache DIR)"}
        reply: Reply[FlushReport] = Reply()
        # Through the cache owner: every checkpoint it has received is marked dirty first.
        await self._cache.send(FlushThrough(FlushRequest(reply)))
        report = (await reply.wait()).as_dict()
        if self.cold.checkpointer is not None and self.cold.gen_inbox is not None:
            # Generation checkpoints are written (and finished ones removed) too, at full speed;
            # running requests keep adding snapshots, so the wait is bounded.
            settled: Reply[int] = Reply()
            await self.cold.gen_inbox.send(SettleCheckpoints(settled))
            pending = self.cold.checkpointer.snapshot_stats()["pending"]
            with trio.move_on_after(GEN_SETTLE_S):
                pending = await settled.wait()
            report["generation_checkpoints_pending"] = pending
            # A generation whose newest checkpoint failed to write is not durable: say so, and why.
            unwritten = self.cold.checkpointer.unwritten()
            report["generation_checkpoints_unwritten"] = unwritten.count
            if unwritten.reason is not None:
                report["durable"] = False
                before = report.get("reason")
                report["reason"] = unwritten.reason if before is None else f"{before}; {unwritten.reason}"
        return report

    def stop_admission(self) -> None:
        self.admitting = False

    async def drain(self) -> None:
        """Stop admission and wait until every admitted request has finished.

        Bound it with a deadline (`trio.move_on_after`), as the CLI does.
        """
        self.stop_admission()
        while self.scheduler.stats.running or ChannelStats.of(self._submit).queued:
            await self.scheduler.wait_idle()
            await trio.lowlevel.checkpoint()


def _render_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], encode: Callable[[str], tuple[int, ...]],
    kwargs: dict[str, Any], probed: ProbedPrefixes | None, replies: dict[str, tuple[int, ...] | None],
    eos: frozenset[int],
) -> tuple[str, tuple[int, ...], int | None, tuple[int, ...]]:
    """(text, canonical ids, stable prefix or None, ids with the replies' own ids spliced in) (a worker thread)."""
    text, plain, stable = _render_probed(tokenizer, messages, encode, kwargs, probed)
    if not any(ids is not None for ids in replies.values()):
        return text, plain, stable, plain
    ids, _ = encode_chat(tokenizer, messages, replies, eos, (text, plain), encode)
    return text, plain, stable, ids


def _render_probed(
    tokenizer: Any, messages: Sequence[dict[str, Any]], encode: Callable[[str], tuple[int, ...]],
    kwargs: dict[str, Any], probed: ProbedPrefixes | None,
) -> tuple[str, tuple[int, ...], int | None]:
    """(text, canonical ids, stable prefix or None): the chat's rendering and, with `probed`, how much
    of it the template keeps when the conversation goes on (a worker thread: it renders 1 + 2 times,
    or once for a conversation already probed)."""
    text, plain = render(tokenizer, messages, encode=encode, **kwargs)
    if probed is None:
        return text, plain, None
    t0 = time.perf_counter()
    stable = probed.stable(lambda m: render(tokenizer, m, encode=encode, **kwargs)[1], messages, plain,
                           variables=kwargs)
    log.debug("chat.stable_prefix", prompt_tokens=len(plain), stable=stable,
              probe_ms=round((time.perf_counter() - t0) * 1e3, 2))
    return text, plain, stable


@attrs.frozen
class ColdTier:
    """The SSD tier's actors and their inboxes (absent without --ssd-cache)."""

    store: SsdStore
    writer: SsdWriterActor
    durability: DurabilityCoordinator
    durability_inbox: trio.MemorySendChannel[DurabilityMessage]
    prefetcher: PrefetcherActor
    prefetch_inbox: trio.MemorySendChannel[PrefetcherMessage]
    governor: WriteGovernor
    checkpointer: GenerationCheckpointer | None = None  # --generation-checkpoint N
    gen_inbox: trio.MemorySendChannel[GenCheckpointMessage] | None = None  # its inbox (flush settles it)


async def _open_store(config: RuntimeConfig, info: EngineInfo) -> tuple[SsdStore, Scan]:
    """Create the SSD store and scan its directory (header-only) on a worker thread."""
    assert config.ssd_cache_dir is not None
    block_tokens = config.ssd_block_tokens or span_for(info.kv_bytes_per_token)
    store = SsdStore(
        Path(config.ssd_cache_dir), info.store_identity, layout=config.ssd_layout, block_tokens=block_tokens,
        shared_grace_s=config.ssd_shared_grace_s if config.ssd_shared else None,
        # A vision model's encoder outputs are records of the tier too (vision/tensor_store.py).
        encoder_identity=None if config.ssd_shared else vision_identity(Path(info.model_path)),
    )
    t0 = time.perf_counter()
    log.info("ssd.scan_started", dir=str(store.directory))
    scan = await trio.to_thread.run_sync(store.scan)
    log.info(
        "ssd.scan_finished",
        seconds=round(time.perf_counter() - t0, 3),
        entries=len(scan.records),
        bytes=sum(r.nbytes for r in scan.records),
        **{f"removed_{k}": v for k, v in attrs.asdict(scan.report).items() if k != "indexed"},
    )
    return store, scan


def _cold_tier(
    config: RuntimeConfig,
    store: SsdStore,
    cache_send: trio.MemorySendChannel[CacheOwnerMessage],
    governor: WriteGovernor,
    gen_inbox: trio.MemoryReceiveChannel[GenCheckpointMessage] | None,
    gen_send: trio.MemorySendChannel[GenCheckpointMessage] | None,
    land: Callable[[FileHeader], Awaitable[Landing]] | None,
) -> ColdTier:
    # The coordinator's inbox is unbounded on purpose: its producers (the cache
    # owner, the writer) must never block on it, and it waits on nobody but the
    # writer's one-slot inbox and the cache owner's replies, so it always drains.
    durability_send, durability_receive = trio.open_memory_channel[DurabilityMessage](math.inf)
    write_send, write_receive = trio.open_memory_channel[WriteSnapshot](1)
    prefetch_send, prefetch_receive = trio.open_memory_channel[PrefetcherMessage](64)
    writers = store.concurrent_writes  # a flush writes this many files at once
    writer = SsdWriterActor(store, inbox=write_receive, outbox=durability_send.clone(), governor=governor,
                            workers=writers)
    durability = DurabilityCoordinator(
        inbox=durability_receive, writer=write_send, cache=cache_send.clone(), governor=governor,
        backlog_bytes=config.ssd_backlog_bytes or config.prompt_cache_bytes // 2, writers=writers,
        shared_prefixes=store.layout == "blocks",
    )
    prefetcher = PrefetcherActor(
        store, inbox=prefetch_receive, cache=cache_send.clone(), verify=config.ssd_cache_verify, land=land
    )
    checkpointer = None
    if gen_inbox is not None:
        directory = checkpoint_dir(Path(config.ssd_cache_dir or "."), store.identity.fingerprint)
        checkpointer = GenerationCheckpointer(
            directory, store.identity, inbox=gen_inbox, governor=governor, keep=4 * config.max_batch + 16,
            verify=config.ssd_cache_verify,
        )
    return ColdTier(
        store, writer, durability, durability_send, prefetcher, prefetch_send, governor, checkpointer, gen_send
    )


async def _start_kv_events(
    actors: _Actors, config: RuntimeConfig, address: PublishAddress, fingerprint: str
) -> trio.MemorySendChannel[Any]:
    """Start the KV-event publisher (--kv-events-endpoint); return its inbox."""
    from mlxd.actors.kv_publisher import KvEventPublisherActor

    send, receive = trio.open_memory_channel[Any](64)
    publisher = KvEventPublisherActor(
        address, inbox=receive, topic=config.kv_events_topic, token_ids=config.kv_events_token_ids,
        fingerprint=fingerprint,
    )
    await actors.start(publisher.run)
    return send


async def _run_in(
    scope: trio.CancelScope, run: Callable[..., Awaitable[Any]], *, task_status: trio.TaskStatus[Any]
) -> None:
    with scope:
        await run(task_status=task_status)


@attrs.define
class _Actors:
    """The runtime's actor tasks, each in its own cancel scope.

    Once the runtime is up they are shielded: cancelling the caller's scope
    reaches the caller's code, not the actors, so shutdown can flush through
    them first; `stop()` then cancels them.
    """

    nursery: trio.Nursery
    _scopes: list[trio.CancelScope] = attrs.Factory(list)

    async def start(self, run: Callable[..., Awaitable[Any]]) -> Any:
        scope = trio.CancelScope()
        self._scopes.append(scope)
        return await self.nursery.start(_run_in, scope, run)

    def shield(self) -> None:
        for scope in self._scopes:
            scope.shield = True

    def stop(self) -> None:
        for scope in self._scopes:
            scope.cancel()

    @property
    def failed(self) -> bool:
        """An actor raised (trio then cancels the nursery); nothing can flush through them."""
        return self.nursery.cancel_scope.cancel_called


async def _flush_on_exit(runtime: Runtime, actors: _Actors) -> None:
    """The end of open_runtime, however it came: make RAM checkpoints durable first, shielded,
    within config.shutdown_flush_s, as SIGTERM does in `mlxd serve`. Skipped when the caller
    already ran the graceful sequence (admission stopped) or an actor failed."""
    timeout = runtime.config.shutdown_flush_s
    if runtime.cold is None or not runtime.admitting or actors.failed or timeout <= 0:
        return
    runtime.stop_admission()
    with trio.move_on_after(timeout, shield=True) as scope:
        try:
            report = await runtime.flush()
        except Exception as exc:  # a failed flush must not replace how the block ended
            log.warning("runtime.exit_flush_failed", error=repr(exc))
            return
        log.info("runtime.exit_flushed", **report)
    if scope.cancelled_caught:
        log.warning("runtime.exit_flush_timed_out", timeout_s=timeout)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _callers_own(group: BaseExceptionGroup, raised: BaseException | None) -> BaseException | None:
    """`raised` when it is all the actors' nursery holds (the nursery only wrapped the caller's
    exception), else None: an actor's failure, or several errors, stay a group.

    A group the caller raised comes back as a copy (a cancel scope's `split` rebuilds it), so
    it is matched by type and by its leaf exceptions, which keep their identity.
    """
    if raised is None or len(group.exceptions) != 1:
        return None
    inner = group.exceptions[0]
    if inner is raised:
        return raised
    same_leaves = [id(e) for e in _leaves(inner)] == [id(e) for e in _leaves(raised)]
    return raised if type(inner) is type(raised) and same_leaves else None


async def _start_actors(actors: _Actors, config: RuntimeConfig) -> Runtime:
    """Wire the channels, start every actor in dependency order, and hand out the Runtime."""
    submit_send, submit_receive = trio.open_memory_channel[SchedulerInbox](config.max_queue)
    engine_send, engine_receive = trio.open_memory_channel[EngineInbox](config.max_batch * 2 + 8)
    cache_send, cache_receive = trio.open_memory_channel[CacheOwnerMessage](64)
    # Shared by the engine (busy), the durability coordinator and cache owner
    # (urgent) and the SSD writer (which paces itself by it).
    governor = WriteGovernor(busy_rate_bytes_per_s=config.ssd_write_rate_bytes,
                             hold_while_decoding=config.ssd_write_hold_decode)
    # In-flight generation checkpoints: engine -> checkpointer (drained without I/O, so never stuck).
    gen_send, gen_receive = (
        trio.open_memory_channel[GenCheckpointMessage](64) if config.generation_checkpoint else (None, None)
    )
    engine = EngineActor(
        config, inbox=engine_receive, publish=cache_send.clone(), governor=governor, checkpoints=gen_send
    )
    info = await actors.start(engine.run)
    store, scan = await _open_store(config, info) if config.ssd_cache_dir else (None, None)
    # Restored bytes land straight in MLX memory: no copy on the engine thread, and on CUDA
    # no page-by-page migration (docs/benchmarks.md; Metal keeps the host path, unmeasured there).
    # The startup probe timed restores by the same rule (actors/device_probe.py).
    direct = lands_in_mlx(config)
    cold = (
        _cold_tier(config, store, cache_send, governor, gen_receive, gen_send.clone() if gen_send else None,
                   land=engine.landing if direct else None)
        if store is not None else None
    )
    address = config.kv_events_address()
    kv_events = (
        await _start_kv_events(actors, config, address, info.store_identity.fingerprint)
        if address is not None else None
    )
    # The restore advisor starts from what the startup probe measured on this device.
    advisor = RestoreAdvisor.for_choice(
        config.restore_choice, info.probe.cost_model() if info.probe is not None else DEFAULT,
        overlap=config.overlaps_weighed,
    )
    advisor_saved = await _saved_calibration(config, store, info, advisor)
    cache_owner = CacheOwnerActor(
        config, inbox=cache_receive, store=store, governor=governor, advisor=advisor,
        records=scan.records if scan is not None else (),
        corrupt_at_start=scan.report.corrupt if scan is not None else 0,
        memory_budget=info.memory_budget_bytes,
        durability=cold.durability_inbox.clone() if cold is not None else None,
        prefetcher=cold.prefetch_inbox.clone() if cold is not None else None,
        # --distributed: followers drop their shards of what leaves RAM (kv/shard_mirror.py)
        engine=engine_send.clone() if config.distributed else None,
        kv_events=kv_events, kv_fingerprint=info.store_identity.fingerprint,
        **await _saved_pins(config, store),
        **advisor_saved,
    )
    if store is not None and scan is not None:  # (an SSD tier always has a RAM tier: RuntimeConfig)
        # The newest files, up to the RAM tier's size, read into the page cache out of serving's way.
        await actors.start(PageCacheWarmerActor(store, list(scan.records), config.prompt_cache_bytes).run)
    if cold is not None:
        await actors.start(cold.writer.run)
        await actors.start(cold.durability.run)
        await actors.start(cold.prefetcher.run)
        if cold.checkpointer is not None:
            await actors.start(cold.checkpointer.run)
    await actors.start(cache_owner.run)
    scheduler = SchedulerActor(
        config,
        inbox=submit_receive,
        engine=engine_send,
        cache=cache_send.clone(),
        prefetcher=cold.prefetch_inbox.clone() if cold else None,
        checkpoints=gen_send.clone() if gen_send is not None and cold is not None else None,
        kv_admission=_kv_admission(config, info),
        draft_tag=info.draft_tag,
        governor=governor,
    )
    await actors.start(scheduler.run)
    return Runtime(
        config,
        info=info,
        submit=submit_send,
        cache=cache_send,
        scheduler=scheduler,
        engine=engine,
        engine_inbox=engine_send.clone(),
        cache_owner=cache_owner,
        cold=cold,
    )


async def _saved_calibration(
    config: RuntimeConfig, store: SsdStore | None, info: EngineInfo, advisor: RestoreAdvisor
) -> dict[str, Any]:
    """The restore advisor resumes what the last server on this device measured (kv/advisor_file.py), and
    the cache owner saves it again when it stops; none without an SSD tier, or in a shared directory."""
    if store is None or config.ssd_shared:
        return {}
    path = advisor_file.advisor_path(store.directory)
    device = info.probe.device if info.probe is not None else ""
    saved = await trio.to_thread.run_sync(advisor_file.load, path, device)
    if saved:
        advisor.resume(saved)
        log.info("advisor.calibration_resumed", **{k: round(float(v), 4) for k, v in advisor.calibration().items()})
    return {"advisor_file": path, "advisor_device": device}


async def _saved_pins(config: RuntimeConfig, store: SsdStore | None) -> dict[str, Any]:
    """The pins file beside the SSD tier and the live pins it holds (kv/pins.py); none without an SSD
    tier, or in a directory shared by replicas (each would overwrite the others' pins)."""
    if store is None or config.ssd_shared:
        return {}
    path = pin_file.pins_path(store.directory)
    saved, expired = await trio.to_thread.run_sync(pin_file.load, path, time.time())
    if len(saved) or expired:
        log.info("pins.restored", sessions=len(saved.sessions), prefixes=len(saved.prefixes), expired=expired)
    return {"pins_file": path, "saved_pins": saved}


def _kv_admission(config: RuntimeConfig, info: EngineInfo) -> KvAdmission | None:
    """--kv-admission: reservations against the memory budget, beside this runtime's own memory as the
    engine measured it at load (a delta on its thread, never less than the weights' files), counting a
    request's KV (the draft model's too) and its prefill's working memory (kv/admission.py)."""
    if not config.kv_admission or info.memory_budget_bytes <= 0:
        return None
    own = info.own_memory
    fixed = weights_bytes(info.model_path)
    if own is None:
        return KvAdmission(info.memory_budget_bytes, info.kv_bytes_per_token, fixed_bytes=fixed)
    step = info.probe.prefill_step_size if info.probe is not None else config.prefill_step_size
    return KvAdmission(
        info.memory_budget_bytes, info.kv_bytes_per_token + own.draft_kv_bytes_per_token,
        fixed_bytes=max(fixed, own.resident_bytes), kv_step=KV_STEP, prefill_step=int(step),
        prefill_per_token=own.prefill.per_token, prefill_per_token_context=own.prefill.per_token_context,
    )


KV_STEP = 256  # mlx-lm's KVCache grows by this many tokens


@asynccontextmanager
async def open_runtime(config: RuntimeConfig | None = None) -> AsyncIterator[Runtime]:
    """Start every actor; yield a ready Runtime; flush (SSD tier) and cancel them all on exit.

    An exception raised inside the block comes out as itself, not in an
    ExceptionGroup; an actor's failure comes out as a group.
    """
    config = config or RuntimeConfig()
    raised: BaseException | None = None
    unwrapped: BaseException | None = None
    runtime: Runtime | None = None
    try:
        async with trio.open_nursery() as nursery:
            actors = _Actors(nursery)
            try:
                runtime = await _start_actors(actors, config)
                actors.shield()  # from here on only stop() ends them: after the exit flush
                try:
                    yield runtime
                except BaseException as exc:
                    raised = exc
                    raise
                finally:
                    await _flush_on_exit(runtime, actors)
            finally:
                actors.stop()
                nursery.cancel_scope.cancel()
                if runtime is not None:
                    runtime.prompt_tokens.close()
    except BaseExceptionGroup as group:
        # The nursery wraps whatever crossed it; the caller's own exception goes back unwrapped.
        unwrapped = _callers_own(group, raised)
        if unwrapped is None:
            raise
    finally:
        if runtime is not None and runtime.cold is not None:
            runtime.cold.store.close()  # every actor has stopped: the next server may lock the directory
    if unwrapped is not None:
        raise unwrapped  # outside the except clause: no "during handling of the group" context


async def serve_runtime(
    config: RuntimeConfig | None = None, *, task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED
) -> None:
    """The runtime as a service: `rt = await nursery.start(serve_runtime, config)`.

    Reports the Runtime once every actor is up, then runs until cancelled;
    cancelling the nursery that started it flushes the SSD tier (bounded by
    config.shutdown_flush_s) and shuts every actor down.
    """
    async with open_runtime(config) as rt:
        task_status.started(rt)
        await trio.sleep_forever()
