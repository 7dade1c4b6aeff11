"""The cache-tier core: pure, synchronous, no files (the same object serves and simulates)."""

from __future__ import annotations

import attrs

from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import RestoreAdvisor
from mlxd.kv.tiers import CacheTiers, Forget, NotStored, Persist, SsdRecord, Unlink


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(ram: int = 1000, *, ssd: bool = True, ssd_max: int = 0, idle: float = 0.0, advisor=None):
    clock = Clock()
    tiers = CacheTiers(
        PromptCache(max_bytes=ram, clock=clock), ssd=ssd, ssd_max_bytes=ssd_max,
        advisor=advisor or RestoreAdvisor(), demote_idle_s=idle,
    )
    return tiers, clock


def publish(tiers: CacheTiers, tokens, nbytes: int, *, ns: str = "", trimmable: bool = True, durable=False):
    return tiers.publish(tuple(tokens), ns, payload=None, nbytes=nbytes, trimmable=trimmable, durable=durable)


def commit(tiers: CacheTiers, effect: Persist) -> list:
    """What the writer reports once a Persist is on disk."""
    record = SsdRecord(effect.namespace, effect.tokens, effect.nbytes, 0.0, effect.trimmable)
    return tiers.durable(record)


def kinds(effects) -> list[str]:
    return [type(e).__name__ for e in effects]


def test_a_new_checkpoint_is_persisted_and_durable_once_committed():
    tiers, _ = make()
    (persist,) = publish(tiers, range(10), 100)
    assert isinstance(persist, Persist) and persist.tokens == tuple(range(10))
    entry = tiers.ram.find_exact(tuple(range(10)))
    assert not entry.durable
    assert commit(tiers, persist) == []
    assert entry.durable and tiers.ssd_covers(tuple(range(10)))
    # A checkpoint a file already covers is durable at once: no second write.
    assert publish(tiers, range(5), 50) == []  # covered by trimming the 10-token file
    assert tiers.ram.find_exact(tuple(range(5))).durable


def test_persist_before_demotion_then_demote():
    tiers, _ = make(ram=150)
    (a,) = publish(tiers, range(10), 100)
    effects = publish(tiers, range(100, 110), 100)  # over the cap: a must be written first
    assert kinds(effects) == ["Persist"]
    assert tiers.ram_over_cap and len(tiers.ram) == 2
    assert commit(tiers, a) == []  # a is on SSD now: demoted from RAM
    assert len(tiers.ram) == 1 and not tiers.ram_over_cap
    assert tiers.stats().demotions == 1
    # The demoted prefix is served from SSD, strictly longer than RAM's nothing.
    lookup = tiers.lookup(tuple(range(12)))
    assert lookup.hit is None and lookup.restore.usable == 10


def test_a_failed_write_lets_the_victim_go_without_a_copy():
    tiers, _ = make(ram=150)
    publish(tiers, range(10), 100)
    publish(tiers, range(100, 110), 100)
    effects = tiers.not_persisted("", tuple(range(10)))
    assert kinds(effects) == ["Forget"] and effects[0].tokens == tuple(range(10))
    assert tiers.stats().dropped_unpersisted == 1 and not tiers.ram_over_cap


def test_ssd_cap_eviction_clears_the_ram_durable_flag():
    """Hole (a): no RAM entry is dropped believing a copy exists that the cap deleted."""
    tiers, clock = make(ram=1000, ssd_max=150)
    (a,) = publish(tiers, range(10), 100)
    commit(tiers, a)
    entry_a = tiers.ram.find_exact(tuple(range(10)))
    assert entry_a.durable
    clock.now = 1.0
    (b,) = publish(tiers, range(100, 110), 100)
    effects = commit(tiers, b)  # the cap holds one file: a's file goes
    assert kinds(effects) == ["Unlink"] and effects[0].record.tokens == tuple(range(10))
    assert not entry_a.durable
    assert tiers.stats().ssd_evictions == 1
    # Under RAM pressure a is now dropped *as a loss*, never counted as a demotion.
    tiers.ram.max_bytes = 150
    effects = publish(tiers, range(200, 201), 10)
    assert "Forget" in kinds(effects)
    stats = tiers.stats()
    assert stats.demotions == 0 and stats.dropped_unpersisted == 1
    assert tiers.lookup(tuple(range(12))).restore is None


def test_a_restore_whose_file_left_ssd_meanwhile_is_not_durable():
    """A restored checkpoint is durable only while a file still covers it: between the
    lookup that chose a file and the restore's publication, the cap may delete it."""
    tiers, clock = make(ram=1000, ssd_max=250)
    assert tiers.durable(SsdRecord("", tuple(range(10)), 100, 0.0)) == []
    lookup = tiers.lookup(tuple(range(12)))
    assert lookup.restore is not None and lookup.restore.usable == 10
    clock.now = 1.0
    effects = tiers.durable(SsdRecord("", tuple(range(100, 120)), 200, 1.0))  # the cap deletes the file
    assert kinds(effects) == ["Unlink"] and effects[0].record.tokens == tuple(range(10))
    effects = publish(tiers, range(10), 100, durable=True)  # the engine adopted the bytes it had read
    assert kinds(effects) == ["NotStored"] and "left SSD" in effects[0].reason  # a flush reports it
    assert not tiers.ram.find_exact(tuple(range(10))).durable
    # While the file is there, a restore is durable at once and written no second time.
    assert tiers.durable(SsdRecord("", tuple(range(10)), 100, 2.0))[0].record.tokens == tuple(range(100, 120))
    assert publish(tiers, range(10), 100, durable=True) == []
    assert tiers.ram.find_exact(tuple(range(10))).durable


