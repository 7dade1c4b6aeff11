"""What one replay run reports, and the tally that accumulates it."""

from __future__ import annotations

import attrs
import numpy as np

PERCENTILES = (50, 90, 95, 99)


@attrs.frozen(kw_only=True)
class RunResult:
    """One (cache model, policy, capacity) run; `to_json` is one `--format json` line."""

    cache_model: str  # "blocks" or "mlxd"
    policy: str
    capacity_blocks: int | None  # None = unlimited (or given in bytes)
    capacity_bytes: int | None
    ssd_capacity_bytes: int | None
    requests: int
    input_tokens: int
    hit_tokens: int  # = avoided prefill tokens
    token_hit_rate: float
    mean_request_hit_rate: float
    ram_hits: int
    ssd_hits: int
    misses: int
    ram_hit_tokens: int
    ssd_hit_tokens: int
    ssd_bytes_written: int
    ssd_bytes_read: int
    evictions: int  # RAM entries (blocks) dropped with no SSD copy
    demotions: int  # RAM entries dropped while an SSD copy holds them
    ssd_evictions: int
    queue_delay_s: dict[str, float]  # p50/p90/p99/mean
    ttft_s: dict[str, float]
    makespan_s: float
    wall_s: float = 0.0
    session_hits: int = 0  # follow-ups served from their session's checkpoint without a scan
    session_fallbacks: int = 0  # session references that no longer fit or were evicted
    ssd_layout: str = "whole"
    ssd_bytes_retained: int = 0  # what the SSD tier holds at the end (blocks: each block once)
    host_capacity_bytes: int | None = None  # --host-gb: the host-memory tier
    host_hits: int = 0  # lookups served by promoting a host-tier entry
    host_hit_tokens: int = 0
    ttft_by_source_s: dict[str, dict[str, float]] = attrs.Factory(dict)  # p50/... per ram/host/ssd/miss
    # Admission by KV bytes (--kv-admission-gb): requests that waited for room, refused ones,
    # and the most KV bytes reserved at once.
    kv_waited: int = 0
    kv_refused: int = 0
    kv_peak_reserved_bytes: int = 0
    kv_admission: bool = False  # the run applied admission by KV bytes
    kv_waited_recorded: int = 0  # requests the recorded server's --kv-admission held back (a recording)
    restore_decisions: dict[str, float] = attrs.Factory(dict)  # the restore advisor's counters (splits too)
    restarts: int = 0  # times the replayed server restarted on its SSD tier
    # The RAM tier (--ram-pages): pages or contiguous entries; bytes held at the end (pages once) and at the
    # most, and the end's entries' own KV (what contiguous entries of them would hold).
    ram_pages: bool = False
    ram_bytes_retained: int = 0
    ram_bytes_peak: int = 0
    ram_checkpoint_bytes: int = 0

    @property
    def avoided_prefill_tokens(self) -> int:
        return self.hit_tokens

    def to_json(self) -> dict:
        data = attrs.asdict(self)
        data["avoided_prefill_tokens"] = self.hit_tokens
        return data


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in PERCENTILES} | {"mean": 0.0}
    arr = np.asarray(values)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


@attrs.define
class Tally:
    """Counters a replay adds to, request by request."""

    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    fraction_sum: float = 0.0
    hits: dict[str, int] = attrs.Factory(lambda: {"ram": 0, "host": 0, "ssd": 0, "miss": 0})
    hit_tokens_by: dict[str, int] = attrs.Factory(lambda: {"ram": 0, "host": 0, "ssd": 0, "miss": 0})
    ttft_by: dict[str, list[float]] = attrs.Factory(dict)
    ssd_bytes_written: int = 0
    ssd_bytes_read: int = 0
    ssd_bytes_retained: int = 0
    evictions: int = 0
    demotions: int = 0
    ssd_evictions: int = 0
    session_hits: int = 0
    session_fallbacks: int = 0
    queue: list[float] = attrs.Factory(list)
    ttft: list[float] = attrs.Factory(list)
    end: float = 0.0
    kv_waited: int = 0
    kv_refused: int = 0
    kv_peak_reserved_bytes: int = 0
    kv_admission: bool = False
    kv_waited_recorded: int = 0
    ram_bytes_retained: int = 0
    ram_bytes_peak: int = 0
    ram_checkpoint_bytes: int = 0
    restarts: int = 0

    def add_request(self, input_length: int, hit: int, *, source: str) -> None:
        self.requests += 1
        self.input_tokens += input_length
        self.hit_tokens += hit
        self.fraction_sum += hit / input_length if input_length else 0.0
        self.hits[source] += 1
        self.hit_tokens_by[source] += hit

    def add_timing(self, *, queue: float, ttft: float, end: float = 0.0, source: str | None = None) -> None:
        self.queue.append(queue)
        self.ttft.append(ttft)
        if source is not None:
            self.ttft_by.setdefault(source, []).append(ttft)
        self.end = max(self.end, end)

    def result(self, **fields) -> RunResult:
        n = max(self.requests, 1)
        return RunResult(
            requests=self.requests,
            input_tokens=self.input_tokens,
            hit_tokens=self.hit_tokens,
            token_hit_rate=self.hit_tokens / max(self.input_tokens, 1),
            mean_request_hit_rate=self.fraction_sum / n,
            ram_hits=self.hits["ram"],
            ssd_hits=self.hits["ssd"],
            misses=self.hits["miss"],
            ram_hit_tokens=self.hit_tokens_by["ram"],
            ssd_hit_tokens=self.hit_tokens_by["ssd"],
            host_hits=self.hits["host"],
            host_hit_tokens=self.hit_tokens_by["host"],
            ttft_by_source_s={k: percentiles(v) for k, v in sorted(self.ttft_by.items())},
            ssd_bytes_written=self.ssd_bytes_written,
            ssd_bytes_read=self.ssd_bytes_read,
            ssd_bytes_retained=self.ssd_bytes_retained,
            kv_waited=self.kv_waited,
            kv_refused=self.kv_refused,
            kv_peak_reserved_bytes=self.kv_peak_reserved_bytes,
            kv_admission=self.kv_admission,
            kv_waited_recorded=self.kv_waited_recorded,
            restarts=self.restarts,
            ram_bytes_retained=self.ram_bytes_retained,
            ram_bytes_peak=self.ram_bytes_peak,
            ram_checkpoint_bytes=self.ram_checkpoint_bytes,
            evictions=self.evictions,
            demotions=self.demotions,
            ssd_evictions=self.ssd_evictions,
            queue_delay_s=percentiles(self.queue),
            ttft_s=percentiles(self.ttft),
            makespan_s=self.end,
            session_hits=self.session_hits,
            session_fallbacks=self.session_fallbacks,
            **fields,
        )
