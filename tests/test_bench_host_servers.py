"""The servers bench (benchmarks/gpu/bench_host_tier_servers.py, issue 28): each SSD server's tier capped (`_ssd_caps`:
two runs of several SSD servers on the H100's 64 GiB disk ran it out of space, 2026-12-06 10:25), and the decode
rounds' median-stream and client metrics, read from runs recorded before they were ones."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"),
                str(Path(__file__).resolve().parents[1] / "benchmarks")]
from bench_host_tier_servers import (  # noqa: E402
    _ssd_caps,
    by_metric,
    client_sum,
    counts_beside,
    failing_servers,
    first_error,
    median_stream,
    shared_budget_gb,
    writer_summary,
)


def commands() -> dict[str, tuple[list[str], int]]:
    return {"mlx_lm": (["mlx_lm", "server"], 1), "ram": (["mlxd", "serve"], 2),
            "ssd": (["mlxd", "serve", "--ssd-cache", "/x/ssd"], 3),
            "ssd2": (["mlxd", "serve", "--ssd-cache", "/x/ssd-2"], 4)}


def test_the_ssd_servers_share_half_the_free_space(tmp_path):
    cmds = commands()
    cap = _ssd_caps(cmds, ["mlx_lm", "ram", "ssd", "ssd2"], argparse.Namespace(ssd_cap_gb=None, work=tmp_path))
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    assert cap == max(4.0, round(free_gb / 4, 1))
    assert cmds["ssd"][0][-2:] == ["--ssd-cache-max", f"{cap:g}"] == cmds["ssd2"][0][-2:]
    assert "--ssd-cache-max" not in cmds["ram"][0] + cmds["mlx_lm"][0]


def test_a_given_cap_and_zero_for_none(tmp_path):
    cmds = commands()
    assert _ssd_caps(cmds, ["ssd"], argparse.Namespace(ssd_cap_gb=2.5, work=tmp_path)) == 2.5
    assert cmds["ssd"][0][-2:] == ["--ssd-cache-max", "2.5"] and "--ssd-cache-max" not in cmds["ssd2"][0]
    cmds = commands()
    assert _ssd_caps(cmds, ["ssd", "ssd2"], argparse.Namespace(ssd_cap_gb=0, work=tmp_path)) is None
    assert all("--ssd-cache-max" not in cmd for cmd, _ in cmds.values())


def decode_run(rnd: int, slot: str, rates: list[float], at: int) -> dict:
    return {"round": rnd, "streams": 8, "at": at, "slot": slot, "per_stream_tok_s": rates,
            "stream_sum_tok_s": sum(rates)}


def test_the_median_stream_is_a_batched_rows_rate_and_old_runs_read_it_too():
    """mlx_lm.server admits 7 rows, then the 8th alone ~1 s later at 1.2-2x their rate: the sum of the streams'
    rates credits that lone row, the median stream does not. Runs without the key are read from their rates."""
    staggered, together = [100.0] * 7 + [170.0], [105.0] * 8
    assert median_stream({"per_stream_tok_s": staggered}) == 100.0
    assert median_stream({"per_stream_tok_s": []}) is None
    runs = []
    for r in range(3):
        runs += [decode_run(r, "mlx_lm", staggered, 0), decode_run(r, "mlxd", together, 1)]
    medians = by_metric({"runs": runs, "reference": "mlx_lm", "schedule": "interleaved"})["8"]["mlxd"]
    assert medians["stream_sum_tok_s"] == round(840 / 870, 4)  # below mlx_lm's: its lone row's rate counts
    assert medians["median_stream_tok_s"] == 1.05  # a batched row 5% faster


def test_the_client_sum_counts_each_streams_wait_for_its_first_token():
    """mlx_lm.server's 8th stream waits ~1 s for the seven to end, then runs alone at a higher rate: the stream sum
    credits that rate, the client sum divides its tokens by its whole wait. Runs without `ttft_ms` (recorded before
    it) are read from the run's first token."""
    waited = {"tokens": [64] * 8, "ttft_ms": [20.0] * 7 + [1020.0], "first_ms": [0.0] * 7 + [1000.0],
              "last_ms": [640.0] * 7 + [1400.0]}
    together = {"tokens": [64] * 8, "ttft_ms": [20.0] * 8, "first_ms": [0.0] * 8, "last_ms": [680.0] * 8}
    assert client_sum(waited) == pytest.approx(7 * 64 / 0.660 + 64 / 1.420)
    assert client_sum(together) == pytest.approx(8 * 64 / 0.700)
    assert client_sum(together) > client_sum(waited)  # eight together 40 ms slower a token beat seven and a late one
    old = {k: v for k, v in waited.items() if k != "ttft_ms"}
    assert client_sum(old) == pytest.approx(7 * 64 / 0.640 + 64 / 1.400)
    assert client_sum({"tokens": [], "first_ms": [], "last_ms": []}) is None
    runs = []
    for r in range(3):
        runs += [{**decode_run(r, "mlx_lm", [98.0] * 7 + [160.0], 0), **waited},
                 {**decode_run(r, "mlxd", [92.0] * 8, 1), **together}]
    medians = by_metric({"runs": runs, "reference": "mlx_lm", "schedule": "interleaved"})["8"]["mlxd"]
    assert medians["stream_sum_tok_s"] < 1.0 < medians["client_sum_tok_s"]


