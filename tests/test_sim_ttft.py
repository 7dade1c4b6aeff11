"""`mlxd simulate` predicts TTFT per tier from a recorded run.

A recording carries each request's measured TTFT (and queue time), the
server's startup-probe cost model and its online calibration at each flush;
the replay times prefill and restore with those, so a recording whose
timings follow its own model is predicted exactly. The live comparison on
this machine is benchmarks/bench_sim_ttft.py (docs/simulate.md).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import attrs
import pytest
import trio

from mlxd import SamplingParams, open_runtime
from mlxd.cli import record_trace
from mlxd.kv.cost_model import DEFAULT
from mlxd.sim.cli import main as sim_main
from mlxd.sim.trace import TraceRecorder, TraceRequest, load_recording

from serving import config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sim_ttft  # noqa: E402

PROBE = attrs.evolve(DEFAULT, model="probe:test", prefill_fixed=0.05, prefill_per_token=2e-3, prefill_per_pair=1e-6,
                     restore_fixed=0.01, restore_bytes_per_s=1e8, kv_bytes_per_token=4096)
SCALE, RESTORE_BPS = 1.5, 2e8


def simulate(path: Path, capsys) -> dict:
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json"]) == 0
    runs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    (run,) = [r for r in runs if "cache_model" in r]
    return run


def model_recording(path: Path) -> list[tuple[str, float]]:
    """Three conversations: a miss, then (flushed) a RAM hit; one more prompt pushes the first out of
    RAM, and its return is an SSD restore. Measured TTFTs are what the probe model, scaled by the
    calibration the server reported, says: (tier, ttft) per request."""
    rec = TraceRecorder(path)
    rec.server(model="m", kv_bytes_per_token=4096, prompt_cache_bytes=4096 * 700, retention="lru",
               snapshot_min_tokens=16, max_batch=1, ssd=True, ssd_cache_max_bytes=0, ssd_demote_idle_s=0,
               ssd_layout="whole", ssd_block_tokens=256, restore_choice="measured",
               restore_advisor_base=attrs.asdict(PROBE))
    cal = {"prefill_scale": SCALE, "restore_bytes_per_s": RESTORE_BPS, "always": False, "split": False}
    rec.flush(t=0.0, restore_advisor=cal)
    a, b = list(range(1, 601)), list(range(1001, 1601))
    steps = [(a, 0, "none"), (a + [7] * 40, 600, "ram"), (b, 0, "none"), (a + [7] * 40 + [9] * 40, 640, "ssd")]
    want, t = [], 1.0
    for tokens, cached, tier in steps:
        prefill = SCALE * PROBE.prefill_seconds(len(tokens) - cached, cached)
        restore = PROBE.restore_fixed + 4096 * 640 / RESTORE_BPS if tier == "ssd" else 0.0
        ttft = restore + prefill
        rec.record(t=t, tokens=tokens, output_tokens=0, cached_tokens=cached, cache_tier=tier, ttft_s=ttft,
                   queued_s=0.0)
        rec.flush(t=t + 60, restore_advisor=cal)
        want.append((tier, ttft))
        t += 120
    rec.close()
    return want


def test_a_recording_that_follows_its_model_is_predicted_exactly(tmp_path, capsys):
    path = tmp_path / "rec.jsonl"
    want = model_recording(path)
    recording = load_recording(path)
    assert [(r.cache_tier, r.ttft_s) for r in recording.reqs] == [(t, pytest.approx(s, abs=1e-6)) for t, s in want]
    sim = simulate(path, capsys)
    assert (sim["misses"], sim["ram_hits"], sim["ssd_hits"]) == (2, 1, 1)
    rows = bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim)
    assert {r["tier"] for r in rows} == {"miss", "ram", "ssd"}
    for row in rows:
        assert row["ratio_p50"] == pytest.approx(1.0, abs=0.01), row
        assert row["ratio_p95"] == pytest.approx(1.0, abs=0.01), row
    assert "p95" in sim["ttft_by_source_s"]["ram"]


async def test_a_live_recording_carries_each_requests_ttft(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", device_probe="on",
                        device_probe_budget_s=0.2)
    path = tmp_path / "live.jsonl"
    prompt = list(range(5, 105))
    async with open_runtime(config) as rt:
        record_trace(rt, path)
        for extra in ([], [3] * 20):
            async with rt.submit(rt.request(prompt + extra, sampling=SamplingParams(max_tokens=2))) as stream:
                await stream.tokens()
            await rt.flush()
    recording = load_recording(path)
    assert [r.cache_tier for r in recording.reqs] == ["none", "ram"]
    for r in recording.reqs:
        assert r.ttft_s is not None and r.queued_s is not None and 0 <= r.queued_s <= r.ttft_s
    # The server line carries the probe's cost model: the replay times with it (and the flushes' calibration).
    assert recording.server["restore_advisor_base"]["model"].startswith("probe:")
    assert recording.calibrations[0]["prefill_scale"] > 0
    await trio.lowlevel.checkpoint()


def test_a_fit_to_a_recording_recovers_its_model_and_keeps_its_spread(tmp_path, capsys):
    from mlxd.kv.cost_model import CostModel
    from mlxd.sim.ttft_fit import fit_recording

    true = attrs.evolve(PROBE, prefill_fixed=0.08, prefill_per_token=3e-3, prefill_per_pair=2e-6,
                        restore_fixed=0.02)  # restore bandwidth: the base model's, as the fit keeps it
    shapes = [(n, 0, "none") for n in (200, 400, 800)] + [(60, c, "ram") for c in (300, 900)]
    shapes += [(60, c, "ssd") for c in (500, 1500)]
    reqs = []
    for i, (n, ctx, tier) in enumerate(shapes):
        ttft = true.prefill_seconds(n, ctx) + (true.restore_seconds(true.kv_bytes(ctx)) if tier == "ssd" else 0.0)
        reqs.append(TraceRequest(index=i, t=10.0 * i, input_length=n + ctx, output_tokens=0, cached_tokens=ctx,
                                 cache_tier=tier, ttft_s=ttft + 0.5, queued_s=0.5))  # the queue is not service
    fitted = fit_recording(reqs, PROBE, warmup=0)
    for n, ctx in ((100, 0), (800, 0), (60, 900), (200, 2000)):
        assert fitted.prefill_seconds(n, ctx) == pytest.approx(true.prefill_seconds(n, ctx), rel=0.01)
    assert fitted.restore_seconds(true.kv_bytes(1000)) == pytest.approx(true.restore_seconds(true.kv_bytes(1000)),
                                                                         rel=0.01)
    assert len(fitted.service_ratios) == len(reqs) and all(r == pytest.approx(1.0, abs=0.01)
                                                           for r in fitted.service_ratios)

    # Through the CLI: fitted to a recording, written, and replayed with (spread included).
    path = tmp_path / "rec.jsonl"
    model_recording(path)
    out = tmp_path / "fit.json"
    assert sim_main([str(path), "--fit-ttft-out", str(out)]) == 0
    assert CostModel.load(out) == fit_recording(load_recording(path).reqs, PROBE)
    # Replayed with the fitted model (and its spread), the recording is predicted per tier.
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(out)]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    for row in bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim):
        assert row["ratio_p50"] == pytest.approx(1.0, abs=0.05), row


def test_rows_prefilling_at_once_share_the_one_engine(tmp_path, capsys):
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(path)
    rec.server(model="m", kv_bytes_per_token=4096, prompt_cache_bytes=1 << 30, retention="lru",
               snapshot_min_tokens=16, max_batch=4, ssd=False, restore_advisor_base=attrs.asdict(PROBE))
    for i in range(2):  # two 500-token misses that arrive together
        rec.record(t=0.0, tokens=list(range(1 + 1000 * i, 501 + 1000 * i)), output_tokens=0, cache_tier="none")
    rec.close()
    alone = PROBE.prefill_seconds(500, 0)
    shared = simulate(path, capsys)["ttft_by_source_s"]["miss"]
    assert shared["p50"] == pytest.approx(2 * alone) and shared["p95"] == pytest.approx(2 * alone)
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--prefill-sharing", "off"]) == 0
    (slots,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
                if "cache_model" in r]
    assert slots["ttft_by_source_s"]["miss"]["p50"] == pytest.approx(alone)


def tiered_recording(path: Path, factors: dict[str, float], rounds: int = 3,
                     queued: dict[str, float] | None = None) -> None:
    """`rounds` times model_recording's pattern (a miss, a RAM hit, a miss that pushes the first out, its
    SSD restore) on fresh tokens; each tier's measured TTFT is the probe model's times its factor (a RAM
    hit's extra fixed costs, a restore faster than the model says), after the tier's `queued` seconds."""
    rec = TraceRecorder(path)
    rec.server(model="m", kv_bytes_per_token=4096, prompt_cache_bytes=4096 * 700, retention="lru",
               snapshot_min_tokens=16, max_batch=1, ssd=True, ssd_cache_max_bytes=0, ssd_demote_idle_s=0,
               ssd_layout="whole", ssd_block_tokens=256, restore_choice="measured",
               restore_advisor_base=attrs.asdict(PROBE))
    cal = {"prefill_scale": 1.0, "restore_bytes_per_s": PROBE.restore_bytes_per_s, "always": False, "split": False}
    rec.flush(t=0.0, restore_advisor=cal)
    t = 1.0
    for k in range(rounds):
        a, b = list(range(1 + 2000 * k, 601 + 2000 * k)), list(range(1001 + 2000 * k, 1601 + 2000 * k))
        for tokens, cached, tier in ((a, 0, "none"), (a + [7] * 40, 600, "ram"), (b, 0, "none"),
                                     (a + [7] * 40 + [9] * 40, 640, "ssd")):
            model = PROBE.prefill_seconds(len(tokens) - cached, cached)
            if tier == "ssd":
                model += PROBE.restore_seconds(4096 * cached)
            wait = (queued or {}).get(tier, 0.0)
            rec.record(t=t, tokens=tokens, output_tokens=0, cached_tokens=cached, cache_tier=tier,
                       ttft_s=wait + model * factors[tier], queued_s=wait)
            rec.flush(t=t + 60, restore_advisor=cal)
            t += 120
    rec.close()


def test_a_start_delayed_with_every_slot_free_is_part_of_the_tiers_ttft(tmp_path, capsys):
    """A request that arrives with the server idle waits for no slot: its recorded queue time is the server's
    own work before it starts (on the H200 an SSD hit's ~30-50 ms). The fit keeps it per tier and the replay
    adds it, so that tier's TTFT is predicted with it (before, the fitted service left it out and the replay
    had no queue: SSD p50 / p95 low by the queue's share)."""
    from mlxd.sim.ttft_fit import admission_by_tier, fit_recording

    path = tmp_path / "rec.jsonl"
    tiered_recording(path, {"none": 1.0, "ram": 1.0, "ssd": 1.0}, queued={"ssd": 0.2})
    reqs = load_recording(path).reqs
    fitted = fit_recording(reqs, PROBE, warmup=0)
    assert fitted.admission_s == {"miss": 0.0, "ram": 0.0, "ssd": pytest.approx(0.2)}
    out = tmp_path / "fit.json"
    fitted.save(out)
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(out)]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    for row in bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim):
        assert row["ratio_p50"] == pytest.approx(1.0, abs=0.01), row
        assert row["ratio_p95"] == pytest.approx(1.0, abs=0.01), row
    without = attrs.evolve(fitted, admission_s={})
    without.save(out)
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(out)]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    ssd = {r["tier"]: r for r in bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim)}["ssd"]
    assert ssd["ratio_p50"] < 0.9
    # A request that arrived while another was being served may have waited for a slot: not counted.
    busy = [attrs.evolve(r, t=reqs[0].t) if r.index == 1 else r for r in reqs[:2]]
    assert admission_by_tier(busy, {0, 1}) == {}


