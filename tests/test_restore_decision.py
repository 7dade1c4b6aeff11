"""Restore or recompute, calibrated from the engine's own timings."""

from __future__ import annotations

import math

import attrs
import pytest

from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.restore_decision import RETRY_RATIO, RestoreAdvisor, RestoreCut

KV_PER_TOKEN = 114_688  # a 1.7B-class model's fp16 KV per token, roughly


def test_slow_prefill_cpu_restores():
    advisor = RestoreAdvisor()
    # 16k tokens took minutes of prefill here; a 1.9 GB read takes ~1 s.
    advisor.observe_prefill(new_tokens=2048, context=4096, seconds=20.0)
    advisor.observe_restore(nbytes=1_900_000_000, seconds=1.2)
    assert advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.restores_chosen == 1


def test_fast_accelerator_recomputes():
    advisor = RestoreAdvisor()
    # An H200-like engine: 16k tokens of prefill in ~0.2 s, KV to host and back at ~0.7 GB/s.
    seconds = 0.2 * DEFAULT.prefill_seconds(2048, 4096) / DEFAULT.prefill_seconds(16_000, 0)
    advisor.observe_prefill(new_tokens=2048, context=4096, seconds=seconds)
    advisor.observe_restore(nbytes=1_900_000_000, seconds=2.7)
    assert not advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.recomputes_chosen == 1


def test_a_long_warm_prefix_makes_a_slightly_longer_cold_one_not_worth_it():
    advisor = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e8))
    assert not advisor.should_restore(
        restore_bytes=8_000 * KV_PER_TOKEN, cold_tokens=8_010, warm_tokens=8_000, prompt_tokens=8_100
    )


def test_observations_move_the_estimates_smoothly():
    advisor = RestoreAdvisor()
    advisor.observe_restore(nbytes=10**9, seconds=1.0)
    assert advisor.restore_bytes_per_s == 1e9
    advisor.observe_restore(nbytes=10**9, seconds=0.5)
    assert 1e9 < advisor.restore_bytes_per_s < 2e9
    advisor.observe_prefill(new_tokens=4, context=0, seconds=10.0)  # too small to count
    assert advisor.prefill_samples == 0


def _restart_advisor(bytes_per_s: float) -> RestoreAdvisor:
    """A restarted server's advisor: prefill known, the restore bandwidth only its probe's guess."""
    advisor = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=bytes_per_s), explore=True)
    advisor.observe_prefill(new_tokens=2048, context=0, seconds=DEFAULT.prefill_seconds(2048, 0))
    return advisor


def _arms(advisor: RestoreAdvisor, *, warm: int = 0, cold: int = 16_000, prompt: int = 16_140):
    recompute = advisor.prefill_seconds(prompt - warm, warm)
    restore = advisor.restore_seconds(cold * KV_PER_TOKEN) + advisor.prefill_seconds(prompt - cold, cold)
    return recompute, restore


def test_an_unmeasured_restore_slower_than_recompute_is_tried_once_recomputes_forgo_its_cost_then_costs_decide():
    recompute = DEFAULT.prefill_seconds(16_140, 0)
    # The probe's guess makes the restore 1.3x recompute: worse, but not by enough to never look.
    guess = 16_000 * KV_PER_TOKEN / (1.3 * recompute)
    advisor = _restart_advisor(guess)
    ask = {"restore_bytes": 16_000 * KV_PER_TOKEN, "cold_tokens": 16_000, "warm_tokens": 0, "prompt_tokens": 16_140}
    predicted_recompute, predicted_restore = _arms(advisor)
    assert predicted_recompute < predicted_restore < 1.5 * predicted_recompute
    # The first returning turn recomputes (its predicted cost); what it may have forgone, were the read
    # EXPLORE_RATIO times faster than guessed, is counted.
    assert not advisor.should_restore(**ask)
    assert advisor.explorations == 0 and advisor.recomputes_chosen == 1
    assert advisor.last.forgoes == pytest.approx(advisor.forgone_s)
    assert predicted_restore - predicted_recompute < advisor.forgone_s < predicted_recompute
    # Now it covers what trying the restore costs: the next one is tried.
    assert advisor.should_restore(**ask)
    assert advisor.explorations == 1 and advisor.restores_chosen == 1
    stats = advisor.stats()
    assert stats["explorations"] == 1 and stats["last_explored"] == 1 and stats["forgone_s"] == 0  # spent on it
    assert stats["restore_retries"] == 1
    assert stats["last_restore_s"] > stats["last_recompute_s"] > 0
    # Chosen but not yet measured (in flight): no second exploration, nothing more forgone.
    forgone = advisor.forgone_s
    assert not advisor.should_restore(**ask) and advisor.forgone_s == forgone
    # The served restore was 3x faster than the guess: restores win on their measured cost.
    advisor.observe_restore(nbytes=16_000 * KV_PER_TOKEN, seconds=16_000 * KV_PER_TOKEN / (3 * guess))
    assert advisor.should_restore(**ask) and advisor.stats()["last_explored"] == 0
    assert advisor.explorations == 1 and advisor.restores_chosen == 2


