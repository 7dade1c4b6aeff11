"""The managed-memory decode probe (benchmarks/gpu/probe_managed_decode.py, issue 28) on the CPU: every arm
decodes, and the `recycled` phase really runs on the buffers the arm freed (MLX's cache hands them back)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))

import probe_managed_decode  # noqa: E402


def test_each_arm_decodes_live_and_on_recycled_buffers(tmp_path, monkeypatch):
    out = tmp_path / "managed-decode.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--small", "--cases", "2x256", "--steps", "4", "--rounds", "1",
                                      "--json", str(out)])
    assert probe_managed_decode.main() == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert sorted(r["arm"] for r in rows) == sorted(probe_managed_decode.ARMS) and result["managed"] is False
    for r in rows:
        assert r["live"]["median_ms"] > 0 and r["recycled"]["median_ms"] > 0
        assert r["reused_mb"] == r["kv_mb"] > 0  # the new buffers came from the ones the arm had freed
        assert ("convert_ms" in r) == (r["arm"] != "device") and r["clear_ms"] >= 0
    # the host really read every page of the read arms' buffers (one value per 4 KB page, summed)
    assert all(r["read_sum"] > 0 for r in rows if r["arm"] in ("read_mostly", "host_read"))
    assert set(result["medians"]) == {f"2x256 {arm}" for arm in probe_managed_decode.ARMS}
