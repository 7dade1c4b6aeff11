"""`mlxd serve --ssd-cache-max N%`: the SSD tier's cap as a share of the disk space it may use at start (the
filesystem's free space plus the tier's own files), resolved once; the GB form unchanged."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

import mlxd.cli as cli
from mlxd.cli import build_parser, disk_share_bytes, serve_config
from mlxd.runtime.config import GB

Usage = namedtuple("Usage", "total used free")


def config(*flags):
    return serve_config(build_parser().parse_args(["serve", *flags]))


def test_a_share_counts_the_free_space_and_the_tiers_own_files(tmp_path, monkeypatch):
    tier = tmp_path / "ssd"
    (tier / "ns").mkdir(parents=True)
    (tier / "ns" / "a.mlxkv").write_bytes(b"\0" * 3_000_000)  # an earlier run's file: the tier may reuse its space
    (tier / "b.tmp").write_bytes(b"\0" * 1_000_000)
    seen = []
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: seen.append(p) or Usage(10**9, 0, 6_000_000))
    assert disk_share_bytes(tier, 0.5) == 5_000_000
    assert config("--ssd-cache", str(tier), "--ssd-cache-max", "50%").ssd_cache_max_bytes == 5_000_000
    # A directory not made yet: its nearest existing parent's filesystem, nothing of its own.
    assert disk_share_bytes(tmp_path / "new" / "deeper", 0.25) == 1_500_000 and seen[-1] == tmp_path
    # A full disk and no files: the smallest cap, not 0 (which would mean unlimited).
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: Usage(10**9, 10**9, 0))
    assert disk_share_bytes(tmp_path / "empty", 1.0) == 1


def test_on_the_real_filesystem(tmp_path):
    before = shutil.disk_usage(tmp_path).free
    got = config("--ssd-cache", str(tmp_path / "ssd"), "--ssd-cache-max", "80%").ssd_cache_max_bytes
    after = shutil.disk_usage(tmp_path).free
    assert 0.8 * min(before, after) * 0.99 <= got <= 0.8 * max(before, after) * 1.01


def test_the_gb_form_and_bad_shares(tmp_path, capsys):
    assert config("--ssd-cache", str(tmp_path), "--ssd-cache-max", "1.5").ssd_cache_max_bytes == int(1.5 * GB)
    assert config("--ssd-cache", str(tmp_path)).ssd_cache_max_bytes == 0  # unlimited by default
    for bad in ("0%", "101%", "-5%", "nan%", "half%"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["serve", "--ssd-cache", str(tmp_path), "--ssd-cache-max", bad])
        assert exit_.value.code == 2
    assert "--ssd-cache-max" in capsys.readouterr().err
