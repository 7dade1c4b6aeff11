"""benchmarks/gpu/probe_apart_vs_batch.py on the CPU: one EngineCore gives a lone prompt its first token through
its batch and apart on the prompt's own caches, side by side (the GPU run is `wave3.sh apartbatch`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "probe_apart_vs_batch.py"


def test_both_paths_give_a_lone_prompt_its_first_token_and_are_compared(tmp_path):
    run = subprocess.run([sys.executable, str(PROBE), "--small", "--tokens", "160", "--rounds", "2", "--step", "64",
                          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    [result] = (tmp_path / "out").glob("apart_vs_batch-small-*.json")
    data = json.loads(result.read_text())
    assert data["step"] == 64
    size = data["sizes"]["160"]
    assert len(size["rounds"]) == 2 and all(r["apart"] > 0 and r["batch"] > 0 for r in size["rounds"])
    assert list(size["rounds"][0]) == ["apart", "batch"] and list(size["rounds"][1]) == ["batch", "apart"]
    s = size["summary"]
    assert s["apart_vs_batch"] == s["apart_s"] / s["batch_s"]


def test_the_served_arms_with_the_first_token_early_and_late(tmp_path):
    run = subprocess.run([sys.executable, str(PROBE), "--small", "--tokens", "40", "--rounds", "2", "--step", "64",
                          "--arms", "served", "served_late", "--out", str(tmp_path / "out"),
                          "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    [result] = (tmp_path / "out").glob("apart_vs_batch-small-*.json")
    s = json.loads(result.read_text())["sizes"]["40"]["summary"]
    assert s["served_vs_served_late"] == s["served_s"] / s["served_late_s"]
