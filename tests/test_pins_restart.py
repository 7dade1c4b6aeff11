"""Pins survive a restart: persisted beside the SSD tier (kv/pins.py) and re-applied at startup (issue 25)."""

from __future__ import annotations

import signal
import time

from mlxd.kv import pins as pin_file
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.tiers import CacheTiers

from procs import ServeProcess

SYSTEM = "You are a careful assistant who answers briefly and names every colour you know. " * 6
PROMPT_CACHE_GB = "0.0004"  # about two conversations of the tiny model: a third pushes the coldest out


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tiers_at(now: float) -> CacheTiers:
    return CacheTiers(PromptCache(max_bytes=1000, clock=Clock(now)), ssd=True)


def test_the_pin_set_round_trips_with_wall_clock_deadlines(tmp_path):
    a = tiers_at(100.0)  # this process's monotonic clock reads 100 while the wall clock reads 5000
    a.pin_session("s", 60)
    a.publish(tuple(range(10)), "", payload=None, nbytes=100, trimmable=True, session="s")
    a.pin_prefix("s", "", tuple(range(5)), 30)
    path = tmp_path / "pins.json"
    pin_file.save(path, a.pin_set(5000.0))
    # Ten wall seconds later, in a process whose monotonic clock reads 7.
    saved, expired = pin_file.load(path, 5010.0)
    assert expired == 0 and len(saved.sessions) == 1 and len(saved.prefixes) == 1
    b = tiers_at(7.0)
    b.restore_pins(saved, 5010.0)
    assert b.sessions.latest("s", "") is not None and b.stats().pins.restored == 2
    assert b.pin_set(5010.0) == saved  # the same absolute deadlines
    (session,) = b.pin_set(5010.0).sessions
    assert session.deadline == 5060.0 and session.checkpoints == (("", tuple(range(10))),)
    # Past the prefix's deadline it is dropped at load; past both, nothing is left.
    assert [len(pin_file.load(path, t)[0]) for t in (5029.0, 5031.0, 5061.0)] == [2, 1, 0]
    assert pin_file.load(path, 5061.0)[1] == 2
    path.write_text("{not json")
    assert pin_file.load(path, 5000.0) == (pin_file.PinSet(), 0)  # unreadable: no pins, never an error


def serve(tmp_path, model_dir, cache_dir, name: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache_dir),
                        "--prompt-cache-gb", PROMPT_CACHE_GB, log_path=tmp_path / f"{name}.log")


def chat(http, system: str, session: str, **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Which colour is the sky?"}]}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_pin_survives_a_restart_and_still_holds_its_checkpoint_in_ram(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    pinned = "Pinned conversation. " + SYSTEM
    with serve(tmp_path, tiny_model_dir, cache, "first") as first:
        with first.client() as http:
            chat(http, pinned, "keep", prompt_cache_retention="24h")
            assert http.get("/stats").json()["cache"]["pins"]["sessions"] == 1
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    (path,) = cache.glob(f"*/{pin_file.FILE_NAME}")
    saved, _ = pin_file.load(path, time.time())
    (keep,) = saved.sessions
    assert keep.session == "keep" and keep.deadline > time.time() + 23 * 3600 and keep.checkpoints
    # An expired pin in the file is dropped at startup.
    stale = pin_file.SessionPin("stale", time.time() - 1, keep.checkpoints)
    pin_file.save(path, pin_file.PinSet((keep, stale)))

    with serve(tmp_path, tiny_model_dir, cache, "second") as second, second.client() as http:
        pins = http.get("/stats").json()["cache"]["pins"]
        assert (pins["sessions"], pins["restored"], pins["entries"]) == (1, 1, 0)
        # Its first request restores the checkpoint from SSD into RAM, where the pin now holds it.
        first_again = chat(http, pinned, "keep")
        assert cached(first_again) >= first_again["prompt_tokens"] - 1
        assert http.get("/stats").json()["ssd_cache"]["restores"] >= 1
        # Unpinned conversations push RAM past its cap (each flushed, so it is durable and may leave RAM):
        # the pinned checkpoint, the coldest of all, stays.
        for name in "bcde":
            chat(http, f"Unpinned conversation. {SYSTEM} ({name})", name)
            assert http.post("/admin/cache/flush").status_code == 200
        stats = http.get("/stats").json()
        assert stats["cache"]["ram"]["evictions"] >= 2
        assert stats["cache"]["pins"]["entries"] == 1 and stats["cache"]["pins"]["bytes"] > 0
        restores = stats["ssd_cache"]["restores"]
        again = chat(http, pinned, "keep")
        assert cached(again) >= again["prompt_tokens"] - 1
        assert http.get("/stats").json()["ssd_cache"]["restores"] == restores, "served from RAM, not SSD"
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
    assert "pins.restored" in second.log() and '"expired": 1' in second.log()
