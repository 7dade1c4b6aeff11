"""The SSD tier over real files: the stateless store driven by the tier core, as the cache owner does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc

from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ssd_store import (
    Failed,
    SsdStore,
    StoreIdentity,
    compute_fingerprint,
    namespace_dir,
    resident_pages,
)
from mlxd.kv.tiers import CacheTiers, Effect, SsdRecord, Unlink

from serving import mount_tmpfs, umount

FP = compute_fingerprint({"config": "c1", "weights": "w1", "tokenizer": "t", "mlx": "0.32"})
IDENTITY = StoreIdentity(model_id="tiny", fingerprint=FP, tokenizer_hash="tok")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 10
        return self.now


class Tier:
    """A stateless store plus the tier core that indexes it (what the cache owner does)."""

    def __init__(self, root: Path, *, max_bytes: int = 0, identity: StoreIdentity = IDENTITY) -> None:
        self.clock = Clock()
        self.store = SsdStore(root, identity, clock=self.clock)
        ram = PromptCache(max_bytes=1 << 30, clock=self.clock)
        self.tiers = CacheTiers(ram, ssd=True, ssd_max_bytes=max_bytes)
        self.identity = identity

    def apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Unlink):
                self.store.unlink(e.record)

    def scan(self):
        scan = self.store.scan()
        self.apply(self.tiers.load_records(scan.records))
        return scan.report

    def write(self, plan) -> SsdRecord | None:
        outcome = self.store.write(plan)
        if isinstance(outcome, Failed):
            return None
        self.apply(self.tiers.durable(outcome.record))
        return outcome.record

    def load(self, record: SsdRecord, *, verify: bool = False):
        loaded = self.store.load(record, verify=verify)
        if loaded is None:
            self.apply(self.tiers.lost(record))
        return loaded

    def find(self, tokens, ns: str = ""):
        return self.tiers.ssd_find(tokens, ns)

    def records(self) -> list[SsdRecord]:
        return self.tiers.ssd_records()


def make_store(root: Path, **kw) -> Tier:
    return Tier(root, **kw)


def kv(n: int) -> list:
    c = mlc.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return [c]


def rotating_full(n: int) -> list:
    c = mlc.RotatingKVCache(max_size=4)
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return [c]  # offset >= max_size: untrimmable


def put(store: Tier, tokens, ns: str = "", caches=None) -> SsdRecord:
    caches = kv(len(tokens)) if caches is None else caches
    plan = kinds.plan_snapshot(caches, meta=store.identity.meta(tokens, ns))
    record = store.write(plan)
    assert record is not None
    return record


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_fingerprint_is_stable_and_order_free():
    a = compute_fingerprint({"x": "1", "y": "2"})
    assert a == compute_fingerprint({"y": "2", "x": "1"})
    assert a != compute_fingerprint({"x": "1", "y": "3"})


def test_layout_permissions_and_restart_scan(tmp_path):
    store = make_store(tmp_path)
    entry = put(store, [1, 2, 3, 4], "lora")
    assert entry.path.parent == tmp_path / FP / namespace_dir("lora")
    assert len(entry.path.stem) == 32 and entry.path.suffix == ".mlxkv"
    assert os.stat(entry.path).st_mode & 0o777 == 0o600
    assert os.stat(entry.path.parent).st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / FP).st_mode & 0o777 == 0o700

    again = make_store(tmp_path)
    report = again.scan()
    assert report.indexed == 1
    hit = again.find([1, 2, 3, 4, 5], "lora")
    assert hit is not None and hit.usable == 4 and hit.record.path == entry.path
    assert again.find([1, 2, 3, 4, 5], "") is None  # namespaces never cross
    # The cap counts KV bytes, the same number as the RAM entry's (headers excluded).
    assert again.tiers.stats().ssd_bytes == entry.nbytes == kinds.nbytes(kv(4)) < os.path.getsize(entry.path)


def test_find_caps_at_len_minus_one_and_gates_on_trimmability(tmp_path):
    store = make_store(tmp_path)
    put(store, [1, 2, 3, 4, 5, 6], caches=rotating_full(6))  # untrimmable [prompt+gen]
    put(store, [1, 2, 3], caches=kv(3))  # the boundary snapshot
    hit = store.find([1, 2, 3, 4, 5, 9])
    assert hit.usable == 3 and hit.record.tokens == (1, 2, 3)  # the big file would need a trim
    exact = store.find([1, 2, 3, 4, 5, 6, 7])
    assert exact.usable == 6 and not exact.needs_trim
    hit = store.find([1, 2, 3])  # capped at len - 1: must trim the exact file
    assert hit.usable == 2 and hit.record.tokens == (1, 2, 3) and hit.needs_trim


def test_commit_replaces_duplicates_and_trimmable_supersedes_ancestors(tmp_path):
    store = make_store(tmp_path)
    a = put(store, [1, 2])
    b = put(store, [1, 2])
    assert not a.path.exists() and b.path.exists() and len(store.records()) == 1
    u = put(store, [1, 2, 3, 4], caches=rotating_full(4))  # untrimmable: keeps ancestor
    assert b.path.exists() and len(store.records()) == 2
    out = put(store, [1, 2, 3, 4, 5, 6])  # trimmable: supersedes both ancestors
    assert not b.path.exists() and not u.path.exists()
    assert files(tmp_path) == [out.path]
    assert store.tiers.ssd_covers([1, 2, 3])  # covered by trimming the descendant
    assert store.tiers.ssd_find([1, 2, 3, 4, 5, 6, 7, 8], limit=8).usable == 6
    assert not store.tiers.ssd_covers([1, 2, 7])


def test_scan_unlinks_corrupt_mismatched_and_orphans_keeps_foreign(tmp_path):
    store = make_store(tmp_path)
    good = put(store, [1, 2, 3])
    bad = put(store, [4, 5, 6])
    data = bytearray(bad.path.read_bytes())
    data[80] ^= 1  # a header byte
    bad.path.write_bytes(bytes(data))
    trunc = put(store, [7, 8])
    trunc.path.write_bytes(trunc.path.read_bytes()[:-10])
    orphan = good.path.with_name("dead.mlxkv.tmp")
    orphan.write_bytes(b"half a write")
    # a file of another namespace copied into the wrong namespace dir
    other = put(store, [9], "lora")
    moved = good.path.parent / "moved.mlxkv"
    shutil.copy(other.path, moved)
    # another model's store under the same root: never touched
    foreign = tmp_path / ("0" * 32) / "abcd"
    foreign.mkdir(parents=True)
    (foreign / "x.mlxkv").write_bytes(b"garbage")
    (foreign / "y.mlxkv.tmp").write_bytes(b"garbage")

    fresh = make_store(tmp_path)
    report = fresh.scan()
    assert (report.indexed, report.corrupt, report.orphans) == (2, 3, 1)
    assert good.path.exists() and other.path.exists()
    assert not bad.path.exists() and not trunc.path.exists()
    assert not orphan.exists() and not moved.exists()
    assert (foreign / "x.mlxkv").exists() and (foreign / "y.mlxkv.tmp").exists()


def test_scan_drops_files_of_another_identity(tmp_path):
    put(make_store(tmp_path), [1, 2, 3])
    other = make_store(tmp_path, identity=StoreIdentity("tiny", FP, "other-tokenizer"))
    assert other.scan().corrupt == 1 and files(tmp_path) == []


def test_load_verifies_and_a_corrupt_file_becomes_a_miss(tmp_path):
    store = make_store(tmp_path)
    entry = put(store, [1, 2, 3])
    loaded = store.load(entry, verify=True)
    (restored,) = kinds.adopt(loaded)
    assert restored.offset == 3
    t = loaded.header.tensors()[0][1]
    data = bytearray(entry.path.read_bytes())
    data[t.offset] ^= 0xFF
    entry.path.write_bytes(bytes(data))
    assert store.load(entry, verify=False) is not None  # tensor bytes unchecked
    assert store.load(entry, verify=True) is None
    assert not entry.path.exists() and store.find([1, 2, 3, 4]) is None


def test_touch_on_hit_and_cap_evicts_oldest_mtime(tmp_path):
    store = make_store(tmp_path)
    a = put(store, [1])
    b = put(store, [2])
    c = put(store, [3])
    assert store.tiers.lookup((1, 9)).restore.record is a  # a restore: a is now the newest
    assert store.load(a) is not None
    assert os.stat(a.path).st_mtime > os.stat(c.path).st_mtime
    # the LRU clock survives a restart: mtime is on disk
    fresh = make_store(tmp_path, max_bytes=2 * a.nbytes)
    fresh.scan()
    assert not b.path.exists() and [r.tokens for r in fresh.records()] == [(3,), (1,)]
    assert fresh.tiers.stats().ssd_evictions == 1


def test_write_enforces_the_configured_cap(tmp_path):
    store = make_store(tmp_path)
    size = put(store, [1]).nbytes
    capped = make_store(tmp_path, max_bytes=2 * size)
    capped.scan()
    put(capped, [2])
    put(capped, [3])
    assert [e.tokens for e in capped.records()] == [(2,), (3,)]
    assert capped.tiers.stats().ssd_bytes <= 2 * size
    assert len(files(tmp_path)) == 2


def test_disk_full_on_a_real_small_filesystem_is_a_failed_write_with_its_cause(tmp_path):
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=64k,mode=0700")
    try:
        store = make_store(mnt)
        put(store, [1])  # a small file fits
        plan = kinds.plan_snapshot(kv(3000), meta=store.identity.meta([5, 6], ""))
        with pytest.raises(ff.DiskFull):
            ff.write_snapshot(plan, store.store.reserve_path(""))
        outcome = store.store.write(plan)
        assert isinstance(outcome, Failed) and outcome.disk_full
        assert "No space left on device" in outcome.error  # the errno text travels to the flush report
        assert len(store.records()) == 1
        assert not [p for p in mnt.rglob("*.tmp")]
    finally:
        umount(mnt)


def test_read_only_dir_is_a_storage_error(tmp_path):
    mnt = tmp_path / "ro"
    mount_tmpfs(mnt, "size=64k,ro")
    try:
        store = make_store(mnt)
        with pytest.raises(ff.StorageError) as info:
            store.store.reserve_path("")
        assert not isinstance(info.value, ff.DiskFull)
        plan = kinds.plan_snapshot(kv(2), meta=store.identity.meta([1, 2], ""))
        outcome = store.store.write(plan)
        assert isinstance(outcome, Failed) and not outcome.disk_full
        assert "Read-only file system" in outcome.error
        assert store.scan().indexed == 0
    finally:
        umount(mnt)


def test_restart_warms_the_page_cache_with_the_newest_files(tmp_path):
    """After a restart the newest files (by mtime, the LRU clock) are read into the page cache, up to a
    budget (kv/page_cache_warmup.py: on the calling thread, piece by piece)."""
    store = make_store(tmp_path)
    old = put(store, list(range(40_000)))  # 5 MB each
    new = put(store, list(range(1, 40_001)))
    for entry in (old, new):  # start cold, whatever the write path left behind
        fd = os.open(entry.path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if resident_pages(new.path)[0] or resident_pages(old.path)[0]:
        pytest.skip("this filesystem keeps pages after DONTNEED")
    fresh = make_store(tmp_path)
    fresh.scan()
    warm = fresh.store.warm_page_cache
    warmed = warm(fresh.records(), new.nbytes)  # the budget fits the newest file only
    assert (warmed.chosen_bytes, warmed.files, warmed.stopped) == (new.nbytes, 1, False)
    assert warmed.read_bytes == new.path.stat().st_size
    assert resident_pages(new.path)[0] == resident_pages(new.path)[1]
    resident, total = resident_pages(old.path)
    assert resident < total // 4  # only what the header-only scan read (and its readahead)
    assert warm(fresh.records(), 0).chosen_bytes == 0
    again = warm(fresh.records(), new.nbytes)  # in the page cache now: skipped, not read twice
    assert (again.read_bytes, again.skipped_resident) == (0, 1)