def test_the_h200_restart_of_19_28_recomputes_its_returning_turns_before_any_exploration():
    # The 19:28 restart (benchmarks/results/host_servers-h200-restart-20261204-192823.json): the saved probe
    # (prefill points, 1.09 GB/s cold restore) and the first server's whole-prompt prefill scale 3.7144; a
    # 16,454-token prompt whose 16,453-token record is 1.8875 GB. It predicted restore 1.829 s against
    # recompute 1.007 s and tried the restore at once (served 1.683 s, the recompute arm 0.959 / 0.726 s).
    from mlxd.kv.device_costs import DeviceProbe

    probe = DeviceProbe(
        device="Device(gpu, 0)", decode_s_per_token=1 / 140.15, kv_bytes_per_token=KV_PER_TOKEN,
        prefill=((64, 0.02203), (256, 0.03043), (1024, 0.02938), (4096, 0.05976), (16384, 0.26923)),
        restore=((8_257_536, 0.02189), (470_679_552, 0.44511)), prefill_step_size=4096,
        host=((8_257_536, 0.0006), (470_679_552, 0.01482)),  # its host tier's promotion: 31 GB/s
    )
    advisor = RestoreAdvisor(base=probe.cost_model(), explore=True)
    advisor.resume({"prefill_scale": 3.7144, "whole_prefill_samples": 2})
    ask = {"restore_bytes": 1_887_535_104, "cold_tokens": 16_453, "warm_tokens": 0, "prompt_tokens": 16_454}
    turns = []
    while not advisor.should_restore(**ask):
        turns.append(advisor.last)
    # 19:28's 1.829 s, plus the restored pages' move to the device (61 ms at the promotion's 31 GB/s)
    assert turns[0].restore_seconds == pytest.approx(1.829 + 0.061, abs=0.01)
    assert turns[0].recompute_seconds == pytest.approx(1.007, abs=0.01)
    assert len(turns) >= 3 and advisor.last.explore  # three rounds of the benchmark recompute every turn
    assert sum(t.forgoes for t in turns) >= advisor.last.restore_seconds - advisor.last.recompute_seconds
    assert advisor.forgone_s == 0  # spent on the try


def test_a_measured_slow_restore_is_not_tried_again():
    recompute = DEFAULT.prefill_seconds(16_140, 0)
    guess = 16_000 * KV_PER_TOKEN / (1.3 * recompute)
    advisor = _restart_advisor(guess)
    advisor.observe_restore(nbytes=10**9, seconds=10**9 / guess)  # the probe was right
    assert not advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.explorations == 0


def test_no_exploration_far_from_recompute_nor_over_a_long_ram_hit():
    recompute = DEFAULT.prefill_seconds(16_140, 0)
    far = _restart_advisor(16_000 * KV_PER_TOKEN / (3.0 * recompute))  # restore predicted ~3x recompute
    assert not far.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    # A record a little longer than a long RAM hit is never explored, however close the arms.
    near = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e8), explore=True)
    assert not near.should_restore(
        restore_bytes=8_000 * KV_PER_TOKEN, cold_tokens=8_010, warm_tokens=8_000, prompt_tokens=8_100
    )
    # Nor one that adds less than half the prompt over its RAM hit (restore 1.3x recompute here).
    rest = DEFAULT.prefill_seconds(4_100, 5_000)
    half = RestoreAdvisor(base=attrs.evolve(
        DEFAULT, restore_bytes_per_s=9_000 * KV_PER_TOKEN / (1.3 * rest - DEFAULT.prefill_seconds(100, 9_000))
    ), explore=True)
    assert not half.should_restore(
        restore_bytes=9_000 * KV_PER_TOKEN, cold_tokens=9_000, warm_tokens=5_000, prompt_tokens=9_100
    )
    assert 1.2 < half.last.restore_seconds / half.last.recompute_seconds < 1.5
    assert far.explorations == near.explorations == half.explorations == 0


