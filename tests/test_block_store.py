"""Content-addressed SSD blocks (seed §5.11 C1): chains, manifests, real files, real MLX caches."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc
from mlx_lm.models.cache import make_prompt_cache

from mlxd.kv import blocks as bk
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.block_store import (
    BLOCK_EXT,
    MANIFEST_EXT,
    BlockStore,
    BlocksWritten,
    decode_manifest,
    encode_manifest,
    read_manifest,
)
from mlxd.kv.ssd_store import (
    Failed,
    SsdStore,
    Stored,
    StoreIdentity,
    compute_fingerprint,
    namespace_dir,
)

FP = compute_fingerprint({"config": "blocks-test"})
IDENTITY = StoreIdentity(model_id="tiny", fingerprint=FP, tokenizer_hash="tok")
B = 16  # small blocks keep the tests fast


def make_store(root: Path, block_tokens: int = B) -> BlockStore:
    return BlockStore(root, IDENTITY, block_tokens=block_tokens)


def conversation_kv(tokens, layers: int = 2, dtype=mx.float32) -> list:
    """KV whose values depend only on the tokens up to each position (as real attention KV does)."""
    caches = []
    t = mx.array(np.cumsum(np.asarray(tokens, dtype=np.float64)) % 9973, dtype=mx.float32)
    for layer in range(layers):
        base = t[None, None, :, None] * (layer + 1) + mx.arange(8, dtype=mx.float32)[None, None, None, :]
        keys = mx.concatenate([base, -base], axis=1).astype(dtype)  # (1, 2, n, 8)
        c = mlc.KVCache()
        c.update_and_fetch(keys, keys * 0.5)
        caches.append(c)
    return caches


def plan_of(caches, tokens, ns: str = "") -> ff.SnapshotPlan:
    return kinds.plan_snapshot(caches, meta=IDENTITY.meta(tokens, ns))


def write(store: BlockStore, tokens, ns: str = "", caches=None) -> BlocksWritten:
    caches = conversation_kv(tokens) if caches is None else caches
    return store.write(plan_of(caches, tokens, ns))


def manifest_of(written: BlocksWritten) -> bk.Manifest:
    return read_manifest(written.record.path)


def assert_same_caches(restored, original) -> None:
    """Same descriptors and bytes, compared through the file format's own view of the caches."""
    meta = IDENTITY.meta([], "")
    a, b = kinds.plan_snapshot(restored, meta=meta), kinds.plan_snapshot(original, meta=meta)
    assert bk.blank(a.caches) == bk.blank(b.caches)
    for x, y in zip(a.buffers, b.buffers, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def block_files(store: BlockStore) -> list[Path]:
    return sorted(store.blocks_dir.glob("*" + BLOCK_EXT))


# --- pure logic -----------------------------------------------------------------------------------


def test_chain_hash_names_prefix_and_namespace():
    a = bk.chain_hash(bk.ROOT, [1, 2, 3], namespace="", fingerprint=FP)
    assert bk.is_block_name(a)
    assert a == bk.chain_hash(bk.ROOT, (1, 2, 3), namespace="", fingerprint=FP)
    assert a != bk.chain_hash(bk.ROOT, [1, 2, 4], namespace="", fingerprint=FP)
    assert a != bk.chain_hash(bk.ROOT, [1, 2, 3], namespace="lora", fingerprint=FP)
    assert a != bk.chain_hash(bk.ROOT, [1, 2, 3], namespace="", fingerprint="other")
    # The same span after another parent is another block.
    assert bk.chain_hash(a, [4], namespace="", fingerprint=FP) != bk.chain_hash(bk.ROOT, [4], namespace="", fingerprint=FP)


def test_choose_spans_follows_the_grid_and_reuses_a_partial_tail():
    stored: set[str] = set()
    toks = list(range(40))
    first = bk.choose_spans(toks, namespace="", fingerprint=FP, exists=stored.__contains__, block_tokens=B)
    assert [(s.start, s.end, s.exists) for s in first] == [(0, 16, False), (16, 32, False), (32, 40, False)]
    stored.update(s.name for s in first)
    grown = bk.choose_spans(list(range(70)), namespace="", fingerprint=FP, exists=stored.__contains__, block_tokens=B)
    # The partial block [32, 40) is reused; new blocks resume on the grid.
    assert [(s.start, s.end, s.exists) for s in grown] == [
        (0, 16, True), (16, 32, True), (32, 40, True), (40, 48, False), (48, 64, False), (64, 70, False)
    ]
    branch = bk.choose_spans([*range(20), 99, 98], namespace="", fingerprint=FP, exists=stored.__contains__, block_tokens=B)
    assert [(s.start, s.end, s.exists) for s in branch] == [(0, 16, True), (16, 22, False)]


def test_ledger_counts_unique_blocks_and_reports_garbage():
    ledger = bk.BlockLedger()
    a, b, c = (bk.BlockRef(n * 32, 0, 1, 100 * (i + 1)) for i, n in enumerate("abc"))
    assert ledger.new_bytes([a, b, a]) == 300
    assert ledger.add([a, b]) == 300
    assert ledger.add([a, c]) == 300
    assert ledger.bytes == 600 and ledger.refs(a.name) == 2
    assert ledger.unique_bytes([a, c]) == 300
    assert ledger.remove([a, b]) == [b.name]
    assert ledger.remove([a, c]) == [a.name, c.name]
    assert ledger.bytes == 0 and len(ledger) == 0
    assert bk.unreferenced(["x", "y", "z"], [["x"], ["z", "w"]]) == {"y"}


def test_manifest_round_trip_and_damage_is_corrupt(tmp_path):
    store = make_store(tmp_path)
    stored = write(store, list(range(40)))
    manifest = manifest_of(stored)
    data = encode_manifest(manifest)
    assert decode_manifest(data) == manifest
    assert read_manifest(stored.record.path) == manifest
    for pos in (3, 70, len(data) - 2):
        bad = bytearray(data)
        bad[pos] ^= 1
        with pytest.raises(ff.CorruptFile):
            decode_manifest(bytes(bad))
    with pytest.raises(ff.CorruptFile):
        decode_manifest(data[:-5])


# --- real files -----------------------------------------------------------------------------------


def test_layout_restore_and_permissions(tmp_path):
    store = make_store(tmp_path)
    tokens = list(range(1, 41))
    caches = conversation_kv(tokens)
    stored = write(store, tokens, "lora", caches)
    rec = stored.record
    assert rec.path.parent == tmp_path / FP / namespace_dir("lora") and rec.path.suffix == MANIFEST_EXT
    assert [(b.start, b.end) for b in rec.blocks] == [(0, 16), (16, 32), (32, 40)]
    assert rec.nbytes == sum(b.nbytes for b in rec.blocks) == kinds.plan_snapshot(caches, meta=IDENTITY.meta([], "")).nbytes
    assert stored.new_blocks == 3 and stored.reused_blocks == 0
    assert len(block_files(store)) == 3
    for p in (rec.path, *block_files(store)):
        assert os.stat(p).st_mode & 0o777 == 0o600
    assert os.stat(store.blocks_dir).st_mode & 0o777 == 0o700
    for verify in (False, True):
        loaded = store.load(rec, verify=verify)
        assert loaded is not None
        assert loaded.header.tokens == tuple(tokens)
        assert_same_caches(kinds.adopt(loaded), caches)


def test_growing_conversation_writes_only_new_tokens(tmp_path):
    store = make_store(tmp_path)
    per_token = None
    tokens: list[int] = list(range(100, 137))  # 37 tokens
    records = []
    for turn in range(4):
        caches = conversation_kv(tokens)
        stored = write(store, tokens, caches=caches)
        records.append((list(tokens), caches, stored.record))
        blocks_bytes = stored.written_bytes - stored.record.path.stat().st_size
        if per_token is None:
            per_token = manifest_of(stored).nbytes / len(tokens)
        else:
            new = len(tokens) - len(records[-2][0])
            assert stored.reused_blocks >= 1
            # Only the new tokens' spans are written (each block adds a page-aligned header).
            assert blocks_bytes <= new * per_token + 2 * stored.new_blocks * ff.PAGE * 4
        tokens += list(range(1000 * turn, 1000 * turn + 11 + 7 * turn))
    # Every checkpoint restores exactly, the shared blocks once on disk.
    for _, caches, rec in records:
        loaded = store.load(rec, verify=True)
        assert loaded is not None
        assert_same_caches(kinds.adopt(loaded), caches)
    names = {b.name for *_, r in records for b in r.blocks}
    assert {p.stem for p in block_files(store)} == names


def test_branches_share_their_common_prefix(tmp_path):
    store = make_store(tmp_path)
    system = list(range(50))  # 3 full blocks + 2 tokens shared
    a = write(store, system + [1, 2, 3, 4, 5])
    b = write(store, system + [7, 8, 9])
    shared = {x.name for x in a.record.blocks} & {x.name for x in b.record.blocks}
    assert len(shared) == 3
    assert b.reused_blocks == 3 and b.new_blocks == 1


def test_quantized_rotating_and_arrays_state(tmp_path):
    """Quantized KV is cut into spans; rotating and recurrent state go whole into the state block."""
    store = make_store(tmp_path)
    tokens = list(range(40))
    n = len(tokens)
    q = mlc.QuantizedKVCache(group_size=32, bits=8)
    q.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    rot = mlc.RotatingKVCache(max_size=8)
    rot.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    arr = mlc.ArraysCache(2)
    arr[0] = mx.random.normal((1, 3, 4))
    kvc = conversation_kv(tokens, layers=1, dtype=mx.bfloat16)[0]
    caches = [q, rot, arr, mlc.CacheList(kvc, mlc.ArraysCache(1))]
    stored = write(store, tokens, caches=caches)
    manifest = manifest_of(stored)
    assert manifest.state is not None and len(manifest.spans) == 3
    assert not manifest.trimmable
    loaded = store.load(stored.record, verify=True)
    assert loaded is not None
    restored = kinds.adopt(loaded)
    assert_same_caches(restored, caches)
    # The same checkpoint again reuses every block, the state block included.
    again = write(store, tokens, caches=caches)
    assert again.new_blocks == 0 and again.reused_blocks == 4


def test_real_model_caches_restore_bit_identical(tmp_path):
    from models import tiny_qwen3

    model = tiny_qwen3(max_position_embeddings=256)
    store = make_store(tmp_path)
    tokens = [int(x) for x in np.random.default_rng(1).integers(0, 256, 70)]
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    mx.eval([c.state for c in caches])
    stored = write(store, tokens, caches=caches)
    loaded = store.load(stored.record, verify=True)
    restored = kinds.adopt(loaded)
    assert_same_caches(restored, caches)
    nxt = mx.array([[5]])
    assert mx.array_equal(model(nxt, cache=restored), model(nxt, cache=caches))


def test_damaged_block_is_a_miss_and_removed(tmp_path):
    store = make_store(tmp_path)
    stored = write(store, list(range(40)))
    victim = store.block_path(manifest_of(stored).blocks[1].name)
    with open(victim, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    assert store.load(stored.record, verify=True) is None
    assert not victim.exists() and not stored.record.path.exists()


def test_restore_is_the_same_with_any_number_of_readers_and_concurrent_loads(tmp_path):
    """Blocks read one at a time, several at once, and by loads running side by side all land exactly."""
    from concurrent.futures import ThreadPoolExecutor

    tokens = list(range(7, 7 + 16 * 9 + 5))  # 9 full blocks and a partial one
    caches = conversation_kv(tokens, layers=3)
    rec = write(make_store(tmp_path), tokens, caches=caches).record
    for readers in (1, 2, 8):
        store = BlockStore(tmp_path, IDENTITY, block_tokens=B, readers=readers)
        for verify in (False, True):
            loaded = store.load(rec, verify=verify)
            assert loaded is not None and loaded.header.tokens == tuple(tokens)
            assert_same_caches(kinds.adopt(loaded), caches)
    store = BlockStore(tmp_path, IDENTITY, block_tokens=B, readers=3)
    with ThreadPoolExecutor(4) as pool:
        loads = list(pool.map(lambda _: store.load(rec, verify=True), range(8)))
    for loaded in loads:
        assert loaded is not None
        assert_same_caches(kinds.adopt(loaded), caches)


def test_blocks_with_more_rows_than_one_scatter_read_takes(tmp_path):
    """A block's rows go into place by scatter reads of at most 1,024 buffers each: more rows
    than that (many heads) take several reads and still land exactly."""
    tokens = list(range(40))
    heads = 300  # per tensor; 2 layers x K and V = 1,200 rows per block, plus padding
    caches = []
    for layer in range(2):
        c = mlc.KVCache()
        k = mx.random.normal((1, heads, len(tokens), 8), key=mx.random.key(layer))
        c.update_and_fetch(k, k * -2.0)
        caches.append(c)
    store = make_store(tmp_path)
    stored = write(store, tokens, caches=caches)
    assert len(stored.record.blocks) == 3
    for verify in (False, True):
        loaded = store.load(stored.record, verify=verify)
        assert loaded is not None
        assert_same_caches(kinds.adopt(loaded), caches)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_blocks_land_straight_in_mlx_arrays_that_adopt_takes_without_a_copy(tmp_path, dtype):
    """`load(land=kinds.landing)`: every block's rows (and the state block) are read into the MLX
    arrays the landing allocated, and adopt uses those arrays as they are."""
    tokens = list(range(40))
    n = len(tokens)
    kv = conversation_kv(tokens, layers=2, dtype=dtype)
    rot = mlc.RotatingKVCache(max_size=8)
    rot.update_and_fetch(mx.random.normal((1, 2, n, 8)).astype(dtype), mx.random.normal((1, 2, n, 8)).astype(dtype))
    caches = [*kv, rot]
    store = make_store(tmp_path)
    rec = write(store, tokens, caches=caches).record
    assert [b.state for b in rec.blocks] == [False, False, False, True]
    for verify in (False, True):
        loaded = store.load(rec, verify=verify, land=kinds.landing)
        assert loaded is not None and loaded.landed is not None and len(loaded.landed) == 6
        landed_at = {np.asarray(memoryview(a)).ctypes.data for a in loaded.landed}
        seen: list[memoryview] = []
        adopted = kinds.adopt(loaded, landed=seen.extend)
        assert {np.frombuffer(v.cast("B"), dtype=np.uint8).ctypes.data for v in seen} == landed_at
        assert adopted[0].keys.dtype == dtype
        assert_same_caches(adopted, caches)
    # The read reports the seconds of its landing (here 50 ms) and of its checks (summed over reader threads).
    def slow_landing(header):
        time.sleep(0.05)
        return kinds.landing(header)

    for verify in (False, True):
        loaded = store.load(rec, verify=verify, land=slow_landing)
        assert loaded is not None and 0.05 <= loaded.land_s <= loaded.seconds and (loaded.verify_s > 0) == verify
    # A landing that does not fit the checkpoint is refused before any byte is read into it.
    with pytest.raises(ValueError, match="landing"):
        store.load(rec, land=lambda h: ff.Landing((memoryview(bytearray(4)),), None))
    with pytest.raises(ValueError, match="writable"):
        store.load(rec, land=lambda h: ff.Landing(tuple(memoryview(bytes(t.nbytes)) for _, t in h.tensors()), None))
    assert store.load(rec) is not None  # nothing was removed


def test_scatter_read_fills_views_in_order_and_reports_a_short_file(tmp_path):
    from mlxd.kv.block_store import _BadBlock, _preadv_all

    data = np.random.default_rng(3).integers(0, 256, 3 * 1024 + 7, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    sizes = [1, 0, 5, *([2] * 1500), 3]  # more buffers than one call takes, an empty one too
    bufs = [bytearray(n) for n in sizes]
    fd = os.open(path, os.O_RDONLY)
    try:
        _preadv_all(fd, [memoryview(b) for b in bufs], 7, "f")
        assert b"".join(bufs) == data[7 : 7 + sum(sizes)]
        tail = bytearray(20)  # the file ends 11 bytes into this buffer
        with pytest.raises(_BadBlock, match="ends early"):
            _preadv_all(fd, [memoryview(bytearray(3)), memoryview(tail)], len(data) - 14, "f")
        assert bytes(tail[:11]) == data[-11:]
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["padding", "tensor"])
def test_damage_inside_a_block_is_caught_by_verify(tmp_path, where):
    """Nonzero padding between tensors and a flipped tensor byte fail a verified load (a miss that
    removes the block and its manifest); without verify only the header and sizes are checked."""
    store = make_store(tmp_path)
    tokens = list(range(40))
    stored = write(store, tokens)
    ref = stored.record.blocks[1]
    victim = store.block_path(ref.name)
    header = ff.read_header(victim)
    first, second = [t for _, t in header.tensors()][:2]
    assert first.offset + first.nbytes < second.offset  # 1 KiB tensors, page-aligned: padding between
    at = first.offset + first.nbytes + 5 if where == "padding" else second.offset + 9
    with open(victim, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
    assert store.load(stored.record, verify=False) is not None
    assert store.load(stored.record, verify=True) is None
    assert not victim.exists() and not stored.record.path.exists()


def test_missing_block_is_a_miss_and_scan_drops_its_manifest(tmp_path):
    store = make_store(tmp_path)
    a = write(store, list(range(40)))
    b = write(store, list(range(20)) + [9, 9])
    store.block_path(a.record.blocks[2].name).unlink()
    assert store.load(a.record) is None
    again = make_store(tmp_path).scan()
    assert [r.tokens for r in again.records] == [b.record.tokens]
    # Blocks only the dropped manifest used were collected.
    assert {p.stem for p in block_files(store)} == {x.name for x in b.record.blocks}


def test_one_directory_holds_whole_files_and_blocks(tmp_path):
    """Whole files stay readable beside blocks; the scan reaps orphans and collects garbage."""
    whole_store = SsdStore(tmp_path, IDENTITY)
    old_tokens = list(range(500, 530))
    old_caches = conversation_kv(old_tokens)
    assert isinstance(whole_store.write(plan_of(old_caches, old_tokens)), Stored)
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=B)
    kept = store.write(plan_of(conversation_kv(list(range(40))), list(range(40))))
    gone = store.write(plan_of(conversation_kv(list(range(16)) + [5] * 20), list(range(16)) + [5] * 20))
    assert isinstance(kept, Stored) and isinstance(gone, Stored)
    assert kept.written > 0 and gone.reused_blocks == 1
    gone.record.path.unlink()  # a manifest removed, its blocks left behind
    (store.blocks.blocks_dir / ("a" * 32 + BLOCK_EXT + ".tmp")).write_bytes(b"partial")
    (kept.record.path.parent / ("b" * 32 + MANIFEST_EXT + ".tmp")).write_bytes(b"partial")
    for layout in ("whole", "blocks"):  # either layout reads both kinds
        scan = SsdStore(tmp_path, IDENTITY, layout=layout, block_tokens=B).scan()
        assert len(scan.records) == 2 and scan.report.corrupt == 0
    by_tokens = {tuple(r.tokens): r for r in scan.records}
    whole = by_tokens[tuple(old_tokens)]
    assert whole.blocks == () and whole.path.suffix == ff.EXTENSION
    assert_same_caches(kinds.adopt(store.load(whole)), old_caches)
    assert by_tokens[tuple(range(40))].blocks == kept.record.blocks
    assert not list(tmp_path.rglob("*.tmp"))
    assert {p.stem for p in block_files(store.blocks)} == {x.name for x in kept.record.blocks}
    assert store.load(kept.record, verify=True) is not None


def test_collect_removes_only_unreferenced_candidates(tmp_path):
    store = make_store(tmp_path)
    a = write(store, list(range(40)))
    b = write(store, list(range(20)) + [3, 3, 3])
    a.record.path.unlink()
    ledger = bk.BlockLedger()
    ledger.add(a.record.blocks)
    ledger.add(b.record.blocks)
    garbage = ledger.remove(a.record.blocks)
    assert len(garbage) == 2  # [16, 32) and [32, 40): [0, 16) is still b's
    report = store.collect(garbage + [b.record.blocks[0].name])
    assert report.removed == 2 and report.kept == 1  # a candidate b still names stays
    assert store.load(b.record, verify=True) is not None


def test_disk_full_is_a_failed_write_and_nothing_names_a_partial_block(tmp_path):
    from serving import mount_tmpfs

    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=96k,mode=0700")
    try:
        store = SsdStore(mnt, IDENTITY, layout="blocks", block_tokens=B)
        ok = store.write(plan_of(conversation_kv(list(range(16))), list(range(16))))  # one block fits
        assert isinstance(ok, Stored)
        tokens = list(range(16)) + list(range(100, 400))  # needs ~300 KB more
        result = store.write(plan_of(conversation_kv(tokens), tokens))
        assert isinstance(result, Failed) and result.disk_full
        assert not list(mnt.rglob("*.tmp"))
        assert [p for p in mnt.rglob("*" + MANIFEST_EXT)] == [ok.record.path]
        # What was committed before the failure is collected; what the manifest names stays.
        store.blocks.collect()
        assert store.load(ok.record, verify=True) is not None
        assert {p.stem for p in block_files(store.blocks)} == {b.name for b in ok.record.blocks}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_modeled_blocks_match_the_store_and_count_shared_bytes_once():
    ledger = bk.BlockLedger()
    a = bk.model_blocks(list(range(40)), namespace="", fingerprint=FP, stored=ledger.__contains__,
                        bytes_per_token=10, block_tokens=B)
    assert [(r.start, r.end, r.nbytes) for r in a] == [(0, 16, 160), (16, 32, 160), (32, 40, 80)]
    assert ledger.add(a) == 400
    b = bk.model_blocks(list(range(50)), namespace="", fingerprint=FP, stored=ledger.__contains__,
                        bytes_per_token=10, state_bytes=7, block_tokens=B)
    assert [(r.start, r.end, r.state) for r in b] == [(0, 16, False), (16, 32, False), (32, 40, False),
                                                        (40, 48, False), (48, 50, False), (50, 50, True)]
    assert ledger.new_bytes(b) == 100 + 7  # only the ten new tokens and the state
