"""The tests' serve zygote (tests/serve_zygote.py): a forked `mlxd serve` is a real server process that
serves, ends with the exit status a started one would, sees its own environment, and is not forked where a
switch it differs in was read at import."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from procs import Forked, ServeProcess, Zygote, unforkable, zygote_for


def base_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def chat(http) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "What is a cache?"}],
                                                "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.skipif(os.environ.get("MLXD_TEST_FORK") == "0", reason="the zygote is off (MLXD_TEST_FORK=0)")
def test_a_forked_server_serves_ends_as_a_started_one_and_sees_its_environment(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    started = ServeProcess("--model", str(tiny_model_dir), log_path=tmp_path / "started.log", fork=False)
    with started as ref, ref.client() as http:
        expected = chat(http)["choices"][0]["message"]["content"]
        ref.signal(signal.SIGTERM)
        assert ref.wait() == 0

    # MLXD_FINAL_PLAN is read when the engine starts: the child's own value, not the zygote's (unset).
    env = {"MLXD_FINAL_PLAN": "with-token"}
    with ServeProcess("--model", str(tiny_model_dir), log_path=tmp_path / "forked.log", env=env) as proc, \
            proc.client() as http:
        assert isinstance(proc.proc, Forked), unforkable({**base_env(), **env})  # (the names in the way)
        assert proc.proc.pid != os.getpid()
        assert chat(http)["choices"][0]["message"]["content"] == expected  # the same greedy tokens
        assert http.get("/stats").json()["engine"].get("late_final_checkpoints") is None  # with-token: none late
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
    assert "serve.stopped" in proc.log()

    with ServeProcess("--model", str(tiny_model_dir), log_path=tmp_path / "killed.log") as proc:
        assert isinstance(proc.proc, Forked)
        proc.signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL  # as subprocess.Popen.returncode


def test_a_server_differing_in_a_switch_read_at_import_is_started_afresh(tmp_path: Path) -> None:
    zygote = Zygote(base_env())
    try:
        assert zygote.can_fork(base_env() | {"MLXD_FINAL_PLAN": "with-token"})  # read when the engine starts
        assert "MLXD_SUFFIX_APART" in zygote.read  # engine/core.py reads it at import
        assert not zygote.can_fork(base_env() | {"MLXD_SUFFIX_APART": "0"})
        assert not zygote.can_fork(base_env() | {"OPENBLAS_NUM_THREADS": "1"})  # read in C, at load
        assert zygote.can_fork(base_env() | {"PYTEST_CURRENT_TEST": "another test"})
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0  # stdin's end is the zygote's


def test_mlxd_test_fork_0_starts_every_server_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_TEST_FORK", "0")
    assert zygote_for(base_env()) is None


@pytest.mark.skipif(os.environ.get("MLXD_TEST_FORK") == "0", reason="the zygote is off (MLXD_TEST_FORK=0)")
def test_a_zygote_started_under_another_environment_leaves_later_forks_to_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote started while a test had changed a switch read at import could fork no later server: each was
    started afresh, and this file's fork test failed on the order the tests ran in (a fresh-clone CI, 08:43)."""
    monkeypatch.setenv("MLXD_SUFFIX_APART", "0")  # read at import (engine/core.py)
    patched = zygote_for(base_env())
    assert patched is not None and patched.env["MLXD_SUFFIX_APART"] == "0"
    monkeypatch.delenv("MLXD_SUFFIX_APART")
    now = zygote_for(base_env())
    assert now is not None and now is not patched and "MLXD_SUFFIX_APART" not in now.env
    assert zygote_for(base_env()) is now  # kept for the next server
