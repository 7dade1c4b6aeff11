"""A live server whose SSD tier fills up: a real size-limited tmpfs, not a mock."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from serving import ServerThread, config_for, mount_tmpfs


def _fill(path: Path) -> None:
    """Write until the filesystem says it is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\xaa" * 65536)
                f.flush()
        except OSError:
            pass


def chat(server: ServerThread, topic: str) -> dict:
    messages = [{"role": "system", "content": f"You only talk about {topic}. " * 20},
                {"role": "user", "content": "Go on."}]
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 4}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_disk_full_warns_once_serves_from_ram_and_flush_says_why(tiny_model_dir, tmp_path, capfd, caplog):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=4m,mode=0700")
    try:
        with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=mnt / "ssd")) as server:
            admin = server.base_url.removesuffix("/v1")
            chat(server, "lighthouses")
            assert httpx.post(f"{admin}/admin/cache/flush", timeout=60).status_code == 200
            _fill(mnt / "filler")
            first, second = chat(server, "volcanoes"), chat(server, "orchards")
            r = httpx.post(f"{admin}/admin/cache/flush", timeout=60)
            assert r.status_code == 503
            report = r.json()
            assert report["durable"] is False and report["failed"] >= 1
            # The cause travels with the report: the OS's own words.
            assert report["reason"].startswith("disk full") and "No space left on device" in report["reason"]
            # Serving goes on from RAM: the repeats are cache hits.
            assert cached(chat(server, "volcanoes")) >= first["usage"]["prompt_tokens"] - 1
            assert cached(chat(server, "orchards")) >= second["usage"]["prompt_tokens"] - 1
            stats = httpx.get(f"{admin}/stats", timeout=30).json()["ssd_cache"]
            assert stats["disk_full"] is True and stats["failed_spills"] >= 2
            # The repeats' own checkpoints began writing onto the full disk: a flush waits until every write
            # begun so far has ended (failing), so none fails after the space comes back and counts against
            # the flush below (a CI run: "failed": 1 there, a block write that hit ENOSPC before the unlink).
            assert httpx.post(f"{admin}/admin/cache/flush", timeout=60).status_code == 503
            # Failed writes leave nothing behind, once they have ended (looked at before that flush, one CI run
            # found a repeat's block write still in flight: its .tmp, not yet failed).
            assert not list(mnt.rglob("*.tmp"))
            # Space comes back: the next flush retries and is durable.
            (mnt / "filler").unlink()
            r = httpx.post(f"{admin}/admin/cache/flush", timeout=60)
            assert r.status_code == 200, r.text
        # mlxd logs to the `mlxd.*` stdlib loggers (caplog) unless structlog was configured (stderr).
        out = capfd.readouterr()
        logged = out.out + out.err + "\n".join(r.getMessage() for r in caplog.records)
        assert logged.count("ssd_disk_full") == 1  # warned once, not per write
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