def test_each_tier_keeps_its_own_spread_so_its_median_is_its_own(tmp_path, capsys):
    """One formula fitted to misses and RAM hits leaves each tier off by its own factor; the fit keeps each
    tier's ratios, and a replay with it predicts every tier's p50 and p95 (the pooled spread alone does not)."""
    from mlxd.kv.cost_model import CostModel
    from mlxd.sim.ttft_fit import fit_recording

    path = tmp_path / "rec.jsonl"
    tiered_recording(path, {"none": 1.0, "ram": 1.6, "ssd": 0.7})
    fitted = fit_recording(load_recording(path).reqs, PROBE, warmup=0)
    assert set(fitted.tier_ratios) == {"miss", "ram", "ssd"}
    assert [len(v) for v in fitted.tier_ratios.values()] == [6, 3, 3]  # miss, ram, ssd (sorted)
    assert len(fitted.service_ratios) == 12
    # Saved and loaded, the per-tier ratios come back.
    out = tmp_path / "fit.json"
    fitted.save(out)
    assert CostModel.load(out) == fitted

    def replay(model: CostModel) -> list[dict]:
        model.save(out)
        capsys.readouterr()
        assert sim_main([str(path), "--format", "json", "--cost-model", str(out)]) == 0
        (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
                  if "cache_model" in r]
        assert (sim["misses"], sim["ram_hits"], sim["ssd_hits"]) == (6, 3, 3)
        return bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim)

    for row in replay(fitted):
        assert row["ratio_p50"] == pytest.approx(1.0, abs=0.01), row
        assert row["ratio_p95"] == pytest.approx(1.0, abs=0.01), row
    pooled = {r["tier"]: r for r in replay(attrs.evolve(fitted, tier_ratios={}))}
    assert abs(pooled["ram"]["ratio_p50"] - 1) > 0.1 or abs(pooled["ssd"]["ratio_p50"] - 1) > 0.1


