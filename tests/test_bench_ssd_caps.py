"""The servers bench caps each SSD server's tier (benchmarks/gpu/bench_host_tier_servers.py `_ssd_caps`): two runs
of several SSD servers on the H100's 64 GiB disk ran it out of space (2026-12-06 10:25)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"),
                str(Path(__file__).resolve().parents[1] / "benchmarks")]
from bench_host_tier_servers import _ssd_caps  # noqa: E402


def commands() -> dict[str, tuple[list[str], int]]:
    return {"mlx_lm": (["mlx_lm", "server"], 1), "ram": (["mlxd", "serve"], 2),
            "ssd": (["mlxd", "serve", "--ssd-cache", "/x/ssd"], 3),
            "ssd2": (["mlxd", "serve", "--ssd-cache", "/x/ssd-2"], 4)}


def test_the_ssd_servers_share_half_the_free_space(tmp_path):
    cmds = commands()
    cap = _ssd_caps(cmds, ["mlx_lm", "ram", "ssd", "ssd2"], argparse.Namespace(ssd_cap_gb=None, work=tmp_path))
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    assert cap == max(4.0, round(free_gb / 4, 1))
    assert cmds["ssd"][0][-2:] == ["--ssd-cache-max", f"{cap:g}"] == cmds["ssd2"][0][-2:]
    assert "--ssd-cache-max" not in cmds["ram"][0] + cmds["mlx_lm"][0]


def test_a_given_cap_and_zero_for_none(tmp_path):
    cmds = commands()
    assert _ssd_caps(cmds, ["ssd"], argparse.Namespace(ssd_cap_gb=2.5, work=tmp_path)) == 2.5
    assert cmds["ssd"][0][-2:] == ["--ssd-cache-max", "2.5"] and "--ssd-cache-max" not in cmds["ssd2"][0]
    cmds = commands()
    assert _ssd_caps(cmds, ["ssd", "ssd2"], argparse.Namespace(ssd_cap_gb=0, work=tmp_path)) is None
    assert all("--ssd-cache-max" not in cmd for cmd, _ in cmds.values())
