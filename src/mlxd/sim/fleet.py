"""Fleet simulation: one trace, N simulated replicas, a router in front.

Each replica is the single-server replay (`sim/replay.py: MlxdReplay`): the
serving cache core (`kv/tiers.py: CacheTiers`, its RAM cap, SSD tier and
write-behind) with a cost-model engine of `slots` rows. All replicas share one
virtual clock; a dispatcher takes the trace's arrivals in time order and hands
each request to the replica its router picks (`sim/router.py`), given every
replica's in-flight count. A replica serves what it receives first come, first
served, and never sees another's cache.

`mlxd simulate TRACE --replicas 4 --router round_robin,cache_aware` runs this;
it sizes a fleet before buying it: hit rate, TTFT and per-replica load.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from mlxd.kv.cost_model import BLOCK_TOKENS, CostModel
from mlxd.kv.kv_events import block_hashes
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.tiers import CacheTiers
from mlxd.sim.replay import (
    UNLIMITED_BYTES,
    BlockSynth,
    MlxdReplay,
    TokenSynth,
    make_retention,
    seed_trio_scheduler,
)
from mlxd.sim.results import RunResult, Tally, percentiles
from mlxd.sim.router import Router, make_router
from mlxd.sim.trace import TraceRequest

ROUTER_BLOCK_TOKENS = 64  # token traces: the router's prefix granularity


@attrs.define
class _Replica(MlxdReplay):
    """A replay whose arrivals come from the fleet's dispatcher, not from the trace."""

    inbox: trio.MemoryReceiveChannel[TraceRequest] | None = None
    routed: int = 0

    async def _arrivals(self, send: trio.MemorySendChannel[TraceRequest | int]) -> None:
        assert self.inbox is not None
        async with send, self.inbox:
            async for r in self.inbox:
                send.send_nowait(r)

    @property
    def in_flight(self) -> int:
        return self.routed - len(self.tally.ttft)  # routed minus finished


@attrs.frozen(kw_only=True)
class FleetResult(RunResult):
    """A fleet run: the fleet's totals (RunResult fields) plus the router and each replica's share."""

    replicas: int
    router: str
    per_replica: tuple[dict[str, Any], ...]

    @property
    def load_imbalance(self) -> float:
        """Most prefilled tokens on one replica over the mean (1.0 = perfectly even)."""
        work = [r["prefill_tokens"] for r in self.per_replica]
        mean = sum(work) / len(work)
        return max(work) / mean if mean else 1.0

    def to_json(self) -> dict:
        data = super().to_json()
        data["load_imbalance"] = self.load_imbalance
        return data


def router_keys(r: TraceRequest) -> Sequence[int]:
    """The request's block keys as the router sees them (see sim/router.py)."""
    if r.hash_ids is not None:
        return r.hash_ids
    assert r.tokens is not None
    return block_hashes(r.tokens, r.namespace, block_size=ROUTER_BLOCK_TOKENS)


@attrs.define
class FleetReplay:
    reqs: Sequence[TraceRequest]
    replicas: list[_Replica]
    router: Router
    clock: trio.testing.MockClock

    async def main(self) -> None:
        sends = []
        async with trio.open_nursery() as nursery:
            for rep in self.replicas:
                send, receive = trio.open_memory_channel[TraceRequest](math.inf)
                rep.inbox = receive
                sends.append(send)
                nursery.start_soon(rep.main)
            try:
                for r in sorted(self.reqs, key=lambda r: (r.t, r.index)):
                    await trio.sleep_until(max(r.t, self.clock.current_time()))
                    loads = [rep.in_flight for rep in self.replicas]
                    i = self.router.pick(router_keys(r), r.session, loads)
                    self.replicas[i].routed += 1
                    sends[i].send_nowait(r)
            finally:
                for send in sends:
                    send.close()


def _replica(
    *, policy: str, cost: CostModel, ram_bytes: int | None, ssd_bytes: int | None, ssd: bool,
    synth: TokenSynth | BlockSynth, slots: int, snapshot_min_tokens: int, demote_idle_s: float,
    clock: trio.testing.MockClock,
) -> _Replica:
    cache = PromptCache(
        max_bytes=UNLIMITED_BYTES if ram_bytes is None else ram_bytes, policy=make_retention(policy, cost)
    )
    tiers = CacheTiers(
        cache, ssd=ssd, ssd_max_bytes=ssd_bytes or 0, advisor=RestoreAdvisor(base=cost), demote_idle_s=demote_idle_s
    )
    rep = _Replica((), cost, tiers, synth, slots=slots, snapshot_min_tokens=snapshot_min_tokens, clock=clock)
    cache.clock = rep.now
    return rep


def _finish_tally(rep: _Replica) -> Tally:
    """What `MlxdReplay.run` adds after its run: the core's eviction counters."""
    stats = rep.tiers.stats()
    if rep.tiers.ssd:
        rep.tally.evictions = stats.dropped_unpersisted
        rep.tally.demotions = stats.demotions
        rep.tally.ssd_evictions = stats.ssd_evictions
    else:
        rep.tally.evictions = stats.ram.evictions
    return rep.tally


