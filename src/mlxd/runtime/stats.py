"""What `Runtime.stats()` returns: typed, frozen snapshots of a running mlxd.

Each part keeps the value its owner handed out (the engine's `EngineStats`, the
cache owner's `CacheStatsSnapshot`, ...), so readers such as the metrics use
attributes, never string keys. `as_dict()` renders the `/stats` JSON
(docs/http-api.md): its keys and their order are part of the HTTP API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mlxd.actors.scheduler import SchedulerStats
from mlxd.engine.ops import EngineStats
from mlxd.kv.device_costs import DeviceProbe
from mlxd.runtime.chat.stable_prefix import ProbeStats
from mlxd.runtime.kernel.channels import ChannelStats
from mlxd.runtime.kernel.messages import (
    CacheStatsSnapshot,
    DurabilitySnapshot,
    PrefetchSnapshot,
    WriterStats,
)


@attrs.frozen(kw_only=True)
class SchedulerView:
    """The scheduler's counters, with the admission counts the Runtime keeps and the queue's state."""

    submitted: int  # admitted to the queue (counted by the Runtime, which admits)
    completed: int
    cancelled: int
    failed: int
    rejected: int  # refused at a full queue (counted by the Runtime)
    running: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    last_ttft_s: float | None
    queued: int
    max_queue: int
    max_batch: int

    @classmethod
    def of(
        cls, counts: SchedulerStats, *, submitted: int, rejected: int, queued: int, max_queue: int, max_batch: int
    ) -> SchedulerView:
        return cls(
            submitted=submitted, completed=counts.completed, cancelled=counts.cancelled, failed=counts.failed,
            rejected=rejected, running=counts.running, prompt_tokens=counts.prompt_tokens,
            cached_tokens=counts.cached_tokens, generated_tokens=counts.generated_tokens,
            last_ttft_s=counts.last_ttft_s, queued=queued, max_queue=max_queue, max_batch=max_batch,
        )

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class SsdTierStats:
    """The SSD tier at one moment (seed §5.6 names): the cache owner's index, the writes, the reads."""

    entries: int
    bytes: int
    layout: str  # "whole" or "blocks"
    block_tokens: int | None  # the blocks layout's span; None for whole files
    blocks: int
    checkpoint_bytes: int
    max_bytes: int  # 0 = unlimited
    restores: int
    spills: int
    restore_ms_last: float | None
    demotions: int
    pending_snapshots: int
    pending_spills: int
    pending_spill_bytes: int
    dropped_spills: int
    failed_spills: int
    longest_durable_prefix_tokens: int
    superseded_spills: int
    corrupt_removed: int
    not_stored: int
    prefetch: PrefetchSnapshot
    writer: WriterStats
    pacing: dict[str, object]  # the write governor's state (`WriteGovernor.as_dict`)
    restore_decisions: dict[str, float]
    shared: dict[str, int | bool] | None  # a directory shared with other replicas (--ssd-shared)
    encoder_outputs: int = 0  # of `entries`: vision encoder outputs (vision/tensor_store.py)
    encoder_output_bytes: int = 0  # of `bytes`

    @classmethod
    def of(
        cls,
        cache: CacheStatsSnapshot,
        durability: DurabilitySnapshot,
        prefetch: PrefetchSnapshot,
        *,
        pacing: dict[str, object],
        layout: str,
        block_tokens: int,
    ) -> SsdTierStats:
        t = cache.tiers
        return cls(
            entries=t.ssd_entries,
            bytes=t.ssd_bytes,
            layout=layout,
            block_tokens=block_tokens if layout == "blocks" else None,
            blocks=t.ssd_blocks,
            checkpoint_bytes=t.ssd_checkpoint_bytes,
            max_bytes=t.ssd_max_bytes,
            restores=cache.restores,
            spills=durability.spills,
            restore_ms_last=cache.restore_ms_last,
            demotions=t.demotions,
            pending_snapshots=durability.pending_snapshots,
            pending_spills=durability.pending_spills,
            pending_spill_bytes=durability.pending_spill_bytes,
            dropped_spills=durability.dropped_spills,
            failed_spills=durability.failed_spills,
            longest_durable_prefix_tokens=t.longest_durable_prefix_tokens,
            superseded_spills=durability.superseded,
            corrupt_removed=cache.corrupt_removed,
            not_stored=durability.not_stored,
            prefetch=prefetch,
            writer=durability.writer,
            pacing=pacing,
            restore_decisions=t.restore_decisions,
            shared=cache.shared,
            encoder_outputs=cache.encoder_files,
            encoder_output_bytes=cache.encoder_bytes,
        )

    @property
    def disk_full(self) -> bool:
        """A write hit a full disk (ENOSPC/EDQUOT/EFBIG)."""
        return self.writer.disk_full

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "entries": self.entries,
            "bytes": self.bytes,
            "layout": self.layout,
            "block_tokens": self.block_tokens,
            "blocks": self.blocks,
            "checkpoint_bytes": self.checkpoint_bytes,
            "max_bytes": self.max_bytes,
            "restores": self.restores,
            "spills": self.spills,
            "restore_ms_last": self.restore_ms_last,
            "demotions": self.demotions,
            "pending_snapshots": self.pending_snapshots,
            "pending_spills": self.pending_spills,
            "pending_spill_bytes": self.pending_spill_bytes,
            "dropped_spills": self.dropped_spills,
            "failed_spills": self.failed_spills,
            "longest_durable_prefix_tokens": self.longest_durable_prefix_tokens,
            "superseded_spills": self.superseded_spills,
            "corrupt_removed": self.corrupt_removed,
            "disk_full": self.disk_full,
            "not_stored": self.not_stored,
            "prefetch": attrs.asdict(self.prefetch),
            "writer": {**attrs.asdict(self.writer), "pacing": self.pacing},
            "restore_decisions": self.restore_decisions,
            "encoder_outputs": {"entries": self.encoder_outputs, "bytes": self.encoder_output_bytes},
        }
        if self.shared is not None:
            out["shared"] = self.shared
        return out


