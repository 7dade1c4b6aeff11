"""The cache tiers: one pure core for serving and simulation (seed §4, §5.1).

`CacheTiers` owns the RAM `PromptCache`, the index of what the SSD tier
holds, and every decision between the two:

- lookup: a RAM hit, or an SSD record worth restoring. The SSD record must
  serve a *strictly* longer usable prefix, and restoring it plus prefilling
  the rest must beat prefilling on top of the RAM hit (`RestoreAdvisor`, the
  one rule);
- publish: a new RAM checkpoint is either durable already (an SSD file covers
  its tokens) or must be persisted (`Persist`), or can never be (`NotStored`:
  larger than the SSD cap);
- persist-before-demotion: a RAM victim without a durable copy stays resident
  until its write commits (`durable`) or fails (`not_persisted`);
- supersession: a committed trimmable file replaces exact duplicates and
  strict ancestors on SSD (`Unlink` them);
- the SSD cap: least recently used by mtime first; an evicted file clears the
  `durable` flag of RAM entries it was covering;
- idle demotion: durable RAM entries unused for a while leave RAM;
- the host tier (`host`, kv/host_tier.py): with one, every entry that leaves
  RAM (the byte cap, idle demotion, the memory budget) is admitted there
  instead of dropped, and a lookup whose longest usable prefix is there takes
  it back to RAM before the SSD is considered. Its pages move to host memory
  (`Demote`) only when device memory is needed (the memory budget, admission:
  at once) or no row decodes (`idle_moves`, the shell's call: with a
  measured budget only what keeps `idle_headroom_bytes` of it free); a lookup
  before then is a plain hit, and one after copies them back (`Promote`);
- the memory budget: when the process's memory (MLX active memory outside
  the cache, as last measured, plus the cache now) passes `memory_budget`,
  durable RAM entries leave RAM coldest first (`relieve`); entries still
  waiting for their write stay until it commits, and without an SSD tier
  entries are simply evicted.
- pins (`pin_session`): a session's latest checkpoints stay in RAM until a
  deadline on this clock (a prompt-cache retention class, an Anthropic
  `cache_control` TTL). The byte cap, idle demotion and the memory budget pass
  pinned entries over. Pinned bytes stay within `pin_cap` (half the RAM tier
  by default): a pin whose checkpoint would pass it is dropped and counted
  (`refused`), never honoured by growing RAM. A pin ends at its deadline or
  when its session is closed.

No trio, no threads, no files: every method returns the effects the caller
must carry out (`Persist`, `Forget`, `Unlink`, `NotStored`, `Demote`, `Promote`;
a lookup's are collected by `take_effects`) and time comes
from the injected clock (wall time when serving, virtual time when simulating).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import numpy as np

from mlxd.kv.admission import RamRoom
from mlxd.kv.blocks import BlockLedger, BlockRef
from mlxd.kv.host_tier import HostTier, HostTierStats
from mlxd.kv.pins import PinSet, PrefixPin, SessionPin
from mlxd.kv.prefix_index import PrefixIndex, TokenKey, key_tokens, token_key
from mlxd.kv.prompt_cache import CacheEntry, CacheHit, PromptCache, PromptCacheStats, Tokens
from mlxd.kv.ram_pages import PageRef
from mlxd.kv.restore_decision import RECOMPUTE, RestoreAdvisor, RestoreCut, RestorePlan
from mlxd.kv.sessions import SessionIndex, SessionStats

if TYPE_CHECKING:
    from mlxd.kv.file_format import SnapshotPlan

Key = tuple[str, TokenKey]


def key_of(namespace: str, tokens: Tokens | TokenKey) -> Key:
    return (namespace, token_key(tokens))


@attrs.define(eq=False)
class SsdRecord:
    """One entry on SSD: the state after exactly `tokens` in `namespace`.

    A whole file, or (with `blocks`) a manifest naming shared content-addressed
    blocks (`mlxd.kv.blocks`): then the SSD cap counts each block once, however
    many records name it.
    """

    namespace: str
    tokens: Tokens
    nbytes: int  # KV bytes of the checkpoint (= the RAM entry's nbytes)
    mtime: float  # the LRU clock: set on write, refreshed on every restore
    trimmable: bool = True
    path: Path | None = None  # the file or manifest, when serving; None in the simulator
    blocks: tuple[BlockRef, ...] = ()  # a manifest's blocks; () for a whole file


@attrs.frozen
class SsdMatch:
    """A record that can serve `usable` tokens of a prompt (<= len(prompt) - 1).

    `read_tokens` > 0: read only the record's first `read_tokens` tokens (a block
    layout's leading blocks, >= `usable`); 0: read the whole record. `read_from` > 0:
    an overlapped split's tail, read from that token (a block boundary) on, while
    the tokens before it are recomputed.
    """

    record: SsdRecord
    usable: int
    read_tokens: int = 0
    read_from: int = 0

    @property
    def needs_trim(self) -> bool:
        return self.usable < len(self.record.tokens)


@attrs.frozen(eq=False)
class SessionCheckpoint:
    """A session's latest checkpoint (`tokens`) and where it is held: a RAM entry (itself or a
    trimmable descendant) and/or an SSD record (likewise). At least one is set."""

    tokens: tuple[int, ...]
    entry: CacheEntry | None
    record: SsdRecord | None


@attrs.frozen(eq=False)
class PrefixLookup:
    """Where a prompt's prefix comes from: a RAM hit, or an SSD record worth restoring."""

    hit: CacheHit | None
    restore: SsdMatch | None = None  # strictly longer than the RAM hit, and worth it
    promoted: bool = False  # `hit` came back from host memory (its pages are on their way back)
    plan: RestorePlan | None = None  # the restore advisor's choice, when an SSD record was weighed
    # Pinned breakpoint prefixes of the prompt that no RAM entry holds: the engine checkpoints there
    checkpoint_at: tuple[int, ...] = ()
    # The shell's handle on a promotion's copy (runtime/host_memory.Promotion): its cost, for the request record
    promotion: object | None = None
    # The weighed SSD record's bytes in the page cache (per block, in `record.blocks` order; a whole file: one
    # number), as the advisor costed them; None when residency did not enter (none known, or no page-cache rate).
    # Recorded per request (`--record-trace`), so a replay weighs the same bytes as the server did.
    resident: tuple[int, ...] | None = None


# --- effects: what the caller must do after a call ---------------------------------


@attrs.frozen(eq=False)
class Persist:
    """Write this RAM checkpoint to SSD (write-behind; report back with `durable`)."""

    namespace: str
    tokens: Tokens
    plan: SnapshotPlan | None  # None in the simulator
    trimmable: bool
    nbytes: int
    first: bool = False  # pinned: write it before the checkpoints already waiting


@attrs.frozen(eq=False)
class Forget:
    """This RAM checkpoint left RAM without a copy: stop trying to write it."""

    namespace: str
    tokens: Tokens


@attrs.frozen(eq=False)
class NotStored:
    """This checkpoint will never be on SSD (e.g. larger than the whole SSD cap)."""

    namespace: str
    tokens: Tokens
    nbytes: int
    reason: str


