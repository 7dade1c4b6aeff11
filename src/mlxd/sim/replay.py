"""The `mlxd` cache model: replay a trace through the serving cache code in virtual time.

The RAM tier is `mlxd.kv.prompt_cache.PromptCache` with a `mlxd.kv.retention`
policy, the SSD tier is `mlxd.kv.tiering.SsdIndex` with persist-before-demotion
(`mlxd.kv.tiering.may_demote`), and the engine is simulated: a bounded number
of slots, each request holding one for restore + prefill + decode, with costs
from a `CostModel` charged as `trio.sleep` on a `trio.testing.MockClock`. An
hour of trace replays in seconds and a run is deterministic.

Per request, when it gets a slot: look up RAM (`take`) and SSD (`find`); SSD
serves only with a strictly longer usable prefix and only if restoring beats
recomputing; an SSD hit is restored and published into RAM. After prefill the
prompt is stored (the prompt-boundary snapshot) and the RAM tier evicted back
under its byte cap, persisting victims to SSD first when there is an SSD tier.
When the trace recorded the generated ids, prompt + output is stored after
decode too, like the serving engine does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import trio
import trio.testing

from mlxd.kv.cost_model import BLOCK_TOKENS, CostModel
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.retention import CostPolicy, RetentionPolicy, make_policy
from mlxd.kv.tiering import SsdIndex, choose_source, may_demote
from mlxd.sim.results import RunResult, Tally
from mlxd.sim.trace import TraceRequest, block_tokens, half_block_tokens

UNLIMITED_BYTES = 2**62
OnRequest = Callable[[TraceRequest, int, str], None]  # (request, hit tokens, source)


class TokenSynth:
    """Token-level prompts: the trace's own tokens, or 512 ids per Mooncake block."""

    granularity = "token"

    def prompt(self, r: TraceRequest):
        if r.tokens is not None:
            return r.tokens
        return block_tokens(r.hash_ids, r.input_length)

    def hit_tokens(self, r: TraceRequest, usable: int) -> int:
        return usable