def test_never_recomputes_and_a_look_ahead_explores_without_counting():
    never = RestoreAdvisor(never=True, explore=True)
    assert not never.should_restore(restore_bytes=10**6, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140)
    assert never.forgone_s == 0  # a forced arm forgoes nothing
    recompute = DEFAULT.prefill_seconds(16_140, 0)
    advisor = _restart_advisor(16_000 * KV_PER_TOKEN / (1.3 * recompute))
    from mlxd.kv.restore_decision import RestoreCut

    cuts = [RestoreCut(16_000, 16_000 * KV_PER_TOKEN)]
    assert advisor.plan(cuts=cuts, warm_tokens=0, prompt_tokens=16_140).arm == "recompute"  # forgoes its cost
    forgone = advisor.forgone_s
    ahead = advisor.plan(cuts=cuts, warm_tokens=0, prompt_tokens=16_140, count=False)  # the prefetcher's
    assert ahead.explore and advisor.explorations == 0 and advisor.restores_chosen == 0
    assert advisor.forgone_s == forgone
    chosen = advisor.plan(cuts=cuts, warm_tokens=0, prompt_tokens=16_140)
    assert chosen.explore and chosen.cut == ahead.cut and advisor.explorations == 1


def test_without_explore_an_unmeasured_restore_is_decided_by_its_predicted_cost():
    recompute = DEFAULT.prefill_seconds(16_140, 0)
    advisor = _restart_advisor(16_000 * KV_PER_TOKEN / (1.3 * recompute))
    advisor.explore = False
    assert not advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.explorations == 0


def test_a_whole_prompt_timed_as_served_sets_the_prefill_scale_and_chunks_stop_moving_it():
    # The H200's restart (10:23): chunks ran at ~1.85x the probe's prefill model, the whole served
    # prompt at ~7.8x (16454 tokens in 1.87 s against 0.24 s probed); recompute is what a request waits for.
    advisor = RestoreAdvisor()
    advisor.observe_prefill(new_tokens=1024, context=4096, seconds=1.85 * DEFAULT.prefill_seconds(1024, 4096))
    assert advisor.prefill_scale == pytest.approx(1.85)
    advisor.observe_prefill(new_tokens=16_454, context=0, seconds=7.8 * DEFAULT.prefill_seconds(16_454, 0),
                            whole=True)
    assert advisor.prefill_scale == pytest.approx(7.8) and advisor.whole_prefill_samples == 1
    advisor.observe_prefill(new_tokens=1024, context=0, seconds=DEFAULT.prefill_seconds(1024, 0))
    assert advisor.prefill_scale == pytest.approx(7.8) and advisor.stats()["whole_prefill_samples"] == 1


def test_a_restarted_advisor_resumes_what_was_measured_and_does_not_explore_it_again(tmp_path):
    from mlxd.kv import advisor_file

    before = _restart_advisor(16_000 * KV_PER_TOKEN / (1.3 * DEFAULT.prefill_seconds(16_140, 0)))
    before.observe_prefill(new_tokens=16_000, context=0, seconds=5 * DEFAULT.prefill_seconds(16_000, 0), whole=True)
    before.observe_restore(nbytes=2 * 10**9, seconds=0.8)
    path = advisor_file.advisor_path(tmp_path)
    advisor_file.save(path, before.calibration(), "Device(gpu, 0)")
    assert advisor_file.load(path, "Device(cpu, 0)") == {}  # another device's measurements are not ours
    after = RestoreAdvisor(base=before.base, explore=True)
    after.resume(advisor_file.load(path, "Device(gpu, 0)"))
    assert after.prefill_scale == pytest.approx(5.0) and after.whole_prefill_samples == 1
    assert after.restore_bytes_per_s == pytest.approx(2.5e9) and after.restore_samples == 1
    after.should_restore(restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140)
    assert after.explorations == 0  # measured before the restart: decided by that measurement
    # Chunk timings and unmeasured guesses are not carried; a damaged file is no calibration.
    fresh = RestoreAdvisor(explore=True)
    fresh.resume(RestoreAdvisor(prefill_scale=3.0, prefill_samples=4).calibration())
    assert fresh.prefill_scale == 1.0 and fresh.restore_samples == 0
    path.write_text("{not json")
    assert advisor_file.load(path, "Device(gpu, 0)") == {}


