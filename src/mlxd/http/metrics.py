"""`GET /metrics`: the runtime's counters in the Prometheus text format.

Two sources feed one registry per runtime (never the process-global one, so
several servers can share a process):

- per-request histograms and counters, fed by a `SchedulerActor.observers`
  callback with each finished `RequestRecord`, and flush outcomes fed by a
  `Runtime.flush_observers` callback;
- everything else read from `await rt.stats()` at scrape time by a custom
  collector (cache tiers, SSD I/O, queue, batch, channels).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from quart import Response

from mlxd.runtime.gc_pauses import GcPauses, process_pauses
from mlxd.runtime.kernel.channels import ChannelStats
from mlxd.runtime.kernel.messages import CacheStatsSnapshot, RequestRecord
from mlxd.runtime.stats import RuntimeStats, SsdTierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class RequestMetrics:
    """Histograms and counters of finished requests (the scheduler's observer)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        self.finished = Counter(
            "mlxd_requests_finished", "Requests finished, by outcome.", ["reason"], registry=registry
        )
        self.ttft = hist("mlxd_request_ttft_seconds", "Time from submit to the first token.", LATENCY_BUCKETS)
        self.tpot = hist(
            "mlxd_request_time_per_output_token_seconds", "Mean time per output token after the first.", TPOT_BUCKETS
        )
        self.e2e = hist("mlxd_request_duration_seconds", "Time from submit to the last event.", LATENCY_BUCKETS)
        self.queued = hist("mlxd_request_queue_seconds", "Time waiting for a batch slot.", LATENCY_BUCKETS)
        self.prompt = hist("mlxd_request_prompt_tokens", "Prompt length of each request.", TOKEN_BUCKETS)
        self.generated = hist("mlxd_request_generated_tokens", "Tokens generated per request.", TOKEN_BUCKETS)
        self.cache = Counter(
            "mlxd_cache_requests",
            "Requests by where their prefix came from (ram, ssd, checkpoint = a resumed generation, none = miss).",
            ["tier"], registry=registry,
        )
        self.cached_tokens = Counter(
            "mlxd_cache_reused_tokens", "Prompt tokens served from a cache tier instead of prefill.",
            ["tier"], registry=registry,
        )
        for tier in ("ram", "ssd", "none"):
            self.cache.labels(tier)  # export zeros before the first request
        for tier in ("ram", "ssd"):
            self.cached_tokens.labels(tier)
        self.flushes = Counter(
            "mlxd_flushes", "Durability flushes, by outcome.", ["outcome"], registry=registry
        )
        for outcome in ("durable", "not_durable", "no_ssd_tier"):
            self.flushes.labels(outcome)

    def observe(self, record: RequestRecord) -> None:
        self.finished.labels(record.reason).inc()
        for hist, value in (
            (self.ttft, record.ttft_s),
            (self.tpot, record.tpot_s),
            (self.e2e, record.total_s),
            (self.queued, record.queued_s),
        ):
            if value is not None:
                hist.observe(value)
        self.prompt.observe(len(record.prompt))
        self.generated.observe(record.completion_tokens)
        if record.reason == "client_gone" and record.first_token_at is None and record.cached_tokens == 0:
            return  # left before a cache lookup: neither a hit nor a miss
        self.cache.labels(record.cache_tier).inc()
        if record.cache_tier != "none":
            self.cached_tokens.labels(record.cache_tier).inc(record.cached_tokens)

    def observe_flush(self, report: dict[str, Any]) -> None:
        if report.get("durable"):
            outcome = "durable"
        elif "no SSD tier" in str(report.get("reason") or ""):
            outcome = "no_ssd_tier"
        else:
            outcome = "not_durable"
        self.flushes.labels(outcome).inc()


class StatsCollector:
    """Turns the last `rt.stats()` snapshot into metric families at scrape time.

    The route sets `snapshot` and renders in one synchronous step, so a
    scrape never mixes two snapshots.
    """

    def __init__(self) -> None:
        self.snapshot: RuntimeStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield from _runtime_families(s)
        yield from _cache_families(s.cache)
        if s.ssd is not None:
            yield from _ssd_families(s.ssd)
        yield from _channel_families(s.channels)


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    g.add_metric(list((labels or {}).values()), float(value or 0))
    return g


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], float(value or 0))
    return c


