"""With --ssd-shared the cap holds on disk: deletions refused under the grace are retried (issue 27).

The collector deletes only files nobody used for the grace, so files evicted
while fresh used to stay for good (a 51 MiB cap left 376 MiB on disk).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from mlxd.kv.shared_dir import DeletionGuard

from serving import ServerThread, config_for


def test_a_refused_deletion_is_carried_out_after_the_grace(tmp_path: Path) -> None:
    guard = DeletionGuard(tmp_path, grace_s=60)
    fresh, kept = tmp_path / "fresh.mlxkv", tmp_path / "kept.mlxkv"
    for f in (fresh, kept):
        f.write_bytes(b"x")
    assert not guard.unlink(fresh) and not guard.unlink(kept) and guard.pending == 2
    assert guard.retry(lambda p: False) == 0 and fresh.exists()  # still within the grace
    for f in (fresh, kept):
        os.utime(f, (time.time() - 61, time.time() - 61))
    # `kept` was indexed again meanwhile: it stays, and is no longer pending
    assert guard.retry(lambda p: p == kept) == 1
    assert not fresh.exists() and kept.exists() and guard.pending == 0 and guard.retried == 1
    guard.release()


def test_the_cap_holds_on_disk_in_a_shared_directory(tiny_model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    cap = 600_000
    # Whole files: each checkpoint is one file the collector deletes (blocks are collected by manifest,
    # and this test's `*.mlxkv` count would see none of them).
    config = config_for(tiny_model_dir, ssd_cache_dir=ssd, ssd_shared=True, ssd_rescan_s=0.2,
                        ssd_shared_grace_s=1.0, ssd_cache_max_bytes=cap, ssd_layout="whole")
    with ServerThread(config) as server:
        base = server.base_url.removesuffix("/v1")
        for i in range(8):  # eight conversations, each flushed: far over the cap together
            body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Conversation {i}: " + "words to keep " * 60}]}
            assert httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).status_code == 200
            assert httpx.post(f"{base}/admin/cache/flush", timeout=120).status_code == 200

        def on_disk() -> int:
            return sum(p.stat().st_size for p in ssd.rglob("*.mlxkv"))

        shared = httpx.get(f"{base}/stats").json()["ssd_cache"]["shared"]
        assert shared["deletions_refused"] > 0  # evicted while fresh: refused at first
        deadline = time.monotonic() + 60
        while on_disk() > cap:
            assert time.monotonic() < deadline, (on_disk(), httpx.get(f"{base}/stats").json()["ssd_cache"])
            time.sleep(0.2)
        shared = httpx.get(f"{base}/stats").json()["ssd_cache"]["shared"]
        assert shared["deletions_retried"] > 0
