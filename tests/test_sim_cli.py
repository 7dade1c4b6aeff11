"""`mlxd simulate` end to end on small slices of the real traces."""

import json
from pathlib import Path

from mlxd.sim.cli import main

TRACE = Path("/work/shared/traces/synthetic_trace.jsonl")


def test_json_lines_one_per_run(capsys):
    argv = [
        str(TRACE),
        "--limit",
        "300",
        "--sweep",
        "200,inf",
        "--policy",
        "lru,lfu",
        "--format",
        "json",
    ]
    assert main(argv) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(runs) == 2 * 2 * 2  # models x policies x capacities
    for run in runs:
        for key in (
            "policy",
            "capacity_blocks",
            "token_hit_rate",
            "mean_request_hit_rate",
            "requests",
            "cache_model",
        ):
            assert key in run
        assert run["requests"] == 300
    assert {r["capacity_blocks"] for r in runs} == {200, None}


def test_table_and_out_dir(tmp_path, capsys):
    out = tmp_path / "res"
    argv = [
        str(TRACE),
        "--limit",
        "200",
        "--ram-blocks",
        "300",
        "--ssd-gb",
        "20",
        "--policy",
        "cost",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "cost" in capsys.readouterr().out
    data = json.loads((out / "synthetic_trace.json").read_text())
    assert len(data["runs"]) == 2 and data["meta"]["requests"] == 200
    assert sorted(p.name for p in out.glob("*.png")) == [
        "synthetic_trace_hit_rate.png",
        "synthetic_trace_split.png",
        "synthetic_trace_ttft.png",
    ]
