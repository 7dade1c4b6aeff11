"""benchmarks/bench_final_plan.py runs on the CPU with every MLXD_FINAL_PLAN arm (packed too) and reports each
arm paired with the first (the GPU run is `wave3.sh finalplan`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_final_plan.py"


def test_the_bench_runs_every_arm_and_pairs_them_with_the_first(tmp_path):
    arms = ["with-token", "after-token", "after-forward", "after-forward:1", "after-forward@ram",
            "after-forward@ram+mlxfilter", "after-forward+planmain+mlxfilter", "after-forward+hostread"]
    subprocess.run([sys.executable, str(BENCH), "--preset", "test", "--rows", "3", "--prompt", "24", "--tokens", "6",
                    "--rounds", "2", "--ssd", "--arms", ",".join(arms), "--work", str(tmp_path / "work"),
                    "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, check=True)
    [path] = tmp_path.glob("final_plan-tiers-*.json")  # SSD arms and one RAM-only arm
    out = json.loads(path.read_text())
    assert list(out["arms"]) == arms
    for arm in arms:
        runs = out["arms"][arm]["runs"]
        assert len(runs) == 2
        # 3 rows ending over 2 steps: 6, 7 and 6 new tokens, every one handed out
        assert all(r["tokens"] == 19 and r["own_tok_s"] > 0 and r["last_finish_s"] >= r["decode_span_s"] for r in runs)
        assert ("own_vs_with-token" in out["arms"][arm]) == (arm != "with-token")
        # the ending steps taken apart: one time in mlx-lm's next and one leave time per ending step (0 in a late
        # mode's last step, which has no row left to step); the rows' final checkpoints took time to leave
        for r in runs:
            assert len(r["end_next_ms"]) == len(r["end_leave_ms"]) == len(r["end_steps_ms"]) > 0
            assert r["end_next_ms"][0] > 0 and r["end_leave_total_ms"] > 0 and r["median_next_ms"] > 0