def _labelled(kind: type, name: str, doc: str, label: str, values: Mapping[str, float | None]) -> Metric:
    family = kind(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], float(value or 0))
    return family


def _runtime_families(s: RuntimeStats) -> Iterator[Metric]:
    sched, engine = s.scheduler, s.engine
    yield _gauge("mlxd_model_info", "The served model (value is always 1).", 1, {"model": s.model})
    yield _gauge("mlxd_uptime_seconds", "Seconds since the runtime started.", s.uptime_s)
    yield _gauge("mlxd_admitting", "1 while admitting requests, 0 while draining.", 1 if s.admitting else 0)
    yield _counter("mlxd_requests_submitted", "Requests admitted to the queue.", sched.submitted)
    yield _counter("mlxd_requests_rejected", "Requests refused because the queue was full (503).", sched.rejected)
    yield _gauge("mlxd_queue_depth", "Requests waiting for a batch slot.", sched.queued)
    yield _gauge("mlxd_queue_capacity", "Admission queue capacity (--max-queue).", sched.max_queue)
    yield _gauge("mlxd_requests_running", "Requests holding a batch slot.", sched.running)
    yield _gauge("mlxd_batch_size", "Rows in the engine's decode batch.", engine.batch_rows)
    yield _gauge("mlxd_batch_capacity", "Batch slots (--max-batch).", sched.max_batch)
    yield _counter("mlxd_engine_steps", "Engine steps (decode or prefill chunks).", engine.steps)
    yield _counter("mlxd_prompt_tokens", "Prompt tokens of admitted requests.", sched.prompt_tokens)
    yield _counter("mlxd_prefill_tokens", "Prompt tokens the engine actually prefilled.", engine.prompt_tokens)
    yield _counter("mlxd_cached_prompt_tokens", "Prompt tokens reused from a cache tier.", sched.cached_tokens)
    yield _counter("mlxd_generated_tokens", "Tokens generated.", sched.generated_tokens)
    spec = engine.speculation
    if spec is not None:  # --speculative
        yield _gauge("mlxd_speculation_active", "1 while rows draft; 0 when the model cannot (see /stats).",
                     1 if spec.active else 0)
        yield _counter("mlxd_speculation_proposed_tokens", "Draft tokens verified by the target.", spec.proposed)
        yield _counter("mlxd_speculation_accepted_tokens", "Draft tokens the target agreed with.", spec.accepted)
        yield _gauge("mlxd_speculation_acceptance_rate", "Accepted / proposed draft tokens.", spec.acceptance_rate)
        yield _gauge("mlxd_speculation_tokens_per_forward", "Tokens a drafting row emitted per target forward.",
                     spec.tokens_per_forward)
        yield _counter("mlxd_speculation_verify_steps", "Target forwards that verified drafts.", spec.verify_steps)
        yield _counter("mlxd_speculation_constrained_rows", "Speculating rows whose grammar checks their drafts.",
                       spec.constrained_rows)
        yield _counter("mlxd_speculation_grammar_refused_tokens", "Draft tokens cut because the grammar refused them.",
                       spec.grammar_refused)
        yield _counter("mlxd_speculation_draft_prefix_reused_tokens",
                       "Prompt tokens a draft model's KV took from the prompt cache at a row's first step.",
                       spec.draft_prefix_reused)
        yield _counter("mlxd_speculation_draft_prefix_recomputed_tokens",
                       "Prompt tokens a draft model computed itself at a row's first step.",
                       spec.draft_prefix_recomputed)
        yield _counter("mlxd_speculation_draft_steps",
                       "Steps where a draft model proposed (one draft forward per draft position, all rows).",
                       spec.draft_steps)
        yield _counter("mlxd_speculation_draft_rows", "Rows' proposals a draft model made in those steps.",
                       spec.draft_rows)


