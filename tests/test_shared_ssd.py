"""Several replicas on one --ssd-cache directory: discovery, one collector, no early deletes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mlxd.kv import grammar_list
from mlxd.kv.shared_dir import DeletionGuard, DirWatch

from procs import ServeProcess
from ssd_files import checkpoint_files

HOLD_LOCK = """
import sys, time
from pathlib import Path
from mlxd.kv.shared_dir import DeletionGuard
guard = DeletionGuard(Path(sys.argv[1]))
print(guard.acquire(), flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_one_collector_at_a_time_across_processes(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path), "30"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "True"
        here = DeletionGuard(tmp_path, grace_s=0)
        assert not here.acquire() and not here.is_collector
        old = tmp_path / "old.mlxkv"
        old.write_bytes(b"x")
        os.utime(old, (time.time() - 3600, time.time() - 3600))
        assert not here.unlink(old) and old.exists() and here.refused == 1
    finally:
        holder.kill()
        holder.wait()
    # The holder died: the kernel dropped its lock, and the next replica takes over.
    assert here.acquire() and here.is_collector
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
    # A file whose directory mtime did not move (a coarse clock) is found by the periodic full listing.
    d = (tmp_path / "ns2").stat()
    (tmp_path / "ns2" / "d.mlxkv").write_bytes(b"d")
    os.utime(tmp_path / "ns2", ns=(d.st_atime_ns, d.st_mtime_ns))
    polls = [watch.poll().found for _ in range(watch.full_every)]
    assert [f for f in polls if f] == [("d.mlxkv",)]



SAVE_GRAMMARS = """
import sys
from pathlib import Path
from mlxd.kv import grammar_list
from mlxd.structured.spec import Constraint
path, tag, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def listed(t):
    return [Constraint("regex", f"{t}{i}" + "x" * (32 << 10)) for i in range(8)]
mine, theirs = listed(tag), listed("b" if tag == "a" else "a")
print("ready", flush=True)
sys.stdin.readline()
failed = other = 0
for _ in range(rounds):
    try:
        grammar_list.save(path, mine, "vocab")
    except OSError:
        failed += 1
    if grammar_list.load(path, "vocab") not in (mine, theirs):
        other += 1
print(failed, other, flush=True)
"""


def _race_saves(path, script, saves):
    """Two processes ("a", "b") running `script` each save `saves` times to `path`, released at once; their outputs."""
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), tag, str(saves)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ}) for tag in "ab"]
    try:
        assert [w.stdout.readline().strip() for w in writers] == ["ready", "ready"]
        for w in writers:
            w.stdin.write("go\n")
            w.stdin.flush()
        return [w.communicate(timeout=300)[0].split() for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait()


def test_two_replicas_saving_the_grammar_list_at_once_leave_one_whole_list(tmp_path):
    # --ssd-shared: every replica saves its recent constraints to one file in the shared directory. Through one
    # fixed tmp name two saves at once wrote into the same tmp file: the second rename found no tmp (that list
    # unsaved, logged: 57 and 59 of 150 saves here), and a tmp both wrote into could be renamed in mixed.
    path = tmp_path / "fp" / "grammars.json"
    outcomes = _race_saves(path, SAVE_GRAMMARS, 150)
    assert outcomes == [["0", "0"], ["0", "0"]]  # every save whole: no failed rename, no mixed list read
    assert [c.source[:2] for c in grammar_list.load(path, "vocab")] in ([f"a{i}" for i in range(8)],
                                                                         [f"b{i}" for i in range(8)])
    assert sorted(p.name for p in path.parent.iterdir()) == ["grammars.json"]  # no tmp left behind

def test_replicas_on_two_hosts_with_the_same_pid_and_thread_id_leave_one_whole_list(tmp_path):
    # A shared directory in production is on a shared filesystem: replicas in containers on two hosts are both
    # PID 1, and a thread id is an address, equal in two such processes without ASLR. A tmp named by pid and
    # thread was then one tmp for both, as the fixed name was.
    path = tmp_path / "grammars.json"
    same = ("import os, types\nfrom mlxd.kv import small_files\n"
            "class Host:\n    def __getattr__(self, name):\n        return getattr(os, name)\n"
            "    getpid = staticmethod(lambda: 1)\n"
            "small_files.os = Host()\nsmall_files.threading = types.SimpleNamespace(get_ident=lambda: 1 << 40)\n")
    outcomes = _race_saves(path, same + SAVE_GRAMMARS, 60)
    assert outcomes == [["0", "0"], ["0", "0"]]  # every save whole: no failed rename, no mixed list read
    assert sorted(p.name for p in path.parent.iterdir()) == ["grammars.json"]  # no tmp left behind


SYSTEM = "You are a meticulous assistant who keeps notes on every conversation. " * 8


def chat(http, messages):
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "logprobs": True,
            "logit_bias": {"0": -100, "2": -100}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(response) -> list[float]:
    return [c["logprob"] for c in response["choices"][0]["logprobs"]["content"]]


def test_failover_a_conversation_flushed_by_one_replica_hits_on_another(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    common = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
              "--ssd-shared", "--ssd-rescan", "0.2")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What did we decide?"}]
    with ServeProcess(*common, log_path=tmp_path / "a.log") as a, ServeProcess(*common, log_path=tmp_path / "b.log") as b:
        with a.client() as http:
            r1 = chat(http, turn1)
            turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "And after that?"}]
            warm = chat(http, turn2)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert http.post("/admin/cache/flush").json()["durable"] is True
        a.signal(signal.SIGTERM)
        assert a.wait() == 0
        written = set(checkpoint_files(cache))
        assert written
        with b.client() as http:
            deadline = time.monotonic() + 60
            while (shared := http.get("/stats").json()["ssd_cache"]["shared"])["discovered"] < len(written):
                assert time.monotonic() < deadline, shared
                time.sleep(0.1)
            # Replica B never saw this conversation: it restores A's checkpoint...
            again = chat(http, turn2)
            usage = again["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
            # ...and continues exactly as A did.
            assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]
            assert logprobs(again) == pytest.approx(logprobs(warm), abs=1e-4)
            stats = http.get("/stats").json()["ssd_cache"]
            assert stats["restores"] == 1 and stats["shared"]["vanished"] == 0
        # B deleted none of A's files (they are too fresh for any collector).
        assert written <= set(checkpoint_files(cache))
