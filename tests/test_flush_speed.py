"""The SIGTERM flush at the disk's write bandwidth (issue 28): what a flush pays besides the bytes.

A checkpoint's write begun beside decode (one block at a time) hands its remaining blocks to the four
writing threads once a flush waits; a buffered file is written back a slice at a time with one slice in
flight behind the one being filled (sync_file_range), made durable by its fsync at the end; the flush
reports where its seconds went. Bytes on disk are always the source's.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlc

from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.file_format import write as ffw
from mlxd.kv.pacing import Pacer, WriteGovernor
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity

MB = 1 << 20
IDENTITY = StoreIdentity(model_id="m", fingerprint="f" * 32, tokenizer_hash="t")


def _plan(n: int, heads: int = 4, dim: int = 16, layers: int = 1):
    caches = []
    for layer in range(layers):
        c = mlc.KVCache()
        pos = mx.arange(n, dtype=mx.float32)[None, None, :, None]
        k = pos * 1000 + mx.arange(heads, dtype=mx.float32)[None, :, None, None] * 16 + mx.arange(dim, dtype=mx.float32)
        c.update_and_fetch(k + layer, -k - layer)
        caches.append(c)
    return kinds.plan_snapshot(caches, meta=IDENTITY.meta(tuple(range(n)), ""))


def test_a_write_begun_beside_decode_goes_four_blocks_at_a_time_once_a_flush_waits(tmp_path: Path, monkeypatch):
    """Rows decode (paced): the checkpoint's first blocks go one at a time on the calling thread; a flush
    arrives; the blocks not yet started are written several at once on the block-writing threads, and
    every block's bytes are the source's."""
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    g.set_busy(True)
    pacer = Pacer(g)
    assert pacer.serial()
    caller = threading.current_thread().name
    lock = threading.Lock()
    threads: list[str] = []  # the thread that wrote each block, in the order they started
    inflight = [0, 0]  # now, most
    together = threading.Barrier(2, timeout=60)  # two blocks in flight at once after the flush, or a timeout
    real = ff.write_snapshot

    def write(plan, path, **kw):
        with lock:
            threads.append(threading.current_thread().name)
            index = len(threads)
            inflight[0] += 1
            inflight[1] = max(inflight)
        try:
            if index == 2:
                g.set_urgent("flush", True)  # a flush waits from the second block on
            elif index in (3, 4):
                together.wait()
            return real(plan, path, **kw)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(ff, "write_snapshot", write)
    plan = _plan(16 * 10)
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    stored = store.write(plan, pacer)
    assert isinstance(stored, Stored)
    assert len(threads) == 10
    assert threads[:2] == [caller, caller]  # begun one at a time, on the writer's own thread
    assert all(t.startswith("mlxd-block-write") for t in threads[2:]) and inflight[1] >= 2
    loaded = store.load(stored.record)
    assert loaded is not None
    assert all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))


def _tensors_on_disk_are(path: Path, plan) -> bool:
    head = ff.read_header(path)
    raw = path.read_bytes()
    descs = [t for c in head.caches for t in c.tensors if t is not None]
    return len(descs) == len(plan.buffers) and all(
        raw[t.offset : t.offset + t.nbytes] == bytes(buf) for t, buf in zip(descs, plan.buffers, strict=True))


def test_buffered_slices_are_written_back_one_behind_and_the_file_is_the_source(tmp_path: Path, monkeypatch):
    """Unpaced (a flush): each slice's write-back starts at once and only the slice before it is waited for;
    the file is fsynced at its end and holds the source's bytes."""
    calls: list[tuple[int, int, int]] = []
    real = ffw._sync_range

    def record(fd: int, offset: int, nbytes: int, flags: int) -> bool:
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(ffw, "_sync_range", record)
    syncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd))[1])
    plan = _plan(16 * 80, heads=8, dim=128)  # keys and values, 5.2 MB each
    pacer = Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=1 * MB)
    written = ff.write_snapshot(plan, tmp_path / "x.mlxkv", pacer=pacer)
    starts = [c for c in calls if c[2] == ffw._SYNC_RANGE_WRITE]
    waits = [c for c in calls if c[2] == ffw._SYNC_RANGE_WAIT]
    assert len(starts) >= 10 and len(waits) == len(starts) - 1
    assert [w[:2] for w in waits] == [s[:2] for s in starts[:-1]]  # each wait is for the slice before
    assert syncs, "the file is fsynced before its rename"
    assert _tensors_on_disk_are(written.path, plan)


