"""The engine actor: owns the model, the tokenizer and every mx.array.

All native MLX work runs on one dedicated OS thread (``MlxThread``). The actor's
trio task drains its inbox between steps, hands each step to the thread, and
delivers the results: token events to each request's channel, checkpoints to
the cache owner. Continuous batching is mlx-lm's ``BatchGenerator``: new rows
join between steps, and decode and prefill chunks interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from mlxd.kv.device_costs import DeviceProbe
from mlxd.kv.file_format import FileHeader, Landing
from mlxd.kv.pacing import WriteGovernor
from mlxd.kv.shard_mirror import (
    FollowerShards,
    LeaderMirror,
    MissingShard,
    PrefixRef,
    ShardRef,
    shard_key,
)
from mlxd.model.identity import model_identity
from mlxd.runtime import device_memory
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.distributed import MAX_DROPS_PER_STEP, StepChannel, StepOps, pin_seed
from mlxd.runtime.logging import get_logger
from mlxd.runtime.messages import (
    CheckpointGeneration,
    EngineInbox,
    EngineNote,
    GenCheckpointMessage,
    GenerationAbandoned,
    GenerationCompleted,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    MemoryMeasured,
    PrefillMeasured,
    PromptAccepted,
    PublishPrefix,
    RestoreMeasured,
    ShardsDropped,
    StartGeneration,
    TokenGenerated,
)
from mlxd.runtime.mlx_thread import MlxThread

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from mlxd.kv.ssd_store import StoreIdentity

log = get_logger("mlxd.engine")

# With a memory budget, MLX memory is measured for the cache owner at every prefill
# boundary and at least every this many steps (a cheap counter read, no sync).
MEASURE_MEMORY_EVERY = 256

# What a step produces for others: the cache owner's notes and the generation checkpointer's.
_Note = EngineNote | CheckpointGeneration | GenerationCompleted | GenerationAbandoned


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
    store_identity: StoreIdentity | None = None  # when the SSD tier is on
    probe: DeviceProbe | None = None  # the startup device probe, when it ran
    memory_budget_bytes: int = 0  # resolved --memory-budget (0 = none)


@attrs.frozen
class _Emit:
    """One event for one row, computed on the engine thread."""

    uid: int
    event: GenerationEvent


@attrs.frozen
class _StepResult:
    emits: list[_Emit]
    notes: list[_Note]  # publications and timings (cache owner), generation checkpoints (checkpointer)
    finished: list[int]  # uids that left the batch
    rejected: list[tuple[_Row, str]] = attrs.Factory(list)  # rows refused before joining the batch


@attrs.frozen(kw_only=True)
class _Prepared:
    """What a row brings to the batch, built before the generator sees it."""

    caches: list[Any] | None  # the lent prefix (mlx-lm caches), or None for a cold start
    usable: int
    tier: str
    sampler: Any
    processors: list[Any]
    stops: Any  # mlx_lm.generate.StopSequences


@attrs.define
class _Row:
    start: StartGeneration
    uid: int = -1
    cached_tokens: int = 0
    want_snapshot: bool = False
    generated: int = 0
    prefilled: int = 0  # prompt tokens processed so far in this insert
    sampler: Any = None  # gen_hook.SeededSampler, or None for greedy


class EngineActor:
    """Run generations for the scheduler; publish checkpoints to the cache owner."""

    def __init__(
        self,
        config: RuntimeConfig,
        *,
        inbox: trio.MemoryReceiveChannel[EngineInbox],
        publish: trio.MemorySendChannel[EngineNote],
        governor: WriteGovernor | None = None,
        checkpoints: trio.MemorySendChannel[GenCheckpointMessage] | None = None,
    ) -> None:
        self._config = config
        self._inbox = inbox
        self._publish = publish
        # The generation checkpointer's inbox (--generation-checkpoint N), or None.
        self._checkpoints = checkpoints
        # Told whether rows are in the batch, so write-behind paces itself meanwhile.
        self._governor = governor or WriteGovernor(busy_rate_bytes_per_s=None)
        self._thread: MlxThread | None = None
        # Thread-side state (touched only inside MlxThread jobs).
        self._model: Any = None
        self._tokenizer: Any = None
        self._generator: Any = None
        self._stream: Any = None
        self._store_identity: StoreIdentity | None = None
        self._channel: StepChannel | None = None  # --distributed: rank 0 -> followers (runtime/distributed.py)
        # --distributed rank 0 with the prompt cache: the prefixes the followers hold (kv/shard_mirror.py).
        self._mirror: LeaderMirror | None = None
        self._reset_drops: list[str] = []  # keys a failed step stopped lending: dropped with the reset
        self._stepping = False  # inside _step: a failure there loses the step's checkpoints
        self._prefill_step_size = config.prefill_step_size
        self._memory_budget = 0  # resolved at load
        self._steps_unmeasured = 0
        # Task-side state.
        self._rows: dict[int, _Row] = {}
        self._pending: list[_Row] = []
        self._cancelled: set[str] = set()
        self._stopping: set[str] = set()  # to end as a normal "stop" (a client's stop string)
        self._drops: list[ShardRef] = []  # mirrored prefixes the cache owner dropped, for the next step
        self.stats = {
            "steps": 0,
            "batch_rows": 0,
            "generated_tokens": 0,
            "prompt_tokens": 0,
            "failed_steps": 0,
            "checkpoints_skipped": 0,
            "checkpoint_s": 0.0,
        }
        self._done_uid = 0  # negative uids for resumed rows that finish without decoding

    # --- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[EngineInfo] = trio.TASK_STATUS_IGNORED) -> None:
        self._thread = MlxThread("mlxd-engine")
        loaded = False
        try:
            info = await self._thread.run(self._load)
            loaded = True
            log.info("engine.ready", model=info.model_name, max_context=info.max_context,
                     memory_budget_bytes=info.memory_budget_bytes)
            task_status.started(info)
            if self._memory_budget > 0:  # weights and buffers, before any request (the channel buffers it)
                await self._publish.send(await self._thread.run(self._measure_memory, "load"))
            await self._serve()
        finally:
            with trio.CancelScope(shield=True):
                self._fail_all("engine stopped")
                if self._channel is not None and loaded:
                    try:  # the followers are waiting for the next step: tell them to stop
                        await self._thread.run(self._channel.send, StepOps(shutdown=True))
                    except (RuntimeError, OSError):
                        log.warning("engine.followers_gone")  # a rank already stopped (mlx.launch stops the rest)
                await self._thread.run(self._close)
                if self._channel is not None:
                    self._channel.close()
                await self._thread.aclose()

    def _load(self) -> EngineInfo:
        import mlx.core as mx

        from mlxd.kv import kinds
        from mlxd.model import fast_mask
        from mlxd.model.detok import load_model

        fast_mask.install()  # fused causal attention for unpadded prefill chunks
        self._stream = mx.new_stream(mx.default_device())
        with mx.stream(self._stream):
            path = self._resolve_model_path()
            if self._config.distributed:
                model, tokenizer = self._load_sharded(path)
            else:
                model, tokenizer = load_model(path)
            if mx.default_device() == mx.cpu:
                # bf16/fp16 matmuls are ~40x slower than fp32 on CPU.
                _cast_float_weights(model, mx.float32)
            if self._channel is not None:
                self._channel.connect()  # every rank has loaded its shard
                log.info("engine.step_channel", rank=self._channel.rank, mode=self._channel.mode)
                if self._channel.rank == 0 and self._channel.size > 1 and self._config.prompt_cache_bytes > 0:
                    self._mirror = LeaderMirror()
                    self.stats.update(mirrored_prefixes=0, mirror_misses=0)
        self._model, self._tokenizer = model, tokenizer
        device_memory.managed()  # on CUDA: find the runtime for the managed-memory hints, and say so
        try:  # unsupported caches fail the load, not the first request or cache hit
            kinds.check_model_caches(self._fresh_caches())
            kv_bytes_per_token = self._measure_kv_bytes_per_token()
        except (kinds.UnknownCacheKind, ValueError) as exc:
            raise ModelRefused(f"cannot serve {path}: {exc}") from exc
        self._generator = self._new_generator()
        cfg = json.loads((path / "config.json").read_text())
        max_context = self._config.max_context or int(cfg.get("max_position_embeddings", 32768))
        name = self._config.model_name or (
            Path(self._config.model).name if self._config.model and Path(self._config.model).exists()
            else self._config.model or f"mlxd-{self._config.model_preset}"
        )
        identity = model_identity(path)  # content hash (memoized per file); the served name is no part of it
        self._store_identity = (
            _store_identity(identity, path, self._config.kv_scheme) if self._config.ssd_cache_dir else None
        )
        vocab_size = int(cfg.get("vocab_size") or len(tokenizer._tokenizer))
        probe = self._probe(max_context, kv_bytes_per_token, vocab_size) if self._wants_probe() else None
        self._memory_budget = self._resolve_memory_budget()
        return EngineInfo(
            model_name=name,
            model_path=str(path),
            tokenizer=tokenizer,
            eos_token_ids=frozenset(tokenizer.eos_token_ids),
            max_context=max_context,
            kv_bytes_per_token=kv_bytes_per_token,
            vocab_size=vocab_size,
            model_identity=identity,
            store_identity=self._store_identity,
            probe=probe,
            memory_budget_bytes=self._memory_budget,
        )

    def _load_sharded(self, path: Path) -> tuple[Any, Any]:
        """Load lazily and keep this rank's shard: mlx-lm's tensor parallelism (`model.shard`)."""
        import mlx.core as mx

        from mlxd.model.detok import load_model

        try:
            group = mx.distributed.init(strict=True)
        except RuntimeError as exc:
            raise ModelRefused(
                f"--distributed needs the ranks of a distributed launch (e.g. `mlx.launch --backend ring "
                f"-n 2 --hosts 127.0.0.1 -- mlxd serve --distributed ...`): {exc}"
            ) from exc
        self._channel = StepChannel(group, self._stream)
        model, tokenizer = load_model(path, lazy=True)
        if group.size() > 1:
            cfg = json.loads((path / "config.json").read_text())
            cfg = cfg.get("text_config", cfg)
            heads = [cfg.get(k) for k in ("num_attention_heads", "num_key_value_heads")]
            if any(isinstance(h, int) and h % group.size() for h in heads):
                raise ModelRefused(
                    f"cannot shard {path} over {group.size()} ranks: attention heads {heads} do not divide evenly"
                )
            if not hasattr(model, "shard"):
                raise ModelRefused(
                    f"cannot serve {path} distributed: its mlx-lm model class has no tensor-parallel shard()"
                )
            try:
                model.shard(group)
            except ValueError as exc:  # e.g. heads not divisible by the world size
                raise ModelRefused(f"cannot shard {path} over {group.size()} ranks: {exc}") from exc
        log.info(
            "engine.distributed", rank=group.rank(), world_size=group.size(), pid=os.getpid(), sharding="tensor-parallel",
            prompt_cache=("off" if self._config.prompt_cache_bytes <= 0
                          else "ram, mirrored: every rank keeps its shard of each cached prefix"),
        )
        return model, tokenizer

    def _resolve_memory_budget(self) -> int:
        """--memory-budget, or a share of the device's memory (runtime.config.default_memory_budget)."""
        import mlx.core as mx

        from mlxd.runtime.config import default_memory_budget, physical_memory_bytes

        if self._config.memory_budget_bytes is not None:
            return self._config.memory_budget_bytes
        if hasattr(mx, "device_info"):
            info = dict(mx.device_info())
        elif mx.metal.is_available():
            info = dict(mx.metal.device_info())
        else:
            info = {}
        return default_memory_budget(info, physical_memory_bytes())

    def _measure_memory(self, reason: str) -> MemoryMeasured:
        import mlx.core as mx

        self._steps_unmeasured = 0
        return MemoryMeasured(int(mx.get_active_memory()), int(mx.get_peak_memory()), reason)

    def _wants_probe(self) -> bool:
        mode = self._config.device_probe
        if mode == "off":
            return False
        return mode == "on" or self._config.ssd_cache_dir is not None or bool(self._config.tune_prefill_step)

    def _probe(self, max_context: int, kv_bytes_per_token: int, vocab_size: int) -> DeviceProbe:
        """Measure this device (seconds) before serving; see actors/device_probe.py."""
        import mlx.core as mx

        from mlxd.actors.device_probe import probe_device

        tune = self._config.tune_prefill_step
        if tune is None:
            tune = mx.default_device() != mx.cpu
        with mx.stream(self._stream):
            probe = probe_device(
                self._generator,
                vocab_size=vocab_size,
                max_context=max_context,
                kv_bytes_per_token=kv_bytes_per_token,
                budget_s=self._config.device_probe_budget_s,
                restore_dir=Path(self._config.ssd_cache_dir) if self._config.ssd_cache_dir else None,
                tune_step=tune,
            )
        # The probe's rows are finished; a fresh generator starts serving with the chosen chunk size.
        self._close()
        self._generator = self._new_generator(probe.prefill_step_size)
        summary = probe.as_dict()
        summary.pop("cost_model")
        log.info("engine.device_probe", **summary)
        return probe

    def _resolve_model_path(self) -> Path:
        if self._config.model is None:
            from mlxd.model.tiny import ensure_model

            return Path(ensure_model(self._config.model_preset))
        local = Path(self._config.model).expanduser()
        if local.exists():
            return local
        from mlx_lm.utils import _download  # hub repo id, where a network exists

        return Path(_download(self._config.model))

    def _new_generator(self, prefill_step_size: int | None = None) -> Any:
        from mlx_lm.generate import BatchGenerator

        if prefill_step_size is not None:
            self._prefill_step_size = prefill_step_size

        return BatchGenerator(
            self._model,
            max_tokens=self._config.default_max_tokens,
            stop_tokens=[[t] for t in sorted(self._tokenizer.eos_token_ids)],
            completion_batch_size=self._config.max_batch,
            prefill_batch_size=min(self._config.prefill_batch, self._config.max_batch),
            prefill_step_size=self._prefill_step_size,
            stream=self._stream,
        )

    def _fresh_caches(self) -> list[Any]:
        """A new row's caches: the model's own, with plain KV layers quantized under --kv-bits."""
        from mlx_lm.models.cache import make_prompt_cache

        from mlxd.kv.quantized_batch import quantized_like

        caches = make_prompt_cache(self._model)
        if self._config.kv_bits is None:
            return caches
        return quantized_like(caches, group_size=self._config.kv_group_size, bits=self._config.kv_bits)

    def _measure_kv_bytes_per_token(self) -> int:
        """Cache bytes one more token of context costs, all layers, under the KV scheme (two short prefills)."""
        import mlx.core as mx

        from mlxd.kv import kinds

        sizes = []
        with mx.stream(self._stream):
            for n in (32, 64):
                caches = self._fresh_caches()
                try:
                    self._model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
                    mx.eval([c.state for c in caches])
                except (ValueError, TypeError, AttributeError) as exc:  # e.g. head_dim % group size, or
                    # an attention that does not take quantized KV: refused at load, not at a request
                    raise ValueError(f"this model cannot run KV scheme {self._config.kv_scheme}: {exc}") from exc
                sizes.append(kinds.nbytes(caches))
        return max(0, (sizes[1] - sizes[0]) // 32)

    def _row_caches(self, lent: list[Any] | None) -> list[Any] | None:
        """What a row starts from: a lent prefix, or fresh caches; quantized ones made batchable."""
        if self._config.kv_bits is None:
            return lent
        from mlxd.kv.quantized_batch import batchable

        return batchable(lent if lent is not None else self._fresh_caches())

    def _close(self) -> None:
        if self._generator is not None:
            self._generator.close()
            self._generator = None
        if self._stream is not None:
            import mlx.core as mx

            try:
                mx.synchronize(self._stream)  # no work in flight when the thread's streams go
            except RuntimeError:
                log.warning("engine.synchronize_failed")

    # --- the serving loop -----------------------------------------------------------

    async def _serve(self) -> None:
        assert self._thread is not None
        while True:
            if not self._rows and not self._pending and not self._drops:
                self._governor.set_busy(False)
                self._accept(await self._inbox.receive())
            self._governor.set_busy(True)
            while True:
                try:
                    self._accept(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            starts, self._pending = self._pending, []
            cancels = [r.uid for r in self._rows.values() if r.start.request.request_id in self._cancelled]
            stops = [r.uid for r in self._rows.values()
                     if r.start.request.request_id in self._stopping and r.uid not in cancels]
            self._cancelled.clear()
            self._stopping.clear()
            dropped, self._drops = self._drops[:MAX_DROPS_PER_STEP], self._drops[MAX_DROPS_PER_STEP:]
            if self._channel is not None:
                # The same seed on every rank; a RAM hit only if every rank holds its shard
                # (decided in _step_everywhere); no SSD tier when distributed.
                for row in starts:
                    row.start = attrs.evolve(row.start, request=pin_seed(row.start.request), restore=None, resume=None)
            try:
                result = await self._thread.run(self._step_everywhere, starts, cancels, stops, dropped)
            except Exception as exc:  # a model error must not take the server down
                # The generator's state is unknown now: every row in it, and every
                # row of this step not yet inserted, gets its answer at once.
                log.exception("engine.step_failed", rows=len(self._rows), starting=len(starts))
                self.stats["failed_steps"] += 1
                self._fail_all(f"generation failed: {type(exc).__name__}: {exc}", also=starts)
                await self._thread.run(self._reset_everywhere)
                continue
            await self._deliver(result)

    def _accept(self, msg: EngineInbox) -> None:
        if isinstance(msg, StartGeneration):
            self._pending.append(_Row(start=msg))
            return
        if isinstance(msg, ShardsDropped):
            self._drops.extend(msg.refs)
            return
        for row in list(self._pending):
            if row.start.request.request_id == msg.request_id:
                self._pending.remove(row)
                _send(row.start.events, GenerationFinished("cancelled", len(row.start.request.prompt), 0, 0))
                row.start.events.close()
                self._abandon(row)
                return
        self._cancelled.add(msg.request_id)

    async def _deliver(self, result: _StepResult) -> None:
        # Checkpoints first: a client that flushes right after its reply must find
        # that reply's checkpoint already with the cache owner.
        for note in result.notes:
            if isinstance(note, CheckpointGeneration | GenerationCompleted | GenerationAbandoned):
                if self._checkpoints is not None:
                    await self._checkpoints.send(note)
            else:
                await self._publish.send(note)
        for row, message in result.rejected:
            _send(row.start.events, GenerationFailed(message))
            row.start.events.close()
            self._abandon(row)
        for emit in result.emits:
            row = self._rows.get(emit.uid)
            if row is None:
                continue
            if not _send(row.start.events, emit.event):
                self._cancelled.add(row.start.request.request_id)
        for uid in result.finished:
            row = self._rows.pop(uid, None)
            if row is not None:
                row.start.events.close()
        self.stats["batch_rows"] = len(self._rows)

    def _fail_all(self, message: str, *, also: Sequence[_Row] = ()) -> None:
        """Answer every row the engine holds (and `also`, rows taken for a step) with an error."""
        rows = {id(row): row for row in [*self._rows.values(), *self._pending, *also]}
        for row in rows.values():
            _send(row.start.events, GenerationFailed(message))
            row.start.events.close()
            self._abandon(row)
        self._rows.clear()
        self._pending.clear()

    def _abandon(self, row: _Row) -> None:
        """A request leaves without completing: its checkpoint becomes resumable by a retry."""
        key = row.start.checkpoint_key
        if key is not None and self._checkpoints is not None:
            try:
                self._checkpoints.send_nowait(GenerationAbandoned(key, row.start.request.request_id))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the key stays owned until this process ends: no resume, never a wrong one

    # --- thread side -----------------------------------------------------------------

    def _reset(self) -> None:
        self._close()
        self._generator = self._new_generator()

    # --- distributed (runtime/distributed.py) ------------------------------------------

    def _step_everywhere(
        self, starts: list[_Row], cancels: list[int], stops: list[int], dropped: Sequence[ShardRef] = ()
    ) -> _StepResult:
        """A step, told first to the follower ranks (which must run the same generator operations).

        With the prompt cache, a start says which cached prefix it lends (its key),
        and the followers confirm they hold every one before anyone steps: a
        follower that does not fails the step on every rank (then a reset) rather
        than decode from another prefix than rank 0's.
        """
        if self._channel is None or self._channel.size == 1:
            return self._step(starts, cancels, stops)
        prefixes = tuple(self._lent_prefix(row) for row in starts)
        mirror = self._mirror
        drops = tuple(ref.key for ref in dropped if mirror is not None and mirror.dropped(ref))
        ops = StepOps(
            starts=tuple(row.start.request for row in starts),
            prefixes=prefixes if any(p is not None for p in prefixes) else (),
            cancels=tuple(cancels), stops=tuple(stops), drops=drops,
        )
        self._channel.send(ops)
        if ops.lends and self._channel.gather_missing():
            keys = [p.key for p in prefixes if p is not None]
            for key in keys:  # never lent again: hits on them start cold
                if mirror is not None:
                    mirror.forget(key)
            self._reset_drops.extend(keys)
            raise MissingShard(f"a follower rank lacks its shard of a cached prefix this step lends ({len(keys)})")
        self._stepping = True
        result = self._step(starts, cancels, stops)
        self._stepping = False
        if mirror is not None:  # every rank kept the same checkpoints: the followers hold them now
            result.notes[:] = [
                attrs.evolve(n, shard=mirror.published(shard_key(n.namespace, n.tokens)))
                if isinstance(n, PublishPrefix) else n
                for n in result.notes
            ]
            self.stats["mirrored_prefixes"] = len(mirror)
        return result

    def _lent_prefix(self, row: _Row) -> PrefixRef | None:
        """The cached prefix a start lends on every rank; a hit the followers do not hold starts cold."""
        hit = row.start.hit
        if hit is None:
            return None
        key = shard_key(hit.entry.namespace, hit.entry.tokens)
        if hit.usable <= 0 or self._mirror is None or not self._mirror.holds(key):
            row.start = attrs.evolve(row.start, hit=None)  # a cache miss on every rank, never a wrong prefix
            if self._mirror is not None:
                self.stats["mirror_misses"] = self.stats.get("mirror_misses", 0) + 1
            return None
        return PrefixRef(key, hit.usable, len(hit.entry.tokens))

    def _reset_everywhere(self) -> None:
        if self._channel is not None:
            drops, self._reset_drops = tuple(self._reset_drops), []
            self._channel.send(StepOps(reset=True, drops=drops, discard=self._stepping))
        self._stepping = False
        self._reset()

    def follow(self) -> None:
        """A follower rank's whole life, on the calling thread: load, then replay rank 0's steps.

        Returns when rank 0 shuts down. A step that fails here resets the
        generator; rank 0 then fails the same step and says so (`reset`); any
        other next step means the ranks diverged, and the follower stops.

        With the prompt cache, this rank keeps its shard of every checkpoint its
        steps produce (the same ones rank 0's cache owner receives) until rank 0
        says its owner dropped them, and lends them when a start names their
        key. A start from a key not held here is refused before the step: this
        rank tells rank 0 (`confirm`), which fails the step and resets every rank.
        """
        self._load()
        assert self._channel is not None and self._channel.rank > 0
        events, nobody = trio.open_memory_channel[GenerationEvent](0)
        nobody.close()  # rows here deliver nothing: rank 0 answers the clients
        shards = FollowerShards()
        added: list[str] = []  # keys the latest step added (forgotten if rank 0 failed that step)
        failed = False
        try:
            while True:
                ops = self._channel.receive()
                if ops.shutdown:
                    return
                missing = shards.missing_keys(ops.prefixes)
                if ops.lends:
                    self._channel.confirm(len(missing))
                if ops.reset:
                    shards.drop_all([*ops.drops, *(added if ops.discard else ())])
                    added = []
                    self._reset()
                    self._rows.clear()
                    failed = False
                    continue
                if failed:
                    raise RuntimeError("rank 0 went on after a step that failed here: the ranks diverged")
                if missing:  # rank 0 fails this step and resets every rank
                    shards.missing += len(missing)
                    log.error("engine.shard_missing", keys=missing, held=len(shards))
                    shards.drop_all(ops.drops)
                    failed = True
                    continue
                prefixes = ops.prefixes or (None,) * len(ops.starts)
                starts = [
                    _Row(start=StartGeneration(request=r, hit=None if p is None else shards.lend(p), events=events))
                    for r, p in zip(ops.starts, prefixes, strict=True)
                ]
                shards.drop_all(ops.drops)  # lent rows keep what they borrowed
                added = []
                try:
                    result = self._step(starts, list(ops.cancels), list(ops.stops))
                except Exception:
                    log.exception("engine.follower_step_failed", rows=len(self._rows))
                    self._reset()
                    self._rows.clear()
                    failed = True
                    continue
                for uid in result.finished:
                    self._rows.pop(uid, None)
                for note in result.notes:
                    if isinstance(note, PublishPrefix):
                        key = shard_key(note.namespace, note.tokens)
                        if key not in shards:
                            added.append(key)
                        shards.hold(note.namespace, note.tokens, note.payload, nbytes=note.nbytes,
                                    trimmable=note.trimmable)
        finally:
            log.info("engine.follower_shards", rank=self._channel.rank, **shards.summary())
            self._close()
            self._channel.close()

    def stop_early(self, request_id: str) -> None:
        """End a decoding generation as a normal stop (its client matched a stop string).

        At the next step the row leaves the batch with reason "stop" and its
        checkpoint is published, as for an end token.
        """
        self._stopping.add(request_id)

    def _step(self, starts: list[_Row], cancels: list[int], stops: list[int]) -> _StepResult:
        import mlx.core as mx

        emits: list[_Emit] = []
        notes: list[_Note] = []
        finished: list[int] = []
        rejected: list[tuple[_Row, str]] = []
        with mx.stream(self._stream):
            for row in starts:
                try:  # what a row brings (its prefix, sampler) is built before the generator sees it
                    if row.start.resume is not None:
                        emits.extend(self._resume(row, notes))
                        continue
                    prepared = self._prepare(row, notes)
                except Exception as exc:  # fails this request only; the batch is untouched
                    log.exception("engine.request_failed", request_id=row.start.request.request_id)
                    rejected.append((row, f"generation failed: {type(exc).__name__}: {exc}"))
                    continue
                emits.append(self._insert(row, prepared))
            finished.extend(uid for uid in self._rows if uid < 0)  # resumed rows that had nothing left
            for ended, reason in ((cancels, "cancelled"), (stops, "stop")):
                if not ended:
                    continue
                notes.extend(self._cut_snapshots(ended))
                self._generator.remove(ended)
                for uid in ended:
                    row = self._rows[uid]
                    req = row.start.request
                    if row.start.checkpoint_key is not None:  # a stop string ends it; a cancel leaves it resumable
                        end = GenerationCompleted if reason == "stop" else GenerationAbandoned
                        notes.append(end(row.start.checkpoint_key, req.request_id))
                    emits.append(
                        _Emit(uid, GenerationFinished(reason, len(req.prompt), row.cached_tokens, row.generated))
                    )
                    finished.append(uid)
            live = set(self._rows) - set(cancels) - set(stops) - set(finished)
            if not live:
                return _StepResult(emits, notes, finished, rejected)
            decoding = any(r.generated for r in self._rows.values())
            t0 = time.perf_counter()
            prompt_responses, gen_responses = self._generator.next()
            elapsed = time.perf_counter() - t0
            self.stats["steps"] += 1
            chunks = [r for r in prompt_responses if not r.end_of_prompt]
            if len(chunks) == 1 and not decoding:
                self._measure_prefill(chunks[0], elapsed, notes)
            for r in prompt_responses:
                row = self._rows.get(r.uid)
                if row is not None and row.want_snapshot and r.end_of_segment and not r.end_of_prompt:
                    row.want_snapshot = False
                    self._checkpoint(notes, self._boundary_snapshot, row)
            for r in gen_responses:
                row = self._rows.get(r.uid)
                if row is None:
                    continue
                row.generated += 1
                self.stats["generated_tokens"] += 1
                emits.append(_Emit(r.uid, self._token_event(row, r)))
                if row.start.checkpoint_key is not None:
                    self._checkpoint_hook(row, r.finish_reason, notes)
                if r.finish_reason is not None:
                    req = row.start.request
                    emits.append(
                        _Emit(
                            r.uid,
                            GenerationFinished(r.finish_reason, len(req.prompt), row.cached_tokens, row.generated),
                        )
                    )
                    finished.append(r.uid)
                    if self._config.prompt_cache_bytes > 0 and r.prompt_cache is not None:
                        self._checkpoint(
                            notes, self._snapshot, r.all_tokens, req.namespace, r.prompt_cache, "final",
                            session=req.session,
                        )
            if self._memory_budget > 0:  # last: the owner sees this step's publications first
                self._steps_unmeasured += 1
                if any(r.end_of_segment or r.end_of_prompt for r in prompt_responses):
                    notes.append(self._measure_memory("prefill"))
                elif self._steps_unmeasured >= MEASURE_MEMORY_EVERY:
                    notes.append(self._measure_memory("decode"))
        return _StepResult(emits, notes, finished, rejected)

    def _checkpoint(
        self, notes: list[_Note], make: Callable[..., PublishPrefix], *args: Any, **kwargs: Any
    ) -> None:
        """Publish a checkpoint; one that cannot be taken is skipped and logged, never fails its batch."""
        try:
            notes.append(make(*args, **kwargs))
        except Exception:
            log.exception("engine.checkpoint_skipped", kind=getattr(make, "__name__", "snapshot"))
            self.stats["checkpoints_skipped"] += 1

    def _cut_snapshots(self, uids: list[int]) -> list[_Note]:
        """Checkpoints of decoding rows ended early (a stop string, a disconnect).

        Published like a normal end ("final"), with every token the KV holds: the
        prompt and all generated tokens, a few of which may lie past where a stop
        string cut the text. A later lookup lends only the prefix it shares.
        """
        if self._config.prompt_cache_bytes <= 0:
            return []
        decoding = [uid for uid in uids if self._rows[uid].generated > 0]
        if not decoding:
            return []
        try:
            extracted = self._generator.extract_cache(decoding)
        except Exception:  # a checkpoint that cannot be taken never fails the rows
            log.exception("engine.checkpoint_skipped", kind="cut")
            self.stats["checkpoints_skipped"] += 1
            return []
        notes: list[_Note] = []
        for uid, (caches, tokens) in extracted.items():
            if caches and tokens:
                req = self._rows[uid].start.request
                self._checkpoint(notes, self._snapshot, list(tokens), req.namespace, caches, "final", session=req.session)
        return notes

    def _measure_prefill(self, r: Any, seconds: float, notes: list[_Note]) -> None:
        row = self._rows.get(r.uid)
        if row is None:
            return
        done = int(r.progress[0])
        new = done - row.prefilled
        notes.append(PrefillMeasured(new, row.cached_tokens + row.prefilled, seconds))
        row.prefilled = done

    async def landing(self, header: FileHeader) -> Landing:
        """MLX arrays for a cold file to be read straight into (`kinds.landing`, on this engine's thread)."""
        assert self._thread is not None
        return await self._thread.run(self._landing, header)

    def _landing(self, header: FileHeader) -> Landing:
        import mlx.core as mx

        from mlxd.kv import kinds

        with mx.stream(self._stream):
            return kinds.landing(header)

    def _restore(self, row: _Row, notes: list[_Note]) -> tuple[list[Any], int, str]:
        """Adopt a cold file's bytes into MLX, publish it to RAM, and lend its prefix."""
        from mlxd.kv import kinds

        restore = row.start.restore
        t0 = time.perf_counter()
        caches = kinds.adopt(restore.loaded, landed=device_memory.to_device)
        seconds = restore.loaded.seconds + (time.perf_counter() - t0)
        tokens = tuple(restore.record.tokens)
        notes.append(RestoreMeasured(restore.loaded.nbytes, seconds))
        notes.append(
            PublishPrefix(
                tokens=tokens,
                namespace=row.start.request.namespace,
                payload=caches,
                nbytes=kinds.nbytes(caches),
                trimmable=kinds.is_trimmable(caches),
                reason="restore",
                durable=True,
                session=row.start.request.session,
            )
        )
        return kinds.lend(caches, restore.usable, total=len(tokens)), restore.usable, "ssd"

    def _stop_ids(self, s: Any) -> set[int]:
        return set(self._tokenizer.eos_token_ids) | set(s.stop_token_ids)

    def _prepare(self, row: _Row, notes: list[_Note]) -> _Prepared:
        """The lent prefix, sampler and processors of a row; raises without touching the generator."""
        from mlx_lm.generate import StopSequences

        from mlxd.kv import kinds

        hit = row.start.hit
        if row.start.restore is not None and row.start.restore.loaded is not None:
            lent, usable, tier = self._restore(row, notes)
        else:
            usable = hit.usable if hit is not None else 0
            lent = kinds.lend(hit.entry.payload, usable, total=len(hit.entry.tokens)) if hit is not None else None
            tier = "ram" if usable > 0 else "none"
        row_caches = self._row_caches(lent)
        s = row.start.request.sampling
        stops = [[t] for t in sorted(self._stop_ids(s))]
        return _Prepared(
            caches=[row_caches] if row_caches is not None else None,
            usable=usable,
            tier=tier,
            sampler=make_sampler(s),
            processors=make_processors(s),
            stops=StopSequences(stops),
        )

    def _insert(self, row: _Row, prepared: _Prepared) -> _Emit:
        req = row.start.request
        usable = prepared.usable
        row.sampler = prepared.sampler  # a generation checkpoint saves its RNG state
        (uid,) = self._generator.insert(
            [list(req.prompt[usable:])],
            max_tokens=[req.sampling.max_tokens],
            caches=prepared.caches,
            all_tokens=[list(req.prompt[:usable])],
            samplers=[prepared.sampler],
            logits_processors=[prepared.processors],
            stop_sequences=[prepared.stops],
        )
        row.uid = uid
        row.cached_tokens = usable
        new_tokens = len(req.prompt) - usable - 1
        # A session keeps its checkpoints below the anonymous threshold (seed §5.12).
        threshold = 1 if req.session is not None else max(1, self._config.snapshot_min_tokens)
        row.want_snapshot = self._config.prompt_cache_bytes > 0 and new_tokens >= threshold
        self._rows[uid] = row
        self.stats["prompt_tokens"] += len(req.prompt) - usable
        queued = time.monotonic() - row.start.submitted_at if row.start.submitted_at else 0.0
        return _Emit(uid, PromptAccepted(len(req.prompt), usable, prepared.tier, queued))

    # --- generation checkpoints (seed §5.7; kv/gen_checkpoint.py) ----------------------

    def _checkpoint_hook(self, row: _Row, finish_reason: str | None, notes: list[_Note]) -> None:
        """Every N tokens, snapshot the row for the SSD; on a normal finish, drop its checkpoint."""
        key, rid = row.start.checkpoint_key, row.start.request.request_id
        assert key is not None
        if finish_reason is not None:
            notes.append(GenerationCompleted(key, rid))
            return
        every = self._config.generation_checkpoint
        if every <= 0 or row.generated % every or self._store_identity is None:
            return
        t0 = time.perf_counter()
        try:
            notes.append(self._generation_snapshot(row, key))
        except Exception:  # a checkpoint is an optimization: never fail the generation for it
            log.exception("engine.generation_checkpoint_failed")
        self.stats["checkpoint_s"] += time.perf_counter() - t0  # engine-thread time taken from decode

    def _generation_snapshot(self, row: _Row, key: str) -> CheckpointGeneration:
        from mlxd.kv import kinds
        from mlxd.kv.gen_checkpoint import GenerationRecord
        from mlxd.runtime.gen_hook import snapshot_row

        req = row.start.request
        snap = snapshot_row(self._generator, row.uid)
        if snap is None:
            raise RuntimeError("row is not decoding")
        rng = row.sampler.state() if row.sampler is not None else None
        record = GenerationRecord(
            key=key, prompt_tokens=len(req.prompt), emitted=snap.tokens[len(req.prompt):],
            pending=snap.pending, rng_key=rng,
        )
        meta = attrs.evolve(self._store_identity.meta(snap.tokens, req.namespace), generation=record.as_doc())
        plan = kinds.plan_snapshot(snap.caches, meta=meta)
        return CheckpointGeneration(key, req.request_id, plan, len(record.emitted))

    def _resume(self, row: _Row, notes: list[_Note]) -> list[_Emit]:
        """Continue a checkpointed generation: replay its tokens, then decode from the pending one."""
        from mlx_lm.generate import StopSequences

        from mlxd.kv import kinds
        from mlxd.runtime.gen_hook import SeededSampler

        resume = row.start.resume
        assert resume is not None
        req, record, s = row.start.request, resume.record, row.start.request.sampling
        t0 = time.perf_counter()
        caches = kinds.adopt(resume.loaded, landed=device_memory.to_device)
        notes.append(RestoreMeasured(resume.loaded.nbytes, resume.loaded.seconds + time.perf_counter() - t0))
        replay = [*record.emitted, record.pending]
        row.generated = len(replay)
        row.cached_tokens = len(req.prompt)
        queued = time.monotonic() - row.start.submitted_at if row.start.submitted_at else 0.0
        finish = "stop" if record.pending in self._stop_ids(s) else "length" if row.generated >= s.max_tokens else None
        if finish is None:
            if s.temperature > 0 and record.rng_key is not None:
                row.sampler = SeededSampler.restore(s, record.rng_key)
            (uid,) = self._generator.insert(
                [[record.pending]],
                max_tokens=[s.max_tokens - row.generated],
                caches=[self._row_caches(caches)],
                all_tokens=[list(req.prompt) + list(record.emitted)],
                samplers=[row.sampler],
                logits_processors=[make_processors(s)],
                stop_sequences=[StopSequences([[t] for t in sorted(self._stop_ids(s))])],
            )
        else:
            uid = self._done_uid = self._done_uid - 1  # never in the batch: finished this step
        row.uid = uid
        self._rows[uid] = row
        emits = [_Emit(uid, PromptAccepted(len(req.prompt), len(req.prompt), "checkpoint", queued))]
        emits += [_Emit(uid, TokenGenerated(t)) for t in replay]
        if finish is not None:
            emits.append(_Emit(uid, GenerationFinished(finish, len(req.prompt), row.cached_tokens, row.generated)))
            assert row.start.checkpoint_key is not None
            notes.append(GenerationCompleted(row.start.checkpoint_key, req.request_id))
        return emits

    def _boundary_snapshot(self, row: _Row) -> PublishPrefix:
        (caches, tokens) = self._generator.extract_cache([row.uid])[row.uid]
        req = row.start.request
        return self._snapshot(tokens, req.namespace, caches, "boundary", session=req.session)

    def _snapshot(
        self, tokens: list[int], namespace: str, caches: list[Any], reason: str, *, session: str | None = None
    ) -> PublishPrefix:
        """An evaluated checkpoint for the cache owner, with a write plan when the SSD tier is on."""
        import mlx.core as mx

        from mlxd.kv import kinds

        mx.eval([c.state for c in caches])
        exact = tuple(tokens)
        plan = None
        if self._store_identity is not None:
            plan = kinds.plan_snapshot(caches, meta=self._store_identity.meta(exact, namespace))
        return PublishPrefix(
            tokens=exact,
            namespace=namespace,
            payload=caches,
            nbytes=kinds.nbytes(caches),
            trimmable=kinds.is_trimmable(caches),
            reason=reason,
            plan=plan,
            session=session,
        )

    def _token_event(self, row: _Row, r: Any) -> TokenGenerated:
        import mlx.core as mx

        s = row.start.request.sampling
        if not s.logprobs and s.top_logprobs == 0:
            return TokenGenerated(r.token)
        lp = r.logprobs
        chosen = float(lp[r.token].item())
        top: tuple[tuple[int, float], ...] = ()
        if s.top_logprobs > 0:
            k = min(s.top_logprobs, lp.shape[-1])
            idx = mx.argpartition(-lp, kth=k - 1)[:k]
            ids: list[Any] = idx.tolist()  # type: ignore[assignment]
            vals: list[Any] = lp[idx].tolist()  # type: ignore[assignment]
            pairs = sorted(zip(ids, vals, strict=True), key=lambda p: -p[1])
            top = tuple((int(t), float(v)) for t, v in pairs)
        return TokenGenerated(r.token, chosen, top)


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


def make_sampler(s: Any) -> Any:
    """None (the batch's shared greedy sampler) or a per-request sampler with its own RNG key."""
    if s.temperature <= 0:
        return None
    from mlxd.runtime.gen_hook import SeededSampler

    return SeededSampler.seeded(s)  # its key after k samples is a value (generation checkpoints)


def make_processors(s: Any) -> list[Any]:
    """Penalties and logit bias as mlx-lm logits processors (none for plain sampling)."""
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(
        logit_bias=dict(s.logit_bias) or None,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty or None,
        frequency_penalty=s.frequency_penalty or None,
    )


def _cast_float_weights(model: Any, dtype: Any) -> None:
    """Cast floating weights to `dtype`, leaving quantized integer weights alone."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    cast = [
        (k, v.astype(dtype)) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else (k, v)
        for k, v in params
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())


def _store_identity(model_identity: str, path: Path, kv_scheme: str) -> StoreIdentity:
    """What every SSD file must match: model content, tokenizer, KV dtype, MLX version and backend.

    The served name is no part of it: renaming a model keeps its cache.
    """
    import hashlib

    import mlx.core as mx

    from mlxd.kv import file_format
    from mlxd.kv.ssd_store import StoreIdentity, compute_fingerprint

    tok = path / "tokenizer.json"
    tokenizer_hash = hashlib.sha256(tok.read_bytes()).hexdigest()[:16] if tok.exists() else "none"
    fingerprint = compute_fingerprint(
        {
            "model": model_identity,
            "tokenizer": tokenizer_hash,
            # the native scheme keeps its older name, so existing caches stay valid
            "kv_scheme": ("fp32" if mx.default_device() == mx.cpu else "native") if kv_scheme == "native" else kv_scheme,
            "mlx": getattr(mx, "__version__", "unknown"),
            "backend": str(mx.default_device()),
            "format": str(file_format.FORMAT_VERSION),
        }
    )
    return StoreIdentity(model_id=model_identity, fingerprint=fingerprint, tokenizer_hash=tokenizer_hash)