def test_an_entry_larger_than_the_ssd_cap_is_reported_not_stored():
    """Hole (b): never written then evicted, never left dirty blocking a flush or RAM."""
    tiers, _ = make(ram=150, ssd_max=80)
    effects = publish(tiers, range(10), 100)
    assert kinds(effects) == ["NotStored"] and "SSD cap" in effects[0].reason
    # It does not block RAM eviction: the next publication drops it.
    effects = publish(tiers, range(100, 105), 60)
    assert kinds(effects) == ["Persist", "Forget"]
    assert not tiers.ram_over_cap and tiers.stats().not_stored == 1
    # A file that turns out larger than the cap once written is deleted and reported too.
    effects = tiers.durable(SsdRecord("", (7, 8), 90, 0.0))
    assert kinds(effects) == ["Unlink", "NotStored"] and not tiers.ssd_records()


def test_trimmable_file_supersedes_ancestor_files_and_covers_ram_ancestors():
    tiers, _ = make(ram=10_000)
    short = SsdRecord("", (1, 2, 3), 30, 0.0)
    assert tiers.durable(short) == []
    untrimmable = SsdRecord("", (1, 2, 3, 4), 40, 0.0, trimmable=False)
    assert tiers.durable(untrimmable) == []
    effects = tiers.durable(SsdRecord("", (1, 2, 3, 4, 5, 6), 60, 0.0))
    assert {e.record.tokens for e in effects if isinstance(e, Unlink)} == {(1, 2, 3), (1, 2, 3, 4)}
    assert [r.tokens for r in tiers.ssd_records()] == [(1, 2, 3, 4, 5, 6)]
    assert tiers.ssd_covers((1, 2)) and not tiers.ssd_covers((1, 2, 9))
    # An exact duplicate replaces the older file.
    effects = tiers.durable(SsdRecord("", (1, 2, 3, 4, 5, 6), 60, 0.0))
    assert kinds(effects) == ["Unlink"] and len(tiers.ssd_records()) == 1
    assert tiers.stats().ssd_superseded == 3


def test_restore_rule_compares_with_prefill_on_top_of_the_ram_hit():
    # A disk so slow that 10 more cached tokens are not worth reading 8000 tokens of KV.
    slow = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e8))
    tiers, _ = make(ram=10**12, advisor=slow)
    prompt = tuple(range(8100))
    publish(tiers, prompt[:8000], DEFAULT.kv_bytes(8000), durable=True)
    tiers.durable(SsdRecord("", prompt[:8010], DEFAULT.kv_bytes(8010), 0.0))
    lookup = tiers.lookup(prompt)
    assert lookup.hit.usable == 8000 and lookup.restore is None  # recompute 100 on top of RAM
    # From nothing, the same file is worth restoring (the rule is not "vs a prefill from zero" only).
    tiers.ram.max_bytes = 0
    tiers.ram.evict()
    assert tiers.lookup(prompt).restore.usable == 8010
    assert slow.recomputes_chosen == 1 and slow.restores_chosen == 1


def test_ssd_serves_only_when_strictly_longer_than_ram():
    tiers, _ = make(ram=10_000)
    publish(tiers, range(10), 100, durable=True)
    tiers.durable(SsdRecord("", tuple(range(10)), 100, 0.0))
    lookup = tiers.lookup(tuple(range(12)))
    assert lookup.hit.usable == 10 and lookup.restore is None
    assert tiers.prefetch_candidate(tuple(range(12))) is None
    tiers.durable(SsdRecord("", tuple(range(11)), 110, 0.0))
    assert tiers.prefetch_candidate(tuple(range(12))).tokens == tuple(range(11))
    assert tiers.lookup(tuple(range(12))).restore.usable == 11


def test_lost_file_clears_durability_and_the_ssd_hit():
    tiers, _ = make()
    (a,) = publish(tiers, range(10), 100)
    commit(tiers, a)
    record = tiers.ssd_records()[0]
    assert tiers.lost(record) == []
    assert not tiers.ram.find_exact(tuple(range(10))).durable
    assert tiers.ssd_records() == [] and tiers.stats().lost_files == 1


def test_idle_durable_entries_demote_by_the_injected_clock():
    tiers, clock = make(idle=30.0)
    (a,) = publish(tiers, range(10), 100)
    publish(tiers, range(50, 60), 100)  # dirty: never demoted while idle
    commit(tiers, a)
    clock.now = 29.0
    tiers.demote_idle()
    assert len(tiers.ram) == 2
    clock.now = 31.0
    tiers.demote_idle()
    assert [tuple(e.tokens) for e in tiers.ram.entries()] == [tuple(range(50, 60))]
    assert tiers.stats().idle_demotions == 1