def test_a_guess_as_far_off_as_the_h200_s_probe_is_still_tried_once():
    # 15:50 H200 restart: the probe's cold read put the restore at 2.03x the predicted recompute (1.82 vs
    # 0.89 s) while served restores ran 2.3x faster than that guess; it must be tried once, then measured,
    # after the recomputes forgo what trying it costs.
    from mlxd.kv.restore_decision import EXPLORE_RATIO

    recompute = DEFAULT.prefill_seconds(16_140, 0)
    guess = 16_000 * KV_PER_TOKEN / (2.03 * recompute)
    advisor = _restart_advisor(guess)
    ask = {"restore_bytes": 16_000 * KV_PER_TOKEN, "cold_tokens": 16_000, "warm_tokens": 0, "prompt_tokens": 16_140}
    predicted_recompute, predicted_restore = _arms(advisor)
    assert 2.0 * predicted_recompute < predicted_restore < EXPLORE_RATIO * predicted_recompute
    forgoes = []
    while not advisor.should_restore(**ask):
        forgoes.append(advisor.last.forgoes)
        assert len(forgoes) < 20
    assert advisor.explorations == 1 and len(forgoes) == advisor.recomputes_chosen
    # Each recompute forgoes what the restore would save were its read EXPLORE_RATIO times faster.
    read = predicted_restore - advisor.prefill_seconds(140, 16_000)
    assert forgoes[0] == pytest.approx(predicted_recompute - (predicted_restore - read + read / EXPLORE_RATIO))
    assert len(forgoes) == math.ceil((predicted_restore - predicted_recompute) / forgoes[0]) > 1
    advisor.observe_restore(nbytes=16_000 * KV_PER_TOKEN, seconds=16_000 * KV_PER_TOKEN / (2.3 * guess))
    assert advisor.should_restore(**ask) and advisor.explorations == 1  # now by its measured cost


def test_forgone_seconds_are_carried_across_a_restart_until_a_restore_is_measured(tmp_path):
    from mlxd.kv import advisor_file

    recompute = DEFAULT.prefill_seconds(16_140, 0)
    guess = 16_000 * KV_PER_TOKEN / (1.3 * recompute)
    ask = {"restore_bytes": 16_000 * KV_PER_TOKEN, "cold_tokens": 16_000, "warm_tokens": 0, "prompt_tokens": 16_140}
    before = _restart_advisor(guess)
    assert not before.should_restore(**ask) and before.forgone_s > 0
    path = advisor_file.advisor_path(tmp_path)
    advisor_file.save(path, before.calibration(), "Device(gpu, 0)")
    # A server restarted after each returning turn still gets to try the restore.
    after = _restart_advisor(guess)
    after.resume(advisor_file.load(path, "Device(gpu, 0)"))
    assert after.forgone_s == pytest.approx(before.forgone_s)
    assert after.should_restore(**ask) and after.explorations == 1
    # Once a restore is measured, what was forgone no longer matters: not carried.
    after.observe_restore(nbytes=10**9, seconds=0.5)
    measured = _restart_advisor(guess)
    measured.resume(after.calibration())
    assert measured.restore_samples == 1 and measured.forgone_s == 0
    # Nor a damaged figure.
    for bad in (float("inf"), float("nan"), -1.0):
        fresh = _restart_advisor(guess)
        fresh.resume({"forgone_s": bad})
        assert fresh.forgone_s == 0


def test_resident_bytes_never_cost_more_than_bytes_from_the_disk():
    # The H200's probe read the page cache at 0.87 GB/s against its cold 1.04 (a small point's noise);
    # serving then read resident records at 2.0 GB/s: a resident record must not be priced above a cold one.
    base = attrs.evolve(DEFAULT, restore_bytes_per_s=1.04e9, page_cache_bytes_per_s=0.87e9)
    advisor = RestoreAdvisor(base=base)
    n = 1_887_420_416
    assert advisor.restore_seconds(n, n) == pytest.approx(advisor.restore_seconds(n, 0))
    faster = RestoreAdvisor(base=attrs.evolve(base, page_cache_bytes_per_s=2.0e9))
    assert faster.restore_seconds(n, n) == pytest.approx(base.restore_fixed + n / 2.0e9)
    assert faster.restore_seconds(n, n // 2) < faster.restore_seconds(n, 0)


def test_a_restored_turn_waits_for_its_pages_moved_to_the_device_where_memory_is_not_unified():
    # What a restored turn costs beyond the read: the first forward waits for the landed pages' move to the
    # device (the host tier's promotion, as the probe timed it); free on unified memory (no host figure).
    from mlxd.kv.restore_decision import RestoreCut

    cuts = [RestoreCut(16_000, 16_000 * KV_PER_TOKEN)]
    unified = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=2e9))
    cuda = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=2e9, host_bytes_per_s=30e9))
    a = unified.plan(cuts=cuts, warm_tokens=0, prompt_tokens=16_001)
    b = cuda.plan(cuts=cuts, warm_tokens=0, prompt_tokens=16_001)
    assert unified.landed_seconds(10**9) == 0.0
    assert b.restore_seconds - a.restore_seconds == pytest.approx(16_000 * KV_PER_TOKEN / 30e9)
    assert b.recompute_seconds == a.recompute_seconds  # recomputing moves nothing


