"""`mlxd simulate` applies the scheduler's admission by KV bytes (kv/admission.py) to a replay."""

from __future__ import annotations

import attrs

from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRequest

UNIT = attrs.evolve(DEFAULT, kv_bytes_per_token=1)  # bytes = tokens


def burst(n: int = 8, tokens: int = 1000, output: int = 10) -> list[TraceRequest]:
    """`n` distinct long prompts arriving together, then one that can never fit a 2,500-byte budget."""
    reqs = [TraceRequest(index=i, t=0.0, input_length=tokens, output_tokens=output,
                         tokens=tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + tokens))) for i in range(n)]
    reqs.append(TraceRequest(index=n, t=0.0, input_length=3000, output_tokens=output, tokens=tuple(range(3000))))
    return reqs


def run(**kw):
    return replay_mlxd(burst(), policy="lru", cost=UNIT, ram_bytes=None, slots=8, snapshot_min_tokens=16, **kw)


def test_a_burst_waits_for_room_in_the_simulation():
    free, admitted = run(), run(kv_admission_bytes=2500)
    assert free.requests == 9 and free.kv_waited == 0 and free.kv_refused == 0
    # Room for two 1,010-token requests at a time, and they run in pairs: the first of each later pair
    # waits for the pair before it (the second finds its room freed too); the 3,000-token one never fits.
    assert admitted.requests == 8 and admitted.kv_refused == 1 and admitted.kv_waited == 3
    assert admitted.kv_peak_reserved_bytes == 2 * 1010
    assert admitted.queue_delay_s["p90"] > free.queue_delay_s["p90"]
