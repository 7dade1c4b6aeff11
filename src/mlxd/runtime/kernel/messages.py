"""Messages between mlxd's actors: frozen attrs classes named for what they ask or report.

Flow: HTTP handler / embedder --SubmitGeneration--> scheduler
      scheduler --LookupPrefix--> cache owner (reply: PrefixLookup)
      scheduler --ReleaseRam--> cache owner (reply: RamRoom; --kv-admission)
      runtime --PrefetchHint--> cache owner --PrefetchRecord--> prefetcher
      scheduler --FetchSnapshot--> prefetcher (reply: LoadedSnapshot | None)
      scheduler --FetchTail--> prefetcher --TailSlot.land--> engine thread (an overlapped split's tail)
      cache owner --MarkDirty / ForgetDirty / MarkNotStored--> durability coordinator
      durability coordinator --WriteSnapshot--> SSD writer --SnapshotWritten--> coordinator
      coordinator --EntryDurable / EntryNotPersisted--> cache owner; prefetcher --RecordLost--> cache owner
      scheduler --StartGeneration / CancelGeneration--> engine
      engine --GenerationEvent--> the request's own channel (via the scheduler)
      engine --PublishPrefix / MemoryMeasured / EngineBusy--> cache owner
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import attrs
import trio

from mlxd.kv.admission import RamRoom
from mlxd.kv.gen_checkpoint import GenerationRecord
from mlxd.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from mlxd.kv.prompt_cache import CacheHit
from mlxd.kv.ram_pages import PageRef
from mlxd.kv.shard_mirror import ShardRef
from mlxd.kv.tiers import PoolUsage, PrefixLookup, SessionCheckpoint, SsdRecord, TierStats
from mlxd.kv.write_queue import WriteJob
from mlxd.runtime.kernel.channels import Reply

if TYPE_CHECKING:
    from mlxd.kv.file_format import LoadedSnapshot, SnapshotPlan
    from mlxd.kv.ssd_store import WriteOutcome
    from mlxd.structured.spec import Constraint
    from mlxd.vision.encoder import ImageInput
    from mlxd.vision.tensor_store import TensorPlan


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (and batches in one call)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # keep tokens at least this fraction of the likeliest one's probability
    seed: int | None = None
    max_tokens: int = 256
    # Generation stops after any of these token ids (the model's EOS ids are added).
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20  # how many recent tokens the repetition penalty looks at
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report the chosen token's logprob, and this many alternatives per step.
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: what the reply must match (mlxd.structured.spec); None for free text.
    constraint: Constraint | None = None


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One prompt to complete: exact token ids, in a cache namespace."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    namespace: str = ""
    session: str | None = None
    # Images in prompt order; their spans' key ids are in `prompt` (kv/media.py).
    media: tuple[ImageInput, ...] = ()
    # Prompt lengths to checkpoint at besides the cache's own: where the chat template's rendering
    # stops being stable (runtime/chat/stable_prefix.py), for caches that cannot be cut back.
    checkpoint_at: tuple[int, ...] = ()
    # Other requests will borrow this prompt's checkpoint as soon as its first token is out (the first of
    # n > 1 choices): its prompt-boundary checkpoint is published before that token, never after it
    # (engine/core.py `EngineCore.checkpoint`).
    prompt_shared: bool = False


# --- events for one request (engine -> scheduler -> client) -------------------


@attrs.frozen
class PromptAccepted:
    """The request got a batch slot; `cached_tokens` of its prompt come from the cache."""

    prompt_tokens: int
    cached_tokens: int
    cache_tier: str  # "ram", "ssd" or "none"
    queued_s: float


@attrs.frozen
class TokenGenerated:
    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # A row's first token only: where its time went in the engine, (stage, time.monotonic()) in order
    # (engine/core.py RowStages); not part of the token's value.
    stages: tuple[tuple[str, float], ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen
class GenerationFinished:
    reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # Seconds the engine spent on leaving the row (its final checkpoint: with the SSD tier a write plan, on CUDA a
    # host read of every array) before the step that finished it handed its events out; a timing, not part of the
    # value. The rows leaving in one step wait for each other's: their sum delays every token of that step (the
    # step of the last token with MLXD_FINAL_PLAN=with-token, the next one, while the device computes, by default).
    leave_s: float = attrs.field(default=0.0, eq=False)


@attrs.frozen
class GenerationFailed:
    message: str


GenerationEvent = PromptAccepted | TokenGenerated | GenerationFinished | GenerationFailed


# --- scheduler inbox ------------------------------------------------------------


@attrs.frozen(eq=False)
class SubmitGeneration:
    request: GenerationRequest
    events: trio.MemorySendChannel[GenerationEvent]
    submitted_at: float
    # Set when the client closes its stream: a prefill sends no event to fail on, so this tells it.
    client_left: trio.Event = attrs.field(factory=trio.Event)


SchedulerInbox = SubmitGeneration  # the admission queue carries only submissions


@attrs.define
class RequestRecord:
    """One finished request: what the per-request log line, metrics and trace recorder see."""

    request_id: str
    namespace: str
    prompt: tuple[int, ...]
    submitted_at: float  # time.monotonic()
    started_at: float | None = None  # got a batch slot
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    cache_tier: str = "none"
    completion_tokens: int = 0
    reason: str = "unknown"  # stop | length | cancelled | failed | client_gone
    output_ids: list[int] = attrs.Factory(list)
    session: str | None = None
    kv_waited: bool = False  # --kv-admission: it waited at the head of the queue for memory
    lookup_s: float = 0.0  # the cache owner's prefix lookup, reply included (a host-tier promotion is issued in it)
    promoted_bytes: int = 0  # its hit came back from the host tier: the bytes whose pages were moved back
    fetch_s: float = 0.0  # an SSD hit: waiting for the cold file's bytes (the prefetcher's read) before the engine
    read_s: float = 0.0  # of which the read itself on its thread (landing included): the rest waited for it to start
    land_s: float = 0.0  # of the read, making the memory it lands in (on CUDA: allocating the MLX arrays)
    verify_s: float = 0.0  # of the read, checking CRC-32s (reader threads' seconds summed)
    # The lookup's SSD candidate: its bytes in the page cache as the restore advisor weighed them (PrefixLookup)
    resident: tuple[int, ...] | None = None
    promotion: object | None = None  # that promotion (runtime/host_memory.Promotion): issue and landing times
    engine_sent_at: float | None = None  # time.monotonic() when the scheduler handed it to the engine
    engine_stages: tuple[tuple[str, float], ...] = ()  # the engine's stamps to its first token (TokenGenerated.stages)
    leave_s: float | None = None  # the engine's time leaving it in its last step (GenerationFinished.leave_s)

    @property
    def queued_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.submitted_at

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def total_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_at is None or self.finished_at is None or self.completion_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.completion_tokens - 1)


# --- engine inbox --------------------------------------------------------------


@attrs.frozen(eq=False)
class RestoreSnapshot:
    """A cold-tier file read into host buffers, to adopt on the engine thread."""

    record: SsdRecord
    usable: int
    loaded: LoadedSnapshot


class TailSlot:
    """Where an overlapped split's tail lands: set once by the prefetcher (`land`, from the trio thread),
    looked at and waited for, boundedly, by the engine thread once it has recomputed the head
    (engine/overlap.py). `placed`: the read has its memory (MLX arrays allocated on the engine's thread),
    reads the host way, or ended (`place`, from the trio thread; the scheduler starts the row only then,
    `wait_placed`); until then its landing may be a job queued behind the engine thread's own, so that
    thread must not wait for it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._placed = threading.Event()  # for the engine thread
        self._placed_here = trio.Event()  # for the scheduler
        self.loaded: LoadedSnapshot | None = None  # None once landed: the read failed (recompute it)

    def place(self) -> None:
        self._placed.set()
        self._placed_here.set()

    async def wait_placed(self) -> None:
        await self._placed_here.wait()

    @property
    def placed(self) -> bool:
        return self._placed.is_set()

    def land(self, loaded: LoadedSnapshot | None) -> None:
        self.loaded = loaded
        self._placed.set()
        self._done.set()

    @property
    def landed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds (a thread, never the trio loop); whether it landed."""
        return self._done.wait(timeout)


@attrs.frozen(eq=False)
class TailRestore:
    """An overlapped split (kv/restore_decision.py OVERLAP): the engine recomputes the prompt's tokens
    before `start` while the record's KV of the tokens [start, usable) is read into `slot`, then appends
    it and prefills the rest. `start` is a block boundary; the read tail may run past `usable`."""

    record: SsdRecord
    start: int
    usable: int
    slot: TailSlot = attrs.field(factory=TailSlot)
    expect_s: float = 0.0  # the read's predicted seconds (0: none), from `asked_at` (time.monotonic())
    asked_at: float = 0.0


@attrs.frozen(eq=False)
class DraftPrefix:
    """--draft-model: the draft's own cached prefix of a request (its namespace; a RAM hit or a cold file read)."""

    namespace: str
    hit: CacheHit | None = None
    restore: RestoreSnapshot | None = None  # wins over `hit`


@attrs.frozen(eq=False)
class ResumeGeneration:
    """An in-flight generation checkpoint read from disk, to continue on the engine thread."""

    record: GenerationRecord
    loaded: LoadedSnapshot


@attrs.frozen(eq=False)
class StartGeneration:
    request: GenerationRequest
    hit: CacheHit | None  # the RAM prefix to lend
    events: trio.MemorySendChannel[GenerationEvent]
    submitted_at: float = 0.0
    restore: RestoreSnapshot | None = None  # wins over `hit` when present
    # The request key when generation checkpoints are on (kv.gen_checkpoint.request_key).
    checkpoint_key: str | None = None
    resume: ResumeGeneration | None = None  # wins over `hit` and `restore`
    draft: DraftPrefix | None = None  # --draft-model: the draft's own cached prefix
    checkpoint_at: tuple[int, ...] = ()  # prompt lengths to checkpoint at (pinned breakpoint prefixes)
    tail: TailRestore | None = None  # an overlapped split's tail, read meanwhile (with `hit`, never `restore`)


@attrs.frozen
class CancelGeneration:
    """The client went away: the row leaves as "cancelled" (a generation checkpoint stays resumable)."""

    request_id: str


@attrs.frozen
class StopGeneration:
    """The client's stop string matched: the row ends as a normal "stop" and its checkpoint is published."""

    request_id: str


@attrs.frozen
class ShardsDropped:
    """`--distributed`: mirrored prefixes the cache owner no longer holds (kv/shard_mirror.py).

    The engine tells the follower ranks with its next step.
    """

    refs: tuple[ShardRef, ...]


EngineInbox = StartGeneration | CancelGeneration | StopGeneration | ShardsDropped


# --- cache owner inbox ---------------------------------------------------------


@attrs.frozen(eq=False)
class LookupPrefix:
    """Reply: a `PrefixLookup`."""

    tokens: tuple[int, ...]
    namespace: str
    reply: Reply[PrefixLookup]
    session: str | None = None  # its latest checkpoint is tried first (seed §5.12)
    # May an overlapped split be chosen? False while the engine holds other rows: it would decline one (its head
    # is prefilled apart only with the batch empty), so the row is weighed between the other arms alone
    overlap: bool = True


@attrs.frozen(eq=False)
class FindCheckpointTokens:
    """Reply: the exact tokens of the best-matching RAM and SSD checkpoints (a list, maybe empty).

    No accounting, no I/O: used to realign a re-tokenized conversation with the
    ids its cached checkpoint was computed from.
    """

    tokens: tuple[int, ...]
    namespace: str
    reply: Reply[list[tuple[int, ...]]]


@attrs.frozen(eq=False)
class PrefetchHint:
    """A request arrived: if the SSD holds its longest prefix, start reading it now."""

    tokens: tuple[int, ...]
    namespace: str


@attrs.frozen(eq=False)
class PublishPrefix:
    """A checkpoint of exact `tokens`, evaluated, owned by the cache from now on."""

    tokens: tuple[int, ...]
    namespace: str
    payload: list[object]  # mlx-lm caches (opaque to the cache)
    nbytes: int
    trimmable: bool
    reason: str  # "boundary" (prompt-boundary snapshot), "final" (prompt + generation) or "restore"
    plan: SnapshotPlan | None = None  # for the SSD writer (None without an SSD tier)
    durable: bool = False  # already on SSD (a restored file)
    session: str | None = None  # the session whose latest checkpoint this becomes
    shard: ShardRef | None = None  # --distributed: the followers keep their shard of it under this key
    pages: tuple[PageRef, ...] = ()  # --ram-pages on: the shared KV pages `payload` is made of


@attrs.frozen(eq=False)
class EntryDurable:
    """The coordinator reports that a file now holds exactly `record.tokens`."""

    record: SsdRecord


@attrs.frozen(eq=False)
class EntryNotPersisted:
    """A write for these tokens failed; the RAM entry may be dropped under pressure."""

    namespace: str
    tokens: tuple[int, ...]
    reason: str


@attrs.frozen(eq=False)
class RecordLost:
    """A file could not be read back (corrupt, mismatched or gone): forget it."""

    record: SsdRecord


@attrs.frozen
class PrefillMeasured:
    """Engine-side timing of one single-row prefill chunk (for restore-or-recompute); `whole`: of a
    whole prompt prefilled alone, to its first token (every chunk and the steps between them); `head`: an
    overlapped split's head, recomputed apart while its tail was read."""

    new_tokens: int
    context: int
    seconds: float
    whole: bool = False
    head: bool = False


@attrs.frozen
class RestoreMeasured:
    """Engine-side timing of one restore (for the restore-or-recompute model). `taken` False: a restore the
    advisor chose was not made (an overlapped split's tail recomputed): nothing measured, its plan done."""

    nbytes: int
    seconds: float
    taken: bool = True


@attrs.frozen
class MemoryMeasured:
    """Engine-side MLX memory (bytes), read on its thread: the cache owner checks the memory budget."""

    active_bytes: int  # mx.get_active_memory(): weights, batches and the RAM tier's arrays
    peak_bytes: int  # mx.get_peak_memory()
    reason: str  # "prefill" (a prefill boundary), "decode" (every few hundred steps) or "idle" (after a trim)
    buffer_cache_bytes: int = 0  # mx.get_cache_memory(): freed buffers MLX keeps for reuse (not active memory)
    pool: PoolUsage | None = None  # the GPU's memory pool (CUDA; runtime/device_memory.py), its idle trims so far


@attrs.frozen
class EngineBusy:
    """The engine has rows in its batch (True) or none (False), sent when that changes: the cache owner
    issues host-tier moves only while no row decodes (kv/host_tier.py)."""

    busy: bool


@attrs.frozen(eq=False)
class EncoderOutputs:
    """A step's vision encoder outputs (vision/encoder.py): new ones for the SSD tier, and the images
    whose outputs were reused (their SSD copies become the most recently used)."""

    encoded: tuple[TensorPlan, ...]
    used: tuple[str, ...]  # image digests


@attrs.frozen
class CacheStatsSnapshot:
    """The cache owner's counters, frozen at the time of the query."""

    tiers: TierStats
    published: dict[str, int]
    restores: int
    restore_ms_last: float | None
    corrupt_removed: int
    shared: dict[str, int | bool] | None = None  # a directory shared with other replicas (--ssd-shared)
    host: dict[str, object] | None = None  # --host-cache-gb: the host tier, or why it is a no-op
    encoder_files: int = 0  # of the SSD tier's entries: vision encoder outputs (vision/tensor_store.py)
    encoder_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        t = self.tiers
        ram = attrs.asdict(t.ram)
        ram.update({f"published_{k}": v for k, v in self.published.items()})
        out: dict[str, object] = {"ram": ram}
        if t.sessions is not None:
            out["sessions"] = attrs.asdict(t.sessions)
        if t.pins is not None:
            out["pins"] = attrs.asdict(t.pins)
        if t.ssd_enabled:
            ssd: dict[str, object] = {
                "entries": t.ssd_entries,
                "bytes": t.ssd_bytes,
                "blocks": t.ssd_blocks,
                "checkpoint_bytes": t.ssd_checkpoint_bytes,
                "max_bytes": t.ssd_max_bytes,
                "restores": self.restores,
                "restore_ms_last": self.restore_ms_last,
                "demotions": t.demotions,
                "idle_demotions": t.idle_demotions,
                "dropped_unpersisted": t.dropped_unpersisted,
                "longest_durable_prefix_tokens": t.longest_durable_prefix_tokens,
                "corrupt_removed": self.corrupt_removed,
                "evictions": t.ssd_evictions,
                "not_stored": t.not_stored,
                "restore_decisions": t.restore_decisions,
                "encoder_outputs": {"entries": self.encoder_files, "bytes": self.encoder_bytes},
            }
            if self.shared is not None:
                ssd["shared"] = self.shared
            out["ssd"] = ssd
        if t.memory is not None:
            out["memory"] = attrs.asdict(t.memory)
        if self.host is not None:
            out["host"] = self.host
        return out


@attrs.frozen(eq=False)
class FlushThrough:
    """A flush, routed through the cache owner: it reaches the coordinator after every
    publication the owner already received, so the flush covers them."""

    flush: FlushRequest


@attrs.frozen(eq=False)
class QueryCacheStats:
    reply: Reply[CacheStatsSnapshot]


@attrs.frozen(eq=False)
class CloseSession:
    """Drop a session's references (cached state stays). Reply: False if the session is unknown."""

    session: str
    reply: Reply[bool]


@attrs.frozen(eq=False)
class PinSession:
    """Keep a session's latest checkpoints in RAM for `ttl_s` seconds (a retention class, a cache_control TTL).

    Sent before the session's request, so its checkpoints are pinned as they are published.
    """

    session: str
    ttl_s: float


@attrs.frozen(eq=False)
class FindSessionCheckpoint:
    """A session's latest checkpoint and what holds it (an export). Reply: None when no tier holds it."""

    session: str
    namespace: str
    reply: Reply[SessionCheckpoint | None]


@attrs.frozen(eq=False)
class AdoptCheckpoint:
    """An imported, verified checkpoint: its SSD file (`record`, already in the store) and its caches.

    Reply: whether RAM holds it now.
    """

    tokens: tuple[int, ...]
    namespace: str
    payload: list[object]  # mlx-lm caches (opaque to the cache)
    nbytes: int
    trimmable: bool
    record: SsdRecord | None
    session: str | None
    reply: Reply[bool]


@attrs.frozen(eq=False)
class PinPrefix:
    """Keep the RAM entry covering exactly `tokens` (a `cache_control` breakpoint's prefix) for `ttl_s` seconds;
    released with `session`."""

    session: str
    namespace: str
    tokens: tuple[int, ...]
    ttl_s: float


@attrs.frozen(eq=False)
class ReleaseRam:
    """Admission by KV bytes (kv/admission.py): free `nbytes` of RAM the tiers can free (durable entries
    demoted, droppable ones evicted, coldest first; 0: free nothing). Reply: what the RAM tier holds then."""

    nbytes: int
    reply: Reply[RamRoom]


CacheOwnerMessage = (
    FlushThrough
    | LookupPrefix
    | FindCheckpointTokens
    | PrefetchHint
    | PublishPrefix
    | EntryDurable
    | EntryNotPersisted
    | RecordLost
    | PrefillMeasured
    | RestoreMeasured
    | MemoryMeasured
    | EngineBusy
    | EncoderOutputs
    | QueryCacheStats
    | CloseSession
    | PinSession
    | FindSessionCheckpoint
    | AdoptCheckpoint
    | PinPrefix
    | ReleaseRam
)

# What the engine sends the cache owner (a part of the cache owner's inbox).
EngineNote = PublishPrefix | PrefillMeasured | RestoreMeasured | MemoryMeasured | EngineBusy | EncoderOutputs


# --- durability coordinator and SSD writer ---------------------------------------


@attrs.frozen(eq=False)
class MarkDirty:
    """A new RAM checkpoint that is not yet on SSD."""

    namespace: str
    tokens: tuple[int, ...]
    plan: SnapshotPlan | TensorPlan  # a TensorPlan: a vision encoder output (vision/tensor_store.py)
    trimmable: bool
    nbytes: int
    first: bool = False  # pinned: queued before the checkpoints already waiting


@attrs.frozen(eq=False)
class ForgetDirty:
    """The RAM entry is gone without a write (dropped): stop tracking it."""

    namespace: str
    tokens: tuple[int, ...]


@attrs.frozen(eq=False)
class MarkNotStored:
    """A checkpoint that will never be written (e.g. larger than the SSD cap): tell the next flush."""

    namespace: str
    tokens: tuple[int, ...]
    reason: str


@attrs.frozen(eq=False)
class WriteSnapshot:
    job: WriteJob


@attrs.frozen
class WriterStats:
    writes: int = 0
    failures: int = 0
    bytes_written: int = 0
    write_s_last: float = 0.0
    paced_s: float = 0.0
    held_s: float = 0.0  # held still while requests waited for their first token (kv/pacing.py)
    staged: int = 0  # pieces (new blocks, whole files) copied to host memory before their write (CUDA)
    staged_bytes: int = 0
    staged_pieces: int = 0  # copies waited one by one (bounded; while rows decode, one per engine step)
    staged_calls: int = 0  # CUDA runtime calls those copies made (each a GIL hand-off)
    step_waits: int = 0  # staged pieces that waited for the engine's next step
    disk_full: bool = False  # a write hit ENOSPC/EDQUOT/EFBIG
    # Where the writes' seconds went, summed over writing threads (kv/pacing.py WriteTimes): staging to host
    # memory, handing bytes to the OS, waiting for the disk (write-backs, fsyncs), files open to rename.
    stage_s: float = 0.0
    pwrite_s: float = 0.0
    sync_s: float = 0.0
    files_s: float = 0.0


@attrs.frozen(eq=False)
class SnapshotWritten:
    job: WriteJob
    outcome: WriteOutcome
    seconds: float
    stats: WriterStats


@attrs.frozen
class FlushReport:
    durable: bool
    pending: int
    failed: int
    dropped: int
    entries: int
    bytes: int
    longest_durable_prefix_tokens: int
    seconds: float
    reason: str | None = None
    encoder_outputs: int = 0  # of `entries`: vision encoder outputs on SSD (vision/tensor_store.py)
    encoder_output_bytes: int = 0
    # The writes that finished while the flush waited (one begun before it counts whole) and where their
    # seconds went, summed over writing threads (`WriterStats`): staging to host memory (CUDA), handing bytes
    # to the OS, waiting for the disk (write-backs and fsyncs), files open to rename.
    writes: int = 0
    written_bytes: int = 0
    stage_s: float = 0.0
    pwrite_s: float = 0.0
    sync_s: float = 0.0
    files_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


@attrs.frozen(eq=False)
class FlushRequest:
    reply: Reply[FlushReport]


@attrs.frozen
class DurabilitySnapshot:
    spills: int
    failed_spills: int
    dropped_spills: int
    superseded: int
    flushes: int
    not_stored: int
    pending_snapshots: int
    pending_spills: int
    pending_spill_bytes: int
    writer: WriterStats


@attrs.frozen(eq=False)
class DurabilityStats:
    reply: Reply[DurabilitySnapshot]


DurabilityMessage = MarkDirty | ForgetDirty | MarkNotStored | SnapshotWritten | FlushRequest | DurabilityStats


# --- generation checkpointer ------------------------------------------------------


@attrs.frozen(eq=False)
class CheckpointGeneration:
    """A running row's snapshot (prompt + emitted, pending token in the record), for the SSD."""

    key: str
    request_id: str
    plan: SnapshotPlan  # its meta carries the generation record
    emitted: int


@attrs.frozen
class GenerationCompleted:
    """The request finished normally: its checkpoint is no longer needed."""

    key: str
    request_id: str


@attrs.frozen
class GenerationAbandoned:
    """The request left early (cancelled, client gone, failed): its checkpoint stays for a retry."""

    key: str
    request_id: str


@attrs.frozen(eq=False)
class FindGenerationCheckpoint:
    """Reply: a `ResumeGeneration` for this exact request, or None."""

    key: str
    request_id: str
    prompt: tuple[int, ...]
    namespace: str
    reply: Reply[ResumeGeneration | None]


@attrs.frozen(eq=False)
class SettleCheckpoints:
    """Reply (the number of jobs still queued: 0) once every queued checkpoint write and removal is done."""

    reply: Reply[int]


GenCheckpointMessage = (
    CheckpointGeneration | GenerationCompleted | GenerationAbandoned | FindGenerationCheckpoint | SettleCheckpoints
)


# --- prefetcher --------------------------------------------------------------------


@attrs.frozen(eq=False)
class PrefetchRecord:
    """The cache owner says: this record will likely be restored; read it now."""

    record: SsdRecord
    upto: int = 0  # > 0: only its first `upto` tokens (the restore advisor would split it)
    start: int = 0  # > 0: only its tokens from `start` on (an overlapped split's tail)


@attrs.frozen(eq=False)
class FetchSnapshot:
    """Reply: the file's `LoadedSnapshot`, or None when the read failed (a miss)."""

    record: SsdRecord
    reply: Reply[LoadedSnapshot | None]
    upto: int = 0  # > 0: only the record's first `upto` tokens (a block layout's leading blocks)


@attrs.frozen
class PrefetchSnapshot:
    prefetches: int = 0
    prefetch_hits: int = 0
    reads: int = 0
    read_failures: int = 0
    bytes_read: int = 0
    reads_into_mlx: int = 0  # read straight into MLX arrays (restore_landing "mlx")


@attrs.frozen(eq=False)
class PrefetchStats:
    reply: Reply[PrefetchSnapshot]


@attrs.frozen(eq=False)
class FetchTail:
    """Read an overlapped split's tail (the record's tokens from `start` on, to `upto` when > 0) into
    `slot`: its `LoadedSnapshot`, or None when the read failed (the engine recomputes it); `slot.place()`
    once the read has its memory (the engine's thread, recomputing the head, could not allocate it)."""

    record: SsdRecord
    start: int
    slot: TailSlot
    upto: int = 0


PrefetcherMessage = PrefetchRecord | FetchSnapshot | FetchTail | PrefetchStats


@attrs.frozen(eq=False)
class PublishKvEvents:
    """Cache owner -> KV-event publisher: block events of one change to the tiers (kv/kv_events.py)."""

    ts: float
    events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]
