"""The cache-owner actor: a thin trio shell around `mlxd.kv.tiers.CacheTiers`.

It answers lookups, takes publications from the engine, and applies what the
durability coordinator and the prefetcher report (a file committed, a write
failed, a file lost). Every decision is the core's; this actor only carries
out its effects: dirty records to the coordinator, files to delete on a
worker thread, reads to start in the prefetcher. It never blocks on I/O and
never computes on MLX arrays. An exception in one handler fails that
message's reply (or is logged) and the actor keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import trio

from mlxd.kv import advisor_file
from mlxd.kv import pins as pin_file
from mlxd.kv.host_tier import HostTier
from mlxd.kv.kv_events import CPU, RAM, SSD, ResidencyLedger
from mlxd.kv.media import ENCODER_NAMESPACE, encoder_key
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.pins import PinSet
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.retention import make_policy
from mlxd.kv.shard_mirror import OwnerMirror, ShardRef
from mlxd.kv.shared_dir import DeletionGuard, DirWatch
from mlxd.kv.ssd_store import SsdStore
from mlxd.kv.tiers import (
    CacheTiers,
    Demote,
    Effect,
    Forget,
    NotStored,
    Persist,
    Promote,
    SsdRecord,
    TierStats,
    Unlink,
)
from mlxd.runtime import host_memory
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import (
    AdoptCheckpoint,
    CacheOwnerMessage,
    CacheStatsSnapshot,
    CloseSession,
    DurabilityMessage,
    EncoderOutputs,
    EngineBusy,
    EngineInbox,
    EntryDurable,
    EntryNotPersisted,
    FindCheckpointTokens,
    FindSessionCheckpoint,
    FlushThrough,
    ForgetDirty,
    LookupPrefix,
    MarkDirty,
    MarkNotStored,
    MemoryMeasured,
    PinPrefix,
    PinSession,
    PrefetcherMessage,
    PrefetchHint,
    PrefetchRecord,
    PrefillMeasured,
    PublishKvEvents,
    PublishPrefix,
    QueryCacheStats,
    RecordLost,
    ReleaseRam,
    RestoreMeasured,
    ShardsDropped,
)
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.cache")


@attrs.define
class _Counters:
    restores: int = 0
    restore_ms_last: float | None = None
    corrupt_removed: int = 0  # found by the startup scan; later losses are the core's
    discovered: int = 0  # shared directory: other replicas' files indexed after startup
    vanished: int = 0  # shared directory: indexed files another replica deleted


@attrs.define
class _Copies:
    """The host tier's page moves as carried out (runtime/host_memory.py), for /stats `cache.host.copies`."""

    promotions: int = 0
    promote_issue_ms_last: float | None = None  # the lookup's time to issue it (trio thread)
    promote_landed_ms_last: float | None = None  # issue -> every page back on the device
    promote_gb_s_last: float | None = None
    promoted_demotions_stopped: int = 0  # a promotion stopped its own entry's demotion between pieces
    demotions: int = 0
    demoted_bytes: int = 0
    demote_pieces: int = 0
    demote_holds: int = 0  # times a demotion held still (a request waiting for its first token, a promotion)
    demote_held_s: float = 0.0
    demotions_stopped: int = 0
    demote_gb_s_last: float | None = None
    # The longest first host read of a demotion, all its arrays (runtime/host_memory.Demotion.ranges_s): on CUDA
    # their conversion to managed memory, each with the GIL held, so every thread (the event loop too) waits.
    demote_ranges_ms_max: float = 0.0
    # The longest one array's conversion (a demotion converts one array at a time, holding still between):
    # the longest the GIL is held by a demotion's host reads.
    demote_convert_ms_max: float = 0.0
    move_failures: int = 0  # a promotion or demotion that raised (logged; the cache owner serves on)


