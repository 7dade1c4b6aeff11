"""The serving heap frozen after start-up, and every garbage collection timed (runtime/gc_pauses.py)."""

from __future__ import annotations

import gc
import json
import time
import weakref

import httpx
import pytest
import trio

from mlxd.engine.core import EngineCore
from mlxd.runtime import gc_pauses
from mlxd.runtime.gc_pauses import GcPauses
from mlxd.runtime.stall_watch import StallWatch

from procs import ServeProcess
from serving import config_for


class Node:
    """A container the collector tracks (weak-referenceable, to see when it goes)."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def thawed_after():
    yield
    gc_pauses.thaw()


def test_every_collection_is_timed_by_generation_with_the_thread_it_stopped():
    pauses = GcPauses(long_s=0.0).install()
    try:
        before = time.monotonic()
        gc.collect()
        after = time.monotonic()
        stats = pauses.stats()["gc"]
        assert stats["collections"][2] >= 1 and stats["paused_s"][2] > 0 and stats["max_ms"][2] > 0, stats
        assert stats["recent"][-1]["generation"] == 2 and stats["recent"][-1]["thread"] == "MainThread"
        assert 0 < pauses.paused_between(before, after) <= after - before
        assert pauses.paused_between(after + 1, after + 2) == 0.0
    finally:
        pauses.close()
    counted = list(pauses.collections)
    gc.collect()
    assert pauses.collections == counted, "closed: no longer called"


def test_frozen_objects_leave_every_collection_until_thawed(thawed_after):
    kept = [Node() for _ in range(20_000)]
    frozen = gc_pauses.freeze_heap()
    assert frozen["frozen"] >= 20_000 and gc.get_freeze_count() == frozen["frozen"]
    assert not any(o is kept[0] for o in gc.get_objects()), "a frozen object is in no generation"
    # Garbage that start-up made before the freeze was collected first; a cycle made after it is collected.
    late = Node()
    late.other = late
    gone = weakref.ref(late)
    del late
    gc.collect()
    assert gone() is None
    gc_pauses.thaw()
    assert gc.get_freeze_count() == 0
    assert any(o is kept[0] for o in gc.get_objects(generation=2))


def test_a_typo_in_the_switch_is_refused(monkeypatch):
    monkeypatch.setenv("MLXD_GC_FREEZE", "maybe")
    with pytest.raises(ValueError, match="MLXD_GC_FREEZE"):
        gc_pauses.freeze_wanted()
    monkeypatch.setenv("MLXD_GC_FREEZE", "off")
    assert gc_pauses.freeze_wanted() is False
    monkeypatch.delenv("MLXD_GC_FREEZE")
    assert gc_pauses.freeze_wanted() is True


def test_the_engines_old_generator_goes_after_a_failed_step_with_the_heap_frozen(tiny_model_dir, thawed_after):
    """What serving drops of start-up's making must not need a full collection: a frozen object in a
    reference cycle would stay (with the batch's KV), and the freeze is only safe while it does not."""
    core = EngineCore(config_for(tiny_model_dir))
    core.load()
    try:
        core.generator.insert([[5, 6, 7, 8] * 16], max_tokens=[8])
        core.generator.next()  # a batch with a row's KV in it
        old = weakref.ref(core.generator)
        gc_pauses.freeze_heap()
        core.reset()  # what a failed step does
        assert old() is None, "the old generator outlived the reset: a cycle a frozen heap would never collect"
    finally:
        core.close()


def test_a_stall_says_how_much_of_it_was_a_collection():
    pauses = GcPauses().install()
    watch = StallWatch(threshold_s=0.002, gc=pauses)  # (a fast machine's full collection of 300k objects: ~10 ms)
    heap = [[Node() for _ in range(200)] for _ in range(1500)]  # 300k tracked objects: a full collection is long

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            await trio.sleep(0.05)
            for _ in range(3):
                gc.collect()  # on the trio thread: the loop cannot beat meanwhile
                await trio.sleep(0.02)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        pauses.close()
    del heap
    full = [s for s in watch.recent if s.get("gc_ms", 0) > 0]
    assert full, watch.recent
    # The collection is inside the stall (a loaded host may stall it longer, never shorter).
    assert all(s["gc_ms"] <= s["ms"] + pauses.long_s * 1e3 + 5 for s in full), full


def test_a_served_heap_is_frozen_and_its_collections_are_reported(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLXD_GC_FREEZE", raising=False)
    with ServeProcess("--model", str(tiny_model_dir), log_path=tmp_path / "frozen.log") as server:
        base = server.url.removesuffix("/v1")
        httpx.post(server.url + "/completions", json={"prompt": "one two three", "max_tokens": 4}, timeout=60)
        stats = httpx.get(base + "/stats", timeout=60).json()["gc"]
        metrics = httpx.get(base + "/metrics", timeout=60).text
    frozen = [json.loads(line) for line in server.log().splitlines() if '"serve.gc_frozen"' in line]
    assert frozen and frozen[0]["frozen"] > 10_000, frozen  # the imports and the model's modules at least
    # (what start-up made and serving freed since leaves the count: it only shrinks)
    assert 10_000 < stats["frozen_objects"] <= frozen[0]["frozen"] and stats["collections"][2] >= 1, stats
    assert 'mlxd_gc_pause_seconds_total{generation="2"}' in metrics and "mlxd_gc_frozen_objects" in metrics

    monkeypatch.setenv("MLXD_GC_FREEZE", "0")
    with ServeProcess("--model", str(tiny_model_dir), log_path=tmp_path / "thawed.log") as server:
        stats = httpx.get(server.url.removesuffix("/v1") + "/stats", timeout=60).json()["gc"]
    assert stats["frozen_objects"] == 0 and '"serve.gc_frozen"' not in server.log()
