"""kv/small_files.write_durably: a crash or a full disk leaves the old file or the new one whole, never a part."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

import block_writer as bw
from mlxd.http.response_store import ResponseStore
from mlxd.kv.small_files import STORE_FILES, sweep_tmps, write_durably
from mlxd.kv.ssd_store import SsdStore

from serving import mount_tmpfs, umount


def test_a_body_the_disk_takes_only_part_of_is_an_error_and_the_old_file_stays(tmp_path):
    # A 64 KiB tmpfs: write(2) of a 96 KiB body returns short (the bytes that fit), and only the next
    # write says ENOSPC. Written as one os.write, the short part was renamed over the old file.
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=64k,mode=0700")
    try:
        path = mnt / "restore-advisor.json"
        old = json.dumps({"calibration": {"restore_bytes_per_s": 1e9}}).encode()
        write_durably(path, old)
        with pytest.raises(OSError):
            write_durably(path, b"x" * (96 << 10))
        assert path.read_bytes() == old
        assert not list(mnt.glob("*.tmp"))  # a full disk is not left fuller
    finally:
        umount(mnt)


def test_a_response_that_does_not_fit_is_not_left_truncated_on_disk(tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=64k,mode=0700")
    try:
        store = ResponseStore(mnt / "responses")
        rid = "resp_" + "ab" * 16
        record = {"response": {"id": rid, "output": "y" * (96 << 10)}, "messages": []}
        store.put(rid, record)  # kept in memory, the failure logged
        assert store.get(rid) == record
        assert not list((mnt / "responses").iterdir())
    finally:
        umount(mnt)


# ---------------------------------------------------------------- leftover tmps

HOUR = 3600.0


def _aged(path: Path, age_s: float, body: bytes = b"part") -> Path:
    path.write_bytes(body)
    when = time.time() - age_s
    os.utime(path, (when, when))
    return path


def _tmp_of(target: Path) -> Path:
    return target.with_name(f"{target.name}.{uuid.uuid4().hex}.tmp")  # write_durably's own naming


def test_a_killed_save_leaves_a_tmp_of_the_exact_naming_the_sweep_matches(tmp_path, monkeypatch):
    # The sweep matches what write_durably writes: a process killed between open and rename leaves this.
    target = tmp_path / "pins.json"
    seen: list[str] = []

    def stop_before_rename(src, dst):
        seen.append(Path(src).name)
        raise KeyboardInterrupt  # not an OSError: the tmp is left, as a kill leaves it

    monkeypatch.setattr(os, "replace", stop_before_rename)
    with pytest.raises(KeyboardInterrupt):
        write_durably(target, b"{}")
    monkeypatch.undo()
    (left,) = tmp_path.iterdir()
    assert left.name == seen[0]
    old = time.time() - 2 * HOUR
    os.utime(left, (old, old))
    assert sweep_tmps(tmp_path, STORE_FILES) == 1
    assert not list(tmp_path.iterdir())


def test_the_sweep_removes_only_old_tmps_of_this_naming(tmp_path):
    old = _aged(_tmp_of(tmp_path / "pins.json"), 2 * HOUR)
    old_advisor = _aged(_tmp_of(tmp_path / "restore-advisor.json"), 30 * HOUR)
    fresh = _aged(_tmp_of(tmp_path / "grammars.json"), 60)  # a replica saving right now
    kept = [
        fresh,
        _aged(tmp_path / "pins.json", 2 * HOUR, b"{}"),  # the file itself
        _aged(tmp_path / "pins.json.tmp", 2 * HOUR),  # no uuid
        _aged(tmp_path / f"pins.json.{uuid.uuid4().hex[:31]}.tmp", 2 * HOUR),  # 31 digits
        _aged(tmp_path / f"pins.json.{uuid.uuid4().hex.upper()}.tmp", 2 * HOUR),  # not uuid4().hex
        _aged(tmp_path / f"pins.json.{uuid.uuid4().hex}.tmp.keep", 2 * HOUR),
        _aged(tmp_path / f"notes.txt.{uuid.uuid4().hex}.tmp", 2 * HOUR),  # not a file this module writes here
        _aged(tmp_path / f"x.manifest.{uuid.uuid4().hex}.tmp", 2 * HOUR),
    ]
    a_dir = _tmp_of(tmp_path / "probe.json")
    a_dir.mkdir()
    os.utime(a_dir, (time.time() - 2 * HOUR,) * 2)
    victim = _aged(tmp_path / "elsewhere.bin", 2 * HOUR)
    link = _tmp_of(tmp_path / "pins.json")
    link.symlink_to(victim)  # a link is never followed nor removed
    os.utime(link, (time.time() - 2 * HOUR,) * 2, follow_symlinks=False)

    assert sweep_tmps(tmp_path, STORE_FILES) == 2
    assert not old.exists() and not old_advisor.exists()
    for path in (*kept, a_dir, victim):
        assert path.exists(), path.name
    assert link.is_symlink()


def test_every_file_saved_beside_the_ssd_tier_is_one_the_store_sweep_knows():
    from mlxd.kv import advisor_file, grammar_list, pins, probe_file

    for module in (pins, advisor_file, probe_file, grammar_list):
        assert STORE_FILES.fullmatch(module.FILE_NAME), module.__name__


def test_the_sweep_of_a_missing_directory_removes_nothing(tmp_path):
    assert sweep_tmps(tmp_path / "never", STORE_FILES) == 0


def test_a_tmp_the_sweep_cannot_remove_is_logged_and_the_rest_still_go(tmp_path, monkeypatch, caplog):
    stuck = _aged(_tmp_of(tmp_path / "pins.json"), 2 * HOUR)
    other = _aged(_tmp_of(tmp_path / "grammars.json"), 2 * HOUR)
    real_unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if Path(path) == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    with caplog.at_level("WARNING", logger="mlxd"):
        assert sweep_tmps(tmp_path, STORE_FILES) == 1
    assert stuck.exists() and not other.exists()
    assert "small_files.tmp_sweep_failed" in "\n".join(r.getMessage() for r in caplog.records)


def test_the_ssd_store_sweeps_its_directory_at_startup(tmp_path):
    store = SsdStore(tmp_path, bw.IDENTITY, layout="blocks", block_tokens=bw.BLOCK_TOKENS)
    store.directory.mkdir(parents=True)
    old = _aged(_tmp_of(store.directory / "pins.json"), 2 * HOUR)
    fresh = _aged(_tmp_of(store.directory / "device-probe.json"), 10)
    other = _aged(store.directory / f"mine.{uuid.uuid4().hex}.tmp", 2 * HOUR)
    store.scan()
    store.close()
    assert not old.exists()
    assert fresh.exists() and other.exists()


def test_the_response_store_sweeps_its_directory_when_built(tmp_path):
    directory = tmp_path / "responses"
    directory.mkdir()
    rid = "resp_" + "cd" * 16
    old = _aged(_tmp_of(directory / f"{rid}.json"), 2 * HOUR)
    fresh = _aged(_tmp_of(directory / f"{rid}.json"), 5)
    record = _aged(directory / f"{rid}.json", 2 * HOUR, json.dumps({"response": {"id": rid}}).encode())
    other = _aged(directory / f"notes.json.{uuid.uuid4().hex}.tmp", 2 * HOUR)
    store = ResponseStore(directory)
    assert not old.exists()
    assert fresh.exists() and record.exists() and other.exists()
    assert store.get(rid) == {"response": {"id": rid}}