@attrs.frozen(kw_only=True)
class RuntimeStats:
    """Everything `/stats` shows, as the owners handed it out; None = that part is not running."""

    model: str
    uptime_s: float
    admitting: bool
    scheduler: SchedulerView
    engine: EngineStats
    cache: CacheStatsSnapshot
    channels: Mapping[str, ChannelStats]  # the actors' inboxes by name
    blas: Mapping[str, str | None]  # mlxd._blas.status
    prompt_tokens: Mapping[str, int | bool]  # PieceEncoder.stats()
    template_probes: ProbeStats | None = None  # ProbedPrefixes.stats(): chat template cuts remembered
    device_probe: DeviceProbe | None = None  # the startup probe, when it ran
    ssd: SsdTierStats | None = None  # without --ssd-cache: None
    generation_checkpoints: Mapping[str, Any] | None = None  # --generation-checkpoint N

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "uptime_s": self.uptime_s,
            "admitting": self.admitting,
            "scheduler": self.scheduler.as_dict(),
            "engine": self.engine.as_dict(),
            "cache": self.cache.as_dict(),
            "channels": {name: c.as_dict() for name, c in self.channels.items()},
            "blas": dict(self.blas),
            "prompt_tokens": dict(self.prompt_tokens),
        }
        if self.template_probes is not None:
            out["template_probes"] = self.template_probes.as_dict()
        if self.device_probe is not None:
            out["device_probe"] = self.device_probe.as_dict()
        if self.ssd is not None:
            out["ssd_cache"] = self.ssd.as_dict()
        if self.generation_checkpoints is not None:
            out["generation_checkpoints"] = dict(self.generation_checkpoints)
        return out

