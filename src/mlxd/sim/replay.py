"""The `mlxd` cache model: replay a trace through the serving cache core in virtual time.

Both tiers and every decision between them are the serving code itself:
`mlxd.kv.tiers.CacheTiers` (RAM `PromptCache`, SSD index, persist-before-
demotion, supersession, SSD cap, restore-or-recompute) and the write-behind
order of `mlxd.kv.write_queue.WriteQueue`. Only the engine and the SSD writer
are simulated, with costs from a `CostModel` charged as `trio.sleep` on a
`trio.testing.MockClock`: an hour of trace replays in seconds and a run is
deterministic.

The simulated engine publishes what the serving engine publishes: a restored
SSD record (durable), the prompt-boundary snapshot (the prompt minus its last
token, when at least `snapshot_min_tokens` new tokens were prefilled) and the
final checkpoint (prompt + generated ids; the prompt alone when the trace did
not record the ids). The simulated writer writes dirty records one at a time
in the queue's order and reports each commit back to the core, as the serving
SSD writer does. A recorded flush (`mlxd serve --record-trace`) is a barrier:
requests that arrived before it finish, then every pending write commits.

A restart (`restarts`) is a flush followed by a new process: RAM and the host
tier empty, the SSD index read back from its records, and a fresh restore
advisor that resumes what the last one measured (served restores; as a server
resumes its predecessor's calibration file). Each simulated restore is
reported to the advisor as the engine reports a served one, so a restart
before any restore sees the same exploratory restore a server does, then
decisions by measured cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import numpy as np
import trio
import trio.testing

from mlxd.kv.admission import Admit, KvAdmission, Refuse
from mlxd.kv.blocks import BlockRef, SharedStarts, model_blocks
from mlxd.kv.cost_model import BLOCK_TOKENS, CostModel
from mlxd.kv.host_tier import HostTier
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ram_pages import PageRef, model_pages
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.retention import CostPolicy, RetentionPolicy, make_policy
from mlxd.kv.tiers import (
    IMPLICIT_PIN_SESSION,
    CacheTiers,
    Effect,
    Forget,
    NotStored,
    Persist,
    SsdMatch,
    SsdRecord,
    Unlink,
)
from mlxd.kv.write_queue import WriteQueue
from mlxd.sim.results import RunResult, Tally
from mlxd.sim.trace import TraceRequest, block_tokens, half_block_tokens

UNLIMITED_BYTES = 2**62
OnRequest = Callable[[TraceRequest, int, str], None]  # (request, hit tokens, source)


class TokenSynth:
    """Token-level prompts: the trace's own tokens, or 512 ids per Mooncake block."""

    granularity = "token"

    def prompt(self, r: TraceRequest):
        if r.tokens is not None:
            return r.tokens
        return block_tokens(r.block_ids(), r.input_length)

    def hit_tokens(self, r: TraceRequest, usable: int) -> int:
        return usable


