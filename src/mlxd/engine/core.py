"""The engine core: the generation loop, synchronous, on the MLX thread.

`EngineCore` owns the model, the tokenizer, mlx-lm's `BatchGenerator` and the
rows in it. It turns one `StepOps` into one `StepResult` (engine/ops.py):
rows join (from a RAM prefix, an SSD restore, a resumed generation, or cold),
rows leave (cancelled, stopped), one `BatchGenerator.next()` runs, and what
came out is returned as values: token events per request, checkpoints and
timings for the cache owner, generation checkpoints, refusals. It imports no
trio and knows no channel: the engine actor, the distributed leader and its
followers all drive it the same way (actors/engine.py, engine/ranks.py).

What a row does beyond decoding lives in the parts it carries
(engine/features.py), called at fixed points of a step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from mlxd.engine import loading, memory_costs
from mlxd.engine.apart import PendingApart
from mlxd.engine.features import (
    JOIN_EARLY_GAP,
    Constrained,
    Ending,
    Feature,
    GenerationCheckpoints,
    Joining,
    LogprobRead,
    PromptCheckpoints,
    Sampling,
    StepMasks,
    StopTokens,
    final_plan,
    first_token_early,
    gil_switch_ms,
    join_first_early,
    plan_device,
    plan_pack_bytes,
    plan_stream,
    read_logprobs,
    trims_device_pool,
)
from mlxd.engine.ops import (
    Emit,
    EngineInfo,
    EngineStats,
    Note,
    Rejected,
    RowStart,
    StepOps,
    StepResult,
)
from mlxd.engine.prefill_slices import APART_MIN, PrefillSlicer, aligned, prefill_step
from mlxd.engine.speculative import (
    DraftCheckpoints,
    NgramDrafts,
    Speculation,
    draft_namespace,
    engine_drafts,
    speculation_off_reason,
)
from mlxd.kv import grammar_list
from mlxd.kv.device_costs import DeviceProbe
from mlxd.kv.file_format import FileHeader, Landing, LoadedSnapshot, SnapshotMeta, SnapshotPlan
from mlxd.kv.ssd_store import StoreIdentity
from mlxd.model import suffix_attention
from mlxd.model.identity import model_identity
from mlxd.runtime import device_memory
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.distributed import StepChannel
from mlxd.runtime.kernel.messages import (
    GenerationAbandoned,
    GenerationCompleted,
    GenerationFinished,
    MemoryMeasured,
    PrefillMeasured,
    PromptAccepted,
    PublishPrefix,
    RestoreMeasured,
    SamplingParams,
    TokenGenerated,
)
from mlxd.runtime.logging import get_logger
from mlxd.structured.matcher import GrammarCache, Matcher, load_vocabulary
from mlxd.structured.spec import Constraint
from mlxd.vision.encoder import Vision, load_vision

log = get_logger("mlxd.engine")

# With a memory budget, MLX memory is measured for the cache owner at every prefill
# boundary and at least every this many steps (a cheap counter read, no sync).
MEASURE_MEMORY_EVERY = 256
GRAMMAR_WARM_BUDGET_S = 3.0  # at load: the saved constraints compiled before serving, at most this long
# A deferred prompt-boundary checkpoint (`EngineCore.checkpoint`) is published at the start of the first step
# after its row has this many tokens: the step loop runs one step ahead of delivery (engine/step_loop.py), so
# that step starts once the first token's step was delivered, and the plan's host reads (which hold the GIL on
# CUDA) do not compete with that token's way out.
PUBLISH_AFTER_TOKENS = 2
WHOLE_PREFILL_MIN = 256  # prompts this long prefilled alone are timed whole for the restore advisor
# MLXD_SUFFIX_APART=N (off: 0): a suffix of at most N new tokens after a cached prefix, joining an empty batch,
# is prefilled on its lent caches before it joins (as a row joining others' prefills is), not by mlx-lm's
# prompt phase (its per-chunk mx.clear_cache, and a merged batch cache grown for it); an arm on the H200.
def suffix_apart(value: str) -> int:
    """`MLXD_SUFFIX_APART`'s tokens (unset or "": 0, off); ValueError unless a whole number >= 0."""
    value = value.strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"MLXD_SUFFIX_APART must be a whole number of tokens (0: off), not {value!r}")
    return int(value)


SUFFIX_APART = suffix_apart(os.environ.get("MLXD_SUFFIX_APART", ""))  # read once, at import


