"""`GET /v1/loads`: this replica's load in the shape gateways poll.

SMG (the Shepherd Model Gateway, formerly the SGLang router) polls
`GET /v1/loads?include=...` from workers it does not recognise and feeds the
answer to its load-aware policies (power_of_two, cache_aware's balancing,
least_load). The shape is SGLang's: `{"timestamp", "dp_rank_count",
"loads": [one snapshot per data-parallel rank]}`; mlxd is one rank. Fields a
gateway does not know are ignored by it, so mlxd's own view (queue depth,
batch occupancy, cache utilization per tier) rides along under `"mlxd"`.
"""

from __future__ import annotations

import datetime
from typing import Any

from quart import Response

from mlxd.runtime.stats import RuntimeStats


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole > 0 else 0.0


def loads_body(stats: RuntimeStats) -> dict[str, Any]:
    """The `/v1/loads` body from `Runtime.stats()` (pure, so tests can feed it numbers)."""
    sched = stats.scheduler
    ram = stats.cache.tiers.ram
    running, queued, max_batch = sched.running, sched.queued, sched.max_batch
    occupancy = _ratio(min(running, max_batch), max_batch)
    ram_usage = _ratio(ram.bytes, ram.max_bytes)
    snapshot = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": queued,
        "num_total_reqs": running + queued,
        "max_running_requests": max_batch,
        # "token usage" is KV-pool occupancy in SGLang; here the RAM prompt-cache fill.
        "token_usage": ram_usage,
        "cache_hit_rate": _ratio(sched.cached_tokens, sched.prompt_tokens),
        "utilization": occupancy,
    }
    cache_utilization: dict[str, float | None] = {"ram": ram_usage}
    mlxd: dict[str, Any] = {
        "queue_depth": queued,
        "max_queue": sched.max_queue,
        "running": running,
        "batch_occupancy": occupancy,
        "cache_utilization": cache_utilization,
        "ram_cache": {"entries": ram.entries, "bytes": ram.bytes, "max_bytes": ram.max_bytes},
        "admitting": stats.admitting,
    }
    ssd = stats.ssd
    if ssd is not None:
        # None: no cap (--ssd-cache-max unset), so no fill ratio.
        cache_utilization["ssd"] = _ratio(ssd.bytes, ssd.max_bytes) if ssd.max_bytes else None
        mlxd["ssd_cache"] = {"entries": ssd.entries, "bytes": ssd.bytes, "max_bytes": ssd.max_bytes}
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "dp_rank_count": 1,
        "loads": [snapshot],
        "mlxd": mlxd,
    }


def install_loads(app: Any, rt: Any) -> None:
    """Register `GET /v1/loads` (query parameters such as `include=` are accepted and ignored)."""

    @app.get("/v1/loads")
    async def loads() -> Response:
        import json

        body = loads_body(await rt.stats())
        return Response(json.dumps(body), content_type="application/json")