def test_a_calibration_file_with_a_figure_that_is_not_a_number_is_no_calibration(tmp_path):
    # A file that cannot be read is no calibration, never an error (kv/advisor_file.py): a damaged figure
    # (a string, null, a list) made the restarted server's `resume` raise at startup.
    import json

    from mlxd.kv import advisor_file

    path = advisor_file.advisor_path(tmp_path)
    good = RestoreAdvisor(prefill_scale=2.0, whole_prefill_samples=1).calibration()
    for name, bad in (("forgone_s", "x"), ("forgone_s", None), ("prefill_scale", "2.0"),
                      ("whole_prefill_samples", [1]), ("restore_bytes_per_s", {"a": 1})):
        path.write_text(json.dumps({"version": advisor_file.VERSION, "device": "Device(gpu, 0)",
                                    "calibration": {**good, name: bad}}))
        assert advisor_file.load(path, "Device(gpu, 0)") == {}, (name, bad)
        advisor = RestoreAdvisor(explore=True)
        advisor.resume(advisor_file.load(path, "Device(gpu, 0)"))
        assert advisor.prefill_scale == 1.0 and advisor.forgone_s == 0
    advisor_file.save(path, good, "Device(gpu, 0)")
    assert advisor_file.load(path, "Device(gpu, 0)") == good  # whole numbers and floats are read as saved


def test_a_calibration_file_with_a_bool_figure_is_no_calibration(tmp_path, caplog):
    # JSON's true is Python's True, an int (True -> 1.0 in `resume`): a bool figure is no number either.
    import json

    from mlxd.kv import advisor_file

    path = advisor_file.advisor_path(tmp_path)
    good = RestoreAdvisor(prefill_scale=2.0, whole_prefill_samples=1).calibration()
    for name in ("prefill_scale", "whole_prefill_samples", "forgone_s"):
        for bad in (True, False):
            path.write_text(json.dumps({"version": advisor_file.VERSION, "device": "Device(gpu, 0)",
                                        "calibration": {**good, name: bad}}))
            caplog.clear()
            assert advisor_file.load(path, "Device(gpu, 0)") == {}, (name, bad)
            assert "advisor.calibration_unreadable" in caplog.text and "calibration figure is not a" in caplog.text


def test_a_calibration_file_with_a_figure_that_is_not_finite_is_no_calibration(tmp_path):
    # Python's json reads NaN and Infinity as floats: a restore rate of Infinity made every restore look free.
    import json

    from mlxd.kv import advisor_file

    path = advisor_file.advisor_path(tmp_path)
    good = RestoreAdvisor(prefill_scale=2.0, whole_prefill_samples=1).calibration()
    for name in ("prefill_scale", "restore_bytes_per_s", "forgone_s"):
        for bad in (float("inf"), float("nan"), float("-inf")):
            path.write_text(json.dumps({"version": advisor_file.VERSION, "device": "Device(gpu, 0)",
                                        "calibration": {**good, "restore_samples": 3, name: bad}}))
            assert advisor_file.load(path, "Device(gpu, 0)") == {}, (name, bad)


