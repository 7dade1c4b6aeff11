"""Crash consistency, quick version: SIGKILL a real `mlxd serve --ssd-cache` 5 times.

The long version is `python benchmarks/crash_loop.py --kills N`; it writes
benchmarks/results/crash_loop-*.json, and docs/reliability.md cites them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import httpx  # noqa: E402
from crash_loop import CrashLoop, Record  # noqa: E402


def test_sigkill_loop_keeps_durable_prefixes_and_valid_files(tmp_path, tiny_model_dir):
    tally = CrashLoop(tiny_model_dir, tmp_path, seed=7).run(5, time_limit=120)
    assert tally.failures == []
    assert tally.kills == 5
    # The loop exercised what it claims to: durable flushes, promises, restores after restarts.
    assert tally.flushes_durable >= 1
    assert tally.promised_checked >= 1
    assert tally.restores_equal >= 1


def test_a_flush_promises_only_what_its_own_process_served(tmp_path, tiny_model_dir):
    """The checker's bookkeeping: a request served by a process killed before any flush
    may be lost (write-behind); the next process's durable flush does not promise it."""
    loop = CrashLoop(tiny_model_dir, tmp_path)
    loop.tally.restarts = 1
    loop.records.append(Record(0, "before the kill", (1, 2, 3), 0, "x", process=1))
    loop.tally.restarts = 2  # process 1 was SIGKILLed before a flush; this is process 2
    loop.records.append(Record(1, "after the restart", (7, 8, 9), 0, "y", process=2))
    durable = httpx.MockTransport(lambda request: httpx.Response(200, json={"durable": True}))
    with httpx.Client(transport=durable, base_url="http://server") as http:
        loop.flush(http)
        loop.flush(http)
    assert [r.durable for r in loop.records] == [False, True]
    assert loop.tally.not_promised_after_crash == 1 and loop.tally.flushes_durable == 2
    loop.check_durable([(7, 8, 9, 10)])  # only process 2's request must be on disk
    assert loop.tally.failures == [] and loop.tally.promised_checked == 1
    loop.check_durable([(1, 2, 3)])
    assert loop.tally.failures == ["round 2: a durable prefix was lost: files cover 0 of 2 tokens"]


def test_sigkill_loop_with_the_blocks_layout(tmp_path, tiny_model_dir):
    """The same loop on content-addressed blocks (small spans: several blocks a checkpoint): after every
    SIGKILL each manifest names only blocks on disk and loads verified, and durable prefixes survive."""
    loop = CrashLoop(tiny_model_dir, tmp_path, seed=11, serve_args=("--ssd-layout", "blocks", "--ssd-block-tokens", "16"))
    tally = loop.run(5, time_limit=120)
    assert tally.failures == []
    assert tally.kills == 5
    assert tally.flushes_durable >= 1 and tally.promised_checked >= 1 and tally.restores_equal >= 1
    assert tally.manifests_checked >= 1 and tally.blocks_checked > tally.manifests_checked
    assert list((tmp_path / "ssd").rglob("*.mlxblk"))
