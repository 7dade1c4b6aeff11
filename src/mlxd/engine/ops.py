"""The values the engine core takes and gives: one `StepOps` in, one `StepResult` out.

`StepOps` is what every rank does in one step: rank 0 builds it from its inbox,
and in `--distributed` sends it (less what only rank 0 holds: its RAM prefixes,
restores and resumes) to the followers, which drive their own core with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from mlxd.kv.shard_mirror import PrefixRef, ShardRef
from mlxd.runtime.kernel.messages import (
    CheckpointGeneration,
    DraftPrefix,
    EngineNote,
    GenerationAbandoned,
    GenerationCompleted,
    GenerationEvent,
    GenerationRequest,
    RestoreSnapshot,
    ResumeGeneration,
    TailRestore,
)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxd.engine.adapters import AdapterInfo
    from mlxd.engine.memory_costs import OwnMemory
    from mlxd.kv.device_costs import DeviceProbe
    from mlxd.kv.prompt_cache import CacheHit
    from mlxd.kv.ssd_store import StoreIdentity


class ModelRefused(Exception):
    """The model cannot be served as configured (its cache classes, or the KV scheme); raised at load."""


@attrs.frozen(kw_only=True)
class EngineInfo:
    """What the rest of the runtime may know about the loaded model."""

    model_name: str
    model_path: str
    tokenizer: TokenizerWrapper  # thread-safe for encode/decode/templates
    eos_token_ids: frozenset[int]
    max_context: int
    kv_bytes_per_token: int
    vocab_size: int  # rows of the embedding: every valid token id is below this
    model_identity: str  # sha256 of the weights', config's and tokenizer's bytes
    store_identity: StoreIdentity  # what SSD files and KV-event block hashes must match
    probe: DeviceProbe | None = None  # the startup device probe, when it ran
    memory_budget_bytes: int = 0  # resolved --memory-budget (0 = none)
    adapters: tuple[AdapterInfo, ...] = ()  # --adapter: the LoRA adapters requests may name
    draft_tag: str | None = None  # --draft-model: its identity, the suffix of its cache entries' namespace
    own_memory: OwnMemory | None = None  # --kv-admission: this runtime's measured memory (engine/memory_costs.py)
    # Its caches can be cut back to any shorter prefix: plain attention; not recurrent state, nor a
    # sliding window (trimmable only until it wraps, which long prompts do)
    trimmable: bool = True


@attrs.frozen(kw_only=True)
class RowStart:
    """A request joining the batch and what it starts from (at most one of hit, restore, resume)."""

    request: GenerationRequest
    hit: CacheHit | None = None  # a RAM prefix to lend
    restore: RestoreSnapshot | None = None  # a cold file read for it (wins over `hit`)
    resume: ResumeGeneration | None = None  # an in-flight generation to continue (wins over both)
    draft: DraftPrefix | None = None  # --draft-model: the draft's own cached prefix (its RAM hit or cold file)
    checkpoint_key: str | None = None  # its generation-checkpoint key (--generation-checkpoint)
    queued_s: float = 0.0  # from submission to this step
    # prompt lengths to checkpoint at (pinned breakpoint prefixes, the chat template's stable prefix)
    checkpoint_at: tuple[int, ...] = ()
    tail: TailRestore | None = None  # an overlapped split's tail, read meanwhile (with `hit`; never `restore`)


def _prefixes_match(ops: StepOps, _attr: object, prefixes: tuple[PrefixRef | None, ...]) -> None:
    if prefixes and len(prefixes) != len(ops.starts):
        raise ValueError(f"{len(prefixes)} prefixes for {len(ops.starts)} starts")


@attrs.frozen
class StepOps:
    """What the engine does in one step, the same on every rank."""

    starts: tuple[RowStart, ...] = ()
    # --distributed: the mirrored prefix each start lends (None: cold), in the order of
    # `starts`; empty when every start is cold. A follower holds its shard under that key.
    prefixes: tuple[PrefixRef | None, ...] = attrs.field(default=(), validator=_prefixes_match)
    cancels: tuple[str, ...] = ()  # request ids leaving as "cancelled" (a client went away)
    stops: tuple[str, ...] = ()  # request ids ending as a normal "stop" (a client's stop string)
    # --distributed: mirrored prefixes rank 0's cache owner no longer holds (`ShardsDropped`):
    # followers drop their shards, after lending this step's prefixes and before keeping
    # this step's checkpoints.
    drops: tuple[ShardRef, ...] = ()
    reset: bool = False  # the last step failed: drop every row and start a fresh generator
    # With `reset`: the failed step ran on rank 0, so its checkpoints never reached the cache
    # owner; followers forget the prefixes that step added.
    discard: bool = False
    shutdown: bool = False  # rank 0 is stopping: followers exit

    @property
    def lends(self) -> bool:
        """Whether a start begins from a mirrored prefix (the followers then confirm they hold it)."""
        return any(p is not None for p in self.prefixes)

    @property
    def empty(self) -> bool:
        return not (self.starts or self.cancels or self.stops or self.drops or self.reset)


# What a step produces for others: the cache owner's notes and the generation checkpointer's.
Note = EngineNote | CheckpointGeneration | GenerationCompleted | GenerationAbandoned


@attrs.frozen
class Emit:
    """One event for one request."""

    request_id: str
    event: GenerationEvent


@attrs.frozen
class Rejected:
    """A start refused before it joined the batch (its request fails; the batch is untouched)."""

    request_id: str
    message: str


@attrs.frozen(kw_only=True)
class SpeculationStats:
    """--speculative: what drafting did since the engine started."""

    active: bool  # False: the model's caches cannot roll back (off_reason says why)
    off_reason: str | None = None
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens the target agreed with
    acceptance_rate: float = 0.0  # accepted / proposed
    tokens_per_forward: float = 0.0  # tokens a drafting row emitted per target forward (1.0 = no gain)
    verify_steps: int = 0  # target forwards that verified drafts
    verified_rows: int = 0  # row verifications (a forward verifies every drafting row of the batch)
    constrained_rows: int = 0  # speculating rows whose drafts their grammar checks before verification
    grammar_refused: int = 0  # draft tokens cut before verification because the grammar refused them
    gate_pauses: int = 0  # drafting is paused: verifying steps were slower than plain ones (pauses in a row)
    decode_steps: int = 0  # decode steps of the speculating batch (verifying or not)
    gate_withheld_steps: int = 0  # of those, steps the engine gate kept from verifying (paused, or measuring plain)
    draft_prefix_reused: int = 0  # --draft-model: prefix tokens a row's draft KV took from the prompt cache
    draft_prefix_recomputed: int = 0  # --draft-model: prefix tokens the draft computed at a row's first step
    draft_steps: int = 0  # --draft-model: steps where the draft proposed (its forwards batched across rows)
    draft_rows: int = 0  # --draft-model: rows' proposals made in those steps (÷ draft_steps: rows per forward)
    gate_probes: int = 0  # --draft-model: rows' drafts made for the gate's probes (not verified)
    gate_probe_accepted: int = 0  # of those drafts, the ones the rows then emitted (what verifying would keep)
    gate_cannot_pay_steps: int = 0  # withheld steps whose drafts could not beat a plain step even if all accepted
    pending_reads: int = 0  # steps that read the rows' pending tokens back to the host (waiting for the forward)


@attrs.frozen(kw_only=True)
class EngineStats:
    """The engine's counters after a step (a value: the actor hands it out as it is)."""

    steps: int = 0
    # runs of steps handed to the engine thread, one trio round trip each (engine/step_loop.py)
    step_runs: int = 0
    batch_rows: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens prefilled (not reused from a cache)
    failed_steps: int = 0
    checkpoints_skipped: int = 0
    checkpoint_s: float = 0.0  # engine-thread time spent on generation checkpoints
    # MLXD_FINAL_PLAN=after-token with the SSD tier: rows whose final checkpoint came a step after their last
    # token (engine/core.py `_leave_late`); None otherwise.
    late_final_checkpoints: int | None = None
    # MLXD_PLAN_PACK_MB with the SSD tier: write plans made from one packed copy of their tensors; None otherwise.
    packed_plans: int | None = None
    # Overlapped splits (kv/restore_decision.py OVERLAP; engine/overlap.py): tails appended and their
    # tokens, tails recomputed instead (late, or their read failed), splits declined (a busy batch)
    overlap_tails: int = 0
    overlap_tail_tokens: int = 0
    overlap_tails_recomputed: int = 0
    overlap_tails_unplaced: int = 0  # of those, tails whose read had no memory yet when the head was done
    overlaps_declined: int = 0
    # --distributed rank 0 with the prompt cache (kv/shard_mirror.py); None otherwise.
    mirrored_prefixes: int | None = None
    mirror_misses: int | None = None
    # A vision model (vision/encoder.py): images encoded, encoder outputs reused from RAM / SSD.
    media_encoded: int | None = None
    media_encoder_ram_hits: int | None = None
    media_encoder_ssd_hits: int | None = None
    media_prefills: int | None = None
    speculation: SpeculationStats | None = None  # --speculative (None: off)
    # Structured output's compiled grammars (structured/matcher.py CacheStats: entries, hits, misses, warmed);
    # None until the first constrained request or a start that warmed the saved list.
    grammars: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen
class StepResult:
    emits: tuple[Emit, ...] = ()
    notes: tuple[Note, ...] = ()  # in order: checkpoints before the memory reading that follows them
    finished: tuple[str, ...] = ()  # request ids that left the batch (their last event is in `emits`)
    rejected: tuple[Rejected, ...] = ()
    stats: EngineStats = EngineStats()
