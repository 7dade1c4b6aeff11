"""The servers bench's interleaved decode schedule (benchmarks/gpu/interleave.py, issue 28): which runs a
round makes in which order, and the per-round ratios, medians, IQRs and control it reports."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))

import interleave  # noqa: E402
from interleave import Run  # noqa: E402

SERVERS = ["mlx_lm", "mlxd_ram", "mlxd_host_ssd"]


def test_interleaved_visits_every_server_and_the_control_once_a_round_in_every_position():
    rounds = [interleave.slots(SERVERS, "mlx_lm", r, "interleaved") for r in range(4)]
    for order in rounds:
        assert sorted(order) == sorted([*SERVERS, "mlx_lm~"])
    assert rounds[0] == ["mlx_lm", "mlxd_ram", "mlx_lm~", "mlxd_host_ssd"]
    # over as many rounds as slots, each slot takes each position once: no one always goes first
    for at in range(4):
        assert sorted(order[at] for order in rounds) == sorted([*SERVERS, "mlx_lm~"])
    assert interleave.slots(SERVERS, "mlx_lm", 4, "interleaved") == rounds[0]


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_every_slot_follows_every_other_equally_often_over_a_cycle(n):
    # a plain rotation kept mlx_lm~ right after mlxd_host_ssd in every round (H200, 21:07)
    rows = interleave.williams(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:], strict=False))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) == 1
    for at in range(n):
        assert Counter(row[at] for row in rows) == {i: len(rows) // n for i in range(n)}


def test_bracket_puts_every_arm_between_two_reference_runs():
    for r in range(3):
        order = interleave.slots(SERVERS, "mlx_lm", r, "bracket")
        assert order[0::2] == ["mlx_lm"] * 4
        assert sorted(order[1::2]) == ["mlx_lm~", "mlxd_host_ssd", "mlxd_ram"]
    assert interleave.slots(SERVERS, "mlx_lm", 1, "bracket")[1] == "mlxd_host_ssd"  # rotated


def test_a_bad_schedule_or_reference_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        interleave.slots(SERVERS, "mlx_lm", 0, "serial")
    with pytest.raises(ValueError, match="reference"):
        interleave.slots(["mlxd_ram"], "mlx_lm", 0, "interleaved")


def _runs(rates: list[dict[str, float | None]], streams: int = 8, mode: str = "interleaved") -> list[Run]:
    """Runs in the schedule's order, each slot's tok/s from `rates[round]`."""
    out = []
    for r, got in enumerate(rates):
        for at, slot in enumerate(interleave.slots(SERVERS, "mlx_lm", r, mode)):
            out.append(Run(r, streams, at, slot, got[slot]))
    return out


def test_ratios_are_paired_within_the_round_so_a_drift_between_rounds_cancels():
    # the host slows by half from round to round; the SSD server is always 0.9x mlx_lm, RAM 1.1x
    rates = [{"mlx_lm": 600 * 0.5**r, "mlx_lm~": 600 * 0.5**r, "mlxd_ram": 660 * 0.5**r,
              "mlxd_host_ssd": 540 * 0.5**r} for r in range(5)]
    s = interleave.summarize(_runs(rates), "mlx_lm", "interleaved")
    level = s["levels"]["8"]
    assert level["rounds"] == 5
    table = level["ratio_to_mlx_lm"]
    assert table["mlxd_host_ssd"]["median"] == pytest.approx(0.9)
    assert table["mlxd_host_ssd"]["iqr"] == pytest.approx([0.9, 0.9])
    assert table["mlxd_ram"]["values"] == pytest.approx([1.1] * 5)
    assert table["mlx_lm~"]["median"] == pytest.approx(1.0)  # the control
    assert table["mlxd_host_ssd"]["vs_control"]["median"] == pytest.approx(0.9)
    assert "mlx_lm" not in table
    assert level["tok_s"]["mlx_lm"] == pytest.approx(600 * 0.5**2)  # the median round's
    assert interleave.ratio_of(s, 8, "mlxd_host_ssd") == pytest.approx(0.9)
    assert interleave.ratio_of(s, "8", "mlxd_host_ssd", "mlxd_ram") == pytest.approx(0.9 / 1.1, abs=1e-3)  # of rounded ratios


def test_median_and_iqr_of_noisy_rounds_and_a_failed_run_left_out():
    ssd = [0.8, 1.2, 1.0, None, 0.9, 1.1]
    rates = [{"mlx_lm": 100.0, "mlx_lm~": 100.0, "mlxd_ram": 100.0,
              "mlxd_host_ssd": None if x is None else 100 * x} for x in ssd]
    entry = interleave.summarize(_runs(rates, streams=1), "mlx_lm", "interleaved")["levels"]["1"][
        "ratio_to_mlx_lm"]["mlxd_host_ssd"]
    assert entry["n"] == 5
    assert entry["median"] == pytest.approx(1.0)
    assert entry["iqr"] == pytest.approx([0.9, 1.1])
    assert entry["values"] == [0.8, 1.2, 1.0, None, 0.9, 1.1]


def test_a_failed_reference_run_gives_that_round_no_ratio():
    rates = [{"mlx_lm": 100.0, "mlx_lm~": 100.0, "mlxd_ram": 90.0, "mlxd_host_ssd": 95.0},
             {"mlx_lm": None, "mlx_lm~": 100.0, "mlxd_ram": 90.0, "mlxd_host_ssd": 95.0}]
    table = interleave.summarize(_runs(rates), "mlx_lm", "interleaved")["levels"]["8"]["ratio_to_mlx_lm"]
    assert table["mlxd_ram"]["values"] == [0.9, None]
    assert table["mlx_lm~"]["values"] == [1.0, None]


def test_bracket_ratio_is_to_the_mean_of_the_reference_runs_either_side():
    # a linear drift inside the round: the reference runs at 100, 110, 120, 130; each arm sits between two
    runs = []
    for r in range(2):
        order = interleave.slots(SERVERS, "mlx_lm", r, "bracket")
        ref_rates = iter([100.0, 110.0, 120.0, 130.0])
        for at, slot in enumerate(order):
            if slot == "mlx_lm":
                tok = next(ref_rates)
            else:  # the arm's true speed is its ratio x the drifting host's speed at its position
                speed = 100.0 + 5.0 * at
                tok = speed * {"mlxd_ram": 1.0, "mlxd_host_ssd": 0.8, "mlx_lm~": 1.0}[slot]
            runs.append(Run(r, 1, at, slot, tok))
    table = interleave.summarize(runs, "mlx_lm", "bracket")["levels"]["1"]["ratio_to_mlx_lm"]
    assert table["mlxd_host_ssd"]["values"] == pytest.approx([0.8, 0.8])
    assert table["mlxd_ram"]["values"] == pytest.approx([1.0, 1.0])
    assert table["mlx_lm~"]["median"] == pytest.approx(1.0)


def test_levels_are_kept_apart_and_the_schedule_counts_each_slot_once_per_round():
    rates = [{"mlx_lm": 100.0, "mlx_lm~": 100.0, "mlxd_ram": 100.0, "mlxd_host_ssd": 100.0}] * 3
    runs = _runs(rates, streams=1) + _runs([{k: 2 * v for k, v in x.items()} for x in rates], streams=8)
    s = interleave.summarize(runs, "mlx_lm", "interleaved")
    assert set(s["levels"]) == {"1", "8"}
    assert s["levels"]["8"]["tok_s"]["mlxd_ram"] == 200.0
    assert Counter(r.slot for r in runs if r.streams == 1) == {slot: 3 for slot in [*SERVERS, "mlx_lm~"]}