def test_a_mostly_resident_restore_calibrates_the_page_cache_net_of_its_cold_part():
    # CPU 23:01 (reads throttled to 8 MB/s): a restore found 71% of its 13.7 MB in the page cache and took 0.587 s,
    # nearly all of it the cold 29% from the disk; charged whole to the page cache it set that rate to 23 MB/s
    # against the probe's 630. On the H200's figures (1.88 GB record, recompute 1.0 s, disk 1.0 GB/s, page cache
    # 5 GB/s) a half-resident restore charged whole priced a record all in the page cache at 1.13 s: recomputed,
    # and as resident restores were no longer chosen, the figure was never corrected.
    from mlxd.kv.restore_decision import RESTORE, RestoreCut

    n, tokens = 1_887_535_104, 16_453
    base = attrs.evolve(DEFAULT, restore_bytes_per_s=1e9, page_cache_bytes_per_s=5e9)
    advisor = RestoreAdvisor(base=base, prefill_scale=1.0 / DEFAULT.prefill_seconds(tokens + 1, 0))
    advisor.observe_restore(nbytes=n, seconds=n / 1e9)  # a cold restore: the disk's rate, measured
    assert advisor.restore_samples == 1 and advisor.restore_bytes_per_s == pytest.approx(1e9)
    advisor.observe_restore(nbytes=n, seconds=(n / 2) / 1e9 + (n / 2) / 5e9, resident=0.5)
    assert advisor.resident_samples == 1 and advisor.resident_bytes_per_s == pytest.approx(5e9)
    assert advisor.restore_bytes_per_s == pytest.approx(1e9) and advisor.restore_samples == 1
    warm = advisor.plan(cuts=[RestoreCut(tokens, n, n)], warm_tokens=0, prompt_tokens=tokens + 1)
    assert warm.arm == RESTORE and warm.seconds < 0.5 < warm.recompute_seconds
    cold = advisor.plan(cuts=[RestoreCut(tokens, n, 0)], warm_tokens=0, prompt_tokens=tokens + 1)
    assert cold.arm == "recompute"  # from the disk it still loses
    # A mostly resident restore whose cold part alone, at the disk's rate, takes all its time says nothing
    # about the page cache: no sample.
    advisor.observe_restore(nbytes=n, seconds=0.3 * n / 1e9, resident=0.6)
    assert advisor.resident_samples == 1 and advisor.resident_bytes_per_s == pytest.approx(5e9)


def _measured_slow_advisor(true_rate: float, recompute: float) -> tuple[RestoreAdvisor, dict[str, int]]:
    """An advisor whose one served restore read at 0.6x the disk's `true_rate` (the first restore after a
    restart shares the disk with the startup warm-up: 0.55-0.67x on the CPU, 23:00-23:20 UTC), on a machine
    that recomputes the prompt in `recompute` seconds."""
    n = 16_000 * KV_PER_TOKEN
    advisor = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=true_rate), explore=True,
                             prefill_scale=recompute / DEFAULT.prefill_seconds(16_140, 0))
    advisor.observe_restore(nbytes=n, seconds=n / (0.6 * true_rate))
    return advisor, {"restore_bytes": n, "cold_tokens": 16_000, "warm_tokens": 0, "prompt_tokens": 16_140}


def _turns_until_restore(advisor, ask, limit):
    """How many turns `advisor` recomputes `ask` before it restores (fewer than `limit`)."""
    turns = 0
    while not advisor.should_restore(**ask):
        turns += 1
        assert turns < limit
    return turns


def test_a_restore_measured_slow_once_is_tried_again_when_recomputes_forgo_its_cost_and_then_wins():
    # The disk really restores the prompt in 0.8 s against a 1.0 s recompute; its one measurement, taken beside
    # the startup warm-up, put it at 1.33 s. Measured restores were never tried again: recompute for good,
    # carried across restarts in the advisor's file.
    n = 16_000 * KV_PER_TOKEN
    advisor, ask = _measured_slow_advisor(n / 0.8, 1.0)
    turns = _turns_until_restore(advisor, ask, 20)
    assert advisor.last.explore and advisor.explorations == 1 and turns >= 2
    assert advisor.forgone_s == 0  # a try spends what was forgone
    assert not advisor.should_restore(**ask)  # in flight: nothing more tried until it is measured
    advisor.observe_restore(nbytes=n, seconds=0.8)
    assert advisor.should_restore(**ask) and not advisor.last.explore  # now by its cost
    for _ in range(3):  # (or a recompute tried: 1.0 s against 0.8 is close enough to time the prefill again)
        restored = advisor.should_restore(**ask)
        assert advisor.last.recompute_try or (restored and not advisor.last.explore)
    assert advisor.explorations == 1


