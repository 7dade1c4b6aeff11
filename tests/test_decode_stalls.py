"""The servers bench's stall read-out (benchmarks/gpu/bench_host_tier_servers.py, issue 28): where in a decode each
stream lost time, from the times its tokens arrived, and the per-slot summary the decode rounds log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))

from bench_host_tier_servers import TIMING_KEYS, stalls, stream_timing  # noqa: E402

STEP = 0.009  # s a token, every row


def streams_with_a_stall(*, stall_s: float, after_step: int, late: int = 2, rows: int = 8, tokens: int = 64):
    """Token arrival times of `rows` streams decoding together, the last `late` of them a step behind, every
    step after `after_step` delayed by `stall_s` (one stall of the engine)."""
    out = []
    for j in range(rows):
        first = STEP if j >= rows - late else 0.0
        times = [first + i * STEP for i in range(tokens)]
        out.append([t + (stall_s if t > after_step * STEP + 1e-9 else 0.0) for t in times])
    return out


def test_a_stall_right_after_the_first_tokens_shows_in_the_early_streams_only():
    streams = streams_with_a_stall(stall_s=0.040, after_step=0)
    timing = stream_timing(streams)
    assert timing["first_ms"] == [0.0] * 6 + [pytest.approx(49.0)] * 2  # the late rows' first token after it
    for gaps in timing["slow_gaps"][:6]:
        assert gaps == [[1, pytest.approx(49.0)]]  # the gap before each early stream's 2nd token
    assert timing["slow_gaps"][6:] == [[], []]
    assert timing["last_ms"][0] == pytest.approx((63 * STEP + 0.040) * 1e3, abs=0.1)


def test_each_streams_first_token_after_the_first_request_went_out():
    streams = streams_with_a_stall(stall_s=0.040, after_step=0)
    assert "ttft_ms" not in stream_timing(streams)  # (runs recorded before it)
    timing = stream_timing(streams, sent=-0.025)  # the first request went out 25 ms before the first token
    assert timing["ttft_ms"] == [pytest.approx(25.0)] * 6 + [pytest.approx(74.0)] * 2
    assert timing["first_ms"] == stream_timing(streams)["first_ms"]
    assert set(timing) == set(TIMING_KEYS)  # every one kept in a decode run's record (decode_interleaved)


def test_the_summary_reads_a_start_stall_apart_from_an_end_stall():
    runs = []
    for r, (name, after) in enumerate([("start", 0), ("end", 62)]):
        d = {"streams": 8, "slot": name, "round": r, "tok_s": 1.0}
        streams = streams_with_a_stall(stall_s=0.040, after_step=after)
        per = [(len(t) - 1) / (t[-1] - t[0]) for t in streams]
        start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
        inside = sum(sum(start <= x <= end for x in t) for t in streams)
        d.update(stream_sum_tok_s=sum(per), all_rows_tok_s=(inside - 8) / (end - start),
                 **stream_timing(streams, sent=-0.010 if name == "start" else None))
        runs.append(d)
    runs.append({"streams": 8, "slot": "start", "round": 2, "tok_s": None})  # a failed run counts nowhere
    out = stalls(runs)["8"]
    assert out["start"]["runs"] == 1 and out["end"]["runs"] == 1
    # a stall before the late rows' first token: the streams' own rates lose it, the all-rows window does not
    assert out["start"]["own_over_all_rows"] < 0.97
    # at the end every stream and the window both wait: the two rates agree
    assert out["end"]["own_over_all_rows"] == pytest.approx(1.0, abs=0.02)
    assert out["start"]["at_token"] == {"1": 6} and out["start"]["slow_ms_per_run"] == pytest.approx(6 * 49.0)
    assert set(out["end"]["at_token"]) == {"62", "63"}
    # times to first token where the run recorded when its requests went out: the median stream's, the slowest's
    assert out["start"]["ttft_ms"] == pytest.approx(10.0) and out["start"]["last_ttft_ms"] == pytest.approx(59.0)
    assert "ttft_ms" not in out["end"]


def test_a_run_without_token_times_still_gives_its_rate_ratio():
    out = stalls([{"streams": 1, "slot": "mlx_lm", "round": 0, "tok_s": 5.0, "stream_sum_tok_s": 5.0,
                   "all_rows_tok_s": 5.0}])
    assert out == {"1": {"mlx_lm": {"runs": 1, "own_over_all_rows": 1.0}}}


def test_a_server_whose_rows_never_all_ran_together_has_no_all_rows_ratio():
    # mlx_lm.server at 8 streams of 64 tokens: its first stream ends before its last one starts
    out = stalls([{"streams": 8, "slot": "mlx_lm", "round": 0, "tok_s": 900.0, "stream_sum_tok_s": 900.0,
                   "all_rows_tok_s": None}])
    assert out == {"8": {"mlx_lm": {"runs": 1, "own_over_all_rows": None}}}