class CacheOwnerActor:
    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[CacheOwnerMessage],
        store: SsdStore | None = None,
        records: tuple[SsdRecord, ...] = (),
        corrupt_at_start: int = 0,
        advisor: RestoreAdvisor | None = None,
        governor: WriteGovernor | None = None,
        clock: Callable[[], float] | None = None,
        memory_budget: int = 0,
        durability: trio.MemorySendChannel[DurabilityMessage] | None = None,
        prefetcher: trio.MemorySendChannel[PrefetcherMessage] | None = None,
        engine: trio.MemorySendChannel[EngineInbox] | None = None,
        kv_events: trio.MemorySendChannel[PublishKvEvents] | None = None,
        kv_fingerprint: str = "",
        host_tier: bool | None = None,
        pins_file: Path | None = None,
        saved_pins: PinSet | None = None,
        advisor_file: Path | None = None,
        advisor_device: str = "",
    ) -> None:
        """`durability` and `prefetcher`: the SSD tier's inboxes (with `store`). `engine`: under
        `--distributed`, told which mirrored prefixes left RAM so the followers drop their shards.
        `kv_events`: every change of what RAM and SSD hold, as KV block events (kv/kv_events.py),
        hashed along the SSD block store's chain of the store identity's `kv_fingerprint`.
        `host_tier`: keep `config.host_cache_bytes` of RAM victims in a host tier; None decides by
        the device (only where host memory is not the device's: CUDA), True keeps it anyway (tests).
        `advisor_file`: where the restore advisor's calibration is saved when this actor stops, for the
        next server on `advisor_device` (kv/advisor_file.py).
        """
        self._config = config
        self._governor = governor  # told when RAM is over its cap waiting for writes
        self._inbox = inbox
        ram = PromptCache(max_bytes=config.prompt_cache_bytes, policy=make_policy(config.retention))
        if clock is not None:
            ram.clock = clock
        host, self._host_noop = self._host_tier(config, host_tier, ram.clock)
        self.tiers = CacheTiers(
            ram,
            ssd=store is not None,
            ssd_max_bytes=config.ssd_cache_max_bytes,
            advisor=advisor or RestoreAdvisor(),
            demote_idle_s=config.ssd_demote_idle_s,
            memory_budget=memory_budget,  # resolved by the engine (--memory-budget or the device's share)
            host=host,
            # What of a record the page cache holds (mincore: no read), where the advisor has a page-cache
            # bandwidth from the startup probe to price it.
            residency=store.resident_bytes if store is not None else None,
        )
        self._store = store
        # A shared directory (kv/shared_dir.py): other replicas' files come and go.
        self._guard: DeletionGuard | None = None
        self._watch: DirWatch | None = None
        if store is not None and config.ssd_shared:
            self._guard = DeletionGuard(store.directory, grace_s=config.ssd_shared_grace_s)
            self._watch = DirWatch(store.directory, store.read_record, own=store.writer)
            self._watch.know(r.path for r in records if r.path is not None)
        self._startup = list(self.tiers.load_records(records))
        # Pins survive a restart (kv/pins.py): re-applied now, saved again whenever they change.
        if saved_pins is not None:
            self.tiers.restore_pins(saved_pins, time.time())
        self._pins_file = pins_file
        self._advisor_file, self._advisor_device = advisor_file, advisor_device
        self._pins_state = self.tiers.pin_state()
        self._pins_changed: trio.Event | None = None
        # Sends to the coordinator and prefetcher never block (unbounded / dropped
        # when full), so the actors cannot deadlock.
        self._durability = durability
        self._prefetcher = prefetcher
        self._nursery: trio.Nursery | None = None
        self.published = {"boundary": 0, "final": 0, "restore": 0}
        self._count = _Counters(corrupt_removed=corrupt_at_start)
        self._kv_events = kv_events
        self._ledger = ResidencyLedger(block_size=config.kv_events_block_size, fingerprint=kv_fingerprint)
        self._kv_pending: list[Any] = []
        self._engine = engine
        self._mirror = OwnerMirror()
        self._shards_left: list[ShardRef] = []
        self._engine_busy = False  # rows decoding (EngineBusy): host-tier moves wait until none do
        self._copies = _Copies()
        # Demotions run one at a time on a worker thread of their own limiter: dozens decided at once (the
        # idle moves) would otherwise hold trio's shared threads, which requests' parsing and tokenization need
        # (they share one demote lane anyway; a queued one's wait counts against its hold).
        self._demote_threads = trio.CapacityLimiter(1)

    @staticmethod
    def _host_tier(config: RuntimeConfig, wanted: bool | None, clock: Callable[[], float]) -> tuple[HostTier | None, str | None]:
        """The host tier, or None and why it is a no-op (logged once)."""
        if config.host_cache_bytes <= 0:
            return None, None
        if wanted is None:
            wanted = host_memory.separate_host_memory()
        if not wanted:
            why = "host and device share one memory here (CPU or Apple unified memory): the RAM tier is host memory"
            log.info("host_cache.noop", requested_bytes=config.host_cache_bytes, reason=why)
            return None, why
        log.info("host_cache.enabled", max_bytes=config.host_cache_bytes)
        return HostTier(max_bytes=config.host_cache_bytes, clock=clock), None

    def _report_shards(self) -> None:
        if self._engine is None:
            return
        self._shards_left.extend(self._mirror.sync(self.tiers.ram.entries()))
        if self._shards_left:
            try:  # never blocks: a full inbox means a busy engine, and these go after the next message
                self._engine.send_nowait(ShardsDropped(tuple(self._shards_left)))
                self._shards_left.clear()
            except trio.WouldBlock:
                pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._shards_left.clear()  # the engine stopped

    def _announce_residency(self) -> None:
        if self._kv_events is None:
            return
        host = self.tiers.host
        # A host-tier entry whose move is not issued yet is still in device memory: RAM's medium.
        events = self._ledger.sync(RAM, [*self.tiers.ram.entries(), *(host.device_entries() if host else ())])
        if host is not None:
            events += self._ledger.sync(CPU, host.moved_entries())
        if self.tiers.ssd:
            # (vision encoder outputs are no KV blocks)
            events += self._ledger.sync(SSD, [r for r in self.tiers.ssd_records() if r.namespace != ENCODER_NAMESPACE])
        self._kv_pending.extend(events)
        if self._kv_pending:
            try:
                self._kv_events.send_nowait(PublishKvEvents(time.time(), tuple(self._kv_pending)))
                self._kv_pending.clear()
            except trio.WouldBlock:
                pass  # the publisher is behind (it never blocks): these go with the next batch

    @property
    def cache(self) -> PromptCache:
        """The RAM tier (for tests and the embedding API; actors never touch it)."""
        return self.tiers.ram

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._serve(task_status)
        finally:
            if self._advisor_file is not None:  # what the advisor measured, for the next server here
                with trio.move_on_after(2.0, shield=True):
                    await self._save_advisor(self._advisor_file)

    async def _save_advisor(self, path: Path) -> None:
        calibration = self.tiers.advisor.calibration()
        try:
            await trio.to_thread.run_sync(advisor_file.save, path, calibration, self._advisor_device)
        except OSError as exc:  # the next server starts from its probe alone
            log.warning("cache.advisor_not_saved", path=str(path), error=str(exc))

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._apply(self._startup)
            self._startup = []
            self._announce_residency()
            if self._store is not None and self._config.ssd_demote_idle_s > 0:
                nursery.start_soon(self._demote_idle_forever)
            if self._watch is not None:
                nursery.start_soon(self._watch_shared_dir)
            if self._pins_file is not None:
                self._pins_changed = trio.Event()
                nursery.start_soon(self._save_pins_forever)
            task_status.started()
            async with self._inbox:
                async for msg in self._inbox:
                    await self._handle_safely(msg)
                    if self._may_move_pages():
                        self._apply(self.tiers.idle_moves())
                    self._note_pins(msg)
                    self._announce_residency()
                    self._report_shards()
            nursery.cancel_scope.cancel()

    async def _handle_safely(self, msg: CacheOwnerMessage) -> None:
        try:
            if isinstance(msg, LookupPrefix):
                await self._lookup(msg)
            else:
                self._handle(msg)
        except Exception as exc:  # one bad message fails its own reply, not the runtime
            log.exception("cache.handler_failed", message=type(msg).__name__)
            reply = getattr(msg, "reply", None)
            if reply is not None:
                reply.fail(exc)

    async def _lookup(self, msg: LookupPrefix) -> None:
        tiers = self.tiers
        lookup = tiers.lookup(msg.tokens, msg.namespace, session=msg.session, overlap=msg.overlap)
        cuts = tiers.pinned_cuts(msg.tokens, msg.namespace, lookup)
        if cuts:
            lookup = attrs.evolve(lookup, checkpoint_at=cuts)
        # A promotion's pages start back to the device before the reply lets the engine read them, and before
        # the demotions it caused start; then the budget: after the lookup, its hit is the most recently used.
        effects = tiers.take_effects()
        promotion = None
        for effect in effects:
            if isinstance(effect, Promote) and host_memory.separate_host_memory():
                issued = await self._promote(effect.entry.payload)
                promotion = issued if issued is not None else promotion
        self._apply([e for e in effects if not isinstance(e, Promote)])
        if promotion is not None:
            lookup = attrs.evolve(lookup, promotion=promotion)
        msg.reply.send(lookup)
        self._apply(tiers.check_budget())

    async def _promote(self, payload: Any) -> host_memory.Promotion | None:
        """Issue a lookup's promotion on a worker thread: its runtime calls can wait in the driver for another
        thread's migration (a promotion's prefetch waited 299 ms behind a demotion's on an H100, 2026-12-05),
        and on the event loop that stopped every request's stream; the reply still waits for the issue."""
        try:
            promotion = await trio.to_thread.run_sync(host_memory.promote, payload)
        except Exception as exc:  # (e.g. out of memory converting an array) its pages fault back instead
            log.warning("host_cache.promote_failed", error=repr(exc))
            self._copies.move_failures += 1
            return None
        c = self._copies
        c.promotions += 1
        c.promote_issue_ms_last = round(promotion.issue_s * 1000, 3)
        c.promoted_demotions_stopped += promotion.cancelled_demotion
        if self._nursery is not None and promotion.nbytes:
            self._nursery.start_soon(self._promotion_landed, promotion)
        return promotion

    def _handle(self, msg: CacheOwnerMessage) -> None:
        tiers = self.tiers
        if isinstance(msg, PrefetchHint):
            # rows in the engine's batch: its lookup will weigh no overlapped split (the scheduler's rule,
            # LookupPrefix.overlap), so neither does the read ahead (a tail it would not take)
            match = tiers.prefetch_match(msg.tokens, msg.namespace, overlap=not self._engine_busy)
            if match is not None and self._prefetcher is not None:
                try:  # a hint: dropped when the prefetcher is busy
                    self._prefetcher.send_nowait(PrefetchRecord(match.record, upto=match.read_tokens,
                                                                 start=match.read_from))
                except trio.WouldBlock:
                    pass
        elif isinstance(msg, PublishPrefix):
            self.published[msg.reason] += 1
            self._apply(
                tiers.publish(
                    msg.tokens, msg.namespace, payload=msg.payload, nbytes=msg.nbytes, trimmable=msg.trimmable,
                    plan=msg.plan, file_nbytes=None if msg.plan is None else msg.plan.nbytes, durable=msg.durable,
                    session=msg.session, pages=msg.pages,
                )
            )
            if msg.shard is not None and self._engine is not None:
                entry = tiers.ram.find_exact(msg.tokens, msg.namespace)
                stored = entry if entry is not None and entry.payload is msg.payload else None
                self._shards_left.extend(self._mirror.stored(msg.shard, stored))
        elif isinstance(msg, EntryDurable):
            self._apply(tiers.durable(msg.record))
        elif isinstance(msg, EntryNotPersisted):
            self._apply(tiers.not_persisted(msg.namespace, msg.tokens))
        elif isinstance(msg, RecordLost):
            self._apply(tiers.lost(msg.record))
        elif isinstance(msg, PrefillMeasured):
            tiers.advisor.observe_prefill(new_tokens=msg.new_tokens, context=msg.context, seconds=msg.seconds,
                                          whole=msg.whole, head=msg.head)
        elif isinstance(msg, RestoreMeasured) and not msg.taken:
            tiers.advisor.forget_restore()
        elif isinstance(msg, RestoreMeasured):
            tiers.advisor.observe_restore(nbytes=msg.nbytes, seconds=msg.seconds)
            self._count.restores += 1
            self._count.restore_ms_last = round(msg.seconds * 1000, 3)
        elif isinstance(msg, MemoryMeasured):
            self._apply(tiers.observe_memory(msg.active_bytes, peak_bytes=msg.peak_bytes,
                                             buffer_cache_bytes=msg.buffer_cache_bytes, pool=msg.pool))
        elif isinstance(msg, EngineBusy):
            self._engine_busy = msg.busy
        elif isinstance(msg, EncoderOutputs):
            self._encoder_outputs(msg)
        elif isinstance(msg, FindCheckpointTokens):
            msg.reply.send(tiers.checkpoint_tokens(msg.tokens, msg.namespace))
        elif isinstance(msg, CloseSession):
            msg.reply.send(tiers.close_session(msg.session))
        elif isinstance(msg, PinSession):
            if not tiers.pin_session(msg.session, msg.ttl_s):
                log.warning("cache.pin_refused", session=msg.session, ttl_s=msg.ttl_s)
        elif isinstance(msg, PinPrefix):
            if not tiers.pin_prefix(msg.session, msg.namespace, msg.tokens, msg.ttl_s):
                log.warning("cache.pin_refused", session=msg.session, tokens=len(msg.tokens), ttl_s=msg.ttl_s)
        elif isinstance(msg, FindSessionCheckpoint):
            msg.reply.send(tiers.session_checkpoint(msg.session, msg.namespace))
        elif isinstance(msg, AdoptCheckpoint):
            self._apply(tiers.adopt(msg.tokens, msg.namespace, payload=msg.payload, nbytes=msg.nbytes,
                                    trimmable=msg.trimmable, record=msg.record, session=msg.session))
            msg.reply.send(tiers.ram.find_exact(msg.tokens, msg.namespace) is not None)
        elif isinstance(msg, QueryCacheStats):
            msg.reply.send(self.stats())
        elif isinstance(msg, ReleaseRam):
            self._apply(tiers.free_for_rows(msg.nbytes))
            msg.reply.send(tiers.ram_room())
        elif isinstance(msg, FlushThrough):
            if self._durability is None:
                raise RuntimeError("no SSD tier to flush to")
            self._durability.send_nowait(msg.flush)

    def _encoder_outputs(self, msg: EncoderOutputs) -> None:
        """Vision encoder outputs are SSD records like checkpoints (vision/tensor_store.py): a new one is
        written through the coordinator (a flush waits for it), a reused one is the most recently used."""
        if self._durability is None or self._store is None or self._store.encoder_identity is None:
            return
        for digest in msg.used:
            self.tiers.touch_ssd(encoder_key(digest), ENCODER_NAMESPACE)
        for plan in msg.encoded:
            if self.tiers.ssd_fits(plan.nbytes):  # an output larger than the cap is a re-encode each time
                self._durability.send_nowait(
                    MarkDirty(ENCODER_NAMESPACE, encoder_key(plan.digest), plan, False, plan.nbytes))

    def _apply(self, effects: list[Effect]) -> None:
        """Carry out the core's effects (never blocking)."""
        for effect in effects:
            if isinstance(effect, Persist):
                if self._durability is None or effect.plan is None:
                    self._apply(self.tiers.not_persisted(effect.namespace, effect.tokens))
                    continue
                self._durability.send_nowait(
                    MarkDirty(effect.namespace, tuple(effect.tokens), effect.plan, effect.trimmable, effect.nbytes,
                              first=effect.first)
                )
            elif isinstance(effect, Forget):
                if self._durability is not None:
                    self._durability.send_nowait(ForgetDirty(effect.namespace, tuple(effect.tokens)))
            elif isinstance(effect, NotStored):
                log.warning("ssd.not_stored", tokens=len(effect.tokens), nbytes=effect.nbytes, reason=effect.reason)
                if self._durability is not None:
                    self._durability.send_nowait(MarkNotStored(effect.namespace, tuple(effect.tokens), effect.reason))
            elif isinstance(effect, Demote):
                self._start_demotion(effect)
            elif isinstance(effect, Promote):  # (only a lookup makes one, and issues it itself: `_lookup`)
                raise AssertionError("a promotion is issued by its lookup")
            elif isinstance(effect, Unlink):
                if self._store is None or self._nursery is None or effect.record.path is None:
                    continue
                if self._guard is None:
                    self._nursery.start_soon(
                        trio.to_thread.run_sync, self._store.unlink, effect.record, effect.garbage
                    )
                elif effect.record.path not in {r.path for r in self.tiers.ssd_records()}:
                    # Shared: only the collector deletes, and only files unused for the grace.
                    self._nursery.start_soon(trio.to_thread.run_sync, self._unlink_shared, effect)
        if self._governor is not None:
            self._governor.set_urgent("ram", self.tiers.ram_over_cap)
            self._governor.set_urgent("budget", self.tiers.budget_waiting)

    def _may_move_pages(self) -> bool:
        """Host-tier moves not forced by memory pressure go while no row decodes and no request waits for
        its first token (a migration beside either slows it; the next message after the change re-checks)."""
        prefilling = self._governor is not None and self._governor.prefilling
        return not self._engine_busy and not prefilling

    def _unlink_shared(self, effect: Unlink) -> None:
        """(I/O) The collector deletes a file or manifest, then the blocks it leaves that no
        manifest on disk names (another replica's manifests keep theirs)."""
        assert self._guard is not None and self._store is not None and effect.record.path is not None
        if self._guard.unlink(effect.record.path) and effect.garbage:
            self._store.blocks.collect(effect.garbage)

    def _start_demotion(self, effect: Demote) -> None:
        """A demotion: on CUDA the entry's pages migrate to host memory in bulk (runtime/host_memory.py);
        elsewhere nothing moves. (A promotion is issued by its lookup, `_lookup`, before the reply lets the
        engine read the prefix: a first forward pass that faults the pages back instead took 0.28 s on an H200,
        docs/benchmarks.md.) A demotion runs on a worker thread in pieces; unless device memory is needed now
        (`urgent`: admission) it holds still while rows decode, a request waits for its first token or a
        promotion lands, so a returning conversation's promotion, prefill and decode do not share the link
        with it. The core asks for a demotion only under memory pressure or while no row decodes (a migration
        beside decode cost that row 71-77% of its speed)."""
        if not host_memory.separate_host_memory():
            return
        payload = effect.entry.payload
        if self._nursery is not None:
            ticket = host_memory.begin_demotion(payload)
            hold = None if effect.urgent else self._idle_demotion_holds if effect.idle else self._demotion_holds
            self._nursery.start_soon(self._demote, payload, hold, ticket)

    def _demotion_holds(self) -> bool:
        """(any thread) A request waits for its first token: a demotion not urgent holds still."""
        return self._governor is not None and self._governor.prefilling

    def _idle_demotion_holds(self) -> bool:
        """(any thread) An idle move also holds still while rows decode. It was issued while the engine was
        idle, but the next request often comes before it ends (the next decode right after a prompt): the
        rest of the move waits, as its issue would have, up to the demotion's hold limit (H200: 7.5 GB/s to
        the host, so one 8k-token checkpoint of the 1.7B shape is 125 ms of migration, and a migration beside
        decode cost that row 71-77% of its speed). The budget's moves do not wait for decode: it wants the room."""
        return self._engine_busy or self._demotion_holds()

    async def _demote(self, payload: Any, hold: Callable[[], bool] | None, ticket: Any) -> None:
        try:
            done = await trio.to_thread.run_sync(partial(host_memory.demote, payload, hold=hold, ticket=ticket),
                                                 limiter=self._demote_threads)
        except Exception as exc:  # (e.g. out of memory converting an array) its pages stay where they are
            log.warning("host_cache.demote_failed", error=repr(exc))
            self._copies.move_failures += 1
            return
        finally:  # cancelled before its worker ran (the actor stopped): registered no longer
            host_memory.end_demotion(payload, ticket)
        c = self._copies
        c.demotions += 1
        c.demoted_bytes += done.nbytes
        c.demote_pieces += done.pieces
        c.demote_holds += done.holds
        c.demote_held_s = round(c.demote_held_s + done.held_s, 4)
        c.demotions_stopped += done.cancelled
        if done.nbytes and done.seconds > 0:
            c.demote_gb_s_last = round(done.nbytes / done.seconds / 1e9, 3)
        c.demote_ranges_ms_max = max(c.demote_ranges_ms_max, round(done.ranges_s * 1e3, 3))
        c.demote_convert_ms_max = max(c.demote_convert_ms_max, round(done.convert_max_s * 1e3, 3))

    async def _promotion_landed(self, promotion: host_memory.Promotion) -> None:
        await trio.to_thread.run_sync(promotion.wait)
        c = self._copies
        c.promote_landed_ms_last = round((promotion.landed_s or 0.0) * 1000, 3)
        rate = promotion.bytes_per_s
        c.promote_gb_s_last = round(rate / 1e9, 3) if rate else None

    async def _watch_shared_dir(self) -> None:
        """Index the files other replicas publish; forget the ones they delete."""
        assert self._watch is not None
        while True:
            await trio.sleep(self._config.ssd_rescan_s)
            changes = await trio.to_thread.run_sync(self._watch.poll)  # (our own files it skips)
            indexed = {r.path: r for r in self.tiers.ssd_records()}
            found = [r for r in changes.found if r.path not in indexed]
            if found:
                self._count.discovered += len(found)
                self._apply(self.tiers.load_records(found))
            for path in changes.gone:
                record = indexed.get(path)
                if record is not None:
                    self._count.vanished += 1
                    self._apply(self.tiers.lost(record))
            if self._guard is not None and self._guard.pending:
                # Deletions refused under the grace: the cap must hold on disk too. The files indexed
                # again are dropped here, with the index as it is now (an eviction refused while the
                # worker thread runs must stay pending).
                self._guard.forget_indexed({r.path for r in self.tiers.ssd_records()}.__contains__)
                deleted = await trio.to_thread.run_sync(self._guard.retry)
                if deleted and self._store is not None and self._store.blocks.blocks_dir.is_dir():
                    # Manifests among them: their blocks that no manifest on disk names go too.
                    await trio.to_thread.run_sync(self._store.blocks.collect)
            self._announce_residency()

    def _note_pins(self, msg: CacheOwnerMessage) -> None:
        """Wake the pin saver when the pins to persist changed (only messages that can change them are
        compared; an expiry needs no write: expired pins are dropped at load)."""
        if self._pins_changed is None or not isinstance(msg, PinSession | PinPrefix | CloseSession
                                                            | PublishPrefix | AdoptCheckpoint):
            return
        if isinstance(msg, PublishPrefix | AdoptCheckpoint) and not self.tiers.holds_pin(msg.session):
            return
        state = self.tiers.pin_state()
        if state != self._pins_state:
            self._pins_state = state
            self._pins_changed.set()

    async def _save_pins_forever(self) -> None:
        """Write the live pins whenever they change (a worker thread; one write at a time, the latest set);
        a change not yet written when the actor stops is written then (shielded, time-boxed)."""
        assert self._pins_changed is not None
        try:
            while True:
                await self._pins_changed.wait()
                self._pins_changed = trio.Event()
                await self._save_pins()
        finally:
            if self._pins_changed.is_set():
                with trio.move_on_after(5.0, shield=True):
                    await self._save_pins()

    async def _save_pins(self) -> None:
        assert self._pins_file is not None
        pins = self.tiers.pin_set(time.time())
        try:
            await trio.to_thread.run_sync(pin_file.save, self._pins_file, pins)
        except OSError as exc:  # the pins stay in RAM: a full disk costs them the restart only
            log.warning("cache.pins_not_saved", path=str(self._pins_file), error=str(exc))

    async def _demote_idle_forever(self) -> None:
        idle = self._config.ssd_demote_idle_s
        while True:
            await trio.sleep(min(idle / 4, 5.0))
            self._apply(self.tiers.demote_idle())
            self._announce_residency()

    def _host_stats(self, tiers: TierStats) -> dict[str, object] | None:
        if tiers.host is not None:
            return {"enabled": True, **attrs.asdict(tiers.host), "copies": attrs.asdict(self._copies)}
        if self._host_noop is not None:
            return {"enabled": False, "requested_bytes": self._config.host_cache_bytes, "reason": self._host_noop}
        return None

    def stats(self) -> CacheStatsSnapshot:
        tiers = self.tiers.stats()
        encoder = [r.nbytes for r in self.tiers.ssd_records() if r.namespace == ENCODER_NAMESPACE]
        return CacheStatsSnapshot(
            encoder_files=len(encoder),
            encoder_bytes=sum(encoder),
            tiers=tiers,
            published=dict(self.published),
            restores=self._count.restores,
            restore_ms_last=self._count.restore_ms_last,
            corrupt_removed=self._count.corrupt_removed + tiers.lost_files - self._count.vanished,
            host=self._host_stats(tiers),
            shared=None if self._guard is None else {
                "collector": self._guard.is_collector,
                "discovered": self._count.discovered,
                "vanished": self._count.vanished,
                "deletions_refused": self._guard.refused,
                "deletions_retried": self._guard.retried,
                "deletions_pending": self._guard.pending,
            },
        )
