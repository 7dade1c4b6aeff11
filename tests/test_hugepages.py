"""`mlxd serve` re-executes itself with glibc's huge-page malloc tunable (runtime/hugepages.py)."""

from __future__ import annotations

import platform
import sys

import pytest
from procs import ServeProcess

from mlxd.runtime import hugepages

GLIBC = ("glibc", "2.36")


def test_reexec_env_adds_the_tunable_and_keeps_other_tunables():
    env = hugepages.reexec_env({"PATH": "/bin"}, mode="madvise", libc=GLIBC)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = hugepages.reexec_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="madvise", libc=GLIBC)
    assert env is not None
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hugepages.enabled(env)


@pytest.mark.parametrize(
    ("env", "mode", "libc"),
    [
        ({"MLXD_HUGEPAGES": "0"}, "madvise", GLIBC),  # opted out
        ({}, "always", GLIBC),  # every mapping already gets huge pages
        ({}, "never", GLIBC),  # nothing to ask for
        ({}, None, GLIBC),  # no THP in this kernel
        ({}, "madvise", ("glibc", "2.34")),  # the tunable is new in 2.35
        ({}, "madvise", ("", "")),  # musl and friends
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC),  # the user's choice stands
    ],
)
def test_no_reexec_when_nothing_to_gain(env, mode, libc):
    assert hugepages.reexec_env(env, mode=mode, libc=libc) is None


def test_thp_mode_parses_the_kernel_file(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") is None
    assert not hugepages.enabled({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})


def _would_reexec() -> bool:
    return sys.platform.startswith("linux") and hugepages.reexec_env(
        {}, mode=hugepages.thp_mode(), libc=platform.libc_ver()
    ) is not None


@pytest.mark.skipif(not _would_reexec(), reason="needs Linux, glibc >= 2.35 and THP in madvise mode")
@pytest.mark.parametrize("opt_out", [False, True])
def test_serve_runs_with_huge_pages_in_the_same_pid(tmp_path, tiny_model_dir, opt_out):
    env = {"MLXD_HUGEPAGES": "0"} if opt_out else {}
    with ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny",
                      log_path=tmp_path / "serve.log", env=env) as proc, proc.client() as client:
        memory = client.get("/stats").json()["memory"]
        assert memory == {"malloc_hugetlb": not opt_out, "thp_mode": "madvise"}
        assert proc.proc is not None
        environ = open(f"/proc/{proc.proc.pid}/environ", "rb").read().split(b"\0")  # the pid we started
        assert (b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ) is not opt_out
        # The server works after the re-exec (a real completion).
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert proc.log().count('"serve.listening"') == 1
