"""`mlxd simulate` models the block store: bytes written, bytes retained, the cap by unique blocks."""

from __future__ import annotations

import attrs

from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRequest

UNIT = attrs.evolve(DEFAULT, kv_bytes_per_token=1)  # bytes = tokens


def shared_prefix_trace(conversations: int = 6, turns: int = 3, system: int = 4000) -> list[TraceRequest]:
    reqs, t = [], 0.0
    prompts = [list(range(system)) for _ in range(conversations)]
    for turn in range(turns):
        for c, prompt in enumerate(prompts):
            prompt += [10_000 * (c + 1) + 100 * turn + k for k in range(150)]
            reqs.append(TraceRequest(index=len(reqs), t=t, input_length=len(prompt), output_tokens=1,
                                     tokens=tuple(prompt)))
            t += 100.0  # each write finishes before the next request
    return reqs


def run(layout: str, **kw):
    return replay_mlxd(shared_prefix_trace(), policy="lru", cost=UNIT, ram_bytes=None, ssd=True, slots=1,
                       snapshot_min_tokens=16, ssd_layout=layout, ssd_block_tokens=256, **kw)


def test_blocks_write_and_keep_the_shared_prefix_once():
    whole, blocks = run("whole"), run("blocks")
    assert blocks.ssd_layout == "blocks" and whole.ssd_layout == "whole"
    assert blocks.hit_tokens == whole.hit_tokens  # same answers from the cache
    # 6 conversations x 3 turns over a 4,000-token prompt: whole files rewrite it every time.
    assert blocks.ssd_bytes_written < 0.25 * whole.ssd_bytes_written
    assert blocks.ssd_bytes_retained < 0.4 * whole.ssd_bytes_retained
    dedup = 4000 + 6 * 3 * 150  # every distinct prefix token once
    # The prompt's last 160 tokens past the grid are one block shared by all (the store's cut
    # where blocks stop sharing, modeled); only the first conversation's own block repeats them.
    assert blocks.ssd_bytes_retained == dedup + 160


def test_the_cap_counts_unique_blocks():
    cap = 12_000  # below the 6 whole conversations' ~28k, above their ~6.7k of unique blocks
    whole, blocks = run("whole", ssd_bytes=cap), run("blocks", ssd_bytes=cap)
    assert whole.ssd_evictions > 0 and blocks.ssd_evictions == 0
    assert blocks.ssd_bytes_retained <= cap
