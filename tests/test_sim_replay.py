"""The `mlxd` cache model: the serving PromptCache replayed in virtual time."""

from pathlib import Path

import attrs
import pytest

from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRecorder, TraceRequest, load_trace

TRACES = Path(__file__).resolve().parents[1] / "simulations" / "traces"
UNIT = attrs.evolve(DEFAULT, kv_bytes_per_token=1)  # capacity in bytes = tokens


def req(i, tokens, t=None, ns="", out=()):
    return TraceRequest(
        index=i,
        t=float(i if t is None else t),
        input_length=len(tokens),
        output_tokens=len(out) or 1,
        namespace=ns,
        tokens=tuple(tokens),
        output_ids=tuple(out) or None,
    )


def run(reqs, cost=UNIT, **kw):
    seen = {}
    kw.setdefault("policy", "lru")
    kw.setdefault("ram_bytes", None)
    result = replay_mlxd(
        reqs,
        cost=cost,
        slots=1,
        on_request=lambda r, hit, src: seen.setdefault(r.index, (hit, src)),
        **kw,
    )
    return result, [seen[i] for i in range(len(reqs))]


def test_growing_conversation_reuses_previous_turn():
    turn1 = list(range(100, 110))
    turn2 = turn1 + list(range(200, 210))
    result, per = run([req(0, turn1), req(1, turn2), req(2, turn2)])
    assert per == [(0, "miss"), (10, "ram"), (19, "ram")]  # at most len(prompt) - 1
    assert result.hit_tokens == 29
    assert result.token_hit_rate == pytest.approx(29 / 50)
    assert result.mean_request_hit_rate == pytest.approx((0 + 0.5 + 19 / 20) / 3)


def test_namespaces_never_cross():
    a = list(range(10))
    _, per = run([req(0, a, ns="x"), req(1, a + [99], ns="y"), req(2, a + [99], ns="x")])
    assert [h for h, _ in per] == [0, 0, 10]


def test_byte_cap_evicts_and_ssd_keeps_the_victim():
    a, b = list(range(1000)), list(range(5000, 6000))
    trace = [req(0, a), req(1, b), req(2, a)]
    ram_only, per = run(trace, ram_bytes=1500)
    assert per[2] == (0, "miss") and ram_only.evictions == 2  # a, then b
    tiered, per = run(trace, ram_bytes=1500, ssd=True, ssd_bytes=10_000)
    assert per[2] == (999, "ssd")  # persisted before demotion, restored
    # Write-behind, as served: each prompt's boundary (999) and final (1000) checkpoints
    # are written once; a's restored copy is already durable and is not written again.
    assert tiered.ssd_bytes_written == 2 * (999 + 1000) and tiered.ssd_bytes_read == 1000
    assert tiered.demotions >= 1 and tiered.evictions == 0


def test_restore_is_skipped_when_recompute_is_cheaper():
    a, b = list(range(10)), list(range(50, 60))
    slow_disk = attrs.evolve(UNIT, restore_fixed=1.0)  # a restore costs more than a prefill
    trace = [req(0, a), req(1, b), req(2, a)]
    _, per = run(trace, cost=slow_disk, ram_bytes=15, ssd=True, ssd_bytes=1000)
    assert per[2] == (0, "miss")
    _, per = run(trace, ram_bytes=15, ssd=True, ssd_bytes=1000)
    assert per[2] == (9, "ssd")


def test_lfu_and_lru_differ_on_a_known_trace():
    a, b, c = list(range(10)), list(range(20, 30)), list(range(40, 50))
    # x hits a without superseding it (a's use count becomes 2); then b and c
    # arrive in a RAM of 20 tokens: LRU drops a, LFU keeps it.
    x = a[:5] + [99]
    trace = [req(0, a), req(1, x), req(2, b), req(3, c), req(4, a)]
    _, lru = run(trace, ram_bytes=20)
    _, lfu = run(trace, ram_bytes=20, policy="lfu")
    assert lru[1] == lfu[1] == (5, "ram")
    assert lru[4] == (0, "miss")
    assert lfu[4] == (9, "ram")


def test_generated_ids_are_stored_after_decode():
    prompt, reply = list(range(10)), [70, 71, 72]
    _, per = run([req(0, prompt, out=reply), req(1, prompt + reply + [5])])
    assert per[1] == (13, "ram")


def test_block_granularity_matches_token_level_on_a_slice():
    reqs = load_trace(TRACES / "conversation_trace.jsonl", limit=300)
    cap = DEFAULT.kv_bytes(512) * 300
    for policy in ("lru", "lfu", "cost"):
        blk = replay_mlxd(reqs, policy=policy, cost=DEFAULT, ram_bytes=cap, granularity="block")
        tok = replay_mlxd(reqs, policy=policy, cost=DEFAULT, ram_bytes=cap, granularity="token")
        assert (blk.hit_tokens, blk.ttft_s) == (tok.hit_tokens, tok.ttft_s)
        if policy == "lru":  # LFU/cost may credit a different one of two tied entries
            assert blk.evictions == tok.evictions


def test_same_trace_same_seed_same_results():
    reqs = load_trace(TRACES / "synthetic_trace.jsonl", limit=400)
    cap = DEFAULT.kv_bytes(512) * 500

    def once():
        r = replay_mlxd(
            reqs, policy="lfu", cost=DEFAULT, ram_bytes=cap, ssd=True, ssd_bytes=cap * 3, slots=8
        )
        return attrs.evolve(r, wall_s=0.0)

    assert once() == once()