@attrs.frozen(eq=False)
class Unlink:
    """Delete this file: superseded, replaced, evicted for the cap, or never storable.

    `garbage`: blocks no record names any more once this one is gone (collect them after).
    """

    record: SsdRecord
    garbage: tuple[str, ...] = ()


@attrs.frozen(eq=False)
class Demote:
    """This host-tier entry's memory goes to host memory now (CUDA), or nothing moves (unified memory)."""

    entry: CacheEntry  # the host tier's entry (same payload)
    # Device memory is needed now (KV admission for rows about to start): the move never holds still for a
    # request's prefill or a promotion, as the budget's and the idle moves do (runtime/host_memory.demote).
    urgent: bool = False
    # Issued because the engine was idle (`idle_moves`), not for the budget: it also holds still while rows
    # decode (the next request's decode often starts before it ends), where the budget's wants the room.
    idle: bool = False


@attrs.frozen(eq=False)
class Promote:
    """This host-tier entry is back in RAM for a lookup: move its memory to the device, now."""

    entry: CacheEntry  # the RAM tier's entry (same payload)


Effect = Persist | Forget | NotStored | Unlink | Demote | Promote


@attrs.frozen
class PoolUsage:
    """A GPU's memory pool at one moment (bytes; CUDA's stream-ordered pool, runtime/device_memory.py), and the
    trims so far. What it reserves is the process's share of the device, whatever of it MLX uses now."""

    reserved_bytes: int  # device memory the pool holds (allocated, or freed and kept for reuse)
    used_bytes: int  # of it, allocations not freed (the part of MLX's active memory and buffer cache it holds)
    trims: int = 0  # idle trims that ran
    trimmed_bytes: int = 0  # reserved bytes they gave back to the device


@attrs.frozen
class MemoryStats:
    """The memory budget: the last measurement and what the budget made leave RAM."""

    budget_bytes: int
    active_bytes: int  # MLX active memory at the last measurement (includes the cache then)
    peak_active_bytes: int  # the process's MLX peak so far (spikes within a step included)
    max_active_bytes: int  # the largest measurement (between steps: what the budget can act on)
    other_bytes: int  # active memory outside the RAM tier at the last measurement
    cache_bytes: int  # the RAM tier now
    over_bytes: int  # other + cache - budget now (<= 0: within the budget)
    waiting_bytes: int  # over the budget but held: entries waiting for their SSD write
    measurements: int
    checks: int
    demotions: int  # durable entries that left RAM for the budget (their copy stays on SSD)
    evictions: int  # entries dropped for the budget without an SSD tier
    freed_bytes: int
    admission_freed_bytes: int = 0  # freed before a row the scheduler admitted (--kv-admission)
    admission_frees: int = 0  # entries that left RAM for those rows
    buffer_cache_bytes: int = 0  # MLX's cached free buffers at the last measurement (held to an eighth of the budget)
    device_pool: PoolUsage | None = None  # the GPU's memory pool at the last measurement (None off CUDA)


@attrs.frozen
class PinStats:
    """Pinned sessions and what they hold in RAM now."""

    sessions: int  # sessions whose pin holds now
    entries: int  # RAM entries those pins hold
    bytes: int
    max_bytes: int  # the cap on pinned bytes
    pinned: int  # pins granted or extended
    refused: int  # pins dropped because their checkpoint would pass the cap
    expired: int  # pins ended by their deadline
    released: int  # pins ended by the session's deletion
    prefixes: int = 0  # pinned prefixes (cache_control breakpoints) holding now
    restored: int = 0  # pins re-applied from the pins file at startup (kv/pins.py)


@attrs.define
class _PinCounters:
    pinned: int = 0
    refused: int = 0
    expired: int = 0
    released: int = 0
    restored: int = 0


# A record's page-cache residency, checked for a prompt's prefetch hint, is reused by its lookup this soon after.
RESIDENCY_REUSE_S = 1.0
IMPLICIT_PIN_SESSION = "mlxd-pin-"  # sessions made up for a pinned request without one; closed at expiry


@attrs.frozen
class TierStats:
    """A snapshot of both tiers' counters (travels in replies; never shared)."""

    ram: PromptCacheStats
    ssd_enabled: bool
    ssd_entries: int
    ssd_bytes: int
    ssd_max_bytes: int
    longest_durable_prefix_tokens: int
    demotions: int
    idle_demotions: int
    dropped_unpersisted: int
    ssd_evictions: int
    ssd_superseded: int
    not_stored: int
    lost_files: int
    restore_decisions: dict[str, float]
    sessions: SessionStats | None = None
    ssd_blocks: int = 0  # unique blocks the records name (blocks layout)
    ssd_checkpoint_bytes: int = 0  # KV bytes of every record, shared blocks counted per record
    memory: MemoryStats | None = None  # with a memory budget
    host: HostTierStats | None = None  # with a host tier
    pins: PinStats | None = None


@attrs.define
class _SsdIndex:
    """What the SSD holds: prefix lookups per namespace, LRU order by mtime, bytes.

    `bytes` counts whole files by their size and blocks once each (the ledger).
    """

    _indexes: dict[str, PrefixIndex] = attrs.field(factory=dict)
    _lru: OrderedDict[Key, SsdRecord] = attrs.field(factory=OrderedDict)
    _whole_bytes: int = 0
    ledger: BlockLedger = attrs.Factory(BlockLedger)

    @property
    def bytes(self) -> int:
        return self._whole_bytes + self.ledger.bytes

    def __len__(self) -> int:
        return len(self._lru)

    def records(self) -> list[SsdRecord]:
        return list(self._lru.values())

    def find(self, tokens: Tokens, namespace: str, *, limit: int) -> SsdMatch | None:
        index = self._indexes.get(namespace)
        if index is None or limit <= 0:
            return None
        match = index.longest_usable(tokens, limit=limit)
        return None if match is None else SsdMatch(match.value, match.usable)

    def diverging(self, tokens: Tokens, namespace: str) -> list[SsdRecord]:
        index = self._indexes.get(namespace)
        return [] if index is None else index.diverging(tokens)

    def covers(self, tokens: Tokens, namespace: str) -> bool:
        """Can some file restore exactly `tokens` (itself, or a trimmable descendant)?"""
        n = len(tokens)
        match = self.find(tokens, namespace, limit=n)
        return match is not None and match.usable == n

    def get(self, tokens: Tokens | TokenKey, namespace: str) -> SsdRecord | None:
        return self._lru.get(key_of(namespace, tokens))

    def add(self, record: SsdRecord) -> list[tuple[SsdRecord, tuple[str, ...]]]:
        """Index a record; returns the exact duplicate and (if trimmable) strict ancestors it
        replaces, each with the blocks that nothing names any more."""
        index = self._indexes.setdefault(record.namespace, PrefixIndex())
        gone = [self.get(record.tokens, record.namespace)]
        if record.trimmable:
            gone += index.strict_ancestors(record.tokens)
        self._count(record)  # before the replaced ones let go of the blocks they share
        removed = []
        for old in gone:
            if old is not None:
                garbage = self.remove(old)
                if garbage is not None:
                    removed.append((old, garbage))
        index = self._indexes.setdefault(record.namespace, PrefixIndex())
        index.insert(record.tokens, record, trimmable=record.trimmable)
        self._lru[key_of(record.namespace, record.tokens)] = record
        return removed

    def remove(self, record: SsdRecord) -> tuple[str, ...] | None:
        """Forget a record; None if it was not indexed, else the blocks nothing names any more."""
        key = key_of(record.namespace, record.tokens)
        if self._lru.get(key) is not record:
            return None
        del self._lru[key]
        index = self._indexes[record.namespace]
        index.remove(record.tokens)
        if not len(index):
            del self._indexes[record.namespace]
        if not record.blocks:
            self._whole_bytes -= record.nbytes
            return ()
        return tuple(self.ledger.remove(record.blocks))

    def _count(self, record: SsdRecord) -> None:
        if record.blocks:
            self.ledger.add(record.blocks)
        else:
            self._whole_bytes += record.nbytes

    def has_block(self, name: str) -> bool:
        return name in self.ledger

    def touch(self, record: SsdRecord, now: float) -> None:
        record.mtime = now
        key = key_of(record.namespace, record.tokens)
        if self._lru.get(key) is record:
            self._lru.move_to_end(key)

    def oldest(self) -> SsdRecord | None:
        return next(iter(self._lru.values()), None)