class BlockSynth:
    """Block-granular prompts for Mooncake traces: two synthetic tokens (2h, 2h+1) per block.

    Exact for Mooncake's block structure (checked by `check_block_structure`):
    prompts that share k leading ids share exactly 2k synthetic tokens and k*512
    real ones, and a partial block always has its own id. The one case the
    half-block encoding must translate is the cap at len(prompt) - 1: a prompt
    fully covered by an entry gets usable 2n - 1 here and input_length - 1 at
    token level. Entry bytes are those of the real token count, and the cost
    policy is given the real token count, so eviction order is unchanged.
    The prefix index then holds 2 tokens per block instead of 512.
    """

    granularity = "block"

    def prompt(self, r: TraceRequest):
        return half_block_tokens(r.block_ids())

    def hit_tokens(self, r: TraceRequest, usable: int) -> int:
        if usable == 2 * len(r.block_ids()) - 1:
            return r.input_length - 1
        return (usable // 2) * BLOCK_TOKENS


def make_retention(name: str, cost: CostModel) -> RetentionPolicy:
    """The serving policy by name; `cost` counts real tokens (entry bytes / bytes per token)."""
    if name == "cost":
        return CostPolicy(cost=lambda e: e.nbytes / cost.kv_bytes_per_token)
    return make_policy(name)


def seed_trio_scheduler(seed: int) -> None:
    """Make trio's tie-breaking among simultaneously runnable tasks reproducible.

    trio shuffles each batch of runnable tasks with a module-level Random; its
    own Hypothesis integration seeds that same object.
    """
    import trio._core._run as run  # noqa: PLC0415 (private, so kept local)

    rng = getattr(run, "_r", None)
    if rng is not None:
        rng.seed(seed)


_GOLDEN = 0.6180339887498949  # spreads successive quantiles evenly (a low-discrepancy sequence)

@attrs.define
class MlxdReplay:
    """One replay run of the serving cache core against a trace."""

    reqs: Sequence[TraceRequest]
    cost: CostModel
    tiers: CacheTiers
    synth: TokenSynth | BlockSynth
    slots: int = 4
    snapshot_min_tokens: int = 256
    flushes: Sequence[float] = ()
    calibrations: Sequence[dict | None] = ()  # the recorded advisor state at each flush
    restarts: Sequence[float] = ()  # times the server restarts on its SSD tier (after a flush)
    # A restarted server's tiers from the SSD records it finds (set by `replay_mlxd`; None: no restarts)
    fresh_tiers: Callable[[Sequence[SsdRecord]], CacheTiers] | None = None
    on_request: OnRequest | None = None
    sessions: bool = True  # honour the trace's session field (the session index, seed §5.12)
    ssd_layout: str = "whole"  # or "blocks": content-addressed blocks, as `--ssd-layout blocks` serves
    ssd_block_tokens: int = 1024  # real tokens per block
    kv_admission: KvAdmission | None = None  # --kv-admission: the scheduler's rule, on the cost model's KV bytes
    ram_pages: bool = False  # --ram-pages on: RAM entries as shared pages (kv/ram_pages.py), counted once
    ram_page_tokens: int = 1024  # real tokens per page
    calibrate_timing: bool = False  # scale prefill/restore timings by the recorded calibration (a recording's model)
    # One engine: rows prefilling at once share its time (processor sharing), as one MLX thread runs
    # every row's chunks in turn; False = each slot prefills at full speed (independent slots).
    shared_prefill: bool = False
    # The first N requests of each tier are replayed but left out of its TTFT percentiles (a recording's
    # first-use costs: compiling, the allocator growing, the first restore), as the fit leaves them out.
    ttft_warmup: int = 0
    tally: Tally = attrs.Factory(Tally)
    _clock: trio.testing.MockClock = attrs.field(
        factory=lambda: trio.testing.MockClock(autojump_threshold=0)
    )
    _queue: WriteQueue = attrs.field(init=False, factory=WriteQueue)
    _dirty: trio.Event = attrs.field(init=False, factory=trio.Event)
    _idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    _running: int = attrs.field(init=False, default=0)
    _in_engine: int = attrs.field(init=False, default=0)  # rows the engine holds: no overlapped split for the others
    _quiet: trio.Event = attrs.field(init=False, factory=trio.Event)
    _starts: SharedStarts = attrs.field(init=False, factory=SharedStarts)  # as the block store's hint
    _kv_room: trio.Event = attrs.field(init=False, factory=trio.Event)
    # The recorded server's own timings at its last flush (a recording's calibration), or the cost model's.
    _prefill_scale: float = attrs.field(init=False, default=1.0)
    _restore_bytes_per_s: float = attrs.field(init=False, default=0.0)
    _head_scale: float | None = attrs.field(init=False, default=None)  # an overlapped split's head (None: the prefill's)
    _held_until: float = attrs.field(init=False, default=0.0)  # when the last flush barrier let arrivals in
    _engine_rows: int = attrs.field(init=False, default=0)  # rows prefilling now (shared_prefill)
    _engine_changed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _spread_drawn: dict[str, int] = attrs.field(init=False, factory=dict)  # requests per tier that took a spread
    _served_by: dict[str, int] = attrs.field(init=False, factory=dict)  # requests per tier so far (ttft_warmup)
    advisors: list[RestoreAdvisor] = attrs.field(init=False, factory=list)  # one per process, the last live

    def now(self) -> float:
        return self._clock.current_time()

    async def main(self) -> None:
        send, recv = trio.open_memory_channel[TraceRequest | int | _Restart](math.inf)  # the admission queue
        slots = trio.Semaphore(self.slots)
        self._quiet.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer)
            if self.tiers.ssd and self.tiers.demote_idle_s > 0:
                nursery.start_soon(self._demote_idle)
            nursery.start_soon(self._arrivals, send)
            async with recv:
                async for r in recv:  # first come, first served
                    if isinstance(r, _Restart):  # everything admitted finishes and is written, then a new process
                        await self._barrier()
                        self._restart()
                        self._held_until = self.now()
                        continue
                    if isinstance(r, int):  # flush number r: everything admitted so far finishes
                        await self._barrier()
                        self._calibrate(r)
                        self._held_until = self.now()
                        continue
                    # A request held back by a barrier that ran longer than recorded arrives when it ends
                    # (its client was waiting on the flush): its queue and TTFT count from then.
                    arrived = max(r.t, self._held_until)
                    await slots.acquire()
                    if self.kv_admission is not None and not await self._admit_kv(r):
                        slots.release()
                        continue
                    self._running += 1
                    self._quiet = trio.Event()
                    nursery.start_soon(self._serve, r, slots, arrived)
            await self._barrier()
            nursery.cancel_scope.cancel()

    async def _admit_kv(self, r: TraceRequest) -> bool:
        """As the scheduler: wait at the head of the queue until the request's KV fits; False = refused."""
        kv = self.kv_admission
        assert kv is not None
        waited = False
        while True:
            room = self._kv_room
            decision = kv.decide(r.input_length, r.output_tokens)
            if isinstance(decision, Admit):
                kv.admit(str(r.index), decision.nbytes, waited=waited, prefill_bytes=kv.prefill_bytes(r.input_length))
                self.tally.kv_waited += int(waited)
                self.tally.kv_peak_reserved_bytes = kv.peak_reserved_bytes
                return True
            if isinstance(decision, Refuse):
                self.tally.kv_refused += 1
                return False
            waited = True
            await room.wait()

    def _calibrate(self, flush: int) -> None:
        """Take the restore advisor's calibration the recorded server had at this flush."""
        cal = self.calibrations[flush] if flush < len(self.calibrations) else None
        if cal:
            advisor = self.tiers.advisor
            advisor.prefill_scale = float(cal.get("prefill_scale", advisor.prefill_scale))
            advisor.restore_bytes_per_s = float(cal.get("restore_bytes_per_s", advisor.restore_bytes_per_s))
            if cal.get("page_cache_bytes_per_s") is not None:  # what it charged a page-cache byte (`resident`)
                advisor.resident_bytes_per_s = float(cal["page_cache_bytes_per_s"])
            if cal.get("overlap_head_samples"):  # what it charged an overlapped split's head
                advisor.head_scale = float(cal["overlap_head_scale"])
                advisor.head_samples = int(cal["overlap_head_samples"])
            advisor.always = bool(cal.get("always", advisor.always))  # --restore-choice always
            advisor.split = bool(cal.get("split", advisor.split))  # --restore-choice split
            advisor.never = bool(cal.get("never", advisor.never))  # --restore-choice never
            advisor.overlap = bool(cal.get("overlap", advisor.overlap))  # --restore-choice overlap
            # The timings too: the server measured its prefill against the same base model (TTFT).
            if self.calibrate_timing and "prefill_scale" in cal:
                self._prefill_scale = float(cal["prefill_scale"])
            if self.calibrate_timing and "restore_bytes_per_s" in cal:
                self._restore_bytes_per_s = float(cal["restore_bytes_per_s"])
            if self.calibrate_timing and cal.get("overlap_head_samples"):
                self._head_scale = float(cal["overlap_head_scale"])

    def _restart(self) -> None:
        """The server restarts on its SSD files: RAM, host tier and sessions gone, a fresh advisor."""
        if self.fresh_tiers is None:
            raise ValueError("this replay cannot restart (no fresh_tiers)")
        if not self.advisors:
            self.advisors.append(self.tiers.advisor)
        measured = self.tiers.advisor.calibration()
        self.tiers = self.fresh_tiers(self.tiers.ssd_records())
        self.tiers.advisor.resume(measured)  # as a server resumes its predecessor's file (kv/advisor_file.py)
        self.advisors.append(self.tiers.advisor)
        self.tally.restarts += 1

    async def _arrivals(self, send: trio.MemorySendChannel[TraceRequest | int | _Restart]) -> None:
        events: list[tuple[float, int, TraceRequest | int | _Restart]] = sorted(
            [(r.t, 1, r) for r in self.reqs] + [(t, 0, i) for i, t in enumerate(self.flushes)]
            + [(t, 0, _Restart()) for t in self.restarts],
            key=lambda e: (e[0], e[1]),
        )
        async with send:
            for t, _, r in events:
                await trio.sleep_until(max(t, self.now()))
                send.send_nowait(r)

    async def _barrier(self) -> None:
        """Wait for every admitted request, then for every pending write (a flush)."""
        await self._quiet.wait()
        while self._queue.pending():
            self._idle = trio.Event()
            await self._idle.wait()

    async def _serve(self, r: TraceRequest, slots: trio.Semaphore, arrived: float | None = None) -> None:
        arrived = r.t if arrived is None else arrived
        in_engine = False
        try:
            start = self.now()
            prompt = self.synth.prompt(r)
            real = partial(self.synth.hit_tokens, r)
            session = r.session if self.sessions else None
            if r.pin_s > 0:  # as the HTTP layer: a pin without a session gets a made-up one
                session = session or f"{IMPLICIT_PIN_SESSION}{r.index}"
                self.tiers.pin_session(session, r.pin_s)
            # The page cache is not simulated: a recorded request weighs the bytes the server found in it
            # (none recorded: every byte a disk read, as before recordings carried them)
            self.tiers.residency = None if r.resident is None else (lambda record, bytes_=r.resident: bytes_)
            lookup = self.tiers.lookup(
                prompt, r.namespace, model_tokens=lambda n: real(n) if n < len(prompt) else r.input_length,
                session=session, overlap=self._in_engine == 0,  # as the scheduler asks
            )
            restore_s, restored, head, head_s = 0.0, 0, 0, 0.0
            if lookup.restore is None or lookup.restore.read_from:  # as the scheduler: the row goes to the engine
                self._in_engine, in_engine = self._in_engine + 1, True  # now (an overlap's tail is read meanwhile)
            if lookup.restore is not None:
                hit, source = real(lookup.restore.usable), "ssd"
                restore_s, restored = self._restore(lookup.restore, r.namespace)
                if lookup.restore.read_from:  # an overlapped split: the head recomputed while the tail is read
                    warm = real(lookup.hit.usable) if lookup.hit is not None else 0
                    head = real(lookup.restore.read_from) - warm  # prefilled: not a hit in the server's usage
                    scale = self._prefill_scale if self._head_scale is None else self._head_scale
                    head_s = scale * self.cost.prefill_seconds(head, warm)
            elif lookup.hit is not None and lookup.promoted:  # back from the host tier: one bulk copy
                hit, source = real(lookup.hit.usable), "host"
                restore_s = self.cost.host_seconds(lookup.hit.entry.nbytes)
            elif lookup.hit is not None:
                hit, source = real(lookup.hit.usable), "ram"
            else:
                hit, source = 0, "miss"
            admitted_s = self.cost.admission_s.get(source, 0.0)  # the server's own work before its start
            await trio.sleep(admitted_s)
            spread = self._spread(source)
            restore_s *= spread
            if restored:  # as the engine's RestoreMeasured: the advisor calibrates on it
                self.tiers.advisor.observe_restore(nbytes=restored, seconds=restore_s)
            restore_s = max(restore_s, spread * head_s)
            await trio.sleep(restore_s)
            if not in_engine:  # a restore read whole (or a split's leading part) went to the engine only now
                self._in_engine, in_engine = self._in_engine + 1, True
            prefill_s = spread * self._prefill_scale * self.cost.prefill_seconds(r.input_length - hit, hit)
            if self.shared_prefill:
                began = self.now()
                await self._engine_work(prefill_s)
                prefill_s = self.now() - began  # what the request waited for its prefill
            else:
                await trio.sleep(prefill_s)
            if self.kv_admission is not None and self.kv_admission.prefilled(str(r.index)):
                room, self._kv_room = self._kv_room, trio.Event()  # its prefill's working memory is free again
                room.set()
            threshold = 1 if session is not None else max(1, self.snapshot_min_tokens)  # as the engine
            if r.input_length - hit - 1 >= threshold:
                self._publish(prompt[:-1], r.namespace, r.input_length - 1, session)
            self.tally.add_request(r.input_length, hit - head, source=source)
            if self.on_request is not None:
                self.on_request(r, hit - head, source)
            await trio.sleep(self.cost.decode_seconds(r.output_tokens, r.input_length))
            nth = self._served_by[source] = self._served_by.get(source, 0) + 1
            self.tally.add_timing(
                queue=start + admitted_s - arrived, ttft=start + admitted_s + restore_s + prefill_s - arrived, end=self.now(),
                source=source if nth > self.ttft_warmup else None,
            )
            if r.output_ids:
                full = np.concatenate([np.asarray(prompt, np.int32), np.asarray(r.output_ids, np.int32)])
                self._publish(full, r.namespace, len(full), session)
            else:  # the generated ids are unknown: the prompt stands in for prompt + generation
                self._publish(prompt, r.namespace, r.input_length, session)
        finally:
            if in_engine:
                self._in_engine -= 1
            if self.kv_admission is not None:
                self.kv_admission.release(str(r.index))
                room, self._kv_room = self._kv_room, trio.Event()
                room.set()
            slots.release()
            self._running -= 1
            if self._running == 0:
                self._quiet.set()
                self._apply(self.tiers.idle_moves())  # as the cache owner: host-tier moves once no row decodes

    async def _engine_work(self, seconds: float) -> None:
        """Take `seconds` of engine time, shared equally with the rows prefilling meanwhile."""
        if seconds <= 0:
            return
        left = seconds
        self._engine_rows += 1
        self._engine_changed.set()  # the others now progress more slowly
        self._engine_changed = trio.Event()
        try:
            while left > 1e-9 * seconds:
                rows, changed, began = self._engine_rows, self._engine_changed, self.now()
                with trio.move_on_after(left * rows):
                    await changed.wait()
                left -= (self.now() - began) / rows
        finally:
            self._engine_rows -= 1
            self._engine_changed.set()
            self._engine_changed = trio.Event()

    def _spread(self, source: str) -> float:
        """The next request of this tier's factor from the cost model's recorded spread (1 without one).

        The k-th request of a tier takes the spread's quantile at (0.5 + k * golden ratio) mod 1: the
        first the median, then quantiles as evenly spread as a few requests allow (no random draw,
        whose luck would move a small tier's percentiles). A tier with its own spread (`tier_ratios`)
        takes that one.
        """
        ratios = self.cost.tier_ratios.get(source) or self.cost.service_ratios
        if not ratios:
            return 1.0
        k = self._spread_drawn.get(source, 0)
        self._spread_drawn[source] = k + 1
        return float(np.quantile(ratios, (0.5 + k * _GOLDEN) % 1.0))

    def _restore(self, match: SsdMatch, namespace: str) -> tuple[float, int]:
        """Read an SSD record back (a split: its leading blocks; an overlapped split: its tail) and publish
        it in RAM (durable): (seconds, bytes read)."""
        record = match.record
        tokens, nbytes = record.tokens, record.nbytes
        held = nbytes  # what the published prefix holds
        if match.read_from:  # as the engine's overlapped split: the tail's blocks read, the usable prefix published
            end = match.read_tokens or len(record.tokens)
            tokens = record.tokens[: match.usable]
            nbytes = sum(b.nbytes for b in record.blocks if not b.state and match.read_from <= b.start < end)
            held = sum(b.nbytes for b in record.blocks if not b.state and b.start < match.usable)
        elif match.read_tokens:  # as BlockStore.load(upto=...): the checkpoint of the leading blocks
            tokens = record.tokens[: match.read_tokens]
            nbytes = held = sum(b.nbytes for b in record.blocks if not b.state and b.end <= match.read_tokens)
        self.tally.ssd_bytes_read += nbytes
        self._apply(
            self.tiers.publish(tokens, namespace, payload=None, nbytes=held, trimmable=record.trimmable, durable=True,
                               pages=self._pages(tokens, namespace))
        )
        self._count_ram()
        if self._restore_bytes_per_s > 0:  # the server's measured restore bandwidth
            return self.cost.restore_fixed + nbytes / self._restore_bytes_per_s, nbytes
        return self.cost.restore_seconds(nbytes), nbytes

    def _publish(self, tokens, namespace: str, num_tokens: int, session: str | None = None) -> None:
        self._apply(
            self.tiers.publish(
                tokens, namespace, payload=None, nbytes=self.cost.kv_bytes(num_tokens), trimmable=True,
                session=session, pages=self._pages(tokens, namespace),
            )
        )
        self._count_ram()

    def _pages(self, tokens, namespace: str) -> tuple[PageRef, ...]:
        """--ram-pages on: the pages the engine would cut this checkpoint into, given the pages RAM holds."""
        if not self.ram_pages:
            return ()
        real = 1 if self.synth.granularity == "token" else BLOCK_TOKENS // 2
        return model_pages(
            [int(t) for t in tokens], namespace=namespace, fingerprint="sim", page_tokens=max(1, self.ram_page_tokens // real),
            bytes_per_token=self.cost.kv_bytes(real), held=self.tiers.ram.pages,
        )

    def _count_ram(self) -> None:
        """The RAM tier's high-water mark (pages counted once)."""
        ram = self.tiers.ram
        self.tally.ram_bytes_peak = max(self.tally.ram_bytes_peak, ram.bytes)

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Persist):
                self._queue.mark(
                    effect.namespace, effect.tokens, plan=None, trimmable=effect.trimmable, nbytes=effect.nbytes,
                    first=effect.first,
                )
                self._dirty.set()
            elif isinstance(effect, Forget):
                self._queue.forget(effect.namespace, effect.tokens)
            elif isinstance(effect, Unlink):
                self._starts.discard(effect.garbage)  # the block store collects them: no hint is left
            elif isinstance(effect, NotStored):
                pass  # nothing to write: the core already counted it

    async def _writer(self) -> None:
        """The SSD writer: one dirty record at a time, in the queue's order."""
        while True:
            job = self._queue.next_job()
            if job is None:
                self._idle.set()
                self._dirty = trio.Event()
                await self._dirty.wait()
                continue
            record = job.record
            blocks = self._blocks(record.tokens, record.namespace) if self.ssd_layout == "blocks" else ()
            written = self._new_bytes(blocks) if blocks else record.nbytes
            await trio.sleep(self.cost.restore_seconds(written))  # write at read bandwidth
            self._queue.written(job.key, job.version, stored=True)
            self.tally.ssd_bytes_written += written
            stored = SsdRecord(
                record.namespace, record.tokens, record.nbytes, self.now(), record.trimmable, None, blocks
            )
            self._starts.add([int(t) for t in record.tokens], blocks)
            self._apply(self.tiers.durable(stored))

    def _blocks(self, tokens, namespace: str) -> tuple[BlockRef, ...]:
        """The blocks the block store would write for `tokens`, given what the tier holds.

        Block-granular prompts (Mooncake) carry two index tokens per 512 real
        ones, so a span and the bytes per index token scale by 256; a trace's
        final partial block is counted as full there.
        """
        real = 1 if self.synth.granularity == "token" else BLOCK_TOKENS // 2
        return model_blocks(
            [int(t) for t in tokens], namespace=namespace, fingerprint="sim", stored=self.tiers.ssd_has_block,
            bytes_per_token=self.cost.kv_bytes(real), block_tokens=max(1, self.ssd_block_tokens // real),
            starts=self._starts,
        )

    def _new_bytes(self, blocks: tuple[BlockRef, ...]) -> int:
        return sum({b.name: b.nbytes for b in blocks if not self.tiers.ssd_has_block(b.name)}.values())

    async def _demote_idle(self) -> None:
        idle = self.tiers.demote_idle_s
        while True:
            await trio.sleep(min(idle / 4, 5.0))
            self._apply(self.tiers.demote_idle())

    def run(self, *, seed: int = 0) -> Tally:
        seed_trio_scheduler(seed)
        trio.run(self.main, clock=self._clock)
        stats = self.tiers.stats()
        if self.tiers.ssd:
            self.tally.evictions = stats.dropped_unpersisted
            self.tally.demotions = stats.demotions
            self.tally.ssd_evictions = stats.ssd_evictions
            self.tally.ssd_bytes_retained = stats.ssd_bytes
        else:
            self.tally.evictions = stats.ram.evictions
        if stats.sessions is not None:
            self.tally.session_hits = stats.sessions.hits
            self.tally.session_fallbacks = stats.sessions.fallbacks
        self.tally.ram_bytes_retained = stats.ram.bytes
        self.tally.ram_checkpoint_bytes = stats.ram.checkpoint_bytes
        return self.tally


def replay_mlxd(
    reqs: Sequence[TraceRequest],
    *,
    policy: str,
    cost: CostModel,
    ram_bytes: int | None,
    ssd_bytes: int | None = None,
    ssd: bool = False,
    granularity: str = "auto",
    slots: int = 4,
    seed: int = 0,
    snapshot_min_tokens: int = 256,
    demote_idle_s: float = 0.0,
    flushes: Sequence[float] = (),
    calibrations: Sequence[dict | None] = (),
    on_request: OnRequest | None = None,
    sessions: bool = True,
    ssd_layout: str = "whole",
    ssd_block_tokens: int = 1024,
    advisor_base: CostModel | None = None,
    host_bytes: int | None = None,
    kv_admission_bytes: int = 0,
    kv_admission_rule: dict | None = None,
    restore_choice: str = "measured",
    restore_overlap: bool = True,
    restarts: Sequence[float] = (),
    ram_pages: bool = False,
    ram_page_tokens: int = 1024,
    calibrate_timing: bool = False,
    shared_prefill: bool = False,
    ttft_warmup: int = 0,
) -> RunResult:
    """One run of the `mlxd` cache model. `ram_bytes` None = unlimited; `ssd` enables the tier
    (`ssd_bytes` None = unlimited). `advisor_base`: the cost model the recorded server's
    restore advisor started from (its startup probe), when it was not `cost`; `restore_choice`
    its --restore-choice (measured, always, never, split, overlap), `restore_overlap` its --restore-overlap.
    `calibrate_timing`: `cost` is the recorded server's
    probe model, so the calibration recorded at each flush scales its prefill and restore timings too.
    `restarts`: times the server restarts on its SSD tier (`MlxdReplay.restarts`). `ttft_warmup`: the first N
    requests of each tier are left out of its TTFT percentiles (`MlxdReplay.ttft_warmup`)."""
    mooncake = all(r.hash_ids is not None for r in reqs)
    use_blocks = granularity == "block" or (granularity == "auto" and mooncake)
    if use_blocks and not mooncake:
        raise ValueError("block granularity needs a Mooncake trace (hash_ids)")
    def fresh(records: Sequence[SsdRecord] = ()) -> CacheTiers:
        """A server's tiers at start: empty RAM (and host tier), the SSD records it found, a fresh advisor."""
        cache = PromptCache(max_bytes=UNLIMITED_BYTES if ram_bytes is None else ram_bytes,
                            policy=make_retention(policy, cost), clock=lambda: replay.now())
        tiers = CacheTiers(
            cache, ssd=ssd, ssd_max_bytes=ssd_bytes or 0,
            advisor=RestoreAdvisor.for_choice(restore_choice, advisor_base or cost, overlap=restore_overlap),
            demote_idle_s=demote_idle_s,
        )
        if host_bytes:  # the host-memory tier between RAM and SSD (--host-cache-gb)
            tiers.host = HostTier(max_bytes=host_bytes, clock=lambda: replay.now())
        if records:
            replay._apply(tiers.load_records(records))
        return tiers

    tiers = fresh()
    replay = MlxdReplay(
        reqs,
        cost,
        tiers,
        BlockSynth() if use_blocks else TokenSynth(),
        slots=slots,
        snapshot_min_tokens=snapshot_min_tokens,
        flushes=flushes,
        calibrations=calibrations,
        restarts=restarts,
        fresh_tiers=fresh,
        on_request=on_request,
        sessions=sessions,
        ssd_layout=ssd_layout,
        ssd_block_tokens=ssd_block_tokens,
        # The budget's room for rows' KV (weights are not modeled): the scheduler's rule per request;
        # a recorded server's own rule (`kv_admission_rule`, KvAdmission.rule) with its room unless overridden.
        kv_admission=_kv_admission(kv_admission_bytes, kv_admission_rule, cost),
        ram_pages=ram_pages,
        ram_page_tokens=ram_page_tokens,
        calibrate_timing=calibrate_timing,
        shared_prefill=shared_prefill,
        ttft_warmup=ttft_warmup,
    )
    if replay.kv_admission is not None:
        replay.tally.kv_admission = True
        replay.tally.kv_waited_recorded = sum(r.kv_waited for r in reqs)
    started = time.perf_counter()
    tally = replay.run(seed=seed)
    block_bytes = cost.kv_bytes(BLOCK_TOKENS)
    return tally.result(
        cache_model="mlxd",
        policy=policy,
        capacity_blocks=None if ram_bytes is None else ram_bytes // block_bytes,
        capacity_bytes=ram_bytes,
        ssd_capacity_bytes=ssd_bytes if ssd else None,
        wall_s=time.perf_counter() - started,
        ssd_layout=ssd_layout if ssd else "whole",
        host_capacity_bytes=host_bytes or None,
        restore_decisions=_decisions(replay.advisors or [replay.tiers.advisor]),
        ram_pages=ram_pages,
    )


@attrs.frozen
class _Restart:
    """The server restarts here (an admission-queue event, like a flush's number)."""


def _decisions(advisors: Sequence[RestoreAdvisor]) -> dict[str, float]:
    """The restore advisors' stats over every process of a replay: choices summed, the rest the last one's."""
    out = dict(advisors[-1].stats())
    for key in ("restores_chosen", "recomputes_chosen", "splits_chosen", "overlaps_chosen", "explorations",
                "recompute_tries"):
        out[key] = sum(a.stats()[key] for a in advisors)
    return out


def _kv_admission(room_bytes: int, rule: dict | None, cost: CostModel) -> KvAdmission | None:
    """--kv-admission-gb (`room_bytes`) or a recorded server's rule; None: no admission by KV bytes."""
    if rule is not None:
        return KvAdmission.from_rule({**rule, "room_bytes": room_bytes} if room_bytes else rule)
    return KvAdmission(room_bytes, cost.kv_bytes_per_token) if room_bytes else None