def test_a_server_log_is_kept_from_its_first_error():
    # The H100 at 09:30 2026-12-07: the logs' tails held only the last of hundreds of failed steps.
    log = "\n".join(['{"event": "serve.ready", "level": "info"}',
                     '{"event": "engine.step_failed", "level": "error", "exception": "out of memory"}',
                     '{"event": "engine.step_failed", "level": "error", "exception": "illegal memory access"}'])
    first = first_error(log)
    assert first is not None and first.startswith('{"event": "engine.step_failed"') and "out of memory" in first
    plain = "starting\nTraceback (most recent call last):\n  File x\nRuntimeError: boom\n"
    assert first_error(plain) == plain[len("starting\n"):]
    assert first_error('{"event": "serve.ready", "level": "info"}\n') is None


def test_no_shared_budget_on_the_cpu_or_for_one_server():
    args = argparse.Namespace(small=False, no_share=False)
    assert shared_budget_gb(3, args) is None  # this machine's MLX runs on its CPU: nothing to share
    assert shared_budget_gb(1, args) is None


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_decode_rounds_stop_once_a_server_failed_two_rounds_through():
    # The H100 at 09:30 2026-12-07: mlx_lm.server's generation thread died in round 1; 38 rounds of 404s followed.
    runs = json.loads((RESULTS / "host_servers-h100-decodeil-20261207-093031.json").read_text())["decode_interleaved"]["runs"]
    assert failing_servers(runs, 0) == [] and failing_servers(runs, 2) == []  # its 1-stream runs of round 1 went
    assert failing_servers(runs, 3) == ["mlx_lm"]  # every run of rounds 2 and 3: the rounds stop there (not at 40)
    assert failing_servers(runs, 14) == ["mlx_lm", "mlxd_host_ssd", "mlxd_ram"]  # the mlxd servers' device lost
    healthy = json.loads((RESULTS / "host_servers-h100-decodeil-20261207-043441.json").read_text())
    rounds = healthy["decode_interleaved"]["rounds_done"]
    assert all(failing_servers(healthy["decode_interleaved"]["runs"], r) == [] for r in range(rounds))


def test_the_writers_work_beside_a_decode_counts_an_urgency_first_on_inside_it():
    """`counts_beside`: each counter's gain over the decode; an urgency reason that first came on inside it
    (no reading before) counts from zero, any other counter missing before is left out."""
    before = {"bytes_out": 10, "prefill_bytes_out": 0, "urgent_s.flush": 1.5}
    after = {"bytes_out": 30, "prefill_bytes_out": 4, "urgent_s.flush": 1.5, "urgent_s.backlog": 0.25, "new": 3}
    assert counts_beside(before, after) == {"bytes_out": 20, "prefill_bytes_out": 4, "urgent_s.flush": 0.0,
                                            "urgent_s.backlog": 0.25}
    assert counts_beside(None, after) is None


def test_the_writers_summary_per_slot_in_mb_with_its_urgency():
    runs = [{"streams": 8, "slot": "mlxd_host_ssd", "writer_beside": {"bytes_out": 3e8, "held_s": 0.0,
                                                                      "urgent_s.backlog": 0.5}},
            {"streams": 8, "slot": "mlxd_host_ssd", "writer_beside": {"bytes_out": 1e8, "held_s": 0.2}},
            {"streams": 8, "slot": "mlxd_host_ssd", "writer_beside": {"bytes_out": 2e8, "held_s": 0.1}},
            {"streams": 8, "slot": "mlxd_ram", "writer_beside": None}, {"streams": 8, "slot": "mlx_lm"}]
    assert writer_summary(runs) == {"8": {"mlxd_host_ssd": {"mb_out": [200.0, 100.0, 300.0],
                                                            "held_s": [0.1, 0.0, 0.2],
                                                            "urgent_s.backlog": [0.5, 0.5, 0.5]}}}