def test_replay_of_a_recorded_trace_reproduces_reported_hits(tmp_path):
    # What a live server with an unlimited RAM tier stores and reports, written by the recorder.
    path = tmp_path / "live.jsonl"
    rec = TraceRecorder(path)
    sys_prompt = list(range(1, 30))
    turns = [
        (0.0, sys_prompt + [40, 41], [90, 91], 0),
        (1.0, sys_prompt + [40, 41, 90, 91, 42], [92], 33),
        (2.5, sys_prompt + [50], [93], 29),
        (3.0, sys_prompt + [40, 41, 90, 91, 42, 92, 43], [94], 35),
    ]
    for t, toks, out, cached in turns:
        rec.record(t=t, tokens=toks, output_tokens=len(out), output_ids=out, cached_tokens=cached)
    rec.close()
    reqs = load_trace(path)
    assert [r.cached_tokens for r in reqs] == [0, 33, 29, 35]
    _, per = run(reqs)
    assert [h for h, _ in per] == [r.cached_tokens for r in reqs]


@pytest.mark.parametrize("faster", [10.0, 1.0])
def test_a_restart_explores_one_unmeasured_restore_then_decides_by_its_measured_cost(faster):
    # A GPU-like machine: prefill 0.1 ms a token; the restarted server's startup guess puts a
    # restore at 1.3x recomputing, and the disk really is `faster` times that guess. The first returning
    # turn recomputes (as the advisor predicts); what it may have forgone pays for trying the restore on the
    # second (kv/restore_decision.py, as a live server's advisor).
    gpu = attrs.evolve(DEFAULT, prefill_fixed=0.0, prefill_per_token=1e-4, prefill_per_pair=0.0,
                       restore_fixed=0.0, kv_bytes_per_token=1000)
    guess = 2000 * 1000 / (1.3 * gpu.prefill_seconds(2100) - gpu.prefill_seconds(100, 2000))
    firsts = [list(range(10_000 * c, 10_000 * c + 2000)) for c in range(4)]
    trace = [req(c, firsts[c], t=c) for c in range(4)]  # four conversations, then a restart at t=10
    trace += [req(4 + c, firsts[c] + list(range(9000, 9100)), t=20 + c) for c in range(4)]
    result, per = run(trace, cost=attrs.evolve(gpu, restore_bytes_per_s=faster * guess), ssd=True,
                      advisor_base=attrs.evolve(gpu, restore_bytes_per_s=guess), restarts=[10.0])
    assert result.restarts == 1
    # The second returning turn is restored to measure the disk; the others follow what it measured.
    assert [src for _, src in per[4:]] == (["miss"] + ["ssd"] * 3 if faster > 1 else ["miss", "ssd", "miss", "miss"])
    assert result.restore_decisions["explorations"] == 1
    assert result.restore_decisions["restore_samples"] == (3 if faster > 1 else 1)
    # Without the restart RAM serves them all (no restore weighed, nothing explored).
    unbroken, per = run(trace, cost=gpu, ssd=True, advisor_base=attrs.evolve(gpu, restore_bytes_per_s=guess))
    assert [src for _, src in per[4:]] == ["ram"] * 4 and unbroken.restore_decisions["explorations"] == 0


def test_a_second_restart_resumes_the_measured_restore_and_explores_no_more():
    gpu = attrs.evolve(DEFAULT, prefill_fixed=0.0, prefill_per_token=1e-4, prefill_per_pair=0.0,
                       restore_fixed=0.0, kv_bytes_per_token=1000)
    guess = 2000 * 1000 / (1.3 * gpu.prefill_seconds(2100) - gpu.prefill_seconds(100, 2000))
    firsts = [list(range(10_000 * c, 10_000 * c + 2000)) for c in range(4)]
    trace = [req(c, firsts[c], t=c) for c in range(4)]
    trace += [req(4 + c, firsts[c] + list(range(9000, 9100)), t=20 + c) for c in range(2)]  # restart at 10
    trace += [req(6 + c, firsts[2 + c] + list(range(9000, 9100)), t=40 + c) for c in range(2)]  # and at 30
    result, per = run(trace, cost=attrs.evolve(gpu, restore_bytes_per_s=10 * guess), ssd=True,
                      advisor_base=attrs.evolve(gpu, restore_bytes_per_s=guess), restarts=[10.0, 30.0])
    assert result.restarts == 2 and [src for _, src in per[4:]] == ["miss"] + ["ssd"] * 3
    assert result.restore_decisions["explorations"] == 1  # the second restart resumed the measurement


def test_what_a_restart_forgoes_is_carried_to_the_next_so_a_restore_is_still_tried():
    # One returning turn after each restart: the first recomputes (forgoing what trying the restore costs),
    # the second restart resumes that and tries it (kv/restore_decision.py: forgone_s is carried).
    gpu = attrs.evolve(DEFAULT, prefill_fixed=0.0, prefill_per_token=1e-4, prefill_per_pair=0.0,
                       restore_fixed=0.0, kv_bytes_per_token=1000)
    guess = 2000 * 1000 / (1.3 * gpu.prefill_seconds(2100) - gpu.prefill_seconds(100, 2000))
    firsts = [list(range(10_000 * c, 10_000 * c + 2000)) for c in range(2)]
    trace = [req(c, firsts[c], t=c) for c in range(2)]
    trace += [req(2, firsts[0] + list(range(9000, 9100)), t=20), req(3, firsts[1] + list(range(9000, 9100)), t=40)]
    result, per = run(trace, cost=attrs.evolve(gpu, restore_bytes_per_s=10 * guess), ssd=True,
                      advisor_base=attrs.evolve(gpu, restore_bytes_per_s=guess), restarts=[10.0, 30.0])
    assert result.restarts == 2 and [src for _, src in per[2:]] == ["miss", "ssd"]
    assert result.restore_decisions["explorations"] == 1
