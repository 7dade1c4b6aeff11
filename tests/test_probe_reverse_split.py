"""benchmarks/gpu/probe_reverse_split.py on the CPU: a prefix's head recomputed while its tail's KV is read from
its own file on a thread, the two joined into one cache, answer the suffix as recomputing the whole prefix does
(the GPU run is `wave3.sh revsplit`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "probe_reverse_split.py"


def test_the_joined_cache_answers_as_the_recomputed_one(tmp_path):
    run = subprocess.run([sys.executable, str(PROBE), "--small", "--tokens", "192", "--fractions", "0.25", "0.75",
                          "--rounds", "1", "--suffix", "8", "--step", "64", "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    [result] = (tmp_path / "out").glob("reverse_split-small-*.json")
    summary = json.loads(result.read_text())["sizes"]["192"]["summary"]
    assert [s["head"] for s in summary["splits"]] == [48, 144]
    for s in summary["splits"]:
        # The tail's KV came from its file (read, not recomputed), the head's from the model: one answer.
        assert s["read_s"] > 0 and s["head_s"] > 0 and s["split_s"] > 0
        assert s["argmax_same"] and s["max_abs_logit_diff"] < 1e-3
    assert summary["recompute_s"] > 0 and summary["restore_s"] > 0
    assert not list((tmp_path / "out" / "files").iterdir())  # the probe's files removed
