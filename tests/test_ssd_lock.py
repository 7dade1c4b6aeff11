"""One server per --ssd-cache directory unless all share it: the lock, across real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.kv import dir_lock
from mlxd.kv.dir_lock import DirLocked, lock_dir
from mlxd.kv.ssd_store import SsdStore, StoreIdentity, compute_fingerprint

from procs import ServeProcess

IDENTITY = StoreIdentity("tiny", compute_fingerprint({"config": "c"}), "tok")

HOLD = """
import sys, time
from pathlib import Path
from mlxd.kv.dir_lock import DirLocked, lock_dir
from mlxd.kv.ssd_store import SsdStore, StoreIdentity, compute_fingerprint
mode, where = sys.argv[1], Path(sys.argv[2])
try:
    if mode == "store":  # what `mlxd serve` does: the startup scan takes it
        identity = StoreIdentity("tiny", compute_fingerprint({"config": "c"}), "tok")
        held = SsdStore(where, identity)  # the lock lives as long as the store
        held.scan()
    else:
        held = lock_dir(where, shared=mode == "shared")
except DirLocked as exc:
    print("refused", exc, flush=True)
    sys.exit(2)
print("held", flush=True)
time.sleep(60)
"""


class Holder:
    """A process holding the lock until killed."""

    def __init__(self, mode: str, where: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, mode, str(where)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        lines = (line.strip() for line in self.proc.stdout)  # the scan logs to stdout too
        self.said = next((line for line in lines if line.startswith(("held", "refused"))), "")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(mode: str, where: Path) -> Holder:
        started.append(Holder(mode, where))
        return started[-1]

    yield start
    for h in started:
        h.kill()


def test_an_owner_refuses_everyone_and_its_death_frees_the_directory(tmp_path, holders):
    owner = holders("exclusive", tmp_path)
    assert owner.said == "held"
    for shared in (False, True):
        with pytest.raises(DirLocked) as info:
            lock_dir(tmp_path, shared=shared)
        message = str(info.value)
        assert f"pid {owner.proc.pid} on " in message and "--ssd-shared" in message
        assert ("started without --ssd-shared" in message) == shared
    owner.kill()  # SIGKILL: no cleanup ran, its note is left behind
    lock = lock_dir(tmp_path, shared=False)
    assert [h.pid for h in dir_lock.holders(tmp_path)] == [os.getpid()]  # the dead one's note is cleared
    lock.release()
    assert dir_lock.holders(tmp_path) == []


def test_sharers_coexist_and_refuse_an_owner(tmp_path, holders):
    a, b = holders("shared", tmp_path), holders("shared", tmp_path)
    assert (a.said, b.said) == ("held", "held")
    lock = lock_dir(tmp_path, shared=True)
    lock.release()
    with pytest.raises(DirLocked) as info:
        lock_dir(tmp_path, shared=False)
    message = str(info.value)
    assert "is shared by" in message and f"pid {a.proc.pid}" in message and f"pid {b.proc.pid}" in message
    assert "Start this server with --ssd-shared" in message


def test_one_process_reuses_its_lock_and_releases_it_with_the_last_user(tmp_path, holders):
    first = lock_dir(tmp_path, shared=False)
    assert lock_dir(tmp_path, shared=False) is first
    with pytest.raises(DirLocked):
        lock_dir(tmp_path, shared=True)  # one process does not mix the modes either
    assert holders("exclusive", tmp_path).said.startswith("refused")
    del first  # the last reference: the kernel drops the lock
    assert holders("exclusive", tmp_path).said == "held"


def test_the_store_locks_before_its_scan_deletes_anything(tmp_path, holders):
    """A second scan of a held directory is refused, and leaves the other's files alone."""
    assert holders("store", tmp_path).said == "held"
    ns = tmp_path / IDENTITY.fingerprint / "ns"
    ns.mkdir()
    in_flight = ns / "x.mlxkv.tmp"  # the holder's write in progress, to any unlocked scan an orphan
    in_flight.write_bytes(b"half")
    with pytest.raises(DirLocked):
        SsdStore(tmp_path, IDENTITY).scan()
    assert in_flight.exists()


def test_the_holders_note_is_no_cache_file(tmp_path):
    store = SsdStore(tmp_path, IDENTITY)
    assert store.scan().report.indexed == 0
    notes = list(store.directory.glob(dir_lock.NOTE_PREFIX + "*"))
    assert len(notes) == 1 and notes[0].is_symlink() and not notes[0].is_file()
    assert store.scan().report == SsdStore(tmp_path, IDENTITY).scan().report  # counted nowhere, never deleted
    assert notes[0].is_symlink()


# ---------------------------------------------------------------- real servers


def serve(tmp_path: Path, model_dir: Path, cache: Path, name: str, *extra: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache), *extra,
                        log_path=tmp_path / f"{name}.log")


def refused(p: ServeProcess) -> str:
    """Run a server that must be refused: its exit status is 2, and stderr says why."""
    out = subprocess.run(p.args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    return out.stderr


def test_a_second_server_is_refused_until_the_first_dies(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    with serve(tmp_path, tiny_model_dir, cache, "first") as first:
        stderr = refused(serve(tmp_path, tiny_model_dir, cache, "second"))
        assert f"mlxd serve: SSD cache directory {cache}/" in stderr
        assert f"pid {first.proc.pid} on " in stderr and "--ssd-shared" in stderr
        first.signal(signal.SIGKILL)
        first.wait()
    with serve(tmp_path, tiny_model_dir, cache, "third") as third, third.client() as http:
        assert http.get("/health").status_code == 200


def test_shared_servers_start_together_and_refuse_an_unshared_one(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    with serve(tmp_path, tiny_model_dir, cache, "a", "--ssd-shared") as a, \
            serve(tmp_path, tiny_model_dir, cache, "b", "--ssd-shared") as b:
        for p in (a, b):
            with p.client() as http:
                assert http.get("/health").status_code == 200
        stderr = refused(serve(tmp_path, tiny_model_dir, cache, "c"))
        assert f"pid {a.proc.pid}" in stderr and f"pid {b.proc.pid}" in stderr
        assert "Start this server with --ssd-shared too" in stderr