def test_a_retried_restore_that_loses_again_waits_twice_as_long_and_one_clearly_slower_is_never_retried():
    n = 16_000 * KV_PER_TOKEN
    advisor, ask = _measured_slow_advisor(n / (0.6 * 1.4), 1.0)  # measured 1.4 s against 1.0, and right
    gaps, turns = [], 0
    while len(gaps) < 3:
        turns += 1
        assert turns < 200
        if advisor.should_restore(**ask):
            assert advisor.last.explore
            gaps.append(turns)
            turns = 0
            advisor.observe_restore(nbytes=n, seconds=1.4)  # slow again
    assert advisor.explorations == 3 and gaps[1] >= 1.7 * gaps[0] and gaps[2] >= 1.7 * gaps[1], gaps
    # Measured at 1.9x recompute: even were the read 1.6x faster it would lose; nothing forgone, never tried.
    clear = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=n / 1.9), explore=True,
                           prefill_scale=1.0 / DEFAULT.prefill_seconds(16_140, 0))
    clear.observe_restore(nbytes=n, seconds=1.9)
    for _ in range(50):
        assert not clear.should_restore(**ask)
    assert clear.explorations == 0 and clear.forgone_s == 0


def test_what_was_forgone_after_a_measured_restore_and_the_retries_are_carried_across_a_restart(tmp_path):
    from mlxd.kv import advisor_file

    n = 16_000 * KV_PER_TOKEN
    before, ask = _measured_slow_advisor(n / 0.8, 1.0)
    assert not before.should_restore(**ask) and before.forgone_s > 0
    path = advisor_file.advisor_path(tmp_path)
    advisor_file.save(path, before.calibration(), "Device(gpu, 0)")
    after, _ = _measured_slow_advisor(n / 0.8, 1.0)
    after.forgone_s = 0.0
    after.resume(advisor_file.load(path, "Device(gpu, 0)"))
    assert after.forgone_s == pytest.approx(before.forgone_s) and after.restore_samples == 1
    while not after.should_restore(**ask):
        pass
    after.observe_restore(nbytes=n, seconds=2.0)  # lost: the next try waits for twice the cost
    saved = after.calibration()
    assert saved["restore_retries"] == 1 and saved["forgone_s"] == 0
    again, _ = _measured_slow_advisor(n / 0.8, 1.0)
    again.resume(saved)
    assert again.retries == 1


def test_a_try_never_measured_does_not_stop_every_later_try():
    # A chosen restore may never be measured: its request cancelled before it joined, or the record lost on
    # its read (a miss, recomputed). It counted as in flight for good: no restore was tried again in that
    # process, and nothing was forgone meanwhile, so not after a restart either.
    n = 16_000 * KV_PER_TOKEN
    advisor, ask = _measured_slow_advisor(n / 0.8, 1.0)
    _turns_until_restore(advisor, ask, 20)
    assert advisor.last.explore  # tried, and never measured
    _turns_until_restore(advisor, ask, 200)
    assert advisor.last.explore and advisor.explorations == 2


# The H100 restart of 15:10 (docs/benchmarks.md): a 16,453-token record of 1.88 GB, restores served at ~1.5 GB/s,
# and a prefill scale learned from a process's first prefills that put a 16k recompute at 1.76 s (1.74 here), where
# warm ones took 0.51-1.22 s. The advisor restored 11 of 12 returning turns (1.21-1.82 s) and never timed a prefill again.
H100_RECORD = RestoreCut(16_453, 1_880_000_000)
H100_ASK = {"cuts": [H100_RECORD], "warm_tokens": 0, "prompt_tokens": 16_454}


def _stale_scale_advisor(**kw: object) -> RestoreAdvisor:
    advisor = RestoreAdvisor(explore=True, **kw)  # type: ignore[arg-type]
    advisor.observe_prefill(new_tokens=16_454, context=0, seconds=1.74, whole=True)
    advisor.observe_restore(nbytes=H100_RECORD.nbytes, seconds=1.25)
    return advisor


def _restores_until_a_recompute_try(advisor: RestoreAdvisor, limit: int) -> int:
    restores = 0
    while True:
        plan = advisor.plan(**H100_ASK)
        if plan.recompute_try:
            assert plan.arm == "recompute" and plan.cut is None
            return restores
        assert plan.arm == "restore"
        advisor.observe_restore(nbytes=H100_RECORD.nbytes, seconds=1.25)
        restores += 1
        assert restores < limit