def test_far_out_outliers_are_left_out_of_a_tiers_spread_and_counted():
    """A tier's few one-offs 4-6x its median (the H200's 15:54 RAM hits in 16-token chunks: 285-457 ms
    among 53-97 ms) are no tail the next run will have: the fit leaves them out of the spread and counts
    them; a continuous tail (a loaded CPU's) is kept, and fence 0 keeps everything."""
    from mlxd.sim.ttft_fit import far_out, fit_recording

    steady = [1.0 + 0.01 * (i % 20) for i in range(58)]
    kept, out = far_out([*steady, 4.0, 4.5, 5.0, 5.5, 6.0])
    assert sorted(out) == [4.0, 4.5, 5.0, 5.5, 6.0] and len(kept) == 58
    tail = [1.0 + 0.05 * i for i in range(40)]  # 1.0 .. 2.95, evenly
    assert far_out(tail) == (tail, [])
    assert far_out([*steady, 6.0], 0) == ([*steady, 6.0], [])
    assert far_out([1.0, 9.0, 1.0]) == ([1.0, 9.0, 1.0], [])  # too few to tell
    # A tight tier's tail (an H100's misses, 2026-12-06 10:45: a few percent around the median, 3 of 45 at
    # 1.3-1.4x): past Tukey's fence, but under 2x its median, so it stays: it is what the p95 reads.
    tight = [1.0 + 0.002 * (i % 20) for i in range(42)]
    assert far_out([*tight, 1.3, 1.35, 1.4]) == ([*tight, 1.3, 1.35, 1.4], [])
    assert far_out([*tight, 1.3, 1.35, 1.4], floor=1) == (tight, [1.3, 1.35, 1.4])  # the fence alone
    assert far_out([*tight, 1.3, 2.5], floor=2) == ([*tight, 1.3], [2.5])
    reqs = [TraceRequest(index=i, t=10.0 * i, input_length=200, output_tokens=0, cached_tokens=0, cache_tier="none",
                         ttft_s=PROBE.prefill_seconds(200) * x, queued_s=0.0)
            for i, x in enumerate([*steady, 5.0, 6.0])]
    fitted = fit_recording(reqs, PROBE, warmup=0)
    assert fitted.outliers == {"miss": 2} and len(fitted.tier_ratios["miss"]) == 58
    assert max(fitted.tier_ratios["miss"]) < 1.5 * min(fitted.tier_ratios["miss"])
    everything = fit_recording(reqs, PROBE, warmup=0, fence=0)
    assert everything.outliers == {} and len(everything.tier_ratios["miss"]) == 60
    with pytest.raises(ValueError, match="fence"):
        fit_recording(reqs, PROBE, fence=-1)