def _always(entry: CacheEntry) -> bool:
    return True


def restore_cuts(
    cold: SsdMatch, warm: int, real: Callable[[int], int], *, split: bool = False, resident: Sequence[int] = ()
) -> list[tuple[RestoreCut, SsdMatch]]:
    """The prefixes of a cold record that can be restored alone, longer than `warm`, shortest
    first, each with the match that restores it; the last is the whole usable record.

    A block layout (span blocks only: trimmable attention caches) reads its leading
    blocks alone, so a cut ends on a block boundary and costs those blocks' bytes. A
    whole file is read whole (its tensors' CRC-32 covers every token), so its only cut
    is the whole file; with `split` (a forced split, for tests) a middle cut is offered
    at the whole file's cost: it is read, then trimmed.

    `resident`: the bytes of each of the record's blocks (in `record.blocks` order; a whole
    file: one number) already in the page cache, which a cut reads at the page cache's speed.
    """
    record, usable = cold.record, cold.usable
    spans = sorted((b for b in record.blocks if not b.state), key=lambda b: b.start)
    if record.blocks and record.trimmable and len(spans) == len(record.blocks):
        in_cache = dict(zip((b.name for b in record.blocks), resident, strict=False))
        cuts: list[tuple[RestoreCut, SsdMatch]] = []
        read = fast = 0
        for b in spans:
            read += b.nbytes
            fast += min(in_cache.get(b.name, 0), b.nbytes)
            end = min(b.end, usable)
            whole = b.end >= usable
            if end > warm:
                tokens = 0 if b.end >= len(record.tokens) else b.end
                cuts.append((RestoreCut(real(end), read, fast), SsdMatch(record, end, tokens)))
            if whole:
                break
        return cuts
    fast = min(sum(resident), record.nbytes)
    cuts = [(RestoreCut(real(usable), record.nbytes, fast), cold)]
    middle = (warm + usable) // 2
    if split and warm < middle < usable and record.trimmable:
        cuts.insert(0, (RestoreCut(real(middle), record.nbytes, fast), SsdMatch(record, middle)))
    return cuts


def restore_tails(
    cold: SsdMatch, warm: int, real: Callable[[int], int], *, resident: Sequence[int] = ()
) -> list[tuple[RestoreCut, SsdMatch]]:
    """The parts [start, usable) of a cold record that an overlapped split can read while the engine
    recomputes the tokens before `start` (past the warm prefix), each with the match that reads it.

    Only a block layout of span blocks (trimmable attention caches) reads a part alone: a tail starts on
    a block boundary past `warm` and reads its blocks up to the one holding the record's last usable token.
    `resident` as for `restore_cuts`.
    """
    record, usable = cold.record, cold.usable
    spans = sorted((b for b in record.blocks if not b.state), key=lambda b: b.start)
    if not (record.blocks and record.trimmable and len(spans) == len(record.blocks)):
        return []
    last = next((i for i, b in enumerate(spans) if b.end >= usable), None)
    if last is None:
        return []
    in_cache = dict(zip((b.name for b in record.blocks), resident, strict=False))
    end = spans[last].end
    read_tokens = 0 if end >= len(record.tokens) else end
    tails: list[tuple[RestoreCut, SsdMatch]] = []
    nbytes = fast = 0  # of the blocks from this one to the last read, summed from the last back
    for b in reversed(spans[: last + 1]):
        nbytes += b.nbytes
        fast += min(in_cache.get(b.name, 0), b.nbytes)
        if b.start <= warm:
            break
        tails.append((RestoreCut(real(usable), nbytes, fast, start=real(b.start)),
                      SsdMatch(record, usable, read_tokens, read_from=b.start)))
    return tails[::-1]


@attrs.define
class _MemoryCounters:
    active: int = 0
    peak: int = 0
    max_active: int = 0
    other: int = 0
    waiting: int = 0
    measurements: int = 0
    checks: int = 0
    demotions: int = 0
    evictions: int = 0
    freed: int = 0
    admission_freed: int = 0
    admission_frees: int = 0
    buffer_cache: int = 0
    pool: PoolUsage | None = None


