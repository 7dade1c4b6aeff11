"""kv/small_files.write_durably: a crash or a full disk leaves the old file or the new one whole, never a part."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mlxd.http.response_store import ResponseStore
from mlxd.kv.small_files import write_durably


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True, timeout=30)


def test_a_body_the_disk_takes_only_part_of_is_an_error_and_the_old_file_stays(tmp_path):
    # A 64 KiB tmpfs: write(2) of a 96 KiB body returns short (the bytes that fit), and only the next
    # write says ENOSPC. Written as one os.write, the short part was renamed over the old file.
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=64k,mode=0700")
    try:
        path = mnt / "restore-advisor.json"
        old = json.dumps({"calibration": {"restore_bytes_per_s": 1e9}}).encode()
        write_durably(path, old)
        with pytest.raises(OSError):
            write_durably(path, b"x" * (96 << 10))
        assert path.read_bytes() == old
        assert not list(mnt.glob("*.tmp"))  # a full disk is not left fuller
    finally:
        _umount(mnt)


def test_a_response_that_does_not_fit_is_not_left_truncated_on_disk(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=64k,mode=0700")
    try:
        store = ResponseStore(mnt / "responses")
        rid = "resp_" + "ab" * 16
        record = {"response": {"id": rid, "output": "y" * (96 << 10)}, "messages": []}
        store.put(rid, record)  # kept in memory, the failure logged
        assert store.get(rid) == record
        assert not list((mnt / "responses").iterdir())
    finally:
        _umount(mnt)