def test_a_tight_tiers_tail_under_the_floor_stays_in_its_spread_through_the_cli(tmp_path, capsys):
    """`mlxd simulate --fit-ttft-out`: misses all at the model's time but two at 1.35x are past Tukey's fence
    (an IQR of 0) yet under 2x the median: kept by default, left out with `--fit-outlier-floor 1`; a negative
    floor is a usage error."""
    from mlxd.kv.cost_model import CostModel

    path = tmp_path / "rec.jsonl"
    tiered_recording(path, {"none": 1.0, "ram": 1.0, "ssd": 1.0}, rounds=6)
    lines = path.read_text().splitlines()
    misses = [i for i, x in enumerate(lines) if '"cache_tier": "none"' in x or '"cache_tier":"none"' in x]
    for i in misses[-2:]:
        row = json.loads(lines[i])
        row["ttft_s"] *= 1.35
        lines[i] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.json"
    assert sim_main([str(path), "--fit-ttft-out", str(out)]) == 0
    kept = CostModel.load(out)
    assert "miss" not in kept.outliers and max(kept.tier_ratios["miss"]) > 1.3 * min(kept.tier_ratios["miss"])
    assert sim_main([str(path), "--fit-ttft-out", str(out), "--fit-outlier-floor", "1"]) == 0
    fence_alone = CostModel.load(out)
    assert fence_alone.outliers["miss"] == 2 and max(fence_alone.tier_ratios["miss"]) < 1.01 * min(
        fence_alone.tier_ratios["miss"])
    with pytest.raises(SystemExit):
        sim_main([str(path), "--fit-ttft-out", str(out), "--fit-outlier-floor", "-1"])