def test_without_sync_file_range_every_slice_is_fdatasynced(tmp_path: Path, monkeypatch):
    """Where sync_file_range is missing (not Linux), each slice is written back whole before the next."""
    monkeypatch.setattr(ffw, "_sync_file_range", None)
    datasyncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (datasyncs.append(fd), real(fd))[1])
    plan = _plan(16 * 32, heads=8, dim=128)  # 2.1 MB each
    pacer = Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=1 * MB)
    written = ff.write_snapshot(plan, tmp_path / "y.mlxkv", pacer=pacer)
    assert len(datasyncs) >= 4
    assert _tensors_on_disk_are(written.path, plan)


def test_a_sigterm_flush_of_a_write_begun_beside_decode_is_durable_and_reports_its_split(tmp_path, tiny_model_dir):
    """A real server: a conversation's checkpoint starts writing at a crawl beside a decoding row (one block at
    a time); SIGTERM; the drain lets the row finish, the flush writes the rest at full speed and says where
    its seconds went; the process exits 0 after `serve.stopped`; a new process restores the conversation and
    continues it exactly (same tokens, same logprobs)."""
    import json
    import signal

    import pytest

    from procs import ServeProcess

    cache = tmp_path / "ssd"
    flags = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
             "--ssd-block-tokens", "16", "--ssd-write-rate", "0.01", "--shutdown-timeout", "60")
    turn = [{"role": "system", "content": "You are a meticulous assistant. Answer in full sentences. " * 12},
            {"role": "user", "content": "What is a prefix cache?"}]
    body = {"model": "tiny", "messages": turn, "temperature": 0, "max_tokens": 8, "logprobs": True}
    with ServeProcess(*flags, log_path=tmp_path / "first.log") as first:
        decoding = threading.Thread(target=_decode, args=(first.url,))
        decoding.start()
        with first.client() as http:
            _until(lambda: http.get("/stats").json()["scheduler"]["running"] >= 1)
            warm = http.post("/v1/chat/completions", json=body)
            assert warm.status_code == 200, warm.text
            _until(lambda: http.get("/stats").json()["ssd_cache"]["pending_spills"] >= 1)
            assert http.get("/stats").json()["scheduler"]["running"] >= 1, "the row still decodes at the signal"
        first.signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
        decoding.join(timeout=60)
    events = [json.loads(line) for line in first.log().splitlines() if line.startswith("{")]
    flushed = next(e for e in events if e.get("event") == "serve.flushed")
    assert flushed["durable"] is True and flushed["pending"] == 0 and flushed["failed"] == 0, flushed
    assert flushed["writes"] >= 1 and flushed["written_bytes"] > 0
    assert flushed["files_s"] > 0 and flushed["sync_s"] > 0 and flushed["pwrite_s"] > 0
    assert any(e.get("event") == "serve.stopped" for e in events)

    with ServeProcess(*flags, log_path=tmp_path / "second.log") as second, second.client() as http:
        again = http.post("/v1/chat/completions", json=body)
        assert again.status_code == 200, again.text
        a, w = again.json(), warm.json()
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= a["usage"]["prompt_tokens"] - 16
        assert a["choices"][0]["message"]["content"] == w["choices"][0]["message"]["content"]
        lp = [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]]
        assert lp == pytest.approx([c["logprob"] for c in w["choices"][0]["logprobs"]["content"]], abs=1e-4)
        assert http.get("/stats").json()["ssd_cache"]["restores"] == 1
        second.signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 0