def test_a_restore_chosen_on_a_stale_prefill_scale_tries_a_recompute_whose_timing_replaces_the_scale():
    advisor = _stale_scale_advisor()
    first = advisor.plan(**H100_ASK)
    assert first.arm == "restore" and not first.recompute_try
    assert first.recompute_forgoes == pytest.approx(first.seconds - first.recompute_seconds / RETRY_RATIO)
    restores = _restores_until_a_recompute_try(advisor, 10)
    assert advisor.recompute_tries == 1 and advisor.recompute_forgone_s == 0 and restores >= 1
    # timed as served: 1.1 s, not 1.74; the try's figure replaces the scale (an average would still restore)
    advisor.observe_prefill(new_tokens=16_454, context=0, seconds=1.1, whole=True)
    assert advisor.prefill_seconds(16_454, 0) == pytest.approx(1.1)
    plan = advisor.plan(**H100_ASK)  # recompute on its cost now, and that resets the retries
    assert plan.arm == "recompute" and not plan.recompute_try and not plan.explore
    assert advisor.recompute_retries == 0 and advisor.recompute_tries == 1
    assert advisor.stats()["recompute_tries"] == 1


def test_a_recompute_try_that_loses_again_waits_twice_as_long_and_one_clearly_slower_is_never_tried():
    advisor = _stale_scale_advisor()
    gaps = []
    for _ in range(3):
        gaps.append(_restores_until_a_recompute_try(advisor, 200))
        assert not advisor.plan(**H100_ASK).recompute_try  # in flight: no second try before it is timed
        advisor.observe_prefill(new_tokens=16_454, context=0, seconds=1.74, whole=True)  # right all along
    assert advisor.recompute_tries == 3 and advisor.recompute_retries == 3
    assert gaps[1] >= 1.7 * max(gaps[0], 1) and gaps[2] >= 1.7 * gaps[1], gaps
    # A recompute predicted at 2.5 s against a 1.25 s restore: even 1.6x faster it would lose; never tried.
    clear = RestoreAdvisor(explore=True)
    clear.observe_prefill(new_tokens=16_454, context=0, seconds=2.5, whole=True)
    clear.observe_restore(nbytes=H100_RECORD.nbytes, seconds=1.25)
    for _ in range(50):
        assert clear.plan(**H100_ASK).arm == "restore"
    assert clear.recompute_tries == 0 and clear.recompute_forgone_s == 0


def test_no_recompute_try_when_a_choice_is_forced_or_without_explore_or_over_a_short_restore():
    for kw in ({"always": True}, {"split": True}):
        forced = _stale_scale_advisor(**kw)
        for _ in range(30):
            assert not forced.plan(**H100_ASK).recompute_try
        assert forced.recompute_tries == 0 and forced.recompute_forgone_s == 0
    quiet = RestoreAdvisor()
    quiet.observe_prefill(new_tokens=16_454, context=0, seconds=1.74, whole=True)
    quiet.observe_restore(nbytes=H100_RECORD.nbytes, seconds=1.25)
    for _ in range(30):
        assert quiet.plan(**H100_ASK).arm == "restore"
    assert quiet.recompute_tries == 0
    # a restore that brings under half the prompt: its recompute would not be timed whole
    short = _stale_scale_advisor()
    ask = {"cuts": [RestoreCut(8_000, H100_RECORD.nbytes)], "warm_tokens": 0, "prompt_tokens": 16_454}
    for _ in range(30):
        assert not short.plan(**ask).recompute_try
    assert short.recompute_forgone_s == 0


def test_a_recompute_try_is_carried_across_a_restart(tmp_path):
    from mlxd.kv import advisor_file

    alone = _restores_until_a_recompute_try(_stale_scale_advisor(), 10)
    assert alone >= 2
    before = _stale_scale_advisor()
    for _ in range(2):
        assert before.plan(**H100_ASK).arm == "restore"
    path = advisor_file.advisor_path(tmp_path)
    advisor_file.save(path, before.calibration(), "Device(gpu, 0)")
    after = _stale_scale_advisor()
    after.resume(advisor_file.load(path, "Device(gpu, 0)"))
    assert after.recompute_forgone_s == pytest.approx(before.recompute_forgone_s)
    assert after.recompute_forgone_s > 0
    assert _restores_until_a_recompute_try(after, 10) == alone - 2  # what the last process forgone counts
    after.observe_prefill(new_tokens=16_454, context=0, seconds=2.0, whole=True)  # lost
    saved = after.calibration()
    assert saved["recompute_retries"] == 1 and saved["recompute_forgone_s"] == 0
    again = RestoreAdvisor(explore=True)
    again.resume(saved)
    assert again.recompute_retries == 1
