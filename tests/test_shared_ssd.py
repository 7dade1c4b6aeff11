"""Several replicas on one --ssd-cache directory: discovery, one collector, no early deletes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mlxd.kv.shared_dir import DeletionGuard, DirWatch

HOLD_LOCK = """
import sys, time
from pathlib import Path
from mlxd.kv.shared_dir import DeletionGuard
guard = DeletionGuard(Path(sys.argv[1]))
print(guard.is_collector, flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_one_collector_at_a_time_across_processes(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path), "30"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "True"
        here = DeletionGuard(tmp_path, grace_s=0)
        assert not here.is_collector
        old = tmp_path / "old.mlxkv"
        old.write_bytes(b"x")
        os.utime(old, (time.time() - 3600, time.time() - 3600))
        assert not here.unlink(old) and old.exists() and here.refused == 1
    finally:
        holder.kill()
        holder.wait()
    # The holder died: the kernel dropped its lock, and the next replica takes over.
    assert here.is_collector
    assert here.unlink(old) and not old.exists()
    other = subprocess.run([sys.executable, "-c", HOLD_LOCK, str(tmp_path), "0"], capture_output=True, text=True)
    assert other.stdout.strip() == "False"
    here.release()


def test_recently_used_files_are_kept(tmp_path):
    guard = DeletionGuard(tmp_path, grace_s=60)
    fresh = tmp_path / "fresh.mlxkv"
    fresh.write_bytes(b"x")
    assert not guard.unlink(fresh) and fresh.exists()
    os.utime(fresh, (time.time() - 61, time.time() - 61))
    assert guard.unlink(fresh) and not fresh.exists()
    assert not guard.unlink(fresh)  # already gone: nothing to do
    guard.release()


def test_dir_watch_reports_new_and_vanished_files(tmp_path):
    ns = tmp_path / "ns1"
    ns.mkdir()
    reads = []

    def read(path):
        reads.append(path.name)
        return None if path.name.startswith("bad") else path.name

    watch = DirWatch(tmp_path, read)
    (ns / "a.mlxkv").write_bytes(b"a")
    (ns / "a.mlxkv.tmp").write_bytes(b"partial")  # unpublished: never read
    watch.know([ns / "a.mlxkv"])
    assert watch.poll().found == ()
    (ns / "b.mlxkv").write_bytes(b"b")
    (ns / "bad.mlxkv").write_bytes(b"?")
    changes = watch.poll()
    assert changes.found == ("b.mlxkv",) and not changes.gone
    reads.clear()
    assert watch.poll().found == () and reads == []  # no directory changed: no listing, no reads
    (ns / "a.mlxkv").unlink()
    changes = watch.poll()
    assert changes.gone == {ns / "a.mlxkv"} and changes.found == ()
    (tmp_path / "ns2").mkdir()
    (tmp_path / "ns2" / "c.mlxkv").write_bytes(b"c")
    assert watch.poll().found == ("c.mlxkv",)