def test_ssd_hits_of_different_sizes_fit_the_restores_fixed_cost_and_bandwidth():
    """A restore costs a fixed part plus its bytes at the disk's rate (as the server's restore, and the
    advisor's model); with hits of different sizes the fit finds both, not the probe's bandwidth. Hits all of
    one size cannot tell them apart: the probe's bandwidth, the rest fixed."""
    from mlxd.sim.ttft_fit import fit_recording

    true = attrs.evolve(PROBE, restore_fixed=0.03, restore_bytes_per_s=4e8)  # the probe (PROBE) said 1e8
    reqs = [TraceRequest(index=i, t=10.0 * i, input_length=n, output_tokens=0, cached_tokens=0, cache_tier="none",
                         ttft_s=PROBE.prefill_seconds(n), queued_s=0.0) for i, n in enumerate((200, 400, 800, 300))]
    for ctx in (500, 1500, 3000, 800, 2200):
        i = len(reqs)
        reqs.append(TraceRequest(index=i, t=10.0 * i, input_length=ctx + 60, output_tokens=0, cached_tokens=ctx,
                                 cache_tier="ssd", queued_s=0.0,
                                 ttft_s=PROBE.prefill_seconds(60, ctx) + true.restore_seconds(true.kv_bytes(ctx))))
    fitted = fit_recording(reqs, PROBE, warmup=0)
    assert fitted.restore_fixed == pytest.approx(0.03, rel=0.02)
    assert fitted.restore_bytes_per_s == pytest.approx(4e8, rel=0.02)
    assert all(r == pytest.approx(1.0, abs=0.01) for r in fitted.tier_ratios["ssd"])
    same = [r for r in reqs if r.cache_tier != "ssd" or r.cached_tokens == 1500]
    same += [attrs.evolve(r, index=len(same) + k, t=10.0 * (len(same) + k)) for k, r in enumerate(same[-1:] * 2)]
    one_size = fit_recording(same, PROBE, warmup=0)
    assert one_size.restore_bytes_per_s == PROBE.restore_bytes_per_s
    (ratio,) = set(one_size.tier_ratios["ssd"])  # what the tier's spread corrects a replay by
    predicted = ratio * (one_size.prefill_seconds(60, 1500) + one_size.restore_seconds(true.kv_bytes(1500)))
    assert predicted == pytest.approx(same[-1].ttft_s, rel=0.002)


def test_a_tier_with_few_requests_takes_the_pooled_spread():
    from mlxd.sim.ttft_fit import MIN_TIER_REQUESTS, fit_recording

    reqs = [TraceRequest(index=i, t=float(i), input_length=n, output_tokens=0, cached_tokens=0, cache_tier="none",
                         ttft_s=PROBE.prefill_seconds(n), queued_s=0.0) for i, n in enumerate((200, 400, 800, 300))]
    reqs.append(TraceRequest(index=4, t=4.0, input_length=660, output_tokens=0, cached_tokens=600, cache_tier="ram",
                             ttft_s=2 * PROBE.prefill_seconds(60, 600), queued_s=0.0))
    fitted = fit_recording(reqs, PROBE, warmup=0)
    assert MIN_TIER_REQUESTS > 1 and set(fitted.tier_ratios) == {"miss"}
    assert len(fitted.service_ratios) == 5


