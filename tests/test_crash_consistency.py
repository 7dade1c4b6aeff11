"""Crash consistency, quick version: SIGKILL a real `mlxd serve --ssd-cache` 5 times.

The long version is `python benchmarks/crash_loop.py --kills N`; it writes
benchmarks/results/crash_loop-*.json, and docs/reliability.md cites them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from crash_loop import CrashLoop  # noqa: E402


def test_sigkill_loop_keeps_durable_prefixes_and_valid_files(tmp_path, tiny_model_dir):
    tally = CrashLoop(tiny_model_dir, tmp_path, seed=7).run(5, time_limit=120)
    assert tally.failures == []
    assert tally.kills == 5
    # The loop exercised what it claims to: durable flushes, promises, restores after restarts.
    assert tally.flushes_durable >= 1
    assert tally.promised_checked >= 1
    assert tally.restores_equal >= 1
