"""benchmarks/refit_sim_ttft.py: a committed recording fitted again at two outlier floors, offline (issue 28)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import refit_sim_ttft  # noqa: E402

RECORDING = BENCH / "results" / "sim_ttft-20261203-190939.json"  # a small CPU run (8 / 32 / 24 requests a tier)


def test_each_fence_is_fitted_at_each_floor_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(refit_sim_ttft, "RESULTS", tmp_path)
    dest = refit_sim_ttft.main([str(RECORDING), "--fences", "3", "--floors", "1", "2", "--label", "t"])
    out = json.loads(dest.read_text())
    fits = out["files"][RECORDING.name]
    assert sorted(fits) == ["3/1", "3/2"] and all("rows" in fits[k] for k in fits)
    for key in ("3/1", "3/2"):
        counts = out["within_10pct"][key]
        rows = fits[key]["rows"]
        held_out = sum(r[q] is not None for r in rows["fit"] for q in ("ratio_p50", "ratio_p95"))
        assert counts["fit"][1] == held_out > 0 and 0 <= counts["fit"][0] <= held_out
        assert counts["fit_gpu"] == [0, 0]  # a CPU recording
        assert counts["fit_own"][0] == sum(abs(r[q] - 1) <= 0.1 for r in rows["fit_own"]
                                           for q in ("ratio_p50", "ratio_p95") if r[q] is not None)