def _decode(url: str) -> None:
    """One row decoding for a while (end tokens banned), streamed until the server ends it or it finishes."""
    import httpx

    body = {"model": "tiny", "prompt": "Count slowly. " * 4, "max_tokens": 400, "stream": True,
            "logit_bias": {"0": -100, "2": -100}}
    try:
        with httpx.Client(base_url=url, timeout=120) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass


def _until(check, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_write_back_error_fails_the_write_and_leaves_no_file(tmp_path: Path, monkeypatch):
    """EIO from a slice's write-back: the write fails as a storage error (a miss, not a file), its tmp file is
    removed, and the store reports the checkpoint not stored; an EINTR is retried, not a failure."""
    import ctypes
    import errno

    from mlxd.kv.ssd_store import Failed

    calls = []

    def failing(fd, offset, nbytes, flags):
        calls.append(flags)
        if len(calls) == 1:  # the first call is interrupted by a signal: tried again
            ctypes.set_errno(errno.EINTR)
            return -1
        if len(calls) >= 3:
            ctypes.set_errno(errno.EIO)
            return -1
        return 0

    monkeypatch.setattr(ffw, "_sync_file_range", failing)
    plan = _plan(16 * 80, heads=8, dim=128)
    pacer = Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=1 * MB)
    try:
        ff.write_snapshot(plan, tmp_path / "x.mlxkv", pacer=pacer)
    except ff.StorageError as exc:
        assert exc.errno == errno.EIO
    else:
        raise AssertionError("the write-back error was not reported")
    assert calls[:2] == [ffw._SYNC_RANGE_WRITE, ffw._SYNC_RANGE_WRITE]  # EINTR: the same call again
    assert list(tmp_path.iterdir()) == []
    calls.clear()
    store = SsdStore(tmp_path / "store", IDENTITY, layout="blocks", block_tokens=16 * 40)
    outcome = store.write(plan, Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=1 * MB))
    assert isinstance(outcome, Failed) and "Input/output error" in outcome.error
    assert not [p for p in (tmp_path / "store").rglob("*") if p.suffix in (".mlxmf", ".tmp")]


def _spans(plan, store_dir: Path, writers: int):
    """The block files a store with `writers` threads writes for `plan` (unpaced), name -> bytes."""
    store = SsdStore(store_dir, IDENTITY, layout="blocks", block_tokens=16)
    store.blocks.writers = writers
    stored = store.write(plan, Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=64 * 1024))
    assert isinstance(stored, Stored), stored
    return store, stored, {p.name: p.read_bytes() for p in store.blocks.blocks_dir.iterdir()}


def test_the_last_blocks_of_an_unpaced_write_are_split_between_the_writers_and_are_fsynced_before_renamed(
        tmp_path: Path, monkeypatch):
    """Six blocks on four threads: four whole, and the last two each written by several threads in parts (no
    thread finishes a block alone while the others idle); every block file is byte for byte what one thread
    writes, fsynced before its rename; the blocks directory is fsynced before the manifest; the checkpoint
    loads back as the source."""
    from mlxd.kv import block_store

    monkeypatch.setattr(block_store, "SPLIT_MIN_PART", 16 * 1024)
    plan = _plan(16 * 6, heads=8, dim=32, layers=2)  # 4 tensors of 16 KiB a block: four parts
    _, _, single = _spans(plan, tmp_path / "one", writers=1)

    lock = threading.Lock()
    parts: list[tuple[str, str]] = []  # (file, thread) of every part written
    real_part = ffw.SplitWrite.write_part

    def write_part(self, i, prepare=None):
        with lock:
            parts.append((self.path.name, threading.current_thread().name))
        return real_part(self, i, prepare)

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(a, b):
        real_replace(a, b)
        with lock:
            events.append(("rename", str(a)))

    monkeypatch.setattr(ffw.SplitWrite, "write_part", write_part)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store, stored, split = _spans(plan, tmp_path / "four", writers=4)
    monkeypatch.undo()

    assert split == single  # the same names, the same bytes
    files = {name for name, _ in parts}
    assert len(files) == 2 and len(parts) == 8  # the last two blocks, four parts each
    assert all(t.startswith("mlxd-block-write") for _, t in parts)
    for name in files:
        tmp = str(store.blocks.blocks_dir / (name + ".tmp"))
        synced = next(i for i, e in enumerate(events) if e == ("fsync", tmp))
        renamed = next(i for i, e in enumerate(events) if e == ("rename", tmp))
        assert synced < renamed, (name, events)
    dir_sync = max(i for i, e in enumerate(events) if e == ("fsync", str(store.blocks.blocks_dir)))
    block_renames = [i for i, e in enumerate(events) if e[0] == "rename" and e[1].endswith(".mlxblk.tmp")]
    manifest = next(i for i, e in enumerate(events) if e[0] == "rename" and e[1].endswith(".mlxmf.tmp"))
    assert max(block_renames) < dir_sync < manifest
    loaded = store.load(stored.record)
    assert loaded is not None
    assert all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))


