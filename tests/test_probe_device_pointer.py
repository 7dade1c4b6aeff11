"""benchmarks/gpu/probe_device_pointer.py on the CPU: no device addresses to read, said as such in its rows (the GPU
run is `wave3.sh devptr`; serving's path is tested in tests/test_plan_device.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "probe_device_pointer.py"


def test_the_probe_runs_and_says_there_are_no_device_addresses_here(tmp_path):
    out = tmp_path / "devptr.json"
    subprocess.run([sys.executable, str(PROBE), "--tokens", "64", "--rounds", "1", "--json", str(out)],
                   capture_output=True, text=True, timeout=300, check=True)
    [row] = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 64 and row["unavailable"] == ["not CUDA"] and row["addresses_ms"] >= 0
