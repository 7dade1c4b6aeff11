"""`mlxd simulate` applies the scheduler's admission by KV bytes (kv/admission.py) to a replay."""

from __future__ import annotations

import attrs
import trio

from mlxd.kv.admission import KvAdmission
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


def test_a_recorded_kv_admission_run_replays_its_waits(tiny_model_dir, tmp_path, capsys):
    """A live burst under --kv-admission, recorded (`--record-trace`): `mlxd simulate FILE` applies the
    recorded rule and room, and its requests wait as the live ones did."""
    from mlxd import RuntimeConfig, SamplingParams, open_runtime
    from mlxd.cli import record_trace
    from mlxd.sim.cli import main as sim_main
    from mlxd.sim.trace import load_recording

    trace = tmp_path / "burst.jsonl"

    async def burst() -> KvAdmission:
        sampling = SamplingParams(max_tokens=8)
        probe = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=0, kv_admission=True)
        async with open_runtime(probe) as rt:
            kv = rt.scheduler.kv_admission
            assert kv is not None
            fixed = kv.fixed_bytes
            prompts = [await rt.render_chat([{"role": "user", "content": f"Tell me about river {i}. " * 6}])
                       for i in range(4)]
            need = max(kv.need_bytes(len(p), sampling.max_tokens) for p in prompts)
        config = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=0, kv_admission=True,
                               memory_budget_bytes=fixed + fixed // 10 + need * 3 // 2)
        async with open_runtime(config) as rt:
            kv = rt.scheduler.kv_admission
            assert kv is not None  # each runtime measures its own memory: the room is set from this one's
            kv.budget_bytes = kv.fixed_bytes + max(kv.need_bytes(len(p), sampling.max_tokens) for p in prompts) * 3 // 2
            record_trace(rt, trace)

            async def one(i: int) -> None:
                async with rt.submit(rt.request(prompts[i], sampling=sampling, request_id=f"r{i}")) as stream:
                    async for _ in stream:
                        pass

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
            live = rt.scheduler.kv_admission
            assert live is not None and live.waited >= 1
            return live

    live = trio.run(burst)
    rule = live.rule()
    recording = load_recording(trace)
    assert recording.server is not None and recording.server["kv_admission"] == rule
    assert sum(r.kv_waited for r in recording.reqs) == live.waited
    capsys.readouterr()
    assert sim_main([str(trace), "--cache-model", "mlxd", "--format", "table"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("admission by KV bytes"):].splitlines()
    assert table[1].split() == ["policy", "blocks", "waited", "recorded", "refused", "peak", "MiB"]
    _policy, _blocks, waited, recorded, refused, _peak = table[3].split()
    assert int(recorded) == live.waited and int(waited) == live.waited and int(refused) == 0