def test_a_failed_part_fails_the_checkpoint_and_leaves_no_file(tmp_path: Path, monkeypatch):
    """EIO in one part of a split block: the write fails as a storage error naming it (the checkpoint is not
    stored, a miss later), no tmp file, no manifest and no half-written block is left."""
    import errno

    from mlxd.kv import block_store
    from mlxd.kv.ssd_store import Failed

    monkeypatch.setattr(block_store, "SPLIT_MIN_PART", 16 * 1024)
    real = ffw._write_range
    calls = [0]
    lock = threading.Lock()

    def failing(fd, start, descs, buffers, pacer, direct):
        with lock:
            calls[0] += 1
            fail = calls[0] == 2
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, start, descs, buffers, pacer, direct)

    monkeypatch.setattr(ffw, "_write_range", failing)
    plan = _plan(16 * 1, heads=8, dim=32, layers=2)  # one block of 4 tensors of 16 KiB: four parts
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    outcome = store.write(plan, Pacer(WriteGovernor(busy_rate_bytes_per_s=None), slice_bytes=64 * 1024))
    assert isinstance(outcome, Failed) and "Input/output error" in outcome.error, outcome
    left = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "blocks.lock"]
    assert left == [], left


def test_the_flush_hands_the_unstarted_blocks_off_while_the_block_in_flight_is_still_being_written(
        tmp_path: Path, monkeypatch):
    """A write begun beside decode (one block at a time); the flush comes during its first block: the blocks not
    started go to the writing threads at its next slice, before that block ends (it does not finish alone while
    they wait); all blocks are the source's."""
    g = WriteGovernor(busy_rate_bytes_per_s=1024 * MB)
    g.set_busy(True)
    pacer = Pacer(g, slice_bytes=4096)
    assert pacer.serial()
    others = threading.Event()
    lock = threading.Lock()
    order: list[str] = []
    real = ff.write_snapshot

    def write(plan, path, **kw):
        with lock:
            order.append(threading.current_thread().name)
            first = len(order) == 1
        if not first:
            others.set()
            return real(plan, path, **kw)
        g.set_urgent("flush", True)  # the flush arrives as the first block starts
        written = real(plan, path, **kw)  # 64 KiB in 4 KiB slices: the hand-off comes after the first
        assert others.wait(60), "the other blocks waited for the block in flight"
        return written

    monkeypatch.setattr(ff, "write_snapshot", write)
    plan = _plan(16 * 6, heads=8, dim=64)
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    stored = store.write(plan, pacer)
    assert isinstance(stored, Stored), stored
    assert order[0] == threading.current_thread().name
    assert all(t.startswith("mlxd-block-write") for t in order[1:])
    loaded = store.load(stored.record)
    assert loaded is not None
    assert all(bytes(a) == bytes(b) for a, b in zip(loaded.buffers, plan.buffers, strict=True))