class BlockSynth:
    """Block-granular prompts for Mooncake traces: two synthetic tokens (2h, 2h+1) per block.

    Exact for Mooncake's block structure (checked by `check_block_structure`):
    prompts that share k leading ids share exactly 2k synthetic tokens and k*512
    real ones, and a partial block always has its own id. The one case the
    half-block encoding must translate is the cap at len(prompt) - 1: a prompt
    fully covered by an entry gets usable 2n - 1 here and input_length - 1 at
    token level. Entry bytes are those of the real token count, and the cost
    policy is given the real token count, so eviction order is unchanged.
    The prefix index then holds 2 tokens per block instead of 512.
    """

    granularity = "block"

    def prompt(self, r: TraceRequest):
        return half_block_tokens(r.hash_ids)

    def hit_tokens(self, r: TraceRequest, usable: int) -> int:
        if usable == 2 * len(r.hash_ids) - 1:
            return r.input_length - 1
        return (usable // 2) * BLOCK_TOKENS


def make_retention(name: str, cost: CostModel) -> RetentionPolicy:
    """The serving policy by name; `cost` counts real tokens (entry bytes / bytes per token)."""
    if name == "cost":
        return CostPolicy(cost=lambda e: e.nbytes / cost.kv_bytes_per_token)
    return make_policy(name)


def seed_trio_scheduler(seed: int) -> None:
    """Make trio's tie-breaking among simultaneously runnable tasks reproducible.

    trio shuffles each batch of runnable tasks with a module-level Random; its
    own Hypothesis integration seeds that same object.
    """
    import trio._core._run as run  # noqa: PLC0415 (private, so kept local)

    rng = getattr(run, "_r", None)
    if rng is not None:
        rng.seed(seed)


@attrs.define
class MlxdReplay:
    """One replay run of the serving cache code against a trace."""

    reqs: Sequence[TraceRequest]
    cost: CostModel
    cache: PromptCache
    ssd: SsdIndex | None
    synth: TokenSynth | BlockSynth
    slots: int = 4
    on_request: OnRequest | None = None
    tally: Tally = attrs.Factory(Tally)
    _clock: trio.testing.MockClock = attrs.field(
        factory=lambda: trio.testing.MockClock(autojump_threshold=0)
    )

    def now(self) -> float:
        return self._clock.current_time()

    async def main(self) -> None:
        send, recv = trio.open_memory_channel(math.inf)  # the admission queue
        slots = trio.Semaphore(self.slots)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._arrivals, send)
            async with recv:
                async for r in recv:  # first come, first served
                    await slots.acquire()
                    nursery.start_soon(self._serve, r, slots)

    async def _arrivals(self, send) -> None:
        async with send:
            for r in self.reqs:
                await trio.sleep_until(r.t)
                send.send_nowait(r)

    async def _serve(self, r: TraceRequest, slots: trio.Semaphore) -> None:
        try:
            start = self.now()
            prompt = self.synth.prompt(r)
            hit, source, restore_s = self._lookup(r, prompt)
            prefill_s = self.cost.prefill_seconds(r.input_length - hit, hit)
            await trio.sleep(restore_s + prefill_s)
            self._store(prompt, r.namespace, r.input_length)
            self.tally.add_request(r.input_length, hit, source=source)
            if self.on_request is not None:
                self.on_request(r, hit, source)
            decode_s = self.cost.decode_seconds(r.output_tokens, r.input_length)
            await trio.sleep(decode_s)
            self.tally.add_timing(
                queue=start - r.t, ttft=start + restore_s + prefill_s - r.t, end=self.now()
            )
            if r.output_ids:
                full = np.concatenate(
                    [np.asarray(prompt, np.int32), np.asarray(r.output_ids, np.int32)]
                )
                self._store(full, r.namespace, len(full))
        finally:
            slots.release()

    def _lookup(self, r: TraceRequest, prompt) -> tuple[int, str, float]:
        """(hit tokens, "ram"|"ssd"|"miss", restore seconds) for a request."""
        ram = self.cache.take(prompt, r.namespace)
        ssd = self.ssd.find(prompt, r.namespace) if self.ssd is not None else None
        source = choose_source(ram.usable if ram else 0, ssd.usable if ssd else 0)
        if source == "ssd":
            hit = self.synth.hit_tokens(r, ssd.usable)
            if self.cost.should_restore(ssd.record.nbytes, hit, r.input_length - hit):
                return hit, "ssd", self._restore(ssd.record)
            source = "ram" if ram else "miss"
        if source == "ram":
            return self.synth.hit_tokens(r, ram.usable), "ram", 0.0
        return 0, "miss", 0.0

    def _restore(self, record) -> float:
        """Read an SSD record back and publish it in RAM (it stays durable)."""
        self.ssd.touch(record, self.now())
        self.tally.ssd_bytes_read += record.nbytes
        out = self.cache.put(
            record.tokens,
            record.namespace,
            payload=None,
            nbytes=record.nbytes,
            trimmable=record.trimmable,
        )
        if out.entry is not None:
            out.entry.durable = True
        self._evict()
        return self.cost.restore_seconds(record.nbytes)

    def _store(self, tokens, namespace: str, num_tokens: int) -> None:
        out = self.cache.put(
            tokens, namespace, payload=None, nbytes=self.cost.kv_bytes(num_tokens), trimmable=True
        )
        if out.entry is not None and self.ssd is not None:
            # an SSD file with exactly these tokens already makes the new entry durable
            out.entry.durable = self.ssd.get(out.entry.tokens, namespace) is not None
        self._evict()

    def _evict(self) -> None:
        """Evict under the byte cap, persisting refused victims to SSD first."""
        may = may_demote(self.ssd)
        while True:
            ev = self.cache.evict(may_evict=may)
            for entry in ev.evicted:
                if self.ssd is not None and entry.durable:
                    self.tally.demotions += 1
                else:
                    self.tally.evictions += 1
            if ev.blocked is None:
                return
            self._persist(ev.blocked)

    def _persist(self, entry) -> None:
        """Write a RAM entry to SSD (the simulated writer commits at once)."""
        dropped = self.ssd.add(
            entry.tokens,
            entry.namespace,
            nbytes=entry.nbytes,
            now=self.now(),
            trimmable=entry.trimmable,
        )
        self.tally.ssd_bytes_written += entry.nbytes
        entry.durable = True
        for record in dropped:
            self.tally.ssd_evictions += 1
            ram = self.cache.find_exact(record.tokens, record.namespace)
            if ram is not None:
                ram.durable = False

    def run(self, *, seed: int = 0) -> Tally:
        seed_trio_scheduler(seed)
        trio.run(self.main, clock=self._clock)
        return self.tally


def replay_mlxd(
    reqs: Sequence[TraceRequest],
    *,
    policy: str,
    cost: CostModel,
    ram_bytes: int | None,
    ssd_bytes: int | None = None,
    ssd: bool = False,
    granularity: str = "auto",
    slots: int = 4,
    seed: int = 0,
    on_request: OnRequest | None = None,
) -> RunResult:
    """One run of the `mlxd` cache model. `ram_bytes` None = unlimited; `ssd` enables the tier."""
    mooncake = all(r.hash_ids is not None for r in reqs)
    use_blocks = granularity == "block" or (granularity == "auto" and mooncake)
    if use_blocks and not mooncake:
        raise ValueError("block granularity needs a Mooncake trace (hash_ids)")
    cache = PromptCache(
        max_bytes=UNLIMITED_BYTES if ram_bytes is None else ram_bytes,
        policy=make_retention(policy, cost),
    )
    replay = MlxdReplay(
        reqs,
        cost,
        cache,
        SsdIndex(ssd_bytes) if ssd else None,
        BlockSynth() if use_blocks else TokenSynth(),
        slots=slots,
        on_request=on_request,
    )
    cache.clock = replay.now
    started = time.perf_counter()
    tally = replay.run(seed=seed)
    block_bytes = cost.kv_bytes(BLOCK_TOKENS)
    return tally.result(
        cache_model="mlxd",
        policy=policy,
        capacity_blocks=None if ram_bytes is None else ram_bytes // block_bytes,
        capacity_bytes=ram_bytes,
        ssd_capacity_bytes=ssd_bytes if ssd else None,
        wall_s=time.perf_counter() - started,
    )
