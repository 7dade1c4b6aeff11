"""benchmarks/probe_side_stream_eval.py runs on the CPU and reports both arms (the GPU run is `wave3.sh sidestream`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_side_stream_eval.py"


def test_the_probe_times_a_copy_on_the_same_stream_and_on_a_side_one():
    out = subprocess.run([sys.executable, str(PROBE), "--size", "64", "--matmuls", "2", "--rounds", "2"],
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    rows = [json.loads(line) for line in out[:-1]]
    assert [(r["round"], r["arm"]) for r in rows] == [(0, "same"), (0, "side"), (1, "same"), (1, "side")]
    assert all(r["copy_waited_ms"] >= 0 and r["forward_done_ms"] >= r["copy_waited_ms"] for r in rows)
    summary = json.loads(out[-1])
    assert len(summary["same"]) == len(summary["side"]) == 2
