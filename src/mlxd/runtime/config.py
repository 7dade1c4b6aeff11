"""Configuration of an mlxd runtime (what `mlxd serve` flags and embedders set)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from mlxd.kv.kv_events import PublishAddress

GB = 1024**3


_ON, _OFF = ("1", "on", "true"), ("0", "off", "false")


def env_switch(name: str, *, default: bool) -> bool:
    """An environment arm that is on or off: unset or "" (`default`), "1"/"on"/"true", "0"/"off"/"false" (any
    case). Another value is a ValueError naming it (read once, at load: a typo must not measure one path as the
    other)."""
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", *_ON, *_OFF):
        raise ValueError(f"{name} must be 1/on/true or 0/off/false (unset: {'on' if default else 'off'}), "
                         f"not {value!r}")
    return default if value == "" else value in _ON


def _non_negative(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _positive(_inst: object, attr: attrs.Attribute, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attr.name} must be > 0, got {value}")


# The default memory budget: most of the accelerator's recommended working set
# (Metal reports one), else a share of the device's memory (CUDA) or of the
# machine's RAM (CPU) that leaves room for the OS and other processes.
WORKING_SET_SHARE = 0.9
PHYSICAL_SHARE = 0.75


def physical_memory_bytes() -> int:
    """The machine's RAM (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_memory_budget(device_info: Mapping[str, object], physical_bytes: int) -> int:
    """The budget when --memory-budget is not given, from MLX's device info (0 = unknown: none)."""
    working_set = device_info.get("max_recommended_working_set_size")
    if isinstance(working_set, int) and working_set > 0:
        return int(working_set * WORKING_SET_SHARE)
    memory = device_info.get("memory_size", device_info.get("total_memory"))  # Metal / CUDA (device memory)
    total = memory if isinstance(memory, int) and memory > 0 else physical_bytes
    return int(total * PHYSICAL_SHARE)


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """Everything the actors need; immutable once the runtime starts."""

    # A local model directory or a Hugging Face repo id; None = the built-in model.
    model: str | None = None
    # Which built-in model to build when `model` is None.
    model_preset: str = "default"
    # Name served in /v1/models and accepted in requests (defaults from the model).
    model_name: str | None = None
    # A Jinja chat template file that replaces the model's own (--chat-template, as mlx_lm.server's).
    chat_template: str | None = None
    # LoRA adapters (--adapter NAME=DIR, mlx-lm's adapter directories): (name, dir) pairs; a request
    # names one as its `model`, and each is its own cache namespace (engine/adapters.py).
    adapters: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=lambda v: tuple(tuple(p) for p in v))

    # RAM tier byte cap; 0 disables the prompt cache.
    prompt_cache_bytes: int = attrs.field(default=2 * GB, validator=_non_negative)
    # Host-memory tier between RAM and SSD (kv/host_tier.py): RAM victims move there
    # instead of leaving (0 = off; a no-op where host and device memory are one: CPU, Apple).
    host_cache_bytes: int = attrs.field(default=0, validator=_non_negative)
    # RAM entries as shared, reference-counted KV pages (kv/ram_pages.py): "on" = conversations over
    # one prefix hold its KV once (attention-only models; others stay contiguous, logged at load);
    # "off" = one contiguous copy per entry.
    ram_pages: str = attrs.field(default="off", validator=attrs.validators.in_(("on", "off")))
    # Tokens per RAM page (0 = the SSD blocks' span: ssd_block_tokens, else blocks.span_for).
    ram_page_tokens: int = attrs.field(default=0, validator=_non_negative)
    retention: str = attrs.field(
        default="lru", validator=attrs.validators.in_(("lru", "lfu", "cost"))
    )
    # A prefill of at least this many new tokens publishes a prompt-boundary snapshot.
    snapshot_min_tokens: int = attrs.field(default=256, validator=_non_negative)

    # KV scheme: None keeps the model's precision; 4 or 8 stores every plain attention
    # layer's KV affine-quantized (mlx-lm's QuantizedKVCache, groups of kv_group_size
    # along head_dim) while generating, in the RAM tier and on SSD.
    kv_bits: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_((4, 8))))
    kv_group_size: int = attrs.field(default=64, validator=attrs.validators.in_((32, 64, 128)))

    # Bytes of MLX memory (weights, batches and the RAM tier together) the process
    # keeps to: past it, the RAM tier demotes durable entries to SSD (or evicts
    # without an SSD tier). None = a fraction of the device's memory (see
    # default_memory_budget); 0 = no budget, only the RAM tier's byte cap.
    memory_budget_bytes: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative)
    )
    # Admit a request only when its KV (prompt + max_tokens, under the KV scheme) fits the
    # memory budget beside the model and the rows running (kv/admission.py); else it waits
    # in the queue, and one that can never fit gets a 400 at once. Needs a memory budget.
    kv_admission: bool = False

    # Continuous batching: rows decoding together, and rows prefilling together.
    max_batch: int = attrs.field(default=8, validator=_positive)
    prefill_batch: int = attrs.field(default=8, validator=_positive)
    prefill_step_size: int = attrs.field(default=2048, validator=_positive)
    # Seconds of prefill per engine step: a long prompt is prefilled in slices this long, so rows
    # that arrive meanwhile prefill and decode between them (engine/prefill_slices.py); 0 = whole steps.
    prefill_slice_s: float = attrs.field(default=0.05, validator=_non_negative)
    # Pick the prefill chunk size by timing candidates at startup (None = on GPU
    # devices whenever the device probe runs; see actors/device_probe.py).
    tune_prefill_step: bool | None = None
    # Measure prefill, decode and restore on the device before serving, so the
    # first restore-or-recompute choice is right: "auto" = with the SSD tier.
    device_probe: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "on", "off")))
    device_probe_budget_s: float = attrs.field(default=3.0, validator=_positive)
    # Before listening, the probe's longest prefill once, untimed, by the path serving prefills a prompt apart
    # by (an overlapped restore's head, a prompt prefilled beside others), and after a reused probe (no forward run
    # here) through the batch too, so the first request does not build its shapes' kernels (on CUDA, built on
    # each shape's first use): "auto" = on a GPU, "on" = on any device, "off" = never.
    device_warmup: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "on", "off")))
    # Admitted requests waiting for a batch slot; beyond this, requests are refused (503).
    max_queue: int = attrs.field(default=32, validator=_non_negative)
    # Seconds an HTTP request may wait in that queue for a slot before it is answered 503 (0 = no limit).
    queue_timeout_s: float = attrs.field(default=60.0, validator=_non_negative)
    # Seconds from arrival to an HTTP request's first token; past it the request is cancelled and
    # answered 503 (a stream's headers wait for its first token). 0 = no limit.
    ttft_timeout_s: float = attrs.field(default=0.0, validator=_non_negative)

    # Generation limits.
    default_max_tokens: int = attrs.field(default=512, validator=_positive)
    max_tokens_limit: int = attrs.field(default=8192, validator=_positive)
    # Prompt + completion tokens allowed; None = the model's max_position_embeddings.
    max_context: int | None = None

    # SSD cold tier (None = RAM only).
    ssd_cache_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))  # str too
    ssd_cache_max_bytes: int = attrs.field(default=0, validator=_non_negative)  # 0 = unlimited
    # Check every restored byte (per-tensor CRC-32, zero padding); False = header, layout and size only.
    ssd_cache_verify: bool = True
    # Where a restored file's bytes are read to: "mlx" = straight into MLX arrays
    # (no copy; on CUDA the pages then move to the device in bulk), "host" = a
    # private host buffer copied into MLX by the engine; "auto" = "mlx" on CUDA
    # and the CPU (faster on both, docs/benchmarks.md), "host" on Apple GPUs.
    restore_landing: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "mlx", "host")))
    # Restore a cold prefix or prefill it again: "measured" = whichever the restore advisor's
    # calibrated costs say is faster (kv/restore_decision.py), "always" = restore every usable
    # SSD prefix longer than RAM's (deterministic tiers, whatever the timings; tests pin it via
    # MLXD_RESTORE_CHOICE, whose value is the default when it is set), "never" = always prefill
    # (the recompute arm, for a benchmark's comparison), "split" = restore a middle
    # cut of every such prefix and prefill the rest (a test knob for the split's exactness),
    # "overlap" = recompute a first part of it while the rest is read (the overlapped split's knob).
    restore_choice: str = attrs.field(
        factory=lambda: os.environ.get("MLXD_RESTORE_CHOICE", "measured"),
        validator=attrs.validators.in_(("measured", "always", "never", "split", "overlap")),
    )
    # "measured" also weighs overlapped splits (kv/restore_decision.py OVERLAP; the block layout only)
    restore_overlap: bool = True
    # How long the engine waits for an overlapped split's tail once its head is recomputed: None = no longer
    # than recomputing the tail would take, nor than 1.5x its predicted read (engine/overlap.py `tail_wait_s`);
    # a number pins it (tests: a tail read on a loaded machine still lands)
    restore_overlap_wait_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(_non_negative))
    ssd_demote_idle_s: float = attrs.field(default=300.0, validator=_non_negative)
    # Several replicas share ssd_cache_dir (kv/shared_dir.py): poll it for their files
    # every ssd_rescan_s; delete only as the collector, only files unused for the grace.
    ssd_shared: bool = False
    ssd_rescan_s: float = attrs.field(default=1.0, validator=_positive)
    ssd_shared_grace_s: float = attrs.field(default=60.0, validator=_non_negative)
    # Write-behind pacing while the engine is decoding (bytes/s; 0 = never pace). At
    # full speed the writer steals cores from decode (see kv/pacing.py); when the
    # engine is idle, a flush waits, or the backlog passes ssd_backlog_bytes it
    # writes at full speed.
    ssd_write_rate_bytes: int = attrs.field(default=24 * 1024 * 1024, validator=_non_negative)
    # Hold write-behind still while rows decode (as for a prefill; bounded by kv/pacing.MAX_HOLD_S a hold).
    ssd_write_hold_decode: bool = False
    # Dirty bytes beyond which writing is urgent (0 = half the RAM tier).
    ssd_backlog_bytes: int = attrs.field(default=0, validator=_non_negative)
    # Speculative decoding: "ngram" = each row drafts up to num_draft_tokens tokens copied from its own
    # prompt and output (prompt lookup) and one target forward verifies them (docs/speculative.md).
    # "draft" = a small model with the same tokenizer (draft_model, a local directory) proposes them.
    speculative: str = attrs.field(default="off", validator=attrs.validators.in_(("off", "ngram", "draft")))
    num_draft_tokens: int = attrs.field(default=4, validator=_positive)
    draft_model: str | None = None

    # Checkpoint a running generation every N generated tokens so an identical
    # request resumes it after a crash or a client drop (0 = off; needs the SSD tier).
    generation_checkpoint: int = attrs.field(default=0, validator=_non_negative)
    # How new checkpoints are stored: shared content-addressed "blocks" + one manifest each
    # (docs/file-format.md; a shared prefix is stored once), or "whole" files; both are always read.
    ssd_layout: str = attrs.field(default="blocks", validator=attrs.validators.in_(("whole", "blocks")))
    # Tokens per block (0 = sized from the model's KV bytes per token: blocks.span_for).
    ssd_block_tokens: int = attrs.field(default=0, validator=_non_negative)

    # Leaving open_runtime (return, exception or cancellation) first makes every RAM checkpoint
    # durable on SSD, shielded, for at most this many seconds, as `mlxd serve` does on SIGTERM;
    # skipped after rt.stop_admission() (the caller ran the graceful sequence itself). 0 = never.
    shutdown_flush_s: float = attrs.field(default=60.0, validator=_non_negative)

    # KV cache events (vLLM's ZMQ format) for fleet routers and indexers; None = off.
    # tcp://HOST:PORT connects; tcp://*:PORT binds 127.0.0.1 unless kv_events_all_interfaces
    # (then every interface; 0.0.0.0 or :: hosts need it); ipc://PATH binds. See SECURITY.md.
    kv_events_endpoint: str | None = attrs.field(default=None)
    kv_events_topic: str = ""
    kv_events_block_size: int = attrs.field(default=16, validator=_positive)
    kv_events_all_interfaces: bool = False
    # Send each stored block's token ids (the prompt text, to whoever subscribes); off by
    # default: the block hashes alone say which replica holds which prefix.
    kv_events_token_ids: bool = False

    @kv_events_endpoint.validator
    def _check_kv_events_endpoint(self, _attr: attrs.Attribute, value: str | None) -> None:
        if value is not None:
            self.kv_events_address()  # refuses a malformed or unallowed all-interfaces endpoint

    def kv_events_address(self) -> PublishAddress | None:
        """Where the KV-event publisher binds or connects (None: events off)."""
        if self.kv_events_endpoint is None:
            return None
        from mlxd.kv.kv_events import PublishAddress

        return PublishAddress.of(self.kv_events_endpoint, all_interfaces=self.kv_events_all_interfaces)

    # One model sharded over the ranks `mlx.launch` started (runtime/distributed.py):
    # rank 0 serves, the others follow. The prompt cache's RAM tier is mirrored (kv/shard_mirror.py);
    # the SSD tier is not supported yet.
    distributed: bool = False

    # HTTP access and limits (see SECURITY.md). Keys never appear in reprs or logs.
    # Bearer token required on the API (None = open); admin routes need admin_key.
    api_key: str | None = attrs.field(default=None, repr=False)
    admin_key: str | None = attrs.field(default=None, repr=False)
    # End-to-end seconds per request; a generation cut by it ends with
    # finish_reason "length". 0 = no limit.
    request_timeout_s: float = attrs.field(default=0.0, validator=_non_negative)
    # Largest request body accepted (larger ones get 413).
    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive)
    # Open HTTP connections; past it a new connection gets a 503 and is closed
    # (0 = half the process's file-handle limit, at most 4096: http/connections.py).
    max_connections: int = attrs.field(default=0, validator=_non_negative)
    # Seconds an idle keep-alive connection (or one that never sends a request) stays open: longer
    # than clients keep an idle pooled connection (httpx 5 s, aiohttp 15 s), so the client drops it
    # first; at the same 5 s a request sent as the server closed came back "disconnected".
    keep_alive_timeout_s: float = attrs.field(default=20.0, validator=_positive)
    # Vision models (docs/vision.md): file:// image URLs only under this directory (None = off),
    # images per request, encoded bytes of one image.
    allow_media_dir: Path | None = None
    max_images: int = attrs.field(default=16, validator=_positive)
    max_image_bytes: int = attrs.field(default=20 * 1024 * 1024, validator=_positive)

    @property
    def kv_scheme(self) -> str:
        """The KV scheme's name, part of the SSD fingerprint: "native" or e.g. "affine4-g64"."""
        return "native" if self.kv_bits is None else f"affine{self.kv_bits}-g{self.kv_group_size}"

    @property
    def overlaps_weighed(self) -> bool:
        """Does the measured choice weigh overlapped splits? (--restore-overlap, and a plain KV cache: the
        engine appends a read tail only to those)"""
        return self.restore_overlap and self.kv_bits is None

    def __attrs_post_init__(self) -> None:
        if self.ssd_cache_dir is not None and self.prompt_cache_bytes == 0:
            raise ValueError("--ssd-cache needs the RAM tier: --prompt-cache-gb must be > 0")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft and --draft-model DIR go together (ngram needs no draft model)")
        if self.generation_checkpoint > 0 and self.ssd_cache_dir is None:
            raise ValueError("--generation-checkpoint needs the SSD tier: set --ssd-cache DIR")
        if self.distributed and self.ssd_cache_dir is not None:
            # Each rank would have to write, restore and flush its own shard files in step with rank 0.
            raise ValueError("--distributed keeps the prompt cache in RAM only for now (each rank would need its "
                             "own shard files): leave out --ssd-cache")
        if self.distributed and self.adapters:
            # Every rank would have to shard each adapter's A and B the way its linear layers are sharded.
            raise ValueError("--adapter is not supported with --distributed yet: serve adapters on one process")
        if self.ram_pages == "on" and self.distributed:
            # Follower ranks mirror the leader's entries as contiguous shards (kv/shard_mirror.py).
            raise ValueError("--ram-pages on is not supported with --distributed yet: leave it off")
        if self.ram_pages == "on" and self.host_cache_bytes > 0:
            # A demotion moves an entry's memory to the host; a page other RAM entries share must stay.
            raise ValueError("--ram-pages on and --host-cache-gb do not combine yet: choose one")
        if self.distributed and self.device_probe == "on":
            raise ValueError("--distributed runs no device probe: leave out --device-probe on")
        if self.device_warmup == "on" and self.device_probe == "off":
            raise ValueError("--device-warmup on runs the device probe's longest prefill: it needs the probe, "
                             "which --device-probe off and --distributed leave out")
