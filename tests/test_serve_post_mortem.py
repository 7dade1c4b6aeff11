"""A test that fails around a real `mlxd serve` says how the server ended, with its log's tail.

CI once saw a flag-matrix server leave on its first chat with nothing in its log
to say why; the harness (tests/procs.py) now records the exit status or signal,
and a server still running dumps every thread's stack (SIGUSR1, faulthandler).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from procs import ServeProcess, exit_status


def test_an_exit_status_names_its_signal() -> None:
    assert exit_status(0) == "exited 0" and exit_status(2) == "exited 2"
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL (-9)"
    assert exit_status(-signal.SIGSEGV) == "killed by SIGSEGV (-11)"


def test_a_failed_test_reports_the_servers_death_or_its_stacks(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ("--model", str(tiny_model_dir), "--model-name", "tiny")
    with pytest.raises(AssertionError) as dead:
        with ServeProcess(*args, log_path=tmp_path / "dead.log") as proc:
            proc.signal(signal.SIGKILL)
            proc.proc.wait(timeout=60)
            raise AssertionError("the test's own failure")
    assert any("killed by SIGKILL (-9)" in note and "serve.listening" in note for note in dead.value.__notes__)

    with pytest.raises(AssertionError) as hung:
        with ServeProcess(*args, log_path=tmp_path / "hung.log") as proc:
            raise AssertionError("the test's own failure")
    (note,) = hung.value.__notes__
    assert "was still running" in note and "most recent call first" in note, note  # faulthandler's dump
    assert proc.proc.poll() is not None  # and then it was stopped
