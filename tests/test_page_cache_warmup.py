"""The start-up page-cache warm-up steps aside for serving's reads (kv/page_cache_warmup.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc

from mlxd.kv import kinds
from mlxd.kv import page_cache_warmup as warmup
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity, compute_fingerprint, resident_pages

HELD_S = 0.4


def cold_file(path: Path, nbytes: int) -> Path:
    """A file of `nbytes` on disk and out of the page cache (skips where the filesystem keeps it)."""
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_pages(path)[0]:
        pytest.skip("this filesystem keeps pages after DONTNEED")
    return path


class Watched(warmup.ForegroundReads):
    """Says when the warm-up first waits (so a test holds a read from then on, however late the thread ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait_idle(self, stop: threading.Event) -> float:
        self.waiting.set()
        return super().wait_idle(stop)


def warm_in_thread(files, budget, reads, stop=None):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(w=warmup.warm(files, budget, reads, stop=stop,
                                                                        resident=resident_pages)))
    thread.start()
    return thread, out


def test_the_warm_up_reads_nothing_while_serving_reads_then_everything(tmp_path):
    path = cold_file(tmp_path / "a.bin", 3 * warmup.FIRST_PIECE + 123)
    reads = Watched()
    with reads.reading():  # a restore in flight
        thread, out = warm_in_thread([(path.stat().st_size, [path])], 1 << 40, reads)
        assert reads.waiting.wait(60)
        time.sleep(HELD_S)
        assert thread.is_alive()
        assert resident_pages(path)[0] == 0  # not one piece read beside it
    thread.join(60)
    warmed = out["w"]
    assert warmed.read_bytes == path.stat().st_size and warmed.files == 1
    assert warmed.paused_s >= HELD_S * 0.9
    assert resident_pages(path)[0] == resident_pages(path)[1]


def test_the_warm_up_ends_at_stop_and_keeps_to_its_budget_newest_first(tmp_path):
    new = cold_file(tmp_path / "new.bin", warmup.FIRST_PIECE)
    old = cold_file(tmp_path / "old.bin", warmup.FIRST_PIECE)
    reads, stop = warmup.ForegroundReads(), threading.Event()
    with reads.reading():
        thread, out = warm_in_thread([(100, [new]), (100, [old])], 150, reads, stop)
        time.sleep(0.1)
        stop.set()
        thread.join(60)
    assert out["w"].stopped and out["w"].read_bytes == 0
    warmed = warmup.warm([(100, [new]), (100, [old])], 150, reads, resident=resident_pages)
    assert (warmed.chosen_bytes, warmed.files, warmed.read_bytes) == (100, 1, warmup.FIRST_PIECE)
    assert resident_pages(old)[0] == 0
    missing = warmup.warm([(1, [tmp_path / "gone.bin"])], 10, reads)  # vanished: skipped, no error
    assert missing.read_bytes == 0


def test_a_restore_in_flight_holds_the_stores_warm_up(tmp_path):
    """SsdStore.load marks its read: a warm-up started while a restore is landing waits for it."""
    identity = StoreIdentity("m", compute_fingerprint({"m": 1}), "m")
    store = SsdStore(tmp_path, identity)
    store.scan()
    c = mlc.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, 64, 8)), mx.random.normal((1, 2, 64, 8)))
    stored = store.write(kinds.plan_snapshot([c], meta=identity.meta(list(range(64)), "")))
    assert isinstance(stored, Stored)
    record = stored.record
    landing, release = threading.Event(), threading.Event()
    store._reads = Watched()  # the store's own count of its loads, watched

    def land(header):
        landing.set()
        release.wait(30)  # the restore holds here, mid-read
        return kinds.landing(header)

    loaded: dict = {}
    reader = threading.Thread(target=lambda: loaded.update(r=store.load(record, land=land)))
    reader.start()
    assert landing.wait(30)
    out: dict = {}
    warmer = threading.Thread(target=lambda: out.update(w=store.warm_page_cache([record], 1 << 40)))
    t0 = time.monotonic()
    fd = os.open(record.path, os.O_RDONLY)  # out of the page cache, so the warm-up has something to read
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if resident_pages(record.path)[0] == resident_pages(record.path)[1]:
        release.set()
        reader.join(30)
        pytest.skip("this filesystem keeps pages after DONTNEED")
    warmer.start()
    assert store._reads.waiting.wait(60)
    time.sleep(HELD_S)
    assert warmer.is_alive()
    release.set()
    reader.join(30)
    warmer.join(30)
    assert loaded["r"] is not None and tuple(loaded["r"].header.tokens) == tuple(range(64))
    warmed = out["w"]
    assert warmed.paused_s >= HELD_S * 0.9 and warmed.read_bytes > 0
    assert time.monotonic() - t0 >= HELD_S


def test_a_piece_is_what_the_disk_reads_in_piece_s_growing_at_most_twofold():
    piece = warmup.PieceSize()
    assert piece.bytes == warmup.FIRST_PIECE
    piece.measured(piece.bytes, piece.bytes / 4e6)  # a disk read at 4 MB/s: 80 KB in PIECE_S
    assert piece.bytes == int(4e6 * warmup.PIECE_S) // warmup.MIN_PIECE * warmup.MIN_PIECE
    piece.measured(piece.bytes, piece.bytes / 40e3)  # slower still: never under the floor
    assert piece.bytes == warmup.MIN_PIECE
    piece.measured(piece.bytes, 1e-6)  # from the page cache: twice the last piece, not the rate's
    assert piece.bytes == 2 * warmup.MIN_PIECE
    for _ in range(20):
        piece.measured(piece.bytes, piece.bytes / 2e9)  # a disk at 2 GB/s: 40 MB in PIECE_S, capped
    assert piece.bytes == warmup.MAX_PIECE