@attrs.define
class Row:
    """A request in the batch: its start, its generator uid, its parts and progress."""

    start: RowStart
    sampling: Sampling
    features: tuple[Feature, ...]
    adapter: int = 0  # --adapter: the index its forwards select (0: the base model)
    uid: int = -1
    cached_tokens: int = 0  # what its prefill starts on (an overlapped split: recomputed ones among them)
    recomputed: int = 0  # of them, tokens an overlapped split recomputed beside its tail's read
    generated: int = 0
    prefilled: int = 0  # prompt tokens processed so far in this insert
    prompt_new: int = 0  # prompt tokens this insert prefills (the last one goes with the first decode)
    joined_at: int = 0  # the prompt position of this insert's first token (its caches hold what is before)
    prefill_began: float = 0.0  # perf_counter when its prefill began (after a restore's adoption)
    prefill_shared: bool = False  # another row was in the batch during its prefill: its wall time is not its own
    stages: list[tuple[str, float]] = attrs.Factory(list)  # until its first token: (stage, time.monotonic())
    early: bool = False  # its first token went out with the step that sampled it; mlx-lm hands it out again next
    request_id: str = attrs.field(init=False)
    # The parts with a `token` hook (read per token: the others' hooks do nothing)
    token_parts: tuple[Feature, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.request_id = self.start.request.request_id
        self.token_parts = tuple(p for p in self.parts() if type(p).token is not Feature.token)

    def stamp(self, stage: str) -> None:
        """Where its time goes before its first token (handed out with that token: TokenGenerated.stages)."""
        if self.generated == 0:
            self.stages.append((stage, time.monotonic()))

    def parts(self) -> tuple[Feature, ...]:
        return (self.sampling, *self.features)


@attrs.frozen
class BatchParts:
    """What the rows in the batch ask of every step (the core finds it again when a row joins or leaves)."""

    constrained: tuple[tuple[int, Constrained], ...]  # (uid, part) of the rows with a grammar's masks
    logprobs: bool  # a row asks for its tokens' logprobs


@attrs.define
class StepOut:
    """What a step produces, gathered as it runs."""

    emits: list[Emit] = attrs.Factory(list)
    notes: list[Note] = attrs.Factory(list)
    finished: list[str] = attrs.Factory(list)
    rejected: list[Rejected] = attrs.Factory(list)

    def emit(self, row: Row, event: Any) -> None:
        self.emits.append(Emit(row.request_id, event))


@attrs.define
class Counters:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    checkpoints_skipped: int = 0
    checkpoint_s: float = 0.0
    late_finals: int = 0  # MLXD_FINAL_PLAN=after-token: rows whose final checkpoint came a step after their last token
    packed_plans: int = 0  # MLXD_PLAN_PACK_MB: write plans made from one packed copy of their tensors
    # Overlapped splits (`_overlap`): tails appended (and their tokens), tails recomputed instead (not
    # back in time, or their read failed), splits declined (other rows in the batch, or a quantized cache)
    overlap_tails: int = 0
    overlap_tail_tokens: int = 0
    overlap_tails_recomputed: int = 0
    overlap_tails_unplaced: int = 0  # of those, tails whose read had no memory when the head was done
    overlaps_declined: int = 0


class EngineCore:
    """Load a model; run steps; lend landings. Every method runs on the one MLX thread."""

    def __init__(self, config: RuntimeConfig) -> None:
        self._config = config
        self.counters = Counters()
        self._rows: dict[int, Row] = {}  # by generator uid
        self._uids: dict[str, int] = {}  # request id -> generator uid
        self._pending: PendingApart | None = None  # a lone long prompt prefilling apart, a chunk a step
        self._batch: BatchParts | None = None  # what the batch's rows ask of every step (None: to find again)
        self._steps_unmeasured = 0
        # Prompt-boundary checkpoints taken (their caches copied), their publication (the SSD write plan: on
        # CUDA a host read of every array) waiting until their row's first token is out (`publish_deferred`)
        self._deferred: list[tuple[Row, str, Callable[[], PublishPrefix]]] = []
        # MLXD_FINAL_PLAN=after-forward (the default, with a prompt cache) or after-token (with the SSD tier): rows
        # whose last token went out, their final checkpoint and finish waiting for the next step (`_leave_late`);
        # not with speculation (its leave reads the batch)
        plan = final_plan()
        self._late_final = config.speculative == "off" and (
            (plan == "after-token" and config.ssd_cache_dir is not None)
            or (plan == "after-forward" and config.prompt_cache_bytes > 0))
        self._after_forward = self._late_final and plan == "after-forward"  # left after the next step's dispatch
        self._leaving: list[tuple[Row, str, Ending]] = []
        self._left: list[tuple[Row, str, Ending]] = []  # after-forward: those leaving in this step, copies held
        # MLXD_PLAN_PACK_MB with the SSD tier: write plans up to this many bytes come from one packed copy (0: off)
        self._pack_bytes = plan_pack_bytes() if config.ssd_cache_dir is not None else 0
        self._plan_on_side = plan_stream() == "side"  # MLXD_PLAN_STREAM: write plans not behind the forward in flight
        self._plan_device = plan_device()  # MLXD_PLAN_DEVICE: SSD write plans by device address (CUDA)
        # MLXD_FIRST_TOKEN_EARLY: new rows' first tokens with the step that sampled them where no row was decoding
        # (`_first_tokens_now`); MLXD_JOIN_FIRST_EARLY: beside decoding rows too. Not with speculation (its batch is
        # another) nor across ranks
        self._early_first = first_token_early() and config.speculative == "off" and not config.distributed
        self._join_early = self._early_first and join_first_early()
        self._join_early_at = -JOIN_EARLY_GAP  # the step of the last early read beside decoding rows
        # Set by load():
        self._stream: Any = None
        self._reads: Any = None  # a side stream for reads of a step's outputs (None: the current one)
        self.model: Any = None
        self.tokenizer: Any = None
        self.generator: Any = None
        self._store_identity: StoreIdentity | None = None
        self.channel: StepChannel | None = None  # --distributed: this rank's step channel
        self._memory_budget = 0
        self._cache_limit_before: int | None = None  # MLX's buffer-cache limit before load set ours
        self._pool: device_memory.DevicePool | None = None  # CUDA's memory pool, with a memory budget
        self._pool_headroom = 0  # reserved memory an idle trim keeps past what MLX uses (the buffer-cache share)
        self._trim_pool = trims_device_pool()
        self._eos: frozenset[int] = frozenset()
        self._prefill_step_size = config.prefill_step_size
        # No forward run in this process yet (no probe measured or warm-up, no step): its first runs build
        # kernels, so an overlapped head run first is not timed for the advisor (a reused probe without
        # `--device-warmup` leaves a GPU process cold)
        self._cold = True
        # Long prefills in time slices, interleaved with other rows (engine/prefill_slices.py); off across
        # ranks, where every rank must take the same chunk and their clocks differ.
        self._slicer = PrefillSlicer(0.0 if config.distributed else config.prefill_slice_s)
        self._fresh_generator: Callable[[], Any] = self._new_generator
        self._grammars: GrammarCache | None = None
        self._grammar_file: Path | None = None  # with an SSD tier: the recent constraints (kv/grammar_list.py)
        self._model_path: Path | None = None
        self._masks = StepMasks(self._step_inputs, self._constrained_rows, self._pending_inputs,
                                self._current_inputs)  # constrained rows' masks, together
        self._switch_before: float | None = None  # Python's GIL switch interval before MLXD_GIL_SWITCH_MS
        self.vision: Vision | None = None  # a vision model's tower and encoder cache (set by load())
        self._pages: Any = None  # --ram-pages on: kv/page_pool.PagePool, RAM entries' shared pages (set by load())
        # --speculative ngram: rows draft from their own tokens; load() turns it off for caches that cannot roll back.
        self._drafts = engine_drafts(self._rows, draft_model=config.draft_model is not None)
        self._speculate = config.speculative != "off"
        self._draft: Any = None  # --draft-model: engine/draft.py's DraftModel (set by load())
        # False for recurrent, hybrid and other caches that cannot be cut back (set by load()).
        self._trims = True
        # --adapter: LoRA adapters each row may select (engine/adapters.py; set by load()).
        from mlxd.engine.adapters import RowAdapters  # imports MLX: not at module import

        self.adapters = RowAdapters()

    # --- lifecycle -------------------------------------------------------------------

    @classmethod
    def over(
        cls, config: RuntimeConfig, generator: Any, *, eos: frozenset[int], store_identity: StoreIdentity | None = None
    ) -> EngineCore:
        """A core around a generator already built, with no model loaded (tests drive one with a scripted
        generator that has mlx-lm `BatchGenerator`'s insert/next/remove/extract_cache/close)."""
        import mlx.core as mx

        core = cls(config)
        core._stream = mx.default_stream(mx.default_device())
        core.generator, core._eos = generator, eos
        core._store_identity = store_identity or StoreIdentity(model_id="scripted", fingerprint="scripted",
                                                               tokenizer_hash="none")
        core._fresh_generator = lambda: generator
        core._early_first = False  # (a scripted generator keeps mlx-lm's timing: the first token with the next step)
        return core

    def load(self) -> EngineInfo:
        """Load the model, measure its KV cost and the device, and start a generator."""
        import mlx.core as mx

        from mlxd.model import (
            batch_filter,
            batch_handover,
            carry_rows,
            fast_mask,
            keep_buffers,
            window_mask,
        )

        switch = gil_switch_ms()
        if switch is not None:  # process-wide: restored by close()
            self._switch_before = sys.getswitchinterval()
            sys.setswitchinterval(switch / 1000)
        fast_mask.install()  # fused causal attention for unpadded prefill chunks
        suffix_attention.install()  # GPU: short chunks over long contexts without cuDNN's per-shape graph
        batch_handover.install()  # a lone row into mlx-lm's batch and on to generation uncopied
        keep_buffers.install()  # prompt chunks reuse MLX's buffers, no clear after each (MLXD_KEEP_BUFFERS=0: mlx-lm's)
        batch_filter.install()  # rows leave the batch without waiting for the forward in flight
        carry_rows.install()  # a row that ends while others decode leaves a step later (no copy if they end too)
        window_mask.install()  # a rotated window cache's chunk mask agrees with its keys (time slices)
        self._stream = mx.new_stream(mx.default_device())
        self._reads = mx.new_stream(mx.default_device())  # logprob reads, beside the queued next step
        before = memory_costs.active_bytes() if self._config.kv_admission else 0  # this runtime's own memory
        with mx.stream(self._stream):
            loaded = loading.load(self._config, self._stream)
            self.model, self.tokenizer, self.channel = loaded.model, loaded.tokenizer, loaded.channel
            self.adapters = loading.adapters(self.model, self._config)
            self._eos = frozenset(self.tokenizer.eos_token_ids)
            self.vision = load_vision(
                loaded.path, self.model, dtype=mx.float32 if mx.default_device() == mx.cpu else None,
                persist=self._config.ssd_cache_dir is not None,
            )
            device_memory.managed()  # on CUDA: find the runtime for the managed-memory hints, and say so
            kv_bytes_per_token = loading.check_caches(self.model, self._config, loaded.path)
            self._trims = loading.trimmable(self.model, self._config)
            self._speculation_check()
            if self._speculate and self._config.draft_model is not None:
                from mlxd.engine.draft import load_draft

                self._draft = load_draft(self._config.draft_model, self.tokenizer,
                                         prefill_step=self._prefill_step_size,
                                         placeholder=self.vision.placeholder if self.vision is not None else None)
                self._draft_gate_ceiling()
            self.generator = self._new_generator()
            cfg = loaded.config
            max_context = self._config.max_context or int(cfg.get("max_position_embeddings", 32768))
            identity = model_identity(loaded.path)  # content hash (memoized per file); not the served name
            self._store_identity = loading.store_identity(identity, loaded.path, self._config.kv_scheme)
            self._pages = self._page_pool(kv_bytes_per_token)
            self._model_path = loaded.path
            if self._config.ssd_cache_dir is not None:
                self._warm_grammars(Path(self._config.ssd_cache_dir) / self.store_identity.fingerprint)
            vocab_size = int(cfg.get("vocab_size") or len(self.tokenizer._tokenizer))
            probe = self._probe(max_context, kv_bytes_per_token, vocab_size) if loading.wants_probe(self._config) else None
            self._memory_budget = loading.memory_budget(self._config)
            cache_limit = loading.keep_buffer_cache_to(self._memory_budget)
            if cache_limit is not None:
                self._cache_limit_before = cache_limit[1]
                log.info("engine.buffer_cache_limit", limit_bytes=cache_limit[0], mlx_default_bytes=cache_limit[1])
                self._pool = device_memory.device_pool()  # CUDA only: its reserved memory is the process's share
                self._pool_headroom = cache_limit[0]
            own = None
            if self._config.kv_admission:  # what admission counts beside rows' KV (engine/memory_costs.py)
                own = memory_costs.measure_own(before, self.model, lambda: loading.fresh_caches(self.model, self._config),
                                               self._draft.model if self._draft is not None else None)
        return EngineInfo(
            model_name=loading.served_name(self._config),
            model_path=str(loaded.path),
            tokenizer=self.tokenizer,
            eos_token_ids=self._eos,
            max_context=max_context,
            kv_bytes_per_token=kv_bytes_per_token,
            vocab_size=vocab_size,
            model_identity=identity,
            store_identity=self.store_identity,
            probe=probe,
            memory_budget_bytes=self._memory_budget,
            adapters=self.adapters.infos,
            draft_tag=self._draft.tag if self._draft is not None else None,
            own_memory=own,
            trimmable=self._trims and not loading.has_windows(self.model, self._config),
        )

    def _page_pool(self, kv_bytes_per_token: int) -> Any:
        """--ram-pages on: where RAM entries' shared pages come from (None: off, or caches that stay contiguous)."""
        if self._config.ram_pages != "on":
            return None
        from mlxd.kv.blocks import span_for
        from mlxd.kv.page_pool import PagePool, unpaged_reason

        reason = unpaged_reason(loading.fresh_caches(self.model, self._config))
        if reason is not None:
            log.warning("engine.ram_pages_off", reason=reason)
            return None
        tokens = self._config.ram_page_tokens or self._config.ssd_block_tokens or span_for(kv_bytes_per_token)
        log.info("engine.ram_pages", page_tokens=tokens)
        return PagePool(fingerprint=self.store_identity.fingerprint, page_tokens=tokens)

    def _paged(self, caches: list[Any], tokens: tuple[int, ...], namespace: str) -> tuple[Any, tuple[Any, ...]]:
        """A checkpoint's RAM payload and its pages: shared pages with --ram-pages on, else the caches as they are."""
        paged = None if self._pages is None else self._pages.page(caches, tokens, namespace)
        return (caches, ()) if paged is None else (paged, paged.refs)

    def _probe(self, max_context: int, kv_bytes_per_token: int, vocab_size: int) -> DeviceProbe:
        """Measure this device (seconds) before serving; see actors/device_probe.py. With the SSD tier and
        `--device-probe auto`, the last server's probe on this device and setup is reused (kv/probe_file.py)."""
        import mlx.core as mx

        from mlxd.actors.device_probe import (
            RestorePath,
            lands_in_mlx,
            probe_device,
        )
        from mlxd.kv import probe_file
        from mlxd.kv.blocks import span_for
        from mlxd.runtime import host_memory

        tune = self._config.tune_prefill_step
        if tune is None:
            tune = mx.default_device() != mx.cpu
        c = self._config
        restore = None
        if c.ssd_cache_dir:  # the path serving restores by: its landing, checks, layout and host tier
            restore = RestorePath(
                directory=Path(c.ssd_cache_dir), land=self.landing if lands_in_mlx(c) else None,
                verify=c.ssd_cache_verify, layout=c.ssd_layout,
                block_tokens=c.ssd_block_tokens or span_for(kv_bytes_per_token),
                host_tier=c.host_cache_bytes > 0 and host_memory.separate_host_memory(),
            )
        saved_at, setup = None, _probe_setup(c, restore, tune=tune, max_context=max_context,
                                            kv_bytes_per_token=kv_bytes_per_token, step=self._prefill_step_size)
        if c.ssd_cache_dir and not c.ssd_shared:  # (replicas sharing a directory may sit on other devices)
            saved_at = probe_file.probe_path(Path(c.ssd_cache_dir) / self.store_identity.fingerprint)
        probe = probe_file.load(saved_at, setup) if saved_at is not None and c.device_probe == "auto" else None
        if probe is None:
            probe = probe_device(
                self.generator,
                vocab_size=vocab_size,
                max_context=max_context,
                kv_bytes_per_token=kv_bytes_per_token,
                budget_s=c.device_probe_budget_s,
                restore=restore,
                tune_step=tune,
            )
            self._cold = False  # the probe's prefills ran here
            if saved_at is not None:
                try:
                    probe_file.save(saved_at, probe, setup)
                except OSError as exc:  # the next server probes again
                    log.warning("engine.device_probe_not_saved", path=str(saved_at), error=str(exc))
        # The probe's rows are finished; a fresh generator starts serving with the chosen chunk size, and
        # the old one's buffers leave MLX's cache with the probe's own (`reset` gives them back).
        self._prefill_step_size = probe.prefill_step_size
        self.reset()
        if _warms_up(c):
            probe = self._warm_up(probe, vocab_size)
        summary = probe.as_dict()
        summary.pop("cost_model")
        log.info("engine.device_probe", **summary)
        return probe

    def _warm_up(self, probe: DeviceProbe, vocab_size: int) -> DeviceProbe:
        """The probe's longest prefill once, untimed, by the path serving prefills a prompt apart by (and, after
        a reused probe, which ran no forward here, through the batch), so the first request's shapes find their
        kernels built (actors/device_probe.py `warm_up`); then a fresh generator."""
        from mlxd.actors.device_probe import warm_up

        tokens = probe.prefill[-1][0]
        seconds = warm_up(self.generator, lambda prompt: self._prefill_apart(tuple(prompt), None, 0),
                          vocab_size=vocab_size, tokens=tokens, batch=probe.reused)
        self._cold = False
        self.reset()
        return attrs.evolve(probe, warmup_tokens=tokens, warmup_s=seconds)

    def _speculation_check(self) -> None:
        reason = speculation_off_reason(self.model, self._config) if self._speculate else None
        if reason is not None:
            self._speculate = False
            self._drafts.off_reason = reason
            log.warning("engine.speculation_off", reason=reason)

    def _new_generator(self) -> Any:
        from mlx_lm.generate import BatchGenerator

        generator = BatchGenerator(
            self.model,
            max_tokens=self._config.default_max_tokens,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=self._config.max_batch,
            prefill_batch_size=min(self._config.prefill_batch, self._config.max_batch),
            prefill_step_size=self._prefill_step_size,
            stream=self._stream,
        )
        if self._speculate:  # decoding rows verify their drafts (engine/spec_batch.py)
            from mlxd.engine.spec_batch import SpeculativeBatch

            generator._generation_batch = SpeculativeBatch.build(
                self.model, generator.sampler, drafts=self._drafts, k=self._config.num_draft_tokens
            )
        self.adapters.bind(generator, self._row_adapter)  # --adapter: each forward selects its rows' adapters
        return generator

    def _row_adapter(self, uid: int) -> int:
        """The adapter a generator row selects (0 for rows not in the batch's book, e.g. the device probe's)."""
        row = self._rows.get(uid)
        return row.adapter if row is not None else 0

    def reset(self) -> None:
        """Drop every row and start a fresh generator (after a failed step), and give the dropped rows' buffers,
        which MLX keeps cached for reuse, back to the device: a step that failed for want of device memory (a
        failed allocation) should not leave the next ones short of what the failed batch held."""
        import gc

        import mlx.core as mx

        self._stop_generating()
        self._rows.clear()
        self._uids.clear()
        self._pending = None
        self._batch = None
        self._deferred.clear()
        self._leaving.clear()
        self._left.clear()
        self.generator = self._fresh_generator()
        gc.collect()  # (mlx-lm's batch rows hold their caches in reference cycles)
        mx.clear_cache()

    def close(self) -> None:
        """The engine stops for good: the generation state goes, and MLX's buffer-cache limit is given back."""
        self._stop_generating()
        if self._cache_limit_before is not None:  # an embedding program's MLX as it was (the limit is per process)
            import mlx.core as mx

            mx.set_cache_limit(self._cache_limit_before)
            self._cache_limit_before = None

    def _stop_generating(self) -> None:
        """The generator, the grammar masks and the thread's stream closed (at the end, and in a reset)."""
        self._save_grammars()  # their order of use up to now (SIGTERM's flush comes through here)
        self._masks.close()
        if self._switch_before is not None:
            sys.setswitchinterval(self._switch_before)
            self._switch_before = None
        if self.generator is not None:
            self.generator.close()
            self.generator = None
        if self._stream is not None:
            import mlx.core as mx

            try:
                mx.synchronize(self._stream)  # no work in flight when the thread's streams go
            except RuntimeError:
                log.warning("engine.synchronize_failed")

    @property
    def grammars(self) -> GrammarCache:
        """Compiled structured-output grammars for this model's vocabulary.

        Built by the first constrained request, or at load when the SSD tier holds a saved list
        (`_warm_grammars`): a server that never gets one never reads the tokenizer for llguidance.
        """
        if self._grammars is None:
            if self._model_path is None:
                raise RuntimeError("the engine core has no model loaded")
            self._grammars = GrammarCache(load_vocabulary(self._model_path, eos_ids=sorted(self._eos)))
        return self._grammars

    @grammars.setter
    def grammars(self, cache: GrammarCache) -> None:
        self._grammars = cache

    def _warm_grammars(self, directory: Path, budget_s: float = GRAMMAR_WARM_BUDGET_S) -> None:
        """Compile the constraints the last server saved beside the SSD tier's files, before serving,
        within `budget_s`; the tokenizer is read for llguidance only when the list has entries."""
        self._grammar_file = grammar_list.list_path(directory)
        saved = grammar_list.load(self._grammar_file, self._vocabulary_id())
        if not saved:
            return
        began = time.monotonic()
        grammars, warmed = self.grammars, 0
        for constraint in reversed(saved):  # the most recent first, in case the budget runs out
            if time.monotonic() - began > budget_s:
                break
            warmed += grammars.warm(constraint)
        for constraint in saved:  # the saved order of use, the most recent last
            grammars.touch(constraint)
        log.info("engine.grammars_warmed", warmed=warmed, saved=len(saved),
                 seconds=round(time.monotonic() - began, 3))

    def _vocabulary_id(self) -> str:
        return f"{self.store_identity.model_id} {self.store_identity.tokenizer_hash}"

    def _save_grammars(self) -> None:
        """With an SSD tier: write the recent constraints (a small file); a failure is logged, never raised."""
        if self._grammar_file is None or self._grammars is None:
            return
        try:
            grammar_list.save(self._grammar_file, self._grammars.recent(), self._vocabulary_id())
        except OSError as exc:
            log.warning("engine.grammars_unsaved", path=str(self._grammar_file), error=str(exc))

    def _constrained(self, constraint: Constraint) -> Matcher:
        """A new row's matcher; a grammar compiled for it is added to the saved list at once."""
        grammars = self.grammars
        misses = grammars.stats().misses
        matcher = grammars.matcher(constraint)
        if grammars.stats().misses != misses:
            self._save_grammars()
        return matcher

    @property
    def store_identity(self) -> StoreIdentity:
        """What SSD files and KV-event hashes must match (known once a model is loaded)."""
        if self._store_identity is None:
            raise RuntimeError("the engine core has no model loaded")
        return self._store_identity

    @store_identity.setter
    def store_identity(self, identity: StoreIdentity) -> None:
        self._store_identity = identity

    def landing(self, header: FileHeader) -> Landing:
        """MLX arrays for a cold file to be read straight into (`kinds.landing`)."""
        import mlx.core as mx

        from mlxd.kv import kinds

        with mx.stream(self._stream):
            return kinds.landing(header)

    def plan_checkpoint(self, caches: list[Any], length: int, total: int, meta: SnapshotMeta) -> SnapshotPlan:
        """A write plan of a cached checkpoint's first `length` tokens (a session export)."""
        import mlx.core as mx

        from mlxd.kv import page_pool

        with mx.stream(self._stream):
            whole = length == total and isinstance(caches, list)
            lent = caches if whole else page_pool.lend(caches, length, total=total)
            return self.plan(lent, meta)

    def adopt_checkpoint(self, loaded: LoadedSnapshot) -> tuple[list[Any], int, bool]:
        """An imported file's caches, nbytes and trimmability; ValueError when they do not fit this model.

        Checked: the cache kinds of every layer, the token count, and one forward token on a copy.
        """
        import mlx.core as mx

        from mlxd.kv import kinds

        n = len(loaded.header.tokens)
        with mx.stream(self._stream):
            caches = kinds.adopt(loaded, landed=device_memory.to_device)
            want, got = kinds.signatures(loading.fresh_caches(self.model, self._config)), kinds.signatures(caches)
            if got != want:
                raise ValueError(f"its caches are {got}, this model's are {want}")
            kinds.num_tokens(caches, total=n)  # ValueError when a layer holds another count
            try:
                probe = kinds.lend(caches, n, total=n)
                with self.adapters.rows([self.adapters.index_of(loaded.header.namespace)]):
                    mx.eval(self.model(mx.array([[0]]), cache=probe))
            except Exception as exc:
                raise ValueError(f"its tensors do not fit this model ({type(exc).__name__}: {exc})") from exc
            return caches, kinds.nbytes(caches), kinds.is_trimmable(caches)

    def measure_memory(self, reason: str) -> MemoryMeasured:
        import mlx.core as mx

        self._steps_unmeasured = 0
        return MemoryMeasured(int(mx.get_active_memory()), int(mx.get_peak_memory()), reason,
                              buffer_cache_bytes=int(mx.get_cache_memory()),
                              pool=self._pool.usage() if self._pool is not None else None)

    @property
    def trims_when_idle(self) -> bool:
        """Does an idle engine trim its GPU's memory pool (a memory budget on CUDA, `MLXD_POOL_TRIM` on)?"""
        return self._pool is not None and self._trim_pool

    def idle_trim(self) -> MemoryMeasured:
        """(MLX thread, the engine idle) Give the device back what the memory pool holds past what MLX uses and
        one buffer-cache share of the budget (for the next request's first allocations), then measure.

        A backstop for servers sharing a GPU: CUDA gives free pool memory back at synchronizations already when
        the pool's release threshold is its default (0, which MLX leaves), so the trim frees what is left past
        that, and the measurement after it tells what the pool holds (`device_pool`), where a server's device
        memory past MLX's own memory and cache may sit (docs/benchmarks.md, H100 2026-12-07 11:03). The engine's
        streams are synchronized first, so the frees behind its last step count
        as free."""
        import mlx.core as mx

        assert self._pool is not None
        mx.synchronize()
        t0 = time.perf_counter()
        usage = self._pool.usage()
        freed = self._pool.trim(usage.used_bytes + self._pool_headroom) if usage is not None else 0
        if freed:
            log.debug("engine.pool_trimmed", freed_bytes=freed, ms=round(1000 * (time.perf_counter() - t0), 2))
        return self.measure_memory("idle")

    @property
    def measures_memory(self) -> bool:
        return self._memory_budget > 0

    @property
    def prefill_step_size(self) -> int:
        return int(self._prefill_step_size)

    @property
    def prefill_slice_s(self) -> float:
        """The prefill time slice in use (0: whole steps; see engine/prefill_slices.py)."""
        return self._slicer.slice_s

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(
            steps=c.steps, batch_rows=len(self._rows) + len(self._leaving) + (self._pending is not None),
            generated_tokens=c.generated_tokens,
            prompt_tokens=c.prompt_tokens,
            checkpoints_skipped=c.checkpoints_skipped, checkpoint_s=c.checkpoint_s,
            late_final_checkpoints=c.late_finals if self._late_final else None,
            packed_plans=c.packed_plans if self._pack_bytes else None,
            overlap_tails=c.overlap_tails, overlap_tail_tokens=c.overlap_tail_tokens,
            overlap_tails_recomputed=c.overlap_tails_recomputed, overlap_tails_unplaced=c.overlap_tails_unplaced,
            overlaps_declined=c.overlaps_declined,
            **(self.vision.stats() if self.vision is not None else {}),
            speculation=self._drafts.stats() if self._config.speculative != "off" else None,
            grammars=attrs.asdict(self._grammars.stats()) if self._grammars is not None else None,
        )

    # --- a step --------------------------------------------------------------------------

    def step(self, ops: StepOps) -> StepResult:
        """Do `ops`, then one generator step if any row is left; the same on every rank."""
        import mlx.core as mx

        if ops.reset:
            self.reset()
            return StepResult(stats=self.stats())
        out = StepOut()
        with mx.stream(self._stream):
            # Rows whose last token went out with the step before (MLXD_FINAL_PLAN). after-token: their final
            # checkpoints and finish make a step of their own, with no forward, handed out as soon as the plans
            # are done, while the device computes the forward the step before dispatched (mlx-lm's pipelining);
            # the next step collects it. after-forward: they leave after this step's forward is dispatched.
            self._left, self._leaving = self._leaving, []
            left_late = bool(self._left) and not self._after_forward
            if left_late:
                self._leave_late(out)
            if self._deferred:  # rows whose first token was delivered (PUBLISH_AFTER_TOKENS); a row that ends
                # first publishes its own as it leaves (PromptCheckpoints.leave)
                self.publish_deferred(out, lambda r: r.generated >= PUBLISH_AFTER_TOKENS or r.uid not in self._rows)
            for start in ops.starts:
                self._join(start, out)
            if ops.cancels:
                self._end(ops.cancels, "cancelled", out)
            if ops.stops:
                self._end(ops.stops, "stop", out)
            pending = self._pending
            if pending is not None and self._first_tokens_due():
                pending = None  # not beside a first token due in this step's forward: it waits a step
            if pending is not None:  # one chunk; the last one admits it, and this step's forward has it
                try:
                    self._advance_pending(out)
                except Exception as exc:  # refused alone, as a row that fails to join
                    self._pending = None
                    self._refuse(pending.start, exc, out)
            if self._rows and not left_late:
                self._next(out)  # (counts the step)
                self._cold = False
            elif pending is not None:  # a step of the apart prefill alone is a step too
                self.counters.steps += 1
            if self._left:  # after-forward: the device computes the step's forward (their copies came before it)
                self._leave_late(out)
        if self.vision is not None:  # encoder outputs to keep on SSD (vision/encoder.py)
            out.notes.extend(self.vision.notes())
        return StepResult(tuple(out.emits), tuple(out.notes), tuple(out.finished), tuple(out.rejected), self.stats())

    def _join(self, start: RowStart, out: StepOut) -> None:
        """Insert a row; a row that cannot join is refused alone, the batch untouched."""
        if start.request.request_id in self._uids or (
                self._pending is not None and self._pending.request_id == start.request.request_id):
            out.rejected.append(Rejected(start.request.request_id, "a request with this id is already generating"))
            return
        try:
            if start.resume is not None:
                self._resume(start, out)
            else:
                self._insert(start, out)
        except Exception as exc:
            self._refuse(start, exc, out)

    def _refuse(self, start: RowStart, exc: Exception, out: StepOut) -> None:
        """A row that failed to join (or to prefill apart) is refused alone; a resumable one is left to a retry."""
        log.exception("engine.request_failed", request_id=start.request.request_id)
        out.rejected.append(Rejected(start.request.request_id, f"generation failed: {type(exc).__name__}: {exc}"))
        if start.checkpoint_key is not None:  # resumable by a retry
            out.notes.append(GenerationAbandoned(start.checkpoint_key, start.request.request_id))

    def _parts(self, start: RowStart, sampling: Sampling, prompt_new_tokens: int, *, cuts: int = 0) -> Row:
        req, config = start.request, self._config
        features: list[Feature] = [StopTokens(self._stop_ids(req.sampling))]
        if req.sampling.constraint is not None:
            features.append(Constrained(self._constrained(req.sampling.constraint), len(req.prompt), self._masks))
            self._drafts.counters.constrained_rows += self._speculate  # its grammar checks its drafts
        if self._speculate:
            features.append(self._speculation(start, prompt_new_tokens))
        if config.prompt_cache_bytes > 0:
            # A session keeps its checkpoints below the anonymous threshold (seed §5.12). So does a
            # model whose caches cannot be cut back: its end-of-turn checkpoint cannot serve the same
            # prompt again (a regenerated turn), only the prompt-boundary one can.
            threshold = 1 if req.session is not None or not self._trims else max(1, config.snapshot_min_tokens)
            features.append(PromptCheckpoints(at_boundary=prompt_new_tokens >= threshold, cuts=cuts))
        if start.checkpoint_key is not None:
            features.append(GenerationCheckpoints(start.checkpoint_key, config.generation_checkpoint))
        return Row(start=start, sampling=sampling, features=tuple(features),
                   adapter=self.adapters.index_of(req.namespace))

    def _draft_gate_ceiling(self) -> None:
        """--draft-model: the gate never lets a step verify where the draft costs too much to pay."""
        from mlxd.engine.draft import forward_cost
        from mlxd.engine.speculative import draft_ceiling

        given = os.environ.get("MLXD_DRAFT_COST")  # a draft forward's cost in target forwards, instead of measured
        cost = float(given) if given else forward_cost(self._draft.model, self.model)
        gate = self._drafts.gate
        gate.ceiling = draft_ceiling(self._config.num_draft_tokens, cost)
        if gate.ceiling < gate.min_speedup:
            log.warning("engine.draft_cannot_pay", draft_cost=round(cost, 3), ceiling=round(gate.ceiling, 3),
                        k=self._config.num_draft_tokens)

    def _speculation(self, start: RowStart, prompt_new_tokens: int) -> Speculation:
        """A speculating row's part: drafts from its own n-grams, or from the draft model, whose KV
        checkpoints go to the prompt cache when the target's do (in the draft's namespace)."""
        req, config = start.request, self._config
        if self._draft is None:
            return Speculation(config.num_draft_tokens, NgramDrafts())
        from mlxd.engine.draft import ModelDrafts

        source = ModelDrafts(self._draft, self._drafts.prefix, prefix_tokens=len(req.prompt),
                             most=config.num_draft_tokens)
        checkpoints = None
        if config.prompt_cache_bytes > 0:  # the same boundary rule as the target's PromptCheckpoints
            threshold = 1 if req.session is not None else max(1, config.snapshot_min_tokens)
            checkpoints = DraftCheckpoints(source, draft_namespace(req.namespace, self._draft.tag),
                                           boundary=prompt_new_tokens >= threshold)
        return Speculation(config.num_draft_tokens, source, checkpoints=checkpoints)

    def _draft_prefix(self, row: Row, start: RowStart, out: StepOut, tokens: Sequence[int] | None = None) -> None:
        """--draft-model: the row's draft starts from its own cached prefix (RAM, or a cold file adopted
        and published to RAM); without one it computes the prefix at its first step. `tokens`: what
        the draft's lookup was made with (a resumed generation's prompt and emitted tokens)."""
        from mlxd.engine.draft import ModelDrafts
        from mlxd.kv import kinds, page_pool

        found, source = start.draft, next((p.source for p in row.features if isinstance(p, Speculation)), None)
        if not isinstance(source, ModelDrafts):
            return
        if tokens is not None:
            source.prefix_tokens = len(tokens)
        if found is None:
            return
        if found.restore is not None and found.restore.loaded is not None:
            restore = found.restore
            t0 = time.perf_counter()
            caches = kinds.adopt(restore.loaded, landed=device_memory.to_device)
            tokens = tuple(restore.loaded.header.tokens)  # the record's, or its leading blocks' (a split)
            out.notes.append(RestoreMeasured(restore.loaded.nbytes, restore.loaded.seconds + time.perf_counter() - t0))
            payload, pages = self._paged(caches, tokens, found.namespace)
            out.notes.append(PublishPrefix(
                tokens=tokens, namespace=found.namespace, payload=payload, nbytes=kinds.nbytes(caches),
                trimmable=kinds.is_trimmable(caches), reason="restore", durable=True, session=start.request.session,
                pages=pages,
            ))
            usable, lent = restore.usable, kinds.lend(caches, restore.usable, total=len(tokens))
        elif found.hit is not None and found.hit.usable > 0:
            usable = found.hit.usable
            lent = page_pool.lend(found.hit.entry.payload, usable, total=len(found.hit.entry.tokens))
        else:
            return
        source.start(lent, (start.request.prompt if tokens is None else tokens)[:usable])

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """The tokens that end a row as "stop": the model's end tokens and the request's stop ids."""
        return self._eos | frozenset(sampling.stop_token_ids)

    def _admit(
        self, row: Row, prompt: list[int], max_tokens: int, caches: list[Any] | None, history: list[int],
        cuts: tuple[int, ...] = (),
    ) -> None:
        """Insert the row; `cuts` (positions in `prompt`) end prefill segments, each checkpointed."""
        from mlx_lm.generate import StopSequences

        joining = Joining()
        for part in row.parts():
            part.join(row, joining)
        row_caches = self._batchable(caches)
        ends = [0, *cuts, len(prompt)]
        insert = getattr(self.generator, "insert_segments", None) if cuts else None
        if insert is not None:
            seqs: list[Any] = [[prompt[a:b] for a, b in zip(ends, ends[1:], strict=False)]]
        else:
            insert, seqs, ends = self.generator.insert, [prompt], [0, len(prompt)]
        (uid,) = insert(
            seqs,
            max_tokens=[max_tokens],
            caches=[row_caches] if row_caches is not None else None,
            all_tokens=[history],
            samplers=[joining.sampler],
            logits_processors=[joining.processors],
            stop_sequences=[StopSequences([[t] for t in sorted(joining.stop_tokens)])],
        )
        row.uid = uid
        row.prompt_new = ends[-1] - 1
        self._rows[uid] = row
        self._uids[row.request_id] = uid
        self._batch = None

    def _insert(self, start: RowStart, out: StepOut) -> None:
        from mlxd.kv import page_pool

        req = start.request
        joined = time.monotonic()
        sampling = Sampling.of(req.sampling)  # built (and checked) before the generator sees the row
        if start.restore is not None and start.restore.loaded is not None:
            lent, usable, tier = self._restore(start, out)
        elif start.hit is not None:
            hit = start.hit
            usable = hit.usable
            lent = page_pool.lend(hit.entry.payload, usable, total=len(hit.entry.tokens))
            tier = "ram" if usable > 0 else "none"
        else:
            lent, usable, tier = None, 0, "none"
        recomputed = 0  # tokens an overlapped split recomputed beside its tail's read
        overlapped: tuple[tuple[str, float], ...] = ()  # its stages (the head done, the wait for the tail over)
        if start.tail is not None and start.restore is None and not req.media:
            lent, usable, tier, recomputed, overlapped = self._overlap(start, lent, usable, tier, out)
        began, lent_at = time.perf_counter(), time.monotonic()
        stages = [("joined", joined), *overlapped, ("lent", lent_at)]
        joins_at = usable  # images past the cached prefix are prefilled first (vision/encoder.py)
        apart = False
        cuts = tuple(c for c in start.checkpoint_at if usable < c < len(req.prompt) - 1) if not req.media else ()
        idle = not self._rows and self._pending is None
        new_tokens = len(req.prompt) - usable - 1
        if not req.media and not cuts and idle and self.model is not None and self._slicer.alone(  # (model: a
                new_tokens, self._prefill_step_size):  # scripted core has none to prefill with)
            # a lone long prompt: prefilled apart a slice a step (`_advance_pending`), so a request that comes
            # meanwhile joins the batch at the next step
            caches = lent if lent is not None else loading.fresh_caches(self.model, self._config)
            self._pending = PendingApart(start, sampling, caches, usable, usable, tier, recomputed, stages, began)
            return
        with self.adapters.rows([self.adapters.index_of(req.namespace)]):  # prefills outside the batch
            if req.media:
                lent, joins_at = self._media_prefill(req, lent, usable)
            elif not cuts and (self._slicer.apart(new_tokens, others_prefilling=self._long_prefill())
                               or (usable > 0 and idle and 0 < new_tokens <= SUFFIX_APART)):
                timed = out if not self._rows else None  # chunks that ran alone are timed (rows decode async)
                lent, joins_at, apart = *self._prefill_apart(req.prompt, lent, usable, timed), True
        self._enter(start, sampling, lent, usable, joins_at, tier, recomputed, cuts, out, stages=stages,
                    began=began, apart=apart, shared=bool(req.media))

    def _advance_pending(self, out: StepOut) -> None:
        """The pending lone prompt's next chunk (engine/apart.py), the slicer's size for a row prefilling alone,
        timed when it ran alone; after its last one it joins the batch (its last token there, for its first token
        in this step's forward)."""
        pending = self._pending
        assert pending is not None
        alone = not self._rows
        size = self._slicer.chunk(self._prefill_step_size, newcomers=(), shared=not alone)  # the batch's slice
        with self.adapters.rows([self.adapters.index_of(pending.start.request.namespace)]):
            context = pending.at
            tokens, seconds = pending.advance(self.model, size, alone=alone)
        if alone:  # (beside rows, their decode's work in flight would be counted in it)
            self._chunk_measured(tokens, context, seconds, out)
        if not pending.done:
            return
        self._pending = None
        self._enter(pending.start, pending.sampling, pending.caches, pending.usable, pending.at, pending.tier,
                    pending.recomputed, (), out, stages=pending.stages, began=pending.began, apart=True,
                    shared=pending.shared)

    def _enter(
        self, start: RowStart, sampling: Sampling, lent: list[Any] | None, usable: int, joins_at: int, tier: str,
        recomputed: int, cuts: tuple[int, ...], out: StepOut, *, stages: list[tuple[str, float]], began: float,
        apart: bool, shared: bool,
    ) -> None:
        """A row into the batch from `joins_at` on (its prompt before it in `lent`; `apart`: prefilled on its own
        up to its last token), and its prompt accepted."""
        req = start.request
        row = self._parts(start, sampling, len(req.prompt) - usable - 1, cuts=len(cuts))
        row.stages += stages + ([("prefilled_apart", time.monotonic())] if apart else [])
        self._draft_prefix(row, start, out)
        self._admit(row, list(req.prompt[joins_at:]), req.sampling.max_tokens, lent, list(req.prompt[:joins_at]),
                    cuts=tuple(c - joins_at for c in cuts))
        if apart:  # its prompt ends now: the parts see the boundary a batch prefill would have shown them
            for part in row.parts():
                part.segment(row, self, out)
        row.cached_tokens, row.joined_at, row.recomputed = usable, joins_at, recomputed
        row.stamp("admitted")
        row.prefill_began, row.prefill_shared = began, shared
        if len(self._rows) > 1:  # rows share the batch now: no prefill still running is timed alone
            for each in self._rows.values():
                each.prefill_shared = each.prefill_shared or each.generated == 0
        self.counters.prompt_tokens += len(req.prompt) - usable + recomputed
        out.emit(row, PromptAccepted(len(req.prompt), usable - recomputed, tier, start.queued_s))

    def _overlap(
        self, start: RowStart, lent: list[Any] | None, usable: int, tier: str, out: StepOut
    ) -> tuple[list[Any] | None, int, str, int, tuple[tuple[str, float], ...]]:
        """An overlapped split (engine/overlap.py): its head recomputed apart while the tail is read, the
        tail appended and the prefix published as a restore's. Only with the batch empty (other rows would
        wait for the head: the row recomputes in the batch instead). Returns the caches, the position the
        row goes on from, its tier, the tokens recomputed here, and its stages (`Overlapped.stamps`)."""
        from mlxd.engine import overlap
        from mlxd.kv import kinds

        tail = start.tail
        assert tail is not None
        c = self.counters
        if self._rows or self._pending is not None or usable >= tail.start or self._config.kv_bits is not None:
            c.overlaps_declined += 1
            out.notes.append(RestoreMeasured(0, 0.0, taken=False))  # the advisor's plan: not measured
            return lent, usable, tier, 0, ()
        prompt = start.request.prompt
        caches = lent if lent is not None else loading.fresh_caches(self.model, self._config)
        cold, self._cold = self._cold, False
        done = overlap.recompute_then_append(self.model, caches, prompt, usable, tail, step=self._prefill_step_size,
                                             wait_s=self._config.restore_overlap_wait_s)
        if tail.start - usable >= WHOLE_PREFILL_MIN and not cold:  # the head alone, as the advisor predicted it
            out.notes.append(PrefillMeasured(tail.start - usable, usable, done.head_s, head=True))
        if done.appended is None:
            c.overlap_tails_recomputed += 1
            c.overlap_tails_unplaced += int(not done.placed)
            out.notes.append(RestoreMeasured(0, 0.0, taken=False))
            # served from its warm prefix alone, as a recompute
            return done.caches, done.at, tier, done.at - usable, done.stamps
        read = done.appended
        out.notes.append(RestoreMeasured(read.nbytes, read.seconds + done.append_s))
        c.overlap_tails, c.overlap_tail_tokens = c.overlap_tails + 1, c.overlap_tail_tokens + done.at - done.recomputed_to
        self._publish_restored(done.caches, tuple(prompt[: done.at]), start, out)
        return kinds.lend(done.caches, done.at, total=done.at), done.at, "ssd", done.recomputed_to - usable, done.stamps

    def _first_tokens_due(self) -> bool:
        """A row of the batch is about to get its first token: it joined this step, or its prompt is in and it
        waits for the step that samples (the slicer keeps those steps short; a lone prompt prefilling apart
        skips them)."""
        return any(r.generated == 0 and (r.prefilled == 0 or r.prefilled >= r.prompt_new) for r in self._rows.values())

    def _prefilling(self) -> list[Row]:
        """The rows in the batch part way through their prompt."""
        return [r for r in self._rows.values() if r.generated == 0 and r.prefilled < r.prompt_new]

    def _long_prefill(self) -> bool:
        """A prompt a short joining one is kept out of the batch's forwards for (prefilled apart): a lone long
        prompt prefilling apart, or a row with more than `APART_MIN` tokens of its prompt left. Beside short ones
        (eight requests at once) a short prompt shares their forward: apart, each would run a forward of its own,
        one after another, before any of them joined."""
        return self._pending is not None or any(r.prompt_new - r.prefilled > APART_MIN for r in self._prefilling())

    def _prefill_apart(
        self, prompt: tuple[int, ...], lent: list[Any] | None, usable: int, out: StepOut | None = None
    ) -> tuple[list[Any], int]:
        """Prefill a prompt on its own caches, outside the batch, up to its last token.

        In the batch a short prompt would share each forward pass with a long prompt's chunk (padded to it,
        and attending over its context), and a long one alone pays the batch's steps chunk by chunk; apart
        it costs what its forwards cost. With `out`, each chunk is timed (each ran alone, evaluated) for the
        slicer and the restore advisor, as a chunk of a row prefilling alone in the batch is.
        """
        caches = lent if lent is not None else loading.fresh_caches(self.model, self._config)
        end, at = len(prompt) - 1, usable
        while at < end:  # chunks end on multiples of the step: the same shapes as every other prompt's
            t0 = time.perf_counter()
            upto = prefill_step(self.model, caches, prompt, at, end, self._prefill_step_size)
            if out is not None:
                seconds = time.perf_counter() - t0
                self._chunk_measured(upto - at, at, seconds, out)
            at = upto
        return caches, end

    def _media_prefill(self, req: Any, lent: list[Any] | None, usable: int) -> tuple[list[Any] | None, int]:
        """Run the prompt through its last image (tower outputs in the image spans); the text joins after."""
        from mlxd.kv.media import media_end

        if self.vision is None:
            raise ValueError("this model has no vision tower: it cannot read images")
        if media_end([m.span for m in req.media]) <= usable:  # the cached prefix covers every image
            return lent, usable
        caches = lent if lent is not None else loading.fresh_caches(self.model, self._config)
        end = self.vision.prefill(self.model, req.prompt, req.media, caches, usable, step=self._prefill_step_size)
        return caches, end

    def _batchable(self, lent: list[Any] | None) -> list[Any] | None:
        """What a row starts from: a lent prefix, or fresh caches; quantized ones made batchable."""
        if self._config.kv_bits is None:
            return lent
        from mlxd.kv.quantized_batch import batchable

        return batchable(lent if lent is not None else loading.fresh_caches(self.model, self._config))

    def _restore(self, start: RowStart, out: StepOut) -> tuple[list[Any], int, str]:
        """Adopt a cold file's bytes into MLX, publish it to RAM, and lend its prefix."""
        from mlxd.kv import kinds

        restore = start.restore
        assert restore is not None and restore.loaded is not None
        t0 = time.perf_counter()
        caches = kinds.adopt(restore.loaded, landed=device_memory.to_device)
        seconds = restore.loaded.seconds + (time.perf_counter() - t0)
        tokens = tuple(restore.loaded.header.tokens)  # the record's, or its leading blocks' (a split)
        out.notes.append(RestoreMeasured(restore.loaded.nbytes, seconds))
        self._publish_restored(caches, tokens, start, out)
        return kinds.lend(caches, restore.usable, total=len(tokens)), restore.usable, "ssd"

    def _publish_restored(self, caches: list[Any], tokens: tuple[int, ...], start: RowStart, out: StepOut) -> None:
        """A prefix restored from SSD (whole, in part, or an overlapped split's) goes to RAM, durable."""
        from mlxd.kv import kinds

        ns = start.request.namespace
        payload, pages = self._paged(caches, tokens, ns)
        out.notes.append(
            PublishPrefix(
                tokens=tokens, namespace=ns, payload=payload, nbytes=kinds.nbytes(caches),
                trimmable=kinds.is_trimmable(caches), reason="restore", durable=True, session=start.request.session,
                pages=pages,
            )
        )

    def _resume(self, start: RowStart, out: StepOut) -> None:
        """Continue a checkpointed generation: replay its tokens, then decode from the pending one."""
        from mlxd.kv import kinds

        resume = start.resume
        assert resume is not None
        req, record, s = start.request, resume.record, start.request.sampling
        t0 = time.perf_counter()
        caches = kinds.adopt(resume.loaded, landed=device_memory.to_device)
        out.notes.append(RestoreMeasured(resume.loaded.nbytes, resume.loaded.seconds + time.perf_counter() - t0))
        replay = [*record.emitted, record.pending]
        rng = record.rng_key if s.temperature > 0 else None
        row = self._parts(start, Sampling.of(s, rng), 0)
        row.generated, row.cached_tokens = len(replay), len(req.prompt)
        finish = "stop" if record.pending in self._stop_ids(s) else "length" if row.generated >= s.max_tokens else None
        if finish is None:
            self._draft_prefix(row, start, out, tokens=list(req.prompt) + list(record.emitted))
            self._admit(row, [record.pending], s.max_tokens - row.generated, caches,
                        list(req.prompt) + list(record.emitted))
        out.emit(row, PromptAccepted(len(req.prompt), len(req.prompt), "checkpoint", start.queued_s))
        for t in replay:
            out.emit(row, TokenGenerated(t))
        if finish is not None:  # nothing left to decode: it never joins the batch
            out.emit(row, GenerationFinished(finish, len(req.prompt), row.cached_tokens, row.generated))
            out.finished.append(row.request_id)
            if start.checkpoint_key is not None:
                out.notes.append(GenerationCompleted(start.checkpoint_key, req.request_id))

    def _end(self, request_ids: tuple[str, ...], reason: str, out: StepOut) -> None:
        """Rows a client ended: "stop" (its stop string matched) or "cancelled" (it went away)."""
        pending = self._pending
        if pending is not None and pending.request_id in request_ids:  # still prefilling apart
            self._pending = None
            req = pending.start.request
            out.emits.append(Emit(req.request_id, GenerationFinished(
                reason, len(req.prompt), pending.usable - pending.recomputed, 0, 0.0)))
            out.finished.append(req.request_id)
        rows = [self._rows[self._uids[rid]] for rid in dict.fromkeys(request_ids) if rid in self._uids]
        if not rows:
            return
        # their checkpoints first, while the generator still holds them
        leave_s = {row.uid: self._leave(row, Ending(reason, requested=True), out) for row in rows}
        self.generator.remove([row.uid for row in rows])
        for row in rows:
            self._finish(row, reason, out, leave_s=leave_s[row.uid])

    def _finish(self, row: Row, reason: str, out: StepOut, *, leave_s: float = 0.0) -> None:
        self._forget(row)
        self._finished(row, reason, out, leave_s)

    def _forget(self, row: Row) -> None:
        """The row leaves the batch's book (a cancel or stop for its request id is ignored from now on)."""
        del self._rows[row.uid]
        del self._uids[row.request_id]
        self._batch = None

    def _finished(self, row: Row, reason: str, out: StepOut, leave_s: float) -> None:
        req = row.start.request
        out.emit(row, GenerationFinished(reason, len(req.prompt), row.cached_tokens - row.recomputed, row.generated, leave_s))
        out.finished.append(row.request_id)

    def _leave(self, row: Row, ending: Ending, out: StepOut) -> float:
        """The row's features see it leave (its final checkpoint among them); the seconds they took."""
        left = time.perf_counter()
        for part in row.parts():
            part.leave(row, ending, self, out)
        return time.perf_counter() - left

    def _leave_late(self, out: StepOut) -> None:
        """The rows that ended in the step before: their final checkpoints, then their finish, so the cache
        owner has each checkpoint before its reply ends (`EngineActor._deliver`: notes first)."""
        leaving, self._left = self._left, []
        for row, reason, ending in leaving:
            self._finished(row, reason, out, self._leave(row, ending, out))
            self.counters.late_finals += 1

    def _next(self, out: StepOut) -> None:
        import mlx.core as mx

        waiting = [r for r in self._rows.values() if r.generated == 0]  # rows before their first token
        decoding = len(waiting) < len(self._rows)
        # Only rows before their first token have prompt left: with none, the chunk is not used.
        if waiting and hasattr(self.generator, "prefill_step_size"):
            self.generator.prefill_step_size = self._prefill_chunk()
        for each in waiting:
            each.stamp("step")
        t0 = time.perf_counter()
        self._masks.start()
        suffix_attention.next_forward()  # MLXD_UNFUSED_AREA counts a chunk shape's sightings per forward
        prompt_responses, gen_responses = self.generator.next()
        elapsed = time.perf_counter() - t0
        for each in waiting:
            each.stamp("stepped")
        self._masks.prepare()  # MLXD_MASK_MODE=ahead-early: the next step's masks start now
        self.counters.steps += 1
        if prompt_responses:
            self._prefill_progress(prompt_responses, elapsed if not decoding else None, out)
        for r in prompt_responses:
            row = self._rows.get(r.uid)
            if row is not None and r.end_of_segment and not r.end_of_prompt:
                for part in row.parts():
                    part.segment(row, self, out)
        rows, emit, tokens = self._rows, out.emits.append, 0
        reads = self._read_logprobs(gen_responses)
        for i, r in enumerate(gen_responses):
            row = rows.get(r.uid)
            if row is None:
                continue
            if row.early:  # this token went out with the step before (`_first_tokens_now`)
                row.early = False
                continue  # (never its last: a stop token or a one-token reply is not handed out early)
            row.generated += 1
            tokens += 1
            event = row.sampling.event(r, reads.get(i))
            if row.generated == 1:
                event = self._first_event(row, event, out)
            emit(Emit(row.request_id, event))
            if r.finish_reason is None:
                for part in row.token_parts:
                    part.token(row, r.token, self, out)
            else:
                ending = Ending(r.finish_reason, caches=r.prompt_cache, tokens=tuple(r.all_tokens or ()))
                if self._late_final:  # its last token goes out first; its checkpoint and finish next step
                    if ending.caches is not None:  # its KV as of now, whatever the batch's buffers do next
                        # (after-forward: queued behind the forward mlx-lm dispatched, not waited for)
                        (mx.async_eval if self._after_forward else mx.eval)([c.state for c in ending.caches])
                    self._forget(row)
                    self._leaving.append((row, r.finish_reason, ending))
                    continue
                self._finish(row, r.finish_reason, out, leave_s=self._leave(row, ending, out))
        if self._early_first and prompt_responses:
            tokens += self._first_tokens_now(prompt_responses, decoding, out)
        self.counters.generated_tokens += tokens
        if self._memory_budget > 0:  # last: the owner sees this step's publications first
            self._steps_unmeasured += 1
            # (not while a deferred checkpoint's copy waits: it would be counted as memory outside the cache,
            # then again inside it once published; measured after its publication, publish_deferred)
            held = bool(self._deferred or self._left or self._leaving)  # copies not yet in the cache
            if not held and any(r.end_of_segment or r.end_of_prompt for r in prompt_responses):
                out.notes.append(self.measure_memory("prefill"))
            elif not held and self._steps_unmeasured >= MEASURE_MEMORY_EVERY:
                out.notes.append(self.measure_memory("decode"))

    def _first_tokens_now(self, prompt_responses: list[Any], decoding: bool, out: StepOut) -> int:
        """The rows whose prompt ended in this step, where no row was decoding (MLXD_FIRST_TOKEN_EARLY), or beside
        decoding rows (MLXD_JOIN_FIRST_EARLY, at most once every `JOIN_EARLY_GAP` steps): their first tokens,
        sampled by this step's forward, read now and handed out with this step (mlx-lm hands them out with the next
        one, once that step has built the forward after them); each row skips its own then. Not while a row has a
        grammar (its masks follow the tokens mlx-lm hands out), nor for a token that ends the reply (its finish goes
        with the step that finishes it). Tokens handed out."""
        from mlxd.engine.gen_hook import first_tokens

        ended = {r.uid for r in prompt_responses if r.end_of_prompt}
        fresh = [row for row in self._rows.values() if row.uid in ended and not row.generated]
        if not fresh or self._constrained_rows():
            return 0
        beside = decoding or len(fresh) < len(self._rows)  # (a row still prefilling counts as beside them)
        if beside and not (self._join_early and self.counters.steps - self._join_early_at >= JOIN_EARLY_GAP):
            return 0
        got = first_tokens(self.generator, {row.uid for row in fresh}, beside=beside)
        if not got:
            return 0
        if beside:
            self._join_early_at = self.counters.steps
        early = [(row, got[row.uid]) for row in fresh if row.uid in got
                 and got[row.uid].token not in self._stop_ids(row.start.request.sampling)]
        asks = [(r, row.sampling.top_k) for row, r in early if row.sampling.top_k is not None]
        reads = iter(read_logprobs(asks, self._reads) if asks else ())
        for row, r in early:
            row.generated, row.early = 1, True
            read = next(reads) if row.sampling.top_k is not None else None
            out.emit(row, self._first_event(row, row.sampling.event(r, read), out))
            for part in row.token_parts:
                part.token(row, r.token, self, out)
        return len(early)

    def _first_event(self, row: Row, event: TokenGenerated, out: StepOut) -> TokenGenerated:
        """A row's first token: its prefill timed whole (`_prefill_whole`), its stages handed out with it."""
        self._prefill_whole(row, out)
        event = attrs.evolve(event, stages=(*row.stages, ("first_token", time.monotonic())))
        row.stages = []
        return event

    def _read_logprobs(self, responses: list[Any]) -> dict[int, LogprobRead]:
        """The logprobs of this step's tokens that their rows asked for, by index in `responses` (a verifying
        step gives a row several), read together on the side stream."""
        if not (self._batch or self._batch_parts()).logprobs:
            return {}
        at, asks = [], []
        for i, r in enumerate(responses):
            row = self._rows.get(r.uid)
            k = row.sampling.top_k if row is not None else None
            if k is not None:
                at.append(i)
                asks.append((r, k))
        if not asks:
            return {}
        return dict(zip(at, read_logprobs(asks, self._reads), strict=True))

    def _prefill_progress(self, responses: list[Any], seconds: float | None, out: StepOut) -> None:
        """Move each prefilling row's progress; time the chunk when it ran alone (`seconds`)."""
        chunks = [r for r in responses if not r.end_of_prompt]
        for r in chunks:
            row = self._rows.get(r.uid)
            if row is None:
                continue
            done = int(r.progress[0])
            if seconds is not None and len(chunks) == 1:
                self._chunk_measured(done - row.prefilled, row.cached_tokens + row.prefilled, seconds, out)
            row.prefilled = done

    def _chunk_measured(self, tokens: int, context: int, seconds: float, out: StepOut) -> None:
        """A prefill chunk that ran alone, timed: for the restore advisor and the slicer."""
        out.notes.append(PrefillMeasured(tokens, context, seconds))
        self._slicer.measured(tokens, seconds)

    def _prefill_whole(self, row: Row, out: StepOut) -> None:
        """A long prompt prefilled alone, timed to its first token as served (every chunk, the steps'
        own costs between them): what recomputing a prefix costs here, beside the chunks' timings."""
        new = row.prompt_new + 1
        if row.prefill_shared or new < WHOLE_PREFILL_MIN or row.prefill_began <= 0:
            return
        out.notes.append(PrefillMeasured(new, row.cached_tokens, time.perf_counter() - row.prefill_began, whole=True))

    def _prefill_chunk(self) -> int:
        """This step's prefill chunk: a time slice, cut so rows that just joined finish their prompt, and,
        for a row prefilling alone, so it ends on a multiple of its size (prefill_slices.aligned)."""
        newcomers = [r.prompt_new for r in self._rows.values() if r.prefilled == 0 and r.generated == 0]
        awaiting = any(0 < r.prompt_new <= r.prefilled and r.generated == 0 for r in self._rows.values())
        shared = len(newcomers) < len(self._rows)
        size = self._slicer.chunk(self._prefill_step_size, newcomers=newcomers, shared=shared, awaiting=awaiting)
        prefilling = self._prefilling()
        if len(prefilling) == 1:
            (row,) = prefilling
            size = aligned(size, row.joined_at + row.prefilled, row.prompt_new - row.prefilled)
        return size

    # --- what features call --------------------------------------------------------------

    def _step_inputs(self) -> dict[int, int]:
        from mlxd.engine.gen_hook import step_inputs

        return step_inputs(self.generator)

    def _pending_inputs(self) -> tuple[list[int], Any] | None:
        from mlxd.engine.gen_hook import pending_inputs

        return None if self._speculate else pending_inputs(self.generator)  # a speculative step is another

    def _current_inputs(self) -> tuple[list[int], Any] | None:
        from mlxd.engine.gen_hook import current_inputs

        return current_inputs(self.generator)

    def _batch_parts(self) -> BatchParts:
        """What the batch's rows ask of every step, found again only after a row joined or left."""
        if self._batch is None:
            self._batch = BatchParts(
                constrained=tuple((uid, part) for uid, row in self._rows.items() for part in row.features
                                  if isinstance(part, Constrained)),
                logprobs=any(row.sampling.top_k is not None for row in self._rows.values()),
            )
        return self._batch

    def _constrained_rows(self) -> tuple[tuple[int, Constrained], ...]:
        return (self._batch or self._batch_parts()).constrained

    def extract(self, uid: int) -> tuple[list[Any], list[int]]:
        """A row's caches (new arrays: the row keeps decoding in place) and the tokens they hold."""
        caches, tokens = self.generator.extract_cache([uid])[uid]
        return caches, list(tokens)

    def checkpoint(
        self, out: StepOut, reason: str, take: Callable[[], tuple[list[Any], list[int]]], namespace: str,
        session: str | None, *, before_first_token: Row | None = None,
    ) -> None:
        """Publish a prefix checkpoint; one that cannot be taken is skipped and logged, never fails its batch.

        `before_first_token`: the row waits for its first token (a prompt-boundary checkpoint). With the SSD
        tier its caches are copied now, and its publication, with the write plan whose host read of every
        array is on CUDA a conversion to managed memory (79-258 ms of a 16k-token turn's TTFT on the H200,
        80-218 ms on the H100: docs/benchmarks.md), waits until the row's first token has been delivered
        (`PUBLISH_AFTER_TOKENS`, `publish_deferred`): it then takes that time from a later token, not the first."""
        import mlx.core as mx

        try:
            caches, tokens = take()
            if not (caches and tokens):
                return
            if before_first_token is None or self._config.ssd_cache_dir is None:
                out.notes.append(self._snapshot(tokens, namespace, caches, reason, session))
                return
            mx.eval([c.state for c in caches])  # the copy now: the row goes on in place
            self._deferred.append((before_first_token, reason,
                                   partial(self._snapshot, tokens, namespace, caches, reason, session)))
        except Exception:
            log.exception("engine.checkpoint_skipped", kind=reason)
            self.counters.checkpoints_skipped += 1

    def publish_deferred(self, out: StepOut, due: Callable[[Row], bool]) -> None:
        """Publish the deferred checkpoints (`checkpoint(before_first_token=...)`) of the rows `due` says, in
        the order they were taken (a row's boundary before its final checkpoint: `PromptCheckpoints.leave`)."""
        kept, published = [], False
        for row, reason, publish in self._deferred:
            if not due(row):
                kept.append((row, reason, publish))
                continue
            try:
                out.notes.append(publish())
                published = True
            except Exception:
                log.exception("engine.checkpoint_skipped", kind=reason)
                self.counters.checkpoints_skipped += 1
        self._deferred = kept
        if published and not kept and self._memory_budget > 0:  # the reading held back while they waited
            out.notes.append(self.measure_memory("prefill"))

    def plan(
        self, caches: list[Any], meta: SnapshotMeta, *, pack_max_bytes: int = 0, staged: bool = False
    ) -> SnapshotPlan:
        """A write plan of caches whose arrays are evaluated (`kinds.plan_snapshot`), its token slices evaluated on
        the side stream (`MLXD_PLAN_STREAM`): on the generation stream they would wait for the forward this step
        dispatched, and the step's events with them. `staged`: for a writer that stages a plan of device addresses to
        host memory before writing it (the SSD writer, the generation checkpointer; not a session export): on CUDA
        its buffers are then device addresses (`MLXD_PLAN_DEVICE`)."""
        import mlx.core as mx

        from mlxd.kv import kinds

        with mx.stream(self._planning_stream()):
            return kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=pack_max_bytes,
                                       device=staged and self._plan_device)

    def _planning_stream(self) -> Any:
        """Where checkpoints' slices are evaluated (`MLXD_PLAN_STREAM`): the side stream, or the generation one."""
        return self._reads if self._plan_on_side and self._reads is not None else self._stream

    def _snapshot(
        self, tokens: list[int], namespace: str, caches: list[Any], reason: str, session: str | None
    ) -> PublishPrefix:
        """An evaluated checkpoint for the cache owner, with a write plan when the SSD tier is on."""
        import mlx.core as mx

        from mlxd.kv import kinds

        with mx.stream(self._planning_stream()):  # (a cache's `state` slices it to its length: new arrays)
            mx.eval([c.state for c in caches])
        exact = tuple(tokens)
        plan = None
        if self._config.ssd_cache_dir is not None:
            plan = self.plan(caches, self.store_identity.meta(exact, namespace), pack_max_bytes=self._pack_bytes,
                             staged=True)
            if plan.packed:
                self.counters.packed_plans += 1
        payload, pages = self._paged(caches, exact, namespace)
        return PublishPrefix(
            tokens=exact, namespace=namespace, payload=payload, nbytes=kinds.nbytes(caches),
            trimmable=kinds.is_trimmable(caches), reason=reason, plan=plan, session=session, pages=pages,
        )


