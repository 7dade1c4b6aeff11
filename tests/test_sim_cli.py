"""`mlxd simulate` end to end on small slices of the real traces."""

import json
import subprocess
import sys
from pathlib import Path

from mlxd.sim.cli import main

TRACE = Path(__file__).resolve().parents[1] / "simulations" / "traces" / "synthetic_trace.jsonl"


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


def test_a_recording_replays_its_server_with_no_other_flags(tmp_path, capsys):
    from mlxd.sim.trace import TraceRecorder

    path = tmp_path / "live.jsonl"
    rec = TraceRecorder(path)
    rec.server(prompt_cache_bytes=40, retention="lfu", snapshot_min_tokens=4, max_batch=1, ssd=True,
               ssd_cache_max_bytes=100, ssd_demote_idle_s=0, kv_bytes_per_token=1)
    a, b = list(range(10, 30)), list(range(50, 80))
    rec.record(t=0.0, tokens=a, output_tokens=1, output_ids=[5], cached_tokens=0, cache_tier="none")
    rec.flush(t=0.5)
    rec.record(t=1.0, tokens=b, output_tokens=1, output_ids=[6], cached_tokens=0, cache_tier="none")
    rec.flush(t=1.5)
    rec.record(t=2.0, tokens=a + [5, 7], output_tokens=1, output_ids=[8], cached_tokens=21, cache_tier="ssd")
    rec.close()
    assert main([str(path), "--format", "json"]) == 0
    (run,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert run["cache_model"] == "mlxd" and run["policy"] == "lfu"
    assert run["capacity_bytes"] == 40 and run["ssd_capacity_bytes"] == 100
    # a's final checkpoint (21 tokens) was demoted to SSD by b and restored for the third request.
    assert (run["ram_hit_tokens"], run["ssd_hit_tokens"]) == (0, 21)
    assert run["ssd_layout"] == "whole"  # a recording without a layout predates blocks: whole files


def test_without_a_recording_the_ssd_layout_is_the_server_default(capsys):
    from mlxd import RuntimeConfig

    argv = [str(TRACE), "--limit", "100", "--ssd-gb", "20", "--cache-model", "mlxd", "--policy", "lru",
            "--format", "json"]
    assert main(argv) == 0
    (run,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert run["ssd_layout"] == RuntimeConfig().ssd_layout == "blocks"
    assert main([*argv, "--ssd-layout", "whole"]) == 0
    (whole,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert whole["ssd_layout"] == "whole"
    assert run["ssd_bytes_retained"] <= whole["ssd_bytes_retained"]  # shared prefixes stored once


def test_the_command_line_leaves_the_replay_engine_to_simulate():
    """`mlxd serve` builds the parser of every subcommand: simulate's flags come without its replay
    engine (sim/flags.py), so a server does not import it, nor pytest through trio.testing."""
    code = ("import sys, mlxd.cli; mlxd.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('mlxd.sim.', 'trio.testing', 'pytest'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['mlxd.sim.flags']"