def _cache_families(cache: CacheStatsSnapshot) -> Iterator[Metric]:
    t = cache.tiers
    ram = t.ram

    def per_tier(ram_value: float, ssd_value: float) -> dict[str, float]:
        return {"ram": ram_value, **({"ssd": ssd_value} if t.ssd_enabled else {})}

    yield _labelled(
        GaugeMetricFamily, "mlxd_cache_entries", "Entries held, by tier.", "tier", per_tier(ram.entries, t.ssd_entries)
    )
    yield _labelled(GaugeMetricFamily, "mlxd_cache_bytes", "Bytes held, by tier.", "tier", per_tier(ram.bytes, t.ssd_bytes))
    yield _labelled(
        GaugeMetricFamily, "mlxd_cache_capacity_bytes", "Byte cap, by tier (0 = unlimited).", "tier",
        per_tier(ram.max_bytes, t.ssd_max_bytes),
    )
    yield _labelled(
        CounterMetricFamily, "mlxd_cache_evictions", "Entries evicted, by tier.", "tier",
        per_tier(ram.evictions, t.ssd_evictions),
    )
    yield _labelled(
        CounterMetricFamily, "mlxd_ram_cache_lookups", "RAM tier lookups, by result.", "result",
        {"hit": ram.hits, "miss": ram.misses},
    )
    yield _counter("mlxd_ram_cache_lookup_tokens", "Prompt tokens looked up in the RAM tier.", ram.lookup_tokens)
    yield _counter("mlxd_ram_cache_hit_tokens", "Prompt tokens the RAM tier matched.", ram.hit_tokens)
    yield _counter("mlxd_ram_cache_inserts", "Entries stored in the RAM tier.", ram.inserts)
    yield _counter("mlxd_ram_cache_evicted_bytes", "Bytes evicted from the RAM tier.", ram.evicted_bytes)
    if t.ssd_enabled:
        yield _counter("mlxd_cache_demotions", "RAM entries dropped because an SSD copy covers them.", t.demotions)
        yield _counter("mlxd_cache_idle_demotions", "Demotions of entries idle past --ssd-demote-idle.", t.idle_demotions)
        yield _counter(
            "mlxd_cache_dropped_unpersisted", "RAM entries evicted before their SSD write.", t.dropped_unpersisted
        )
    memory = t.memory
    if memory is not None:
        yield _gauge("mlxd_memory_budget_bytes", "The memory budget (--memory-budget).", memory.budget_bytes)
        yield _gauge("mlxd_memory_active_bytes", "MLX active memory at the last measurement.", memory.active_bytes)
        yield _gauge("mlxd_memory_peak_active_bytes", "MLX peak active memory so far.", memory.peak_active_bytes)
        yield _gauge("mlxd_memory_buffer_cache_bytes", "MLX's cached free buffers at the last measurement.",
                     memory.buffer_cache_bytes)
        if memory.device_pool is not None:  # CUDA
            yield _gauge("mlxd_memory_device_pool_reserved_bytes",
                         "GPU memory the CUDA memory pool held at the last measurement.", memory.device_pool.reserved_bytes)
            yield _counter("mlxd_memory_device_pool_trimmed_bytes",
                           "GPU memory idle trims gave back to the device.", memory.device_pool.trimmed_bytes)
        yield _counter(
            "mlxd_memory_budget_freed_bytes", "RAM-tier bytes demoted or evicted for the memory budget.",
            memory.freed_bytes,
        )