def test_the_first_request_is_left_out_of_the_fit_as_warm_up(tmp_path, capsys):
    from mlxd.kv.cost_model import CostModel
    from mlxd.sim.ttft_fit import fit_recording

    path = tmp_path / "rec.jsonl"
    tiered_recording(path, {"none": 1.0, "ram": 1.0, "ssd": 1.0}, rounds=2)
    lines = path.read_text().splitlines()
    first = next(i for i, x in enumerate(lines) if '"ttft_s"' in x)
    slow = json.loads(lines[first])
    slow["ttft_s"] *= 20  # the first request after a start: one-off costs
    lines[first] = json.dumps(slow)
    path.write_text("\n".join(lines) + "\n")
    reqs = load_recording(path).reqs
    skipped, without = fit_recording(reqs, PROBE).to_json(), fit_recording(reqs[1:], PROBE, warmup=0).to_json()
    assert skipped == {k: pytest.approx(v, rel=1e-9) if isinstance(v, float) else v for k, v in without.items()}
    assert all(r == pytest.approx(1.0, abs=0.01) for r in fit_recording(reqs, PROBE).service_ratios)
    assert max(fit_recording(reqs, PROBE, warmup=0).service_ratios) > 5
    with pytest.raises(ValueError, match="warmup"):
        fit_recording(reqs, PROBE, warmup=-1)
    # Through the CLI: --fit-warmup 0 keeps it.
    for flags, want in (([], fit_recording(reqs, PROBE)), (["--fit-warmup", "0"], fit_recording(reqs, PROBE, warmup=0))):
        out = tmp_path / "fit.json"
        assert sim_main([str(path), "--fit-ttft-out", str(out), *flags]) == 0
        assert CostModel.load(out) == want
    with pytest.raises(SystemExit):
        sim_main([str(path), "--fit-ttft-out", str(out), "--fit-warmup", "-1"])


def test_each_tiers_first_use_is_left_out_of_the_fit_and_of_both_sides_percentiles(tmp_path, capsys):
    """--ttft-warmup N: each tier's first N requests pay one-off costs (a shape's first compile, the first
    restore); they are replayed (the cache state) but left out of the fit and of the recorded and the
    predicted percentiles alike."""
    from mlxd.sim.ttft_fit import fit_recording, tier_warmup_indices

    path = tmp_path / "rec.jsonl"
    tiered_recording(path, {"none": 1.0, "ram": 1.3, "ssd": 0.8}, rounds=4)
    lines = path.read_text().splitlines()
    seen: set[str] = set()
    for i, line in enumerate(lines):
        r = json.loads(line)
        if "ttft_s" in r and r["cache_tier"] not in seen:  # each tier's first request: 20x slower
            seen.add(r["cache_tier"])
            r["ttft_s"] *= 20
            lines[i] = json.dumps(r)
    path.write_text("\n".join(lines) + "\n")
    reqs = load_recording(path).reqs
    assert tier_warmup_indices(reqs, 1) == {0, 1, 3}  # miss, RAM hit, SSD hit (the second miss is index 2)
    assert tier_warmup_indices(reqs, 0) == set()
    fitted = fit_recording(reqs, PROBE, warmup=0, tier_warmup=1)
    assert max(fitted.service_ratios) < 1.5
    out = tmp_path / "fit.json"
    assert sim_main([str(path), "--fit-ttft-out", str(out), "--ttft-warmup", "1"]) == 0
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(out), "--ttft-warmup", "1"]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    recorded = bench_sim_ttft.recorded_percentiles(path, 1)
    assert {t: v["n"] for t, v in recorded.items()} == {"miss": 7, "ram": 3, "ssd": 3}
    for row in bench_sim_ttft.compare(recorded, sim, 1):
        assert row["recorded_n"] == row["predicted_n"]
        assert row["ratio_p50"] == pytest.approx(1.0, abs=0.02), row
        assert row["ratio_p95"] == pytest.approx(1.0, abs=0.02), row
    with pytest.raises(SystemExit):
        sim_main([str(path), "--ttft-warmup", "-1"])


def test_with_a_cost_model_the_replay_still_decides_as_the_recorded_server(tmp_path, capsys):
    """--cost-model times the requests; restore-or-recompute is the recorded server's (its probe model and
    its calibration at each flush), so a model whose restores look hopeless still replays the SSD hit."""
    path = tmp_path / "rec.jsonl"
    model_recording(path)
    slow = tmp_path / "slow.json"
    attrs.evolve(PROBE, restore_fixed=1e3, restore_bytes_per_s=1.0).save(slow)
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(slow)]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    assert (sim["misses"], sim["ram_hits"], sim["ssd_hits"]) == (2, 1, 1)