@attrs.define
class CacheTiers:
    """RAM and SSD tiers and the decisions between them; see the module docstring.

    `ssd` False means a RAM-only cache (no SSD tier: victims are simply dropped).
    `ssd_max_bytes` 0 means an unlimited SSD tier. `memory_budget` 0 means no
    memory budget (only the RAM tier's byte cap).
    """

    ram: PromptCache
    ssd: bool = False
    ssd_max_bytes: int = 0
    advisor: RestoreAdvisor = attrs.Factory(RestoreAdvisor)
    demote_idle_s: float = 0.0  # 0 = never demote idle entries
    memory_budget: int = 0  # bytes of MLX memory the process may use (0 = no budget)
    host: HostTier | None = None  # the host-memory tier between RAM and SSD (None: victims leave)
    pin_max_bytes: int = -1  # cap on pinned RAM bytes (-1: half the RAM tier; never more than all of it)
    # The bytes of a record's blocks (a whole file: one number) in the page cache now (the SSD store's
    # `resident_bytes`); None: unknown (the simulator), every byte costs a disk read.
    residency: Callable[[SsdRecord], Sequence[int]] | None = None
    _pending: list[Effect] = attrs.field(init=False, factory=list)  # a lookup's effects (take_effects)
    _index: _SsdIndex = attrs.field(init=False, factory=_SsdIndex)
    # Session id + namespace -> latest checkpoint (seed §5.12); process-local.
    sessions: SessionIndex = attrs.field(init=False, factory=SessionIndex)
    _unpersistable: set[Key] = attrs.field(init=False, factory=set)
    _demotions: int = attrs.field(init=False, default=0)
    _idle_demotions: int = attrs.field(init=False, default=0)
    _dropped_unpersisted: int = attrs.field(init=False, default=0)
    _ssd_evictions: int = attrs.field(init=False, default=0)
    _ssd_superseded: int = attrs.field(init=False, default=0)
    _not_stored: int = attrs.field(init=False, default=0)
    _lost: int = attrs.field(init=False, default=0)
    # A prefetch hint's residency check (record, when, bytes), for its prompt's lookup: they follow each
    # other within milliseconds, and a check of a 16k-token record walks 460k pages (RESIDENCY_REUSE_S).
    _residency_seen: tuple[SsdRecord, float, Sequence[int]] | None = attrs.field(init=False, default=None)
    _memory: _MemoryCounters = attrs.field(init=False, factory=_MemoryCounters)
    _pins: dict[str, float] = attrs.field(init=False, factory=dict)  # session -> deadline (this clock)
    # (session, namespace, exact tokens) -> deadline: a breakpoint's prefix, held by the entry covering it
    _prefix_pins: dict[tuple[str, Key], float] = attrs.field(init=False, factory=dict)
    _pin_count: _PinCounters = attrs.field(init=False, factory=_PinCounters)

    @property
    def now(self) -> float:
        return self.ram.clock()

    @property
    def ram_over_cap(self) -> bool:
        """RAM is above its cap because its victims wait for their writes."""
        return self.ram.bytes > self.ram.max_bytes

    def ssd_records(self) -> list[SsdRecord]:
        """Every SSD record, least recently used first."""
        return self._index.records()

    def ssd_find(self, tokens: Tokens, namespace: str = "", *, limit: int | None = None) -> SsdMatch | None:
        """The SSD record serving the longest usable prefix (default limit len - 1); no touch."""
        cap = len(tokens) - 1 if limit is None else limit
        return self._index.find(tokens, namespace, limit=cap) if self.ssd else None

    def ssd_covers(self, tokens: Tokens, namespace: str = "") -> bool:
        """Can some SSD file restore exactly `tokens` (itself or a trimmable descendant)?"""
        return self.ssd and self._index.covers(tokens, namespace)

    def ssd_has_block(self, name: str) -> bool:
        """Does an indexed record name this block (the simulator's stand-in for the block files)?"""
        return self._index.has_block(name)

    def touch_ssd(self, tokens: Tokens, namespace: str = "") -> None:
        """A record read outside a lookup (a vision encoder output) is now the most recently used."""
        record = self._index.get(tokens, namespace)
        if record is not None:
            self._index.touch(record, self.now)

    def ssd_fits(self, nbytes: int) -> bool:
        return self.ssd_max_bytes <= 0 or nbytes <= self.ssd_max_bytes

    # --- startup ----------------------------------------------------------------

    def load_records(self, records: Iterable[SsdRecord]) -> list[Effect]:
        """Index the files a startup scan found (oldest first); enforce the cap."""
        effects: list[Effect] = []
        for record in sorted(records, key=lambda r: r.mtime):
            effects += self._add_record(record, count_superseded=False)
        return effects

    # --- lookups ----------------------------------------------------------------

    def lookup(
        self,
        tokens: Tokens,
        namespace: str = "",
        *,
        model_tokens: Callable[[int], int] | None = None,
        session: str | None = None,
        overlap: bool = True,
    ) -> PrefixLookup:
        """RAM hit (counted and refreshed), or an SSD record to restore (touched).

        `model_tokens` maps index tokens to model tokens where they differ (the
        simulator's block encoding); the restore decision is taken in model tokens.
        A `session` whose latest checkpoint prefixes the prompt is served from
        it without a candidate scan: from RAM when resident, else its exact SSD
        record is the restore candidate (the restore rule still decides).
        Otherwise (no reference, an edited history, a checkpoint gone from both
        tiers) the ordinary lookup runs. `overlap` False: no overlapped split is
        weighed (the engine holds other rows and would decline one).
        """
        ref = self.sessions.usable_for(session, namespace, token_key(tokens)) if session is not None else None
        if ref is not None:
            direct = self.ram.take_exact(ref, namespace, prompt_tokens=len(tokens))
            if direct is not None:
                return PrefixLookup(direct)
        hit = self.ram.take(tokens, namespace)
        back = self._promote(tokens, namespace, hit)
        promoted = None
        if back is not None:
            hit, copied = back
            promoted = hit if copied else None
        record = self._index.get(ref, namespace) if ref is not None and self.ssd else None
        if ref is not None and record is None:
            self.sessions.fallback()
        if not self.ssd:
            return PrefixLookup(hit, promoted=promoted is not None)
        if record is not None and ref is not None:
            cold: SsdMatch | None = SsdMatch(record, ref.num_tokens)
        else:
            cold = self._index.find(tokens, namespace, limit=len(tokens) - 1)
        warm = hit.usable if hit is not None else 0
        real = model_tokens or (lambda n: n)
        plan = None
        weighed: tuple[int, ...] | None = None
        if cold is not None and cold.usable > warm:
            resident = self._resident(cold.record)
            if self.residency is not None and self.advisor.resident_bytes_per_s:
                weighed = tuple(int(b) for b in resident)
            cuts, plan = self._weigh(cold, warm, len(tokens), real, resident, overlap=overlap)
        if cold is None or plan is None or plan.cut is None:
            if record is not None:
                self.sessions.fallback()  # the session's file was not worth restoring
            return PrefixLookup(hit, promoted=promoted is not None, plan=plan, resident=weighed)
        self._index.touch(cold.record, self.now)
        chosen = next(m for c, m in cuts if c is plan.cut)
        return PrefixLookup(hit, chosen, promoted=promoted is not None, plan=plan, resident=weighed)

    def _weigh(
        self, cold: SsdMatch, warm: int, prompt: int, real: Callable[[int], int], resident: Sequence[int],
        *, count: bool = True, overlap: bool = True,
    ) -> tuple[list[tuple[RestoreCut, SsdMatch]], RestorePlan]:
        """The advisor's plan for a cold record past a `warm` prefix of a `prompt`-token prompt: its cuts,
        and the overlapped splits when it weighs or forces them (and `overlap`), each with the match that
        reads it."""
        cuts = restore_cuts(cold, warm, real, split=self.advisor.split, resident=resident)
        if overlap and (self.advisor.weigh_overlap or self.advisor.overlap):
            cuts += restore_tails(cold, warm, real, resident=resident)
        plan = self.advisor.plan(cuts=[c for c, _ in cuts if not c.start], tails=[c for c, _ in cuts if c.start],
                                 warm_tokens=real(warm), prompt_tokens=real(prompt), count=count)
        return cuts, plan

    def _resident(self, record: SsdRecord, *, hint: bool = False) -> Sequence[int]:
        """The record's bytes in the page cache, where the advisor has a page-cache bandwidth to use them.
        A prefetch hint's check (`hint`) is what its prompt's lookup uses, when it follows soon after."""
        if self.residency is None or not self.advisor.resident_bytes_per_s:
            return ()
        seen, now = self._residency_seen, self.now
        self._residency_seen = None  # a hint's check serves one lookup at most
        if not hint and seen is not None and seen[0] is record and 0 <= now - seen[1] <= RESIDENCY_REUSE_S:
            return seen[2]
        resident = self.residency(record)
        if hint:
            self._residency_seen = (record, now, resident)
        return resident

    def take_effects(self) -> list[Effect]:
        """The effects of the lookups since the last call (a promotion, the demotions it caused)."""
        effects, self._pending = self._pending, []
        return effects

    def _promote(self, tokens: Tokens, namespace: str, hit: CacheHit | None) -> tuple[CacheHit, bool] | None:
        """A host-tier entry serving a longer prefix than RAM's hit goes back to RAM: its hit, counted, and
        whether its pages come back from host memory (False: its move was never issued, no copy)."""
        if self.host is None:
            return None
        found = self.host.find(tokens, namespace, longer_than=hit.usable if hit is not None else 0)
        if found is None:
            return None
        entry, copied = self.host.promote(found)
        outcome = self.ram.put(entry.tokens, namespace, payload=entry.payload, nbytes=entry.nbytes,
                               trimmable=entry.trimmable, pages=entry.pages)
        back = outcome.entry if outcome.entry is not None else entry  # RAM too small: lend it as it is
        back.durable = self.ssd and self._index.covers(back.tokens, namespace)
        if copied:
            self._pending.append(Promote(back))
        if outcome.entry is not None:
            self._pending += self._evict(keep=back)
        return CacheHit(back, found.usable), copied

    def prefetch_candidate(self, tokens: Tokens, namespace: str = "") -> SsdRecord | None:
        """The SSD record a newly arrived prompt will likely restore (no accounting)."""
        match = self.prefetch_match(tokens, namespace)
        return None if match is None else match.record

    def prefetch_match(self, tokens: Tokens, namespace: str = "", *, overlap: bool = True) -> SsdMatch | None:
        """What a newly arrived prompt will likely read from SSD (no accounting): the record and,
        where the restore advisor would split it, the leading part (`read_tokens`); None where it would
        recompute (after a restart the prefetcher read whole records the advisor then recomputed).
        `overlap` False: its lookup will weigh no overlapped split (`lookup`'s), so no tail is read ahead."""
        if not self.ssd:
            return None
        cold = self._index.find(tokens, namespace, limit=len(tokens) - 1)
        if cold is None:
            return None
        warm = self.ram.peek(tokens, namespace)
        if warm is not None and warm.usable >= cold.usable:
            return None
        if self.host is not None and self.host.find(tokens, namespace, longer_than=cold.usable - 1) is not None:
            return None  # the host tier will serve it: no SSD read
        usable = warm.usable if warm is not None else 0
        cuts, plan = self._weigh(cold, usable, len(tokens), lambda n: n, self._resident(cold.record, hint=True),
                                 count=False, overlap=overlap)
        if plan.arm == RECOMPUTE:  # read for nothing: the disk, a landing's memory and the engine's time for it
            return None
        return next((m for c, m in cuts if c is plan.cut), cold)

    def checkpoint_tokens(self, tokens: Tokens, namespace: str = "") -> list[tuple[int, ...]]:
        """The exact tokens of the best RAM and SSD checkpoints for `tokens` (no accounting)."""
        candidates: list[Tokens] = []
        hit = self.ram.peek(tokens, namespace)
        if hit is not None:
            candidates.append(hit.entry.tokens)
        if self.ssd:
            cold = self._index.find(tokens, namespace, limit=len(tokens) - 1)
            if cold is not None:
                candidates.append(cold.record.tokens)
        # Checkpoints that part from `tokens` where it leaves the indexes: an untrimmable
        # end-of-turn checkpoint whose reply `tokens` re-tokenized (after a restart) is one.
        candidates += [e.tokens for e in self.ram.diverging(tokens, namespace)]
        if self.ssd:
            candidates += [r.tokens for r in self._index.diverging(tokens, namespace)]
        found: list[tuple[int, ...]] = []
        for c in candidates:  # (on the cache owner's thread: no Python loop over the tokens)
            exact = tuple(c.tolist()) if isinstance(c, np.ndarray) else tuple(map(int, c))
            if exact not in found:
                found.append(exact)
        return found

    # --- publications and durability ------------------------------------------------

    def publish(
        self,
        tokens: Tokens,
        namespace: str = "",
        *,
        payload: object,
        nbytes: int,
        trimmable: bool,
        plan: SnapshotPlan | None = None,
        file_nbytes: int | None = None,
        durable: bool = False,
        session: str | None = None,
        pages: tuple[PageRef, ...] = (),
    ) -> list[Effect]:
        """Store a checkpoint in RAM; persist it unless a file covers it already; evict.

        `durable` says the checkpoint came from SSD (a restore, which carries no
        write plan); it is durable only while a file still covers it. If the
        file was deleted since the lookup chose it (the cap), it is reported
        `NotStored`: a flush must not count it, and leaving RAM is a loss.
        `file_nbytes` is its size on SSD (default: `nbytes`). A `session`'s
        reference advances to this checkpoint. `pages`: the shared KV pages of a paged
        entry (`--ram-pages on`), counted once in RAM however many entries name them.
        """
        outcome = self.ram.put(tokens, namespace, payload=payload, nbytes=nbytes, trimmable=trimmable, pages=pages)
        entry = outcome.entry
        if entry is not None and session is not None:
            self.sessions.advance(session, namespace, entry.tokens)
            if session in self._pins or self._prefix_pins:
                self._honour_pin(session)
        effects: list[Effect] = []
        if entry is not None and self.ssd:
            if self._index.covers(entry.tokens, namespace):
                entry.durable = True
            elif durable:
                gone = "its file left SSD during the restore"
                effects.append(self._never_stored(entry.namespace, entry.tokens, nbytes, gone))
            else:
                size = nbytes if file_nbytes is None else file_nbytes
                if self.ssd_fits(size):
                    first = session is not None and session in self._pins
                    effects.append(Persist(namespace, entry.tokens, plan, trimmable, size, first=first))
                else:
                    effects.append(self._never_stored(entry.namespace, entry.tokens, size))
        return effects + self._evict() + self.check_budget()

    def durable(self, record: SsdRecord) -> list[Effect]:
        """A write committed `record`: index it as the most recently used, supersede, enforce the cap."""
        effects = self._add_record(record, count_superseded=True)
        self._unpersistable.discard(key_of(record.namespace, record.tokens))
        return effects + self._evict() + self.check_budget()

    def not_persisted(self, namespace: str, tokens: Tokens) -> list[Effect]:
        """A write failed: the RAM entry may now be dropped under pressure."""
        self._unpersistable.add(key_of(namespace, tokens))
        return self._evict()

    def lost(self, record: SsdRecord) -> list[Effect]:
        """A file turned out unreadable or gone (the reader removed it): forget it."""
        garbage = self._index.remove(record)
        if garbage is None:
            return []
        self._lost += 1
        self._refresh_durable(record)
        return [Unlink(record, garbage)] if garbage else []

    def close_session(self, session: str) -> bool:
        """Drop a session's references and its pin (its cached state stays); False if it is unknown."""
        pinned = self._pins.pop(session, None) is not None
        prefixes = [k for k in self._prefix_pins if k[0] == session]
        for k in prefixes:
            del self._prefix_pins[k]
        self._pin_count.released += pinned or bool(prefixes)  # one release per session
        return self.sessions.close(session) or pinned or bool(prefixes)

    # --- session files (export / import) ----------------------------------------------

    def session_checkpoint(self, session: str, namespace: str = "") -> SessionCheckpoint | None:
        """The session's latest checkpoint and what holds it; None when neither tier does (no accounting)."""
        ref = self.sessions.latest(session, namespace)
        if ref is None:
            return None
        tokens = key_tokens(ref)
        entry = self.ram.covering(ref, namespace)
        match = self._index.find(tokens, namespace, limit=len(tokens)) if self.ssd else None
        record = match.record if match is not None and match.usable == len(tokens) else None
        return None if entry is None and record is None else SessionCheckpoint(tokens, entry, record)

    def adopt(
        self, tokens: Tokens, namespace: str = "", *, payload: object, nbytes: int, trimmable: bool,
        record: SsdRecord | None = None, session: str | None = None,
    ) -> list[Effect]:
        """An imported checkpoint: index its committed SSD file (`record`), then publish it to RAM."""
        effects = self.durable(record) if record is not None else []
        if session is not None:
            self.sessions.advance(session, namespace, tokens)  # also when RAM cannot hold it: its file can
        return effects + self.publish(tokens, namespace, payload=payload, nbytes=nbytes, trimmable=trimmable,
                                      durable=record is not None, session=session)

    # --- pins -----------------------------------------------------------------------

    @property
    def pin_cap(self) -> int:
        """The most RAM bytes pinned entries may hold."""
        cap = self.ram.max_bytes // 2 if self.pin_max_bytes < 0 else self.pin_max_bytes
        return max(0, min(cap, self.ram.max_bytes))

    def pin_session(self, session: str, ttl_s: float) -> bool:
        """Pin `session`'s latest checkpoints (now and as it advances) for `ttl_s` seconds.

        Extends an earlier pin, never shortens it. False (counted `refused`) when
        the pin cannot be honoured: no RAM tier, or its checkpoints already pass the cap.
        """
        if ttl_s <= 0 or self.pin_cap <= 0:
            self._pin_count.refused += 1
            return False
        deadline = self.now + ttl_s
        self._pins[session] = max(self._pins.get(session, deadline), deadline)
        self._pin_count.pinned += 1
        return self._honour_pin(session)

    def pin_prefix(self, session: str, namespace: str, tokens: Tokens, ttl_s: float) -> bool:
        """Pin the prefix of exactly `tokens` (a `cache_control` breakpoint) for `ttl_s` seconds: whichever RAM
        entry covers it (itself, or a trimmable descendant) stays. Released with `session` or at the deadline."""
        if ttl_s <= 0 or self.pin_cap <= 0 or not len(tokens):
            self._pin_count.refused += 1
            return False
        key = (session, key_of(namespace, tokens))
        deadline = self.now + ttl_s
        self._prefix_pins[key] = max(self._prefix_pins.get(key, deadline), deadline)
        self._pin_count.pinned += 1
        self.pinned()
        return key in self._prefix_pins

    def pinned_cuts(self, tokens: Tokens, namespace: str, lookup: PrefixLookup) -> tuple[int, ...]:
        """Where the prompt's pinned prefixes end, past the prefix it starts from, when no RAM entry holds
        them (a model whose caches cannot be cut back keeps only exact checkpoints): checkpoint there."""
        if not self._prefix_pins:
            return ()
        key, now = token_key(tokens), self.now
        starts = [m.usable for m in (lookup.hit, lookup.restore) if m is not None]
        start = max(starts, default=0)
        cuts = {
            k.num_tokens for (_, (ns, k)), d in self._prefix_pins.items()
            if ns == namespace and d > now and start < k.num_tokens < len(tokens) - 1 and key.startswith(k)
            and self.ram.covering(k, ns) is None
        }
        return tuple(sorted(cuts))

    def holds_pin(self, session: str | None) -> bool:
        """Is `session` pinned now (its publications move what the pin holds)?"""
        return session is not None and session in self._pins

    def pin_state(self) -> tuple[object, ...]:
        """A cheap value that changes when the persisted pins would (`pin_set`): compare, then save."""
        sessions = tuple(sorted((s, d, tuple(sorted(self.sessions.references(s)))) for s, d in self._pins.items()))
        return sessions, tuple(sorted(self._prefix_pins.items()))

    def pin_set(self, wall_now: float) -> PinSet:
        """The live pins with wall-clock deadlines and each pinned session's latest checkpoints (to persist)."""
        now = self.now
        sessions = tuple(
            SessionPin(s, wall_now + (d - now), tuple((ns, key_tokens(k)) for ns, k in self.sessions.references(s)))
            for s, d in self._pins.items() if d > now
        )
        prefixes = tuple(
            PrefixPin(s, ns, key_tokens(k), wall_now + (d - now)) for (s, (ns, k)), d in self._prefix_pins.items()
            if d > now
        )
        return PinSet(sessions, prefixes)

    def restore_pins(self, pins: PinSet, wall_now: float) -> None:
        """Re-apply persisted pins (startup): sessions point at their checkpoints again, deadlines carry over."""
        now = self.now
        for sp in pins.sessions:
            if sp.deadline <= wall_now:
                continue
            for ns, tokens in sp.checkpoints:
                self.sessions.advance(sp.session, ns, tokens)
            self._pins[sp.session] = max(self._pins.get(sp.session, 0.0), now + (sp.deadline - wall_now))
            self._pin_count.restored += 1
        for pp in pins.prefixes:
            if pp.deadline > wall_now and pp.tokens:
                key = (pp.session, key_of(pp.namespace, pp.tokens))
                self._prefix_pins[key] = max(self._prefix_pins.get(key, 0.0), now + (pp.deadline - wall_now))
                self._pin_count.restored += 1

    def pinned(self) -> set[CacheEntry]:
        """The RAM entries live pins hold (expired pins end here).

        Pins count in the order they were first granted; one whose entries would
        take pinned bytes past `pin_cap` is dropped (`refused`).
        """
        now = self.now
        for session, deadline in list(self._pins.items()):
            if deadline <= now:
                del self._pins[session]
                self._pin_count.expired += 1
                if session.startswith(IMPLICIT_PIN_SESSION):
                    self.sessions.close(session)
        for pkey, deadline in list(self._prefix_pins.items()):
            if deadline <= now:
                del self._prefix_pins[pkey]
                self._pin_count.expired += 1
        held: set[CacheEntry] = set()
        held_bytes, cap = 0, self.pin_cap
        namespaces = self.ram.namespaces()
        for session in list(self._pins):
            mine: set[CacheEntry] = set()
            for namespace in namespaces:
                ref = self.sessions.latest(session, namespace)
                # the checkpoint, or the trimmable descendant that superseded it (it holds the prefix now)
                entry = None if ref is None else self.ram.covering(ref, namespace)
                if entry is not None and entry not in held:
                    mine.add(entry)
            more = sum(e.nbytes for e in mine)
            if held_bytes + more > cap:
                del self._pins[session]
                self._pin_count.refused += 1
                continue
            held |= mine
            held_bytes += more
        for pkey in list(self._prefix_pins):
            _, (namespace, key) = pkey
            entry = self.ram.covering(key, namespace)
            if entry is None or entry in held:
                continue
            if held_bytes + entry.nbytes > cap:
                del self._prefix_pins[pkey]
                self._pin_count.refused += 1
                continue
            held.add(entry)
            held_bytes += entry.nbytes
        return held

    def _honour_pin(self, session: str) -> bool:
        """Keep `session`'s pin if pinned bytes stay within the cap; else it is dropped (`refused`)."""
        self.pinned()
        return session in self._pins

    def _keep(self) -> Callable[[CacheEntry], bool] | None:
        held = self.pinned() if self._pins or self._prefix_pins else set()
        return held.__contains__ if held else None

    def _pin_stats(self) -> PinStats:
        held = self.pinned() if self._pins or self._prefix_pins else set()
        c = self._pin_count
        return PinStats(
            sessions=len(self._pins), entries=len(held), bytes=sum(e.nbytes for e in held),
            max_bytes=self.pin_cap, pinned=c.pinned, refused=c.refused, expired=c.expired, released=c.released,
            prefixes=len(self._prefix_pins), restored=c.restored,
        )

    def demote_idle(self) -> list[Effect]:
        """Free RAM held by durable entries idle for `demote_idle_s` (their prefix stays on SSD)."""
        if not self.ssd or self.demote_idle_s <= 0:
            return []
        gone = []
        keep = self._keep() or (lambda e: False)
        for entry in self.ram.idle_entries(idle_for=self.demote_idle_s):
            if entry.durable and not keep(entry):
                self.ram.remove(entry, evicted=True)
                self._idle_demotions += 1
                self._demotions += 1
                gone.append(entry)
        return self._to_host(gone)

    # --- the memory budget --------------------------------------------------------

    @property
    def over_budget_bytes(self) -> int:
        """How far the process is over the budget now (<= 0: within it, or no budget); host-tier entries
        whose move is not issued yet are still device memory."""
        if self.memory_budget <= 0:
            return 0
        return self._memory.other + self.ram.bytes + self._host_device_bytes() - self.memory_budget

    def _host_device_bytes(self) -> int:
        return self.host.device_bytes if self.host is not None else 0

    def move_to_host(self, nbytes: int | None = None, *, urgent: bool = False, idle: bool = False) -> list[Effect]:
        """Issue host-tier moves not issued yet, coldest first: at least `nbytes` (None: all). The shell
        calls it when no row decodes (`idle_moves`: `idle`); the budget and admission (`urgent`) call it when
        device memory is needed."""
        if self.host is None:
            return []
        return [Demote(e, urgent=urgent, idle=idle) for e in self.host.take_moves(nbytes)]

    def idle_moves(self) -> list[Effect]:
        """Host-tier moves worth issuing while no row decodes and none waits: with a measured memory budget,
        only enough to keep `idle_headroom_bytes` of it free; without one, all of them.

        An entry kept on the device is a plain hit with no copy back (a returning conversation, or a next
        turn on an entry demoted while idle); moving it while the device had room made that turn wait
        for a promotion (H200: +109 ms for 1.88 GB). The budget and admission still move the rest, coldest
        first, when device memory is needed."""
        if self.host is None:
            return []
        if self.memory_budget <= 0 or not self._memory.measurements:
            return self.move_to_host(idle=True)
        need = self.over_budget_bytes + self.idle_headroom_bytes()
        return self.move_to_host(need, idle=True) if need > 0 else []

    def idle_headroom_bytes(self) -> int:
        """Device memory an idle server keeps free of host-tier entries: the largest entry either tier holds
        (about what the next checkpoint of a conversation adds)."""
        largest = max((e.nbytes for e in self.ram.entries()), default=0)
        if self.host is not None:
            largest = max(largest, max((e.nbytes for e in self.host.entries()), default=0))
        return largest

    @property
    def budget_waiting(self) -> bool:
        """Over the budget, and what could go waits for SSD writes (make them urgent)."""
        return self._memory.waiting > 0

    def unfreeable_bytes(self) -> int:
        """RAM bytes the budget cannot free now (admission by KV bytes, kv/admission.py): pinned entries,
        and with an SSD tier entries still waiting for their write."""
        keep = self._keep() or (lambda e: False)
        may = self._may_evict if self.ssd else _always
        return sum(e.nbytes for e in self.ram.entries() if keep(e) or not may(e))

    def ram_room(self) -> RamRoom:
        """What the RAM tier holds against the memory budget: the part it cannot free now and the rest
        (pages shared by several entries are counted once, in the rest)."""
        held = min(self.unfreeable_bytes(), self.ram.bytes)
        # Host-tier entries not moved yet hold device memory that a move frees.
        return RamRoom(unfreeable_bytes=held, freeable_bytes=max(0, self.ram.bytes - held) + self._host_device_bytes())

    def free_for_rows(self, nbytes: int) -> list[Effect]:
        """Admission: free at least `nbytes` of RAM before a row that needs them starts, coldest first,
        what can go (durable entries demoted, droppable ones evicted; never pinned ones)."""
        if nbytes <= 0:
            return []
        moves = self.move_to_host(nbytes, urgent=True)  # host-tier entries still on the device go first
        moved = sum(e.entry.nbytes for e in moves if isinstance(e, Demote))
        self._memory.admission_freed += moved
        if nbytes <= moved:
            return moves
        prefer = self._unreferenced if len(self.sessions) else None
        may = self._may_evict if self.ssd else _always
        released = self.ram.release(nbytes - moved, may_evict=may, prefer=prefer, keep=self._keep())
        self._memory.admission_freed += released.freed_bytes
        self._memory.admission_frees += len(released.evicted)
        if self.ssd:
            self._demotions += len(released.evicted)
        return moves + self._to_host(released.evicted, move=True, urgent=True)

    def observe_memory(self, active_bytes: int, *, peak_bytes: int = 0, buffer_cache_bytes: int = 0,
                       pool: PoolUsage | None = None) -> list[Effect]:
        """The engine measured MLX active memory (which holds the RAM tier's arrays): check the budget.

        Memory outside the cache (weights, batches, buffers) is taken as
        `active_bytes - ram.bytes` and kept until the next measurement, so later
        checks see the cache grow and shrink between measurements.
        """
        m = self._memory
        m.active, m.peak = active_bytes, max(m.peak, peak_bytes, active_bytes)
        m.max_active = max(m.max_active, active_bytes)
        m.buffer_cache = buffer_cache_bytes
        m.pool = pool or m.pool
        # Host-tier entries are MLX arrays whose pages moved to the host: still MLX memory, not "other".
        m.other = max(0, active_bytes - self.ram.bytes - (self.host.bytes if self.host is not None else 0))
        m.measurements += 1
        return self.check_budget()

    def check_budget(self) -> list[Effect]:
        """Relieve the RAM tier by however much the process is over its budget (if at all)."""
        if self.memory_budget <= 0 or not self._memory.measurements:
            return []
        self._memory.checks += 1
        over = self.over_budget_bytes
        if over <= 0:
            self._memory.waiting = 0
            return []
        return self.relieve(over)

    def relieve(self, over_bytes: int) -> list[Effect]:
        """Free at least `over_bytes` of RAM, coldest first (memory pressure, not the byte cap).

        With an SSD tier only durable entries go (their prefix stays restorable);
        an entry waiting for its write is skipped and goes at a later check, once
        the write commits; one that can never be written stays. Without an SSD
        tier entries are evicted, like the byte cap does. Host-tier entries still
        on the device move first (they leave no hit behind).
        """
        moves = self.move_to_host(over_bytes)
        moved = sum(e.entry.nbytes for e in moves if isinstance(e, Demote))
        m = self._memory
        m.freed += moved
        if over_bytes <= moved:
            m.waiting = 0
            return moves
        over_bytes -= moved
        prefer = self._unreferenced if len(self.sessions) else None
        may = (lambda e: e.durable) if self.ssd else _always
        released = self.ram.release(over_bytes, may_evict=may, prefer=prefer, keep=self._keep())
        m.freed += released.freed_bytes
        if self.ssd:
            m.demotions += len(released.evicted)
            self._demotions += len(released.evicted)
        else:
            m.evictions += len(released.evicted)
        pending = sum(e.nbytes for e in self.ram.entries() if not self._may_evict(e)) if self.ssd else 0
        m.waiting = min(max(0, over_bytes - released.freed_bytes), pending)
        return moves + self._to_host(released.evicted, move=True)

    def _memory_stats(self) -> MemoryStats | None:
        if self.memory_budget <= 0:
            return None
        m = self._memory
        return MemoryStats(
            budget_bytes=self.memory_budget,
            active_bytes=m.active,
            peak_active_bytes=m.peak,
            max_active_bytes=m.max_active,
            other_bytes=m.other,
            cache_bytes=self.ram.bytes,
            over_bytes=self.over_budget_bytes,
            waiting_bytes=m.waiting,
            measurements=m.measurements,
            checks=m.checks,
            demotions=m.demotions,
            evictions=m.evictions,
            freed_bytes=m.freed,
            admission_freed_bytes=m.admission_freed,
            admission_frees=m.admission_frees,
            buffer_cache_bytes=m.buffer_cache,
            device_pool=m.pool,
        )

    # --- internals ------------------------------------------------------------------

    def _never_stored(self, namespace: str, tokens: Tokens, nbytes: int, reason: str | None = None) -> NotStored:
        self._unpersistable.add(key_of(namespace, tokens))
        self._not_stored += 1
        why = reason or f"{nbytes} bytes exceed the SSD cap of {self.ssd_max_bytes}"
        return NotStored(namespace, tokens, nbytes, why)

    def _add_record(self, record: SsdRecord, *, count_superseded: bool) -> list[Effect]:
        if not self.ssd_fits(record.nbytes):
            # Written, but it could never stay: delete it and say so.
            garbage = tuple(b.name for b in record.blocks if not self._index.has_block(b.name))
            return [Unlink(record, garbage), self._never_stored(record.namespace, record.tokens, record.nbytes)]
        removed = self._index.add(record)
        if count_superseded:
            self._ssd_superseded += len(removed)
        evicted = []
        while self.ssd_max_bytes > 0 and self._index.bytes > self.ssd_max_bytes:
            victim = self._index.oldest()
            if victim is None or victim is record:
                break
            evicted.append((victim, self._index.remove(victim) or ()))
        self._ssd_evictions += len(evicted)
        for gone, _ in (*removed, *evicted):
            self._refresh_durable(gone)
        self._refresh_durable(record)
        return [Unlink(r, garbage) for r, garbage in (*removed, *evicted)]

    def _refresh_durable(self, record: SsdRecord) -> None:
        """RAM entries at or below `record`'s tokens: durable iff some file still covers them.

        An entry whose only copy was deleted (the cap, a lost file) is not written
        again: it may leave RAM without a copy, and is counted as a loss when it does.
        """
        for entry in self._ram_prefixes(record.tokens, record.namespace):
            covered = self._index.covers(entry.tokens, entry.namespace)
            if entry.durable and not covered:
                self._unpersistable.add(key_of(entry.namespace, entry.tokens))
            entry.durable = covered

    def _ram_prefixes(self, tokens: Tokens, namespace: str) -> list[CacheEntry]:
        exact = self.ram.find_exact(tokens, namespace)
        ancestors = self.ram.strict_ancestors(tokens, namespace)
        return ancestors + ([exact] if exact is not None else [])

    def _unreferenced(self, entry: CacheEntry) -> bool:
        """Eviction considers entries no session points at first."""
        return not self.sessions.referenced(entry.namespace, entry.tokens)

    def _may_evict(self, entry: CacheEntry) -> bool:
        if not self.ssd or entry.durable:
            return True
        return key_of(entry.namespace, entry.tokens) in self._unpersistable

    def _evict(self, *, keep: CacheEntry | None = None) -> list[Effect]:
        prefer = self._unreferenced if len(self.sessions) else None
        may = self._may_evict if self.ssd else _always
        eviction = self.ram.evict(may_evict=may if keep is None else (lambda e: e is not keep and may(e)),
                                  prefer=prefer, keep=self._keep())
        effects: list[Effect] = self._to_host(eviction.evicted)
        for entry in eviction.evicted:
            if not self.ssd:
                continue
            if entry.durable:
                self._demotions += 1
                continue
            key = key_of(entry.namespace, entry.tokens)
            if key in self._unpersistable:
                self._unpersistable.discard(key)
            self._dropped_unpersisted += 1
            effects.append(Forget(entry.namespace, entry.tokens))
        return effects

    def _to_host(self, entries: Iterable[CacheEntry], *, move: bool = False, urgent: bool = False) -> list[Effect]:
        """RAM victims go to the host tier (when there is one), their pages still on the device; `move`
        (device memory is wanted now): `Demote` them at once (`urgent`: for rows about to start)."""
        if self.host is None:
            return []
        for entry in entries:
            self.host.admit(entry)
        return self.move_to_host(urgent=urgent) if move else []

    # --- stats ----------------------------------------------------------------------

    def stats(self) -> TierStats:
        records = self._index.records()
        return TierStats(
            ram=self.ram.stats,
            ssd_enabled=self.ssd,
            ssd_entries=len(records),
            ssd_blocks=len(self._index.ledger),
            ssd_checkpoint_bytes=sum(r.nbytes for r in records),
            ssd_bytes=self._index.bytes,
            ssd_max_bytes=self.ssd_max_bytes,
            longest_durable_prefix_tokens=max((len(r.tokens) for r in records), default=0),
            demotions=self._demotions,
            idle_demotions=self._idle_demotions,
            dropped_unpersisted=self._dropped_unpersisted,
            ssd_evictions=self._ssd_evictions,
            ssd_superseded=self._ssd_superseded,
            not_stored=self._not_stored,
            lost_files=self._lost,
            restore_decisions=self.advisor.stats(),
            sessions=self.sessions.stats,
            memory=self._memory_stats(),
            host=self.host.stats() if self.host is not None else None,
            pins=self._pin_stats(),
        )
