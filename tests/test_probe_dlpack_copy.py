"""benchmarks/gpu/probe_dlpack_copy.py reads an array's memory through DLPack and copies it out as the write plan's
`memoryview` path sees it (on the CPU a memmove; the GPU run is `wave3.sh dlpackcopy`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "probe_dlpack_copy.py"


def test_the_probe_copies_the_plans_bytes_through_dlpack(tmp_path):
    out = tmp_path / "dlpack.json"
    subprocess.run([sys.executable, str(PROBE), "--tokens", "64", "--rounds", "1", "--json", str(out)],
                   capture_output=True, text=True, timeout=300, check=True)
    [row] = json.loads(out.read_text())["rows"]
    # 28 layers x keys and values of 65 tokens x 8 heads x 128 dims in bf16 (the 1.7B shape, sliced to its length)
    assert row["equal"] is True and row["copy_mb"] == round(28 * 2 * 65 * 8 * 128 * 2 / 1e6, 1)
    assert row["dlpack_device_type"] == [1]  # the CPU
