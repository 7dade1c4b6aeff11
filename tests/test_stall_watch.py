"""The event loop's stalls, caught while they last (runtime/stall_watch.py, MLXD_STALL_WATCH_MS)."""

from __future__ import annotations

import time

import httpx
import pytest
import trio

from mlxd.runtime.stall_watch import StallWatch

from serving import ServerThread, config_for


def busy_on_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # the trio thread does not run meanwhile: every task on it waits


def test_a_stall_of_the_trio_thread_is_counted_with_what_it_was_running():
    watch = StallWatch(threshold_s=0.05)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            await trio.sleep(0.05)
            busy_on_the_loop(0.3)
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    stats = watch.stats()["event_loop"]
    assert stats["stalls"] >= 1 and stats["max_ms"] >= 290, stats
    # A loaded host may stall the loop elsewhere too: the block is the stall whose frames show it.
    blocked = [s for s in watch.recent if any("busy_on_the_loop" in f for f in s["frames"].get("MainThread", ()))]
    assert blocked and blocked[0]["ms"] >= 290, watch.recent
    assert "mlxd-stall-watch" not in blocked[0]["frames"], "the watcher leaves itself out"


def test_stats_carry_the_event_loop_when_asked(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MLXD_STALL_WATCH_MS", "40")
    with ServerThread(config_for(tiny_model_dir)) as server:
        loop = httpx.get(f"{server.base_url.removesuffix('/v1')}/stats", timeout=60).json()["event_loop"]
    assert loop["watch_ms"] == 40 and isinstance(loop["stalls"], int) and isinstance(loop["recent"], list)


@pytest.mark.parametrize("given", ["fast", "0", "-5"])
def test_a_bad_value_leaves_the_watch_off(monkeypatch, given):
    monkeypatch.setenv("MLXD_STALL_WATCH_MS", given)
    assert StallWatch.from_env() is None