def _ssd_families(ssd: SsdTierStats) -> Iterator[Metric]:
    writer, prefetch = ssd.writer, ssd.prefetch
    decisions = ssd.restore_decisions  # the restore advisor's counters (RestoreAdvisor.stats)
    yield _counter("mlxd_ssd_restores", "Prefixes restored from SSD into a request.", ssd.restores)
    yield _gauge("mlxd_ssd_restore_last_seconds", "Duration of the last SSD restore.", (ssd.restore_ms_last or 0) / 1000)
    yield _counter("mlxd_ssd_written_bytes", "Bytes of cache files written.", writer.bytes_written)
    yield _counter("mlxd_ssd_read_bytes", "Bytes of cache files read.", prefetch.bytes_read)
    yield _labelled(
        CounterMetricFamily, "mlxd_ssd_writes", "Cache file writes, by result.", "result",
        {"ok": writer.writes, "failed": writer.failures},
    )
    yield _labelled(
        CounterMetricFamily, "mlxd_ssd_reads", "Cache file reads, by result.", "result",
        {"ok": prefetch.reads - prefetch.read_failures, "failed": prefetch.read_failures},
    )
    yield _counter("mlxd_ssd_prefetches", "Reads started ahead of a batch slot.", prefetch.prefetches)
    yield _counter("mlxd_ssd_prefetch_hits", "Restores whose read was already started.", prefetch.prefetch_hits)
    yield _labelled(
        CounterMetricFamily, "mlxd_ssd_spills", "Checkpoints sent to SSD, by outcome.", "outcome",
        {
            "written": ssd.spills,
            "failed": ssd.failed_spills,
            "dropped": ssd.dropped_spills,
            "superseded": ssd.superseded_spills,
        },
    )
    yield _gauge("mlxd_ssd_pending_writes", "Checkpoints queued or being written.", ssd.pending_spills)
    yield _gauge("mlxd_ssd_pending_write_bytes", "Bytes of checkpoints queued or being written.", ssd.pending_spill_bytes)
    yield _gauge("mlxd_ssd_dirty_checkpoints", "Checkpoints not yet durable (incl. failed).", ssd.pending_snapshots)
    yield _gauge(
        "mlxd_ssd_longest_durable_prefix_tokens", "Longest prefix durable on SSD.", ssd.longest_durable_prefix_tokens
    )
    yield _counter("mlxd_ssd_corrupt_removed", "Damaged cache files unlinked.", ssd.corrupt_removed)
    yield _gauge("mlxd_ssd_disk_full", "1 after a write hit a full disk.", 1 if ssd.disk_full else 0)
    yield _gauge("mlxd_ssd_blocks", "Content-addressed blocks the SSD tier's checkpoints name.", ssd.blocks)
    yield _gauge(
        "mlxd_ssd_checkpoint_bytes", "KV bytes of the SSD checkpoints before block sharing.", ssd.checkpoint_bytes
    )
    yield _labelled(
        CounterMetricFamily, "mlxd_ssd_restore_decisions", "Restore-or-recompute choices.", "choice",
        {"restore": decisions["restores_chosen"], "recompute": decisions["recomputes_chosen"],
         "split": decisions.get("splits_chosen", 0)},
    )


def _channel_families(channels: Mapping[str, ChannelStats]) -> Iterator[Metric]:
    yield _labelled(
        GaugeMetricFamily, "mlxd_channel_queued", "Messages buffered in an actor channel.", "channel",
        {name: c.queued for name, c in channels.items()},
    )
    yield _labelled(
        GaugeMetricFamily, "mlxd_channel_capacity", "Buffer size of an actor channel (-1 = unbounded).", "channel",
        {name: -1 if c.capacity == math.inf else c.capacity for name, c in channels.items()},
    )
    yield _labelled(
        GaugeMetricFamily, "mlxd_channel_waiting_senders", "Tasks blocked sending to a full channel.", "channel",
        {name: c.waiting_senders for name, c in channels.items()},
    )


class GcCollector:
    """The process's garbage collections (runtime/gc_pauses.py), by generation, at scrape time."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Metric]:
        p = self.pauses
        gens = {str(g): g for g in range(3)}
        yield _labelled(CounterMetricFamily, "mlxd_gc_collections", "Python garbage collections, by generation.",
                        "generation", {k: p.collections[g] for k, g in gens.items()})
        yield _labelled(CounterMetricFamily, "mlxd_gc_pause_seconds",
                        "Time in Python garbage collections (every thread stopped), by generation.", "generation",
                        {k: p.paused_s[g] for k, g in gens.items()})
        yield _gauge("mlxd_gc_frozen_objects", "Objects frozen after start-up (no collection walks them).",
                     gc.get_freeze_count())


class Metrics:
    """One runtime's registry: observers plus the scrape-time collectors."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry)
        self.stats = StatsCollector()
        self.registry.register(self.stats)
        self.registry.register(GcCollector(process_pauses()))
        rt.scheduler.observers.append(self.requests.observe)
        flush_observers = getattr(rt, "flush_observers", None)
        if flush_observers is not None:
            flush_observers.append(self.requests.observe_flush)

    async def render(self) -> bytes:
        self.stats.snapshot = await self.rt.stats()
        return generate_latest(self.registry)


def install_metrics(app: Any, rt: Any) -> Metrics:
    """Register `GET /metrics` on the Quart app; returns the runtime's Metrics."""
    metrics = Metrics(rt)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(await metrics.render(), content_type=CONTENT_TYPE)

    return metrics