def _merge(tallies: Sequence[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total.requests += t.requests
        total.input_tokens += t.input_tokens
        total.hit_tokens += t.hit_tokens
        total.fraction_sum += t.fraction_sum
        for k in total.hits:
            total.hits[k] += t.hits[k]
            total.hit_tokens_by[k] += t.hit_tokens_by[k]
        total.ssd_bytes_written += t.ssd_bytes_written
        total.ssd_bytes_read += t.ssd_bytes_read
        total.evictions += t.evictions
        total.demotions += t.demotions
        total.ssd_evictions += t.ssd_evictions
        total.queue += t.queue
        total.ttft += t.ttft
        total.end = max(total.end, t.end)
    return total


def _share(t: Tally) -> dict[str, Any]:
    return {
        "requests": t.requests,
        "input_tokens": t.input_tokens,
        "hit_tokens": t.hit_tokens,
        "prefill_tokens": t.input_tokens - t.hit_tokens,
        "token_hit_rate": t.hit_tokens / max(t.input_tokens, 1),
        "ttft_s": percentiles(t.ttft),
        "queue_delay_s": percentiles(t.queue),
    }


def replay_fleet(
    reqs: Sequence[TraceRequest],
    *,
    replicas: int,
    router: str,
    policy: str,
    cost: CostModel,
    ram_bytes: int | None,
    ssd_bytes: int | None = None,
    ssd: bool = False,
    granularity: str = "auto",
    slots: int = 4,
    seed: int = 0,
    snapshot_min_tokens: int = 256,
    demote_idle_s: float = 0.0,
) -> FleetResult:
    """One fleet run: `replicas` servers, each with `ram_bytes` of RAM tier and `slots` rows."""
    mooncake = all(r.hash_ids is not None for r in reqs)
    use_blocks = granularity == "block" or (granularity == "auto" and mooncake)
    if use_blocks and not mooncake:
        raise ValueError("block granularity needs a Mooncake trace (hash_ids)")
    clock = trio.testing.MockClock(autojump_threshold=0)
    reps = [
        _replica(policy=policy, cost=cost, ram_bytes=ram_bytes, ssd_bytes=ssd_bytes, ssd=ssd,
                 synth=BlockSynth() if use_blocks else TokenSynth(), slots=slots,
                 snapshot_min_tokens=snapshot_min_tokens, demote_idle_s=demote_idle_s, clock=clock)
        for _ in range(replicas)
    ]
    fleet = FleetReplay(reqs, reps, make_router(router, replicas), clock)
    started = time.perf_counter()
    seed_trio_scheduler(seed)
    trio.run(fleet.main, clock=clock)
    tallies = [_finish_tally(rep) for rep in reps]
    block_bytes = cost.kv_bytes(BLOCK_TOKENS)
    base = _merge(tallies).result(
        cache_model="mlxd",
        policy=policy,
        capacity_blocks=None if ram_bytes is None else ram_bytes // block_bytes,
        capacity_bytes=ram_bytes,
        ssd_capacity_bytes=ssd_bytes if ssd else None,
        wall_s=time.perf_counter() - started,
    )
    return FleetResult(
        **attrs.asdict(base, recurse=False),
        replicas=replicas,
        router=router,
        per_replica=tuple(_share(t) for t in tallies),
    )


def table(results: Sequence[FleetResult]) -> str:
    head = (f"{'router':12} {'policy':6} {'blocks':>7} {'tok hit':>7} {'ttft p50':>9} {'ttft p99':>9} "
            f"{'ttft mean':>9} {'imbalance':>9}  requests per replica")
    rows = [head, "-" * len(head)]
    for r in results:
        cap = "inf" if r.capacity_blocks is None else str(r.capacity_blocks)
        rows.append(
            f"{r.router:12} {r.policy:6} {cap:>7} {r.token_hit_rate:7.3f} {r.ttft_s['p50']:9.2f} "
            f"{r.ttft_s['p99']:9.2f} {r.ttft_s['mean']:9.2f} {r.load_imbalance:9.2f}  "
            f"{' '.join(str(p['requests']) for p in r.per_replica)}"
        )
    return "\n".join(rows)


def save(out: Path, results: Sequence[FleetResult], meta: dict, *, name: str) -> list[Path]:
    """`<name>.json` and one figure: hit rate, TTFT and per-replica prefill work by router."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "runs": [r.to_json() for r in results]}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.router}\n{r.policy} {'inf' if r.capacity_blocks is None else r.capacity_blocks}" for r in results]
    xs = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(xs, [r.token_hit_rate for r in results])
    axes[0].set_ylabel("token hit rate (fleet)")
    axes[1].bar(xs - 0.2, [r.ttft_s["p50"] for r in results], 0.4, label="p50")
    axes[1].bar(xs + 0.2, [r.ttft_s["mean"] for r in results], 0.4, label="mean")
    axes[1].set_ylabel("TTFT under the cost model (s)")
    axes[1].legend(fontsize=7)
    n = max(r.replicas for r in results)
    width = 0.8 / n
    for i in range(n):
        axes[2].bar(xs - 0.4 + width * (i + 0.5),
                    [r.per_replica[i]["prefill_tokens"] / 1e6 if i < r.replicas else 0 for r in results],
                    width, label=f"replica {i}")
    axes[2].set_ylabel("prefilled tokens per replica (M)")
    axes[2].legend(fontsize=6)
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{meta.get('trace', '')}: {n} replicas by router")
    fig.tight_layout()
    fig_path = out / f"{name}_fleet.png"
    fig.savefig(fig_path, dpi=110)
    plt.close(fig)
    return [path, fig_path]