def test_startup_records_load_oldest_first_and_obey_the_cap():
    tiers, _ = make(ssd_max=200)
    records = [SsdRecord("", (i,), 100, float(t)) for i, t in ((1, 30), (2, 10), (3, 20))]
    effects = tiers.load_records(records)
    assert [e.record.tokens for e in effects if isinstance(e, Unlink)] == [(2,)]
    assert [r.tokens for r in tiers.ssd_records()] == [(3,), (1,)]


def test_ram_only_never_persists():
    tiers, _ = make(ram=150, ssd=False)
    assert publish(tiers, range(10), 100) == []
    assert publish(tiers, range(50, 60), 100) == []  # the victim is simply dropped
    assert len(tiers.ram) == 1 and tiers.lookup(tuple(range(12))).restore is None
    assert not any(isinstance(e, Forget | NotStored) for e in publish(tiers, range(70, 80), 100))


# --- the memory budget ---------------------------------------------------------------


def budgeted(budget: int, *, ssd: bool = True):
    tiers, clock = make(ram=10_000, ssd=ssd)
    tiers.memory_budget = budget
    return tiers, clock


def test_the_budget_demotes_durable_entries_coldest_first():
    tiers, clock = budgeted(1000)
    for i in range(3):  # a (oldest), b, c: 200 bytes each, all on SSD
        clock.now = i
        (p,) = publish(tiers, range(100 * i, 100 * i + 10), 200)
        commit(tiers, p)
    # weights and batches: 700 bytes outside the cache; 700 + 600 is 300 over
    assert tiers.observe_memory(1300) == []
    left = [tuple(e.tokens)[0] for e in tiers.ram.entries()]
    assert left == [200], "a and b (the two coldest) left; c stays"
    memory = tiers.stats().memory
    assert (memory.other_bytes, memory.cache_bytes, memory.over_bytes) == (700, 200, -100)
    assert memory.demotions == 2 and memory.freed_bytes == 400 and memory.waiting_bytes == 0
    assert tiers.stats().demotions == 2
    # the demoted prefixes are still served, from SSD
    assert tiers.lookup(tuple(range(12))).restore.usable == 10


def test_within_the_budget_nothing_moves():
    tiers, _ = budgeted(1000)
    commit(tiers, publish(tiers, range(10), 200)[0])
    assert tiers.observe_memory(900) == []
    assert len(tiers.ram) == 1 and tiers.stats().memory.over_bytes == -100


def test_persist_before_demotion_under_the_budget():
    tiers, clock = budgeted(1000)
    (a,) = publish(tiers, range(10), 300)
    clock.now = 1
    (b,) = publish(tiers, range(100, 110), 300)
    tiers.observe_memory(1500)  # 900 outside the cache: 500 over, nothing durable yet
    assert len(tiers.ram) == 2 and tiers.budget_waiting
    assert tiers.stats().memory.waiting_bytes == 500
    # a's write commits: the check that follows demotes it; b still waits
    assert commit(tiers, a) == []
    assert [tuple(e.tokens)[0] for e in tiers.ram.entries()] == [100]
    assert tiers.budget_waiting and tiers.stats().memory.waiting_bytes == 200
    commit(tiers, b)
    assert len(tiers.ram) == 0 and not tiers.budget_waiting
    assert tiers.stats().dropped_unpersisted == 0


def test_an_unwritable_entry_is_never_dropped_for_the_budget():
    tiers, _ = budgeted(100)
    publish(tiers, range(10), 300)
    tiers.not_persisted("", tuple(range(10)))  # its write failed
    tiers.observe_memory(400)
    assert len(tiers.ram) == 1 and not tiers.budget_waiting  # nothing to wait for: no urgency


def test_without_ssd_the_budget_evicts_lru():
    tiers, clock = budgeted(1000, ssd=False)
    for i in range(3):
        clock.now = i
        publish(tiers, range(100 * i, 100 * i + 10), 200)
    tiers.observe_memory(1300)
    assert [tuple(e.tokens)[0] for e in tiers.ram.entries()] == [200]
    memory = tiers.stats().memory
    assert memory.evictions == 2 and memory.demotions == 0
    assert tiers.lookup(tuple(range(12))).hit is None


def test_the_cache_growing_after_a_measurement_is_checked_at_publish():
    tiers, clock = budgeted(1000)
    commit(tiers, publish(tiers, range(10), 200)[0])
    tiers.observe_memory(900)  # 700 outside the cache
    clock.now = 1
    (p,) = publish(tiers, range(100, 110), 200)  # 700 + 400: 100 over, the old entry goes
    assert [tuple(e.tokens)[0] for e in tiers.ram.entries()] == [100]
    assert tiers.stats().memory.over_bytes == -100


def test_no_budget_no_memory_stats():
    tiers, _ = make()
    assert tiers.observe_memory(10**12) == [] and tiers.stats().memory is None