def _warms_up(config: RuntimeConfig) -> bool:
    """`--device-warmup`: "auto" warms a process on a GPU only, where each shape's kernels are built on its
    first use."""
    import mlx.core as mx

    return config.device_warmup == "on" or (config.device_warmup == "auto" and mx.default_device() != mx.cpu)


def _probe_setup(config: RuntimeConfig, restore: Any, *, tune: bool, max_context: int, kv_bytes_per_token: int,
                 step: int) -> dict[str, Any]:
    """What a device probe's measurements depend on (kv/probe_file.py): the device, MLX, the host, and
    the probe's own options. Another value in any of them: the saved probe is not reused."""
    import platform

    import mlx.core as mx

    info = dict(mx.device_info()) if hasattr(mx, "device_info") else {}
    # The device as it is, not its state now: CUDA's device_info has its free memory, which moves with
    # every process on the device, and kept here it made a saved probe's reuse a matter of luck.
    stable = {k: str(v) for k, v in sorted(info.items()) if "free" not in k}
    return {
        "device": str(mx.default_device()), "device_info": stable,
        "mlx": getattr(mx, "__version__", ""), "host": platform.node(), "budget_s": config.device_probe_budget_s,
        "tune_step": tune, "step": step, "max_context": max_context, "kv_bytes_per_token": kv_bytes_per_token,
        "restore": None if restore is None else {
            "landing": restore.landing, "verify": restore.verify, "layout": restore.layout,
            "block_tokens": restore.block_tokens, "host_tier": restore.host_tier,
        },
    }