def test_the_benchmark_records_fits_and_writes_its_json(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """bench_sim_ttft end to end on the tiny model (--model): warm-up, two recorded runs, the fit and both
    replays in the JSON; a stage that fails still writes it, with the error."""
    monkeypatch.setattr(bench_sim_ttft, "RESULTS", tmp_path / "results")
    small = ["--model", str(tiny_model_dir), "--conversations", "3", "--turns", "2", "--first", "96", "--new", "16",
             "--max-tokens", "2", "--probe-s", "0.2", "--restore-choice", "always", "--label", "t"]
    out = bench_sim_ttft.main(small)
    assert out is not None and out.name.startswith("sim_ttft-t-")
    result = json.loads(out.read_text())
    warmup = result["live"]["warmup"]
    assert warmup["kv_bytes_per_token"] > 0 and len(warmup["turns"]) == 4  # first prompt, a turn, restored, a turn
    assert warmup["restore_decisions"]["restores_chosen"] == 1
    assert [result["live"][k]["requests"] for k in ("calibration", "predicted")] == [12, 12]
    assert result["live"]["calibration"]["interleaved"]  # both runs at once, taking turns (the same load)
    assert result["live"]["calibration"]["gc_frozen"]["frozen"] > 0  # the heap frozen, as `mlxd serve` freezes it
    one_after = json.loads(bench_sim_ttft.main([*small, "--no-interleave", "--wave", "2", "--label", "s",
                                                "--no-gc-freeze"]).read_text())
    assert [one_after["live"][k]["requests"] for k in ("calibration", "predicted")] == [12, 12]
    assert one_after["live"]["predicted"]["gc_frozen"] is None and gc.get_freeze_count() == 0  # thawed after either
    assert not one_after["live"]["predicted"]["interleaved"]
    assert set(result["traces"]) == {"calibration", "predicted"}
    assert {r["tier"] for r in result["rows"]["fit"]} >= {"miss", "ram"}
    assert "tier_ratios" in result["fitted_cost_model"] and "error" not in result
    # Each tier's first request is left out of both runs' percentiles (--ttft-warmup 1, the default), the
    # fit also replays its own run, and the error sits beside the live noise: drift and the bootstrap interval.
    assert result["args"]["ttft_warmup"] == 1 and set(result["rows"]) == {"probe", "fit", "fit_own"}
    assert result["recorded"]["predicted"]["miss"]["n"] == 2  # 3 first prompts, the first left out
    assert {r["tier"] for r in result["noise"]} == {r["tier"] for r in result["rows"]["fit"]}
    for row in result["noise"]:
        lo, hi = row["interval_p50"]
        assert lo <= 1.0 <= hi
        for p in ("p50", "p95"):  # the p95 is checked only where its live drift is within +-10% itself
            assert row[f"{p}_checkable"] == (row[f"drift_{p}"] is not None and abs(row[f"drift_{p}"] - 1) <= 0.1)
        assert row["p50_verdict"] in ("ok", "miss")
        assert row["p95_verdict"] in (("ok", "miss") if row["p95_checkable"] else ("below noise",))
    said = bench_sim_ttft.noise_table(bench_sim_ttft.noise(
        [{"tier": "ram", "recorded_n": 63, "ratio_p50": 1.06, "ratio_p95": 3.15},
         {"tier": "miss", "recorded_n": 31, "ratio_p50": 0.89, "ratio_p95": 1.05}],
        {"ram": {"p50": 0.94, "p95": 0.31}, "miss": {"p50": 1.11, "p95": 1.03}}, {}))
    assert "p50 1.06 ok" in said and "live drift p95 0.31: the check is below the system's own noise" in said
    assert "p50 0.89 MISS (live drift p50 1.11)" in said and "p95 1.05 ok" in said
    parts = result["parts"]["predicted"]
    assert parts["ram"]["lookup"] > 0 and parts["ram"]["fetch"] == 0 and parts["ram"]["engine"] > 0
    assert "ssd" not in parts or parts["ssd"]["fetch"] > 0
    assert set(result["drift"]) == {r["tier"] for r in result["rows"]["fit"]} & set(result["recorded"]["calibration"])
    assert bench_sim_ttft.drift({"miss": {"p50": 2.0, "p95": 4.0}}, {"miss": {"p50": 1.0, "p95": 6.0}, "ram": {
        "p50": 1.0, "p95": 1.0}}) == {"miss": {"p50": 0.5, "p95": 1.5}}

    empty = tmp_path / "empty.jsonl"  # a recording with nothing measured: the fit fails
    empty.write_text(result["traces"]["predicted"][0] + "\n")
    with pytest.raises(ValueError, match="no measured TTFT"):
        bench_sim_ttft.main([*small, "--trace", str(empty), "--calibration-trace", str(empty), "--label", "e"])
    (failed,) = (tmp_path / "results").glob("sim_ttft-e-*.json")
    assert "error" in json.loads(failed.read_text())
    with pytest.raises(SystemExit):
        bench_sim_ttft.parse_args(["--model", str(tmp_path)])  # no config.json there
    # --prefill-slice-ms reaches the runtimes (0 = whole prefill steps: a diagnostic of the slicer's shapes)
    whole = bench_sim_ttft.parse_args([*small, "--prefill-slice-ms", "0"])
    assert bench_sim_ttft.runtime_config(whole, tmp_path).prefill_slice_s == 0
    assert bench_sim_ttft.runtime_config(bench_sim_ttft.parse_args(small), tmp_path).prefill_slice_s > 0


def test_rows_served_together_have_their_shared_time_divided_out(tmp_path, capsys):
    """A request's TTFT past its queue is its own work only when it ran alone: while k requests are between
    admission and first token, each gets 1/k of the engine (as a replay of a recorded server models it)."""
    from mlxd.sim.ttft_fit import fit_recording, own_service

    def req(i: int, t: float, ttft: float, queued: float = 0.0) -> TraceRequest:
        return TraceRequest(index=i, t=t, input_length=100, output_tokens=0, cached_tokens=0, cache_tier="none",
                            ttft_s=ttft, queued_s=queued)

    # together for 2 s: 1 s each; A alone for 1 s then 2 s with B: 2 s, B 1 s; C's queue is not service
    assert own_service([req(0, 0.0, 2.0), req(1, 0.0, 2.0)]) == {0: pytest.approx(1.0), 1: pytest.approx(1.0)}
    assert own_service([req(0, 0.0, 3.0), req(1, 1.0, 2.0), req(2, 10.0, 1.5, queued=0.5)]) == {
        0: pytest.approx(2.0), 1: pytest.approx(1.0), 2: pytest.approx(1.0)}

    # Pairs of misses that arrive together, timed as one shared engine serves them: the fit recovers the
    # model, and a replay (prefill sharing on for a recorded server) predicts their TTFTs.
    true = attrs.evolve(PROBE, prefill_fixed=0.08, prefill_per_token=3e-3, prefill_per_pair=2e-6)
    path = tmp_path / "rec.jsonl"
    rec = TraceRecorder(path)
    rec.server(model="m", kv_bytes_per_token=4096, prompt_cache_bytes=1 << 30, retention="lru",
               snapshot_min_tokens=16, max_batch=4, ssd=False, restore_advisor_base=attrs.asdict(PROBE))
    first = 1
    for k, (n1, n2) in enumerate(((200, 400), (300, 800), (500, 600), (250, 700))):
        p1, p2 = true.prefill_seconds(n1), true.prefill_seconds(n2)
        for n, ttft in ((n1, 2 * p1), (n2, p1 + p2)):
            rec.record(t=100.0 * k, tokens=list(range(first, first + n)), output_tokens=0, cache_tier="none",
                       cached_tokens=0, ttft_s=ttft, queued_s=0.0)
            first += n
    rec.close()
    fitted = fit_recording(load_recording(path).reqs, PROBE, warmup=0)
    assert all(r == pytest.approx(1.0, abs=0.01) for r in fitted.service_ratios)
    for n in (200, 500, 800):
        assert fitted.prefill_seconds(n) == pytest.approx(true.prefill_seconds(n), rel=0.01)
    out = tmp_path / "fit.json"
    fitted.save(out)
    capsys.readouterr()
    assert sim_main([str(path), "--format", "json", "--cost-model", str(out)]) == 0
    (sim,) = [r for r in (json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
              if "cache_model" in r]
    (row,) = bench_sim_ttft.compare(bench_sim_ttft.recorded_percentiles(path), sim)
    assert row["ratio_p50"] == pytest.approx(1.0, abs=0.02) and row["ratio_p95"] == pytest.approx(1.0, abs=0.02)
