"""File I/O of the block store (seed §5.11 C1; the pure part is `mlxd.kv.blocks`).

Layout under the fingerprint directory (as whole files, `mlxd.kv.ssd_store`):

    <root>/<fingerprint>/blocks/<name>.mlxblk      a block: an `.mlxkv` format-2 file
    <root>/<fingerprint>/<ns-hash>/<stem>.mlxmf    a manifest: one checkpoint
    <root>/<fingerprint>/<ns-hash>/<stem>.mlxkv    a whole-file checkpoint (still read)
    <root>/<fingerprint>/blocks.lock               serializes collection with writes

A block is an ordinary snapshot file (hashed header, per-tensor CRC-32) of
its span's tensors, so it is written and verified exactly as a whole file is.
A manifest is a hashed JSON document (sha256, like a file header).

Ordering: every block a manifest names is committed (tmp + fsync + rename,
then the blocks directory is fsynced) before the manifest is written the same
way, so a crash never leaves a manifest naming a missing block. A writer
holds the lock file shared from its first existence probe to its manifest's
rename; collection holds it exclusively and removes only blocks that no
manifest on disk names (and tmp files, which only a dead writer can leave
while nobody holds the lock). One writer thread per process does both, and
`flock` serializes processes sharing the directory.

The store keeps no index (the cache tiers do, with `blocks.BlockLedger`),
only a hint of where known blocks start (`blocks.SharedStarts`, rebuilt by
the scan) so a new block ends where it stops sharing a stored one:
`scan()` returns the manifests' records, `write()` commits one checkpoint,
`load()` returns the loaded snapshot or None (a miss; what is damaged is
removed), `collect()` removes garbage blocks. `mlxd.kv.ssd_store.SsdStore`
uses it for its "blocks" layout, beside its whole files.

Symbolic links below the cache root are never followed: a linked `blocks/`
or namespace directory is not scanned, collected or written into, and a
linked file is skipped (logged as `ssd_symlink_ignored`), so neither the scan
nor a collection can delete anything outside the cache directory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from mlxd.kv import blocks as bk
from mlxd.kv import file_format as ff
from mlxd.kv.file_format import write as ffw
from mlxd.kv.file_format.header import NP_DTYPES as _NP_DTYPES
from mlxd.kv.file_format.header import cache_doc as _cache_doc
from mlxd.kv.file_format.header import parse_cache as _parse_cache
from mlxd.kv.file_format.read import read_open_header as _read_header
from mlxd.kv.listing import is_link, listdir, real_dir
from mlxd.kv.pacing import Pacer
from mlxd.kv.shared_dir import fresh_stem, new_writer_id
from mlxd.kv.tiers import SsdRecord
from mlxd.runtime.logging import get_logger

if TYPE_CHECKING:
    from mlxd.kv.ssd_store import StoreIdentity

log = get_logger(__name__)

# A piece's plan, made ready just before it is written (the SSD writer's staging to host memory).
Prepare = Callable[[ff.SnapshotPlan], ff.SnapshotPlan]


BLOCK_EXT = ".mlxblk"
MANIFEST_EXT = ".mlxmf"
MANIFEST_MAGIC = b"MLXDMF\r\n"
MANIFEST_VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQ32s8x")  # magic, version, flags, body_len, sha256, reserved
_MAX_MANIFEST = 64 << 20
SPLIT_MIN_PART = 2 << 20
"""A block written by several threads at once (the tail of an unpaced write) gets parts of at least this
many bytes: smaller ones would cost an open and a write-back each for little overlap."""
WRITERS = 4
"""New block files one write commits at once while nothing paces the writer (a flush, an idle
engine): each file's write and fsync overlap the others'. Paced write-behind writes one at a time."""
READERS = 8
"""Block files one load reads at once (`BlockStore.readers`). One file at a time, every block
pays the disk's first-read latency and readahead ramp in series; with several files in flight
the device always has requests queued (docs/benchmarks.md, content-addressed SSD blocks)."""


# ------------------------------------------------------------- records


@attrs.frozen
class BlocksWritten:
    """A checkpoint committed as blocks + manifest: its record, and what it cost."""

    record: SsdRecord
    written_bytes: int  # new block files + the manifest
    new_blocks: int
    reused_blocks: int
    seconds: float


@attrs.frozen
class ScanReport:
    manifests: int = 0
    blocks: int = 0
    block_bytes: int = 0
    corrupt: int = 0  # unreadable manifests, and manifests naming a missing block
    orphans: int = 0  # tmp files of interrupted writes
    collected: int = 0  # blocks no manifest names


@attrs.frozen
class BlockScan:
    records: tuple[SsdRecord, ...]
    report: ScanReport


@attrs.frozen
class GcReport:
    removed: int = 0
    removed_bytes: int = 0
    orphans: int = 0
    kept: int = 0  # candidates a manifest still names


# ------------------------------------------------------------ manifests


def encode_manifest(m: bk.Manifest) -> bytes:
    meta = m.meta
    doc = {
        "manifest_version": MANIFEST_VERSION,
        "block_format_version": ff.FORMAT_VERSION,
        "model_id": meta.model_id,
        "config_fingerprint": meta.config_fingerprint,
        "namespace": meta.namespace,
        "tokenizer_hash": meta.tokenizer_hash,
        "created_at": meta.created_at,
        "tokens": list(meta.tokens),
        "block_tokens": m.block_tokens,
        "caches": [_cache_doc(c) for c in m.caches],
        "blocks": [[b.name, b.start, b.end, b.nbytes, b.file_bytes, int(b.state)] for b in m.blocks],
    }
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    head = _PREAMBLE.pack(MANIFEST_MAGIC, MANIFEST_VERSION, 0, len(body), b"\0" * 32)
    digest = hashlib.sha256(head[:24] + body).digest()
    return _PREAMBLE.pack(MANIFEST_MAGIC, MANIFEST_VERSION, 0, len(body), digest) + body


def decode_manifest(data: bytes) -> bk.Manifest:
    """Parse and hash-check a manifest; any surprise is CorruptFile."""
    if len(data) < _PREAMBLE.size:
        raise ff.CorruptFile("manifest ends early")
    magic, version, flags, n, digest = _PREAMBLE.unpack(data[: _PREAMBLE.size])
    if magic != MANIFEST_MAGIC:
        raise ff.CorruptFile("not a manifest (bad magic)")
    if version != MANIFEST_VERSION:
        raise ff.UnsupportedVersion(f"manifest version {version}, this build reads {MANIFEST_VERSION}")
    body = data[_PREAMBLE.size :]
    if flags or n != len(body) or n > _MAX_MANIFEST:
        raise ff.CorruptFile("bad manifest preamble or size")
    if hashlib.sha256(data[:24] + body).digest() != digest:
        raise ff.CorruptFile("manifest hash mismatch")
    try:
        doc = json.loads(body)
        if doc["block_format_version"] != ff.FORMAT_VERSION:
            raise ff.UnsupportedVersion("blocks of another file format version")
        meta = ff.SnapshotMeta(
            model_id=_typed(doc["model_id"], str),
            config_fingerprint=_typed(doc["config_fingerprint"], str),
            namespace=_typed(doc["namespace"], str),
            tokenizer_hash=_typed(doc["tokenizer_hash"], str),
            tokens=[_typed(t, int) for t in doc["tokens"]],
            created_at=float(doc["created_at"]),
        )
        refs = tuple(
            bk.BlockRef(
                _typed(b[0], str), _typed(b[1], int), _typed(b[2], int), _typed(b[3], int), _typed(b[4], int),
                bool(_typed(b[5], int)),
            )
            for b in doc["blocks"]
        )
        manifest = bk.Manifest(
            meta=meta,
            caches=tuple(_parse_cache(c) for c in doc["caches"]),
            blocks=refs,
            block_tokens=_typed(doc["block_tokens"], int),
        )
    except ff.CorruptFile:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError) as exc:
        raise ff.CorruptFile(f"malformed manifest: {exc!r}") from exc
    if not all(bk.is_block_name(b.name) for b in refs):
        raise ff.CorruptFile("bad block name in manifest")
    problem = bk.check_chain(manifest)
    if problem:
        raise ff.CorruptFile(problem)
    return manifest


def _typed(x: Any, kind: type) -> Any:
    if type(x) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {type(x).__name__}")
    return x


def read_manifest(path: Path) -> bk.Manifest:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_MANIFEST + _PREAMBLE.size + 1)
    except OSError as exc:
        raise ff.storage_error(exc, f"reading {path}") from exc
    return decode_manifest(data)


def _write_durably(path: Path, data: bytes) -> None:
    """tmp (O_EXCL) + fsync + rename + fsync of the directory. Raises OSError."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    ff.fsync_dir(path.parent)


# -------------------------------------------------------------- the store


@attrs.define
class BlockStore:
    """Blocks and manifests in one fingerprint directory. Every method is (I/O): a worker thread's."""

    root: Path = attrs.field(converter=Path)
    identity: StoreIdentity
    block_tokens: int = bk.BLOCK_TOKENS
    readers: int = READERS  # block files one load reads at once (their destinations are disjoint)
    writers: int = WRITERS  # new block files one unpaced write commits at once
    writer: str = attrs.field(factory=new_writer_id)  # the first hex digits of its manifests' names
    _manifest_cache: dict[Path, tuple[int, int, tuple[str, ...]]] = attrs.field(factory=dict, init=False)
    # Where this process's known blocks start (scan + writes): a new block ends where it stops sharing.
    _starts: bk.SharedStarts = attrs.field(factory=bk.SharedStarts, init=False)
    _starts_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)  # writer vs collecting threads

    @property
    def directory(self) -> Path:
        return self.root / self.identity.fingerprint

    @property
    def blocks_dir(self) -> Path:
        return self.directory / "blocks"

    def block_path(self, name: str) -> Path:
        return self.blocks_dir / (name + BLOCK_EXT)

    # ------------------------------------------------------------ locking

    @contextmanager
    def _locked(self, *, exclusive: bool) -> Iterator[None]:
        """Shared for writers, exclusive for collection and the startup scan (flock: per open file)."""
        self._make_dirs()
        fd = os.open(self.directory / "blocks.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _make_dirs(self, *more: Path) -> None:
        d = self.root
        try:
            for d in (self.root, self.directory, self.blocks_dir, *more):
                if d != self.root and d.is_symlink():  # the root may be a link: the operator chose it
                    raise OSError(errno.ELOOP, "a symbolic link in the cache directory (never followed)")
                if not d.is_dir():
                    d.mkdir(mode=0o700, exist_ok=True)
                    os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            raise ff.storage_error(exc, f"creating {d}") from exc

    # ------------------------------------------------------------- writes

    def write(self, plan: ff.SnapshotPlan, pacer: Pacer | None = None, *, prepare: Prepare | None = None) -> BlocksWritten:
        """Commit the plan's new blocks, then its manifest. Raises StorageError (blocks it
        committed stay valid until collected) or the pacer's WriteInterrupted. `prepare`: applied to
        each new block's plan just before it is written (on the thread writing it)."""
        t0 = time.perf_counter()
        meta = plan.meta
        ns_dir = self.directory / _namespace_dir(meta.namespace)
        self._make_dirs(ns_dir)
        with self._locked(exclusive=False):
            refs, written, new = self._write_blocks(plan, pacer, prepare)
            manifest = bk.Manifest(meta, bk.blank(plan.caches), tuple(refs), self.block_tokens)
            data = encode_manifest(manifest)
            path = ns_dir / (fresh_stem(self.writer) + MANIFEST_EXT)
            t1 = time.perf_counter()
            try:
                _write_durably(path, data)
            except OSError as exc:
                raise ff.storage_error(exc, f"writing {path}") from exc
            if pacer is not None:  # a small file: its seconds are its two fsyncs
                pacer.times.add(sync_s=time.perf_counter() - t1)
        with self._starts_lock:
            self._starts.add(meta.tokens, refs)
        record = SsdRecord(
            meta.namespace, meta.tokens, manifest.nbytes, time.time(), manifest.trimmable, path, tuple(refs)
        )
        return BlocksWritten(record, written + len(data), new, len(refs) - new, time.perf_counter() - t0)

    def _write_blocks(
        self, plan: ff.SnapshotPlan, pacer: Pacer | None, prepare: Prepare | None = None
    ) -> tuple[list[bk.BlockRef], int, int]:
        meta = plan.meta
        n = len(meta.tokens)
        sizes: dict[str, int] = {}

        def exists(name: str) -> bool:
            try:
                sizes[name] = os.stat(self.block_path(name)).st_size
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise ff.storage_error(exc, f"probing block {name}") from exc
            return True

        views = _LeafViews(plan)
        refs: list[bk.BlockRef] = []
        written = new = 0
        if views.spanned:
            with self._starts_lock:  # probes only the ends of blocks it knows (and the grid line)
                spans = bk.choose_spans(
                    meta.tokens,
                    namespace=meta.namespace,
                    fingerprint=meta.config_fingerprint,
                    exists=exists,
                    block_tokens=self.block_tokens,
                    starts=self._starts,
                )
            fresh = [s for s in spans if not s.exists]
            made = self._write_blocks_of([(s.name, views.span_plan(meta, s.start, s.end)) for s in fresh], pacer,
                                         prepare)
            for s in spans:
                payload = _payload(bk.span_descs(plan.caches, n, s.start, s.end))
                size = made[s.name] if not s.exists else sizes[s.name]
                refs.append(bk.BlockRef(s.name, s.start, s.end, payload, size))
            written, new = sum(made.values()), len(made)
        if views.whole:
            name = bk.state_hash(meta.tokens, namespace=meta.namespace, fingerprint=meta.config_fingerprint)
            payload = _payload(bk.state_descs(plan.caches, n))
            if exists(name):
                refs.append(bk.BlockRef(name, n, n, payload, sizes[name], state=True))
            else:
                size = self._write_block(name, views.state_plan(meta), pacer, prepare)
                refs.append(bk.BlockRef(name, n, n, payload, size, state=True))
                written, new = written + size, new + 1
        t0 = time.perf_counter()
        try:
            ff.fsync_dir(self.blocks_dir)  # blocks reused from another writer are durable too
        except OSError as exc:
            raise ff.storage_error(exc, f"syncing {self.blocks_dir}") from exc
        if pacer is not None:
            pacer.times.add(sync_s=time.perf_counter() - t0)
        return refs, written, new

    def _write_blocks_of(
        self, jobs: list[tuple[str, ff.SnapshotPlan]], pacer: Pacer | None, prepare: Prepare | None = None
    ) -> dict[str, int]:
        """Commit new blocks (name -> file size): `writers` at a time unless the pacer says one at a time
        (`Pacer.serial`: paced, held, or a backlog beside decode). A write that started in parallel (the
        engine idle) and finds it serial at a block's start (rows decode now, or a prompt waits for its
        first token) writes that block and the rest one at a time: four writing threads beside decode
        stage, hash and write four blocks at once (issue 28). The other way round too: a write begun one
        block at a time (rows decoding) hands the blocks it has not started to the `writers` threads the
        moment it may (a flush waits, the engine went idle: checked after every slice of the block in
        flight, which then finishes beside them, not alone before them), so a SIGTERM flush never finishes
        a checkpoint begun beside decode one block at a time (issue 28: a 1.9 GB checkpoint's last 0.9 GB
        flushed at 0.44x the disk on the H200). Unpaced, the last blocks are split between the writing
        threads (`_start_at_once`)."""
        made: dict[str, int] = {}
        left = list(jobs)
        while left and (self.writers <= 1 or (pacer is not None and pacer.serial())):
            name, plan = left.pop(0)
            if pacer is None or not left or self.writers <= 1:
                made[name] = self._write_block(name, plan, pacer, prepare)
            else:
                made.update(self._write_block_handing_off(name, plan, left, pacer, prepare))
        if left:
            made.update(self._start_at_once(left, pacer, prepare).result())
        return made

    def _write_block_handing_off(
        self, name: str, plan: ff.SnapshotPlan, left: list[tuple[str, ff.SnapshotPlan]], pacer: Pacer,
        prepare: Prepare | None,
    ) -> dict[str, int]:
        """Write one block on this thread while the pacer says serial; if it stops saying so between two of
        the block's slices, every block in `left` (emptied) starts on the writing threads at once, beside it."""
        handed: list[_Batch] = []
        lock = threading.Lock()

        def hand_off() -> None:
            if handed or not left or pacer.serial():
                return
            with lock:
                if not handed and left:
                    jobs = list(left)
                    left.clear()
                    handed.append(self._start_at_once(jobs, pacer, prepare))

        def stop() -> _Batch | None:
            with lock:
                batch = handed[0] if handed else None
                handed.append(_Batch([], []))  # no hand-off from here on
            return batch

        made: dict[str, int] = {}
        try:
            with pacer.watching(hand_off):
                made[name] = self._write_block(name, plan, pacer, prepare)
        except BaseException:
            batch = stop()
            if batch is not None:
                try:
                    batch.result()  # waited for: nothing is still writing when this write fails
                except BaseException:  # noqa: S110 - the block in flight's failure is the one reported
                    pass
            raise
        batch = stop()
        if batch is not None:
            made.update(batch.result())
        return made

    def _start_at_once(
        self, jobs: list[tuple[str, ff.SnapshotPlan]], pacer: Pacer | None, prepare: Prepare | None
    ) -> _Batch:
        """Start `jobs` on the `writers` threads; one at a time again for the blocks started while the pacer
        says so. Unpaced, the last `len(jobs) % writers` blocks are written `writers` parts at a time
        (`ff.SplitWrite`: each thread takes a part, the last one to end fsyncs and renames the file), so the
        last wave keeps every thread writing instead of one or two finishing whole blocks alone (issue 28:
        a small flush's tail)."""
        pool = _thread_pool(self.writers, "mlxd-block-write")
        one = threading.Lock()

        def block(name: str, plan: ff.SnapshotPlan) -> int | None:
            if pacer is not None and pacer.serial():
                with one:
                    return self._write_block(name, plan, pacer, prepare)
            return self._write_block(name, plan, pacer, prepare)

        def part(split: ffw.SplitWrite, i: int) -> int | None:
            if pacer is not None and pacer.serial():
                with one:
                    return self._write_part(split, i, prepare)
            return self._write_part(split, i, prepare)

        whole, splits = list(jobs), list[ffw.SplitWrite]()
        tail = len(jobs) % self.writers
        if tail and (pacer is None or not pacer.serial()):
            whole, last = jobs[: len(jobs) - tail], jobs[len(jobs) - tail :]
            for name, plan in last:
                parts = min(self.writers, plan.nbytes // max(1, SPLIT_MIN_PART))
                split = None
                if parts >= 2:
                    try:
                        split = ffw.SplitWrite(plan, self.block_path(name), parts, pacer=pacer, sync_dir=False)
                    except ff.StorageError as exc:
                        if exc.errno != errno.EEXIST:  # EEXIST: another process writes it: whole, as ever
                            for s in splits:
                                s.abort()
                            raise
                if split is None or split.parts < 2:
                    if split is not None:
                        split.abort()
                    whole.append((name, plan))
                else:
                    splits.append(split)
        futures: list[tuple[str, Future[int | None]]] = [(name, pool.submit(block, name, plan)) for name, plan in whole]
        by_path = {self.block_path(name): name for name, _ in jobs}
        futures += [(by_path[s.path], pool.submit(part, s, i)) for s in splits for i in range(s.parts)]
        return _Batch(futures, splits)

    def _write_part(self, split: ffw.SplitWrite, i: int, prepare: Prepare | None) -> int | None:
        written = split.write_part(i, prepare)
        return None if written is None else written.nbytes

    def _write_block(self, name: str, plan: ff.SnapshotPlan, pacer: Pacer | None, prepare: Prepare | None = None) -> int:
        path = self.block_path(name)
        if prepare is not None:
            plan = prepare(plan)
        try:
            return ff.write_snapshot(plan, path, pacer=pacer, sync_dir=False).nbytes  # synced once, below
        except ff.StorageError as exc:
            if exc.errno != errno.EEXIST:
                raise
        # Another process sharing the directory is writing the same block right now: write
        # a private copy (a tmp name, reaped if we die) and rename it over; both are identical.
        private = path.with_name(f"{name}.{uuid.uuid4().hex[:8]}{BLOCK_EXT}.tmp")
        written = ff.write_snapshot(plan, private, pacer=pacer)
        try:
            os.replace(private, path)
            ff.fsync_dir(path.parent)
        except OSError as exc:
            _unlink_quietly(private)
            raise ff.storage_error(exc, f"writing {path}") from exc
        return written.nbytes

    # -------------------------------------------------------------- reads

    def load(
        self,
        record: SsdRecord,
        *,
        verify: bool = True,
        land: Callable[[ff.FileHeader], ff.Landing] | None = None,
        upto: int = 0,
        start: int = 0,
    ) -> ff.LoadedSnapshot | None:
        """Read a checkpoint's manifest and blocks for adoption; None (a miss) when anything is
        missing or damaged (with `verify`, the default, every tensor's CRC-32 and padding too). A damaged block is removed with the manifest that led to it; the
        other manifests naming it miss in turn when they are loaded.

        `land`, as for whole files (`read_snapshot`): called once with the checkpoint's header
        (the manifest's caches), it gives the memory every tensor is read into (e.g. MLX
        arrays, which `adopt()` then takes without a copy) instead of a private mapping.

        `upto` > 0: read only the leading blocks of the first `upto` tokens (a block boundary;
        `blocks.leading`), a checkpoint of those tokens; the whole one when that cannot be.
        `start` > 0: only the blocks from that token (a block boundary) on (to `upto`, or the
        end), the KV of those tokens alone (`blocks.trailing`); None when that cannot be."""
        assert record.path is not None
        t0 = time.perf_counter()
        landing = None
        try:
            manifest = read_manifest(record.path)
            if manifest.tokens != tuple(record.tokens) or manifest.namespace != record.namespace:
                raise ff.CorruptFile("manifest no longer matches its record")
            problem = self.identity.mismatch(manifest.meta, record.path.parent.name)
            if problem:
                raise ff.CorruptFile(problem)
            if start:
                tail = bk.trailing(manifest, start, upto)
                if tail is None:
                    return None  # no such part (the record's layout changed): a miss, nothing is wrong with it
                manifest = tail
            elif upto:
                manifest = bk.leading(manifest, upto) or manifest
            header = ff.FileHeader(meta=manifest.meta, caches=manifest.caches, data_offset=0, file_size=manifest.nbytes)
            t_land = time.perf_counter()
            landing = land(header) if land is not None else None
            land_s = time.perf_counter() - t_land if land is not None else 0.0
            buffers, verify_s = _read_blocks(self, manifest, verify=verify, landing=landing)
        except _BadBlock as bad:
            log.warning("ssd_corrupt_block_removed", block=bad.name, manifest=str(record.path), reason=str(bad))
            _unlink_quietly(self.block_path(bad.name))
            _unlink_quietly(record.path)
            return None
        except ff.CorruptFile as exc:
            log.warning("ssd_corrupt_file_removed", path=str(record.path), reason=str(exc))
            _unlink_quietly(record.path)
            return None
        except ff.StorageError as exc:
            log.warning("ssd_read_failed", path=str(record.path), error=str(exc))
            return None
        _touch(record)
        return ff.LoadedSnapshot(header, buffers, time.perf_counter() - t0, None if landing is None else landing.owner,
                                 land_s, verify_s)

    def read_record(self, path: Path) -> SsdRecord | None:
        """The record of one published manifest (e.g. another replica's); deletes nothing.
        Its blocks become known to the shared-prefix hint."""
        try:
            mtime = path.stat().st_mtime
            m = read_manifest(path)
        except (ff.StorageError, OSError):
            return None
        if self.identity.mismatch(m.meta, path.parent.name):
            return None
        with self._starts_lock:
            self._starts.add(m.tokens, m.blocks)
        return SsdRecord(m.namespace, m.tokens, m.nbytes, mtime, m.trimmable, path, m.blocks)

    def block_paths(self, record: SsdRecord) -> list[Path]:
        return [self.block_path(b.name) for b in record.blocks]

    # ------------------------------------------------- scan and collection

    def scan(self) -> BlockScan:
        """Startup recovery: reap tmp files, read every manifest, collect unreferenced blocks."""
        records: list[SsdRecord] = []
        counts = {"corrupt": 0, "orphans": 0}
        if any(is_link(d) for d in (self.directory, self.blocks_dir)):
            return BlockScan((), ScanReport())  # nothing behind a link is ours to read or remove
        with self._locked(exclusive=True):
            blocks = self._stored_blocks(counts)
            for ns_dir in self._ns_dirs():
                for path in listdir(ns_dir):
                    record = self._scan_file(path, ns_dir.name, blocks, counts)
                    if record is not None:
                        records.append(record)
            live = {b.name for r in records for b in r.blocks}
            garbage = set(blocks) - live
            for name in garbage:
                _unlink_quietly(self.block_path(name))
            if garbage:
                ff.fsync_dir(self.blocks_dir)
        with self._starts_lock:
            self._starts.discard(garbage)
            for record in records:
                self._starts.add(record.tokens, record.blocks)
        report = ScanReport(
            manifests=len(records),
            blocks=len(blocks) - len(garbage),
            block_bytes=sum(size for name, size in blocks.items() if name not in garbage),
            corrupt=counts["corrupt"],
            orphans=counts["orphans"],
            collected=len(garbage),
        )
        log.info("ssd_block_scan", dir=str(self.directory), **attrs.asdict(report))
        return BlockScan(tuple(records), report)

    def _scan_file(
        self, path: Path, ns_name: str, blocks: dict[str, int], counts: dict[str, int]
    ) -> SsdRecord | None:
        if path.name.endswith(MANIFEST_EXT + ".tmp"):
            _unlink_quietly(path)
            counts["orphans"] += 1
            return None
        if path.suffix != MANIFEST_EXT:
            return None  # whole files are the whole-file store's
        try:
            mtime = path.stat().st_mtime
            manifest = read_manifest(path)
        except ff.CorruptFile as exc:
            self._drop(path, str(exc), counts)
            return None
        except (ff.StorageError, OSError) as exc:
            log.warning("ssd_scan_unreadable", path=str(path), error=str(exc))
            return None
        problem = self.identity.mismatch(manifest.meta, ns_name)
        if problem is None:
            missing = [b.name for b in manifest.blocks if blocks.get(b.name) != b.file_bytes]
            if missing:
                problem = f"names {len(missing)} missing or resized blocks"
        if problem:
            self._drop(path, problem, counts)
            return None
        m = manifest
        return SsdRecord(m.namespace, m.tokens, m.nbytes, mtime, m.trimmable, path, m.blocks)

    def _drop(self, path: Path, why: str, counts: dict[str, int]) -> None:
        log.warning("ssd_corrupt_file_removed", path=str(path), reason=why)
        _unlink_quietly(path)
        counts["corrupt"] += 1

    def _ns_dirs(self) -> Iterator[Path]:
        if real_dir(self.directory):
            yield from (p for p in listdir(self.directory) if p.is_dir() and p != self.blocks_dir)

    def _stored_blocks(self, counts: dict[str, int]) -> dict[str, int]:
        """name -> size of every committed block; tmp files are reaped (call with the lock exclusive).

        A linked `blocks/` directory holds no block of ours: nothing in it is read or removed."""
        found: dict[str, int] = {}
        if not real_dir(self.blocks_dir):
            return found
        for path in listdir(self.blocks_dir):
            if path.name.endswith(".tmp"):
                _unlink_quietly(path)
                counts["orphans"] += 1
            elif path.suffix == BLOCK_EXT and bk.is_block_name(path.stem):
                try:
                    found[path.stem] = path.stat().st_size
                except OSError:
                    continue
        return found

    def referenced(self) -> set[str]:
        """Every block name a manifest on disk names (unreadable manifests name none)."""
        live: set[str] = set()
        seen: set[Path] = set()
        for ns_dir in self._ns_dirs():
            for path in listdir(ns_dir):
                if path.suffix != MANIFEST_EXT:
                    continue
                seen.add(path)
                try:
                    st = path.stat()
                    cached = self._manifest_cache.get(path)
                    if cached is None or cached[:2] != (st.st_mtime_ns, st.st_size):
                        names = tuple(b.name for b in read_manifest(path).blocks)
                        cached = self._manifest_cache[path] = (st.st_mtime_ns, st.st_size, names)
                except (ff.StorageError, OSError):
                    continue
                live.update(cached[2])
        for gone in set(self._manifest_cache) - seen:
            del self._manifest_cache[gone]
        return live

    def collect(self, candidates: Iterable[str] | None = None) -> GcReport:
        """Remove blocks no manifest on disk names: `candidates` only, or every stored block.

        Holds the lock exclusively: no writer is between its probes and its
        manifest, so a block a new manifest is about to name is not removed,
        and every tmp file present belongs to a dead writer.
        """
        counts = {"corrupt": 0, "orphans": 0}
        try:
            with self._locked(exclusive=True):
                stored = self._stored_blocks(counts)
                live = self.referenced()
                wanted = set(stored) if candidates is None else set(candidates) & set(stored)
                victims = wanted - live
                for name in victims:
                    _unlink_quietly(self.block_path(name))
                if victims:
                    ff.fsync_dir(self.blocks_dir)
                with self._starts_lock:
                    self._starts.discard(victims)
        except (ff.StorageError, OSError) as exc:
            log.warning("ssd_collect_failed", dir=str(self.directory), error=str(exc))
            return GcReport()
        return GcReport(
            removed=len(victims),
            removed_bytes=sum(stored[n] for n in victims),
            orphans=counts["orphans"],
            kept=len(wanted) - len(victims),
        )

    def stored_block_bytes(self) -> int:
        """Bytes of every block file on disk (for benchmarks and tests)."""
        total = 0
        for path in listdir(self.blocks_dir):
            if path.suffix == BLOCK_EXT:
                total += path.stat().st_size
        return total


class _Batch:
    """Blocks (and parts of blocks) in flight on the writing threads: `result()` waits for them all."""

    def __init__(self, futures: list[tuple[str, Future[int | None]]], splits: list[ffw.SplitWrite]) -> None:
        self._futures = futures
        self._splits = splits

    def result(self) -> dict[str, int]:
        """name -> file size of every block; raises the first failure, after every block still writing
        ended and no block not yet started will be (and no split block's tmp file is left)."""
        try:
            made: dict[str, int] = {}
            for name, future in self._futures:
                size = future.result()
                if size is not None:  # a split block's size comes from the part that finished it
                    made[name] = size
            return made
        finally:  # after a failure: blocks not started are not written, and none is still writing
            for _, future in self._futures:
                future.cancel()
            wait([f for _, f in self._futures])
            for split in self._splits:
                split.abort()  # parts never run: the tmp file goes (a no-op for a finished file)


# ----------------------------------------------------- splitting a plan


class _LeafViews:
    """The plan's tensors as numpy views, by leaf cache: spanned ones cut per span, others whole."""

    def __init__(self, plan: ff.SnapshotPlan) -> None:
        n = len(plan.meta.tokens)
        bufs = iter(plan.buffers)
        self.caches = plan.caches
        self.on_device, self.keep = plan.on_device, plan.keep  # (device addresses: staged before written)
        self.n = n
        self.spanned: list[tuple[ff.CacheDesc, list[np.ndarray | None]]] = []
        self.whole: list[tuple[ff.CacheDesc, list[memoryview | None]]] = []
        for leaf in bk.leaves(plan.caches):
            if bk.spanned(leaf, n):
                self.spanned.append((leaf, [None if t is None else np.asarray(next(bufs)) for t in leaf.tensors]))
            else:
                self.whole.append((leaf, [None if t is None else next(bufs) for t in leaf.tensors]))
        if next(bufs, None) is not None:
            raise ValueError("plan has more buffers than tensors")

    def span_plan(self, meta: ff.SnapshotMeta, start: int, end: int) -> ff.SnapshotPlan:
        descs = bk.span_descs(self.caches, self.n, start, end)
        buffers = tuple(
            memoryview(a[..., start:end, :])  # type: ignore[arg-type]
            for _, arrays in self.spanned
            for a in arrays
            if a is not None
        )
        return ff.SnapshotPlan(meta=attrs.evolve(meta, tokens=meta.tokens[start:end]), caches=descs, buffers=buffers,
                               on_device=self.on_device, keep=self.keep)

    def state_plan(self, meta: ff.SnapshotMeta) -> ff.SnapshotPlan:
        descs = bk.state_descs(self.caches, self.n)
        buffers = tuple(b for _, views in self.whole for b in views if b is not None)
        return ff.SnapshotPlan(meta=meta, caches=descs, buffers=buffers, on_device=self.on_device, keep=self.keep)


# ------------------------------------------------------- reading blocks


class _BadBlock(Exception):
    def __init__(self, name: str, why: str) -> None:
        super().__init__(why)
        self.name = name


def _read_blocks(
    store: BlockStore, manifest: bk.Manifest, *, verify: bool, landing: ff.Landing | None = None
) -> tuple[tuple[np.ndarray, ...], float]:
    """Read every block of a manifest straight into the checkpoint's full tensors, `store.readers`
    block files at a time (their destinations are disjoint), one scatter read per block. Returns the
    tensors and the seconds spent checking the blocks (summed over the reader threads)."""
    n = len(manifest.tokens)
    descs = [(leaf, t) for leaf in bk.leaves(manifest.caches) for t in leaf.tensors if t is not None]
    full = _allocate([t for _, t in descs]) if landing is None else _landed([t for _, t in descs], landing)
    spanned_dest = [a for (leaf, _), a in zip(descs, full, strict=True) if bk.spanned(leaf, n)]
    whole_dest = [a for (leaf, _), a in zip(descs, full, strict=True) if not bk.spanned(leaf, n)]
    meta = manifest.meta
    jobs: list[tuple[bk.BlockRef, Sequence[int], tuple[ff.CacheDesc, ...], list[list[memoryview]]]] = []
    for b in manifest.blocks:
        if b.state:
            runs = [[memoryview(a).cast("B")] if a.size else [] for a in whole_dest]  # type: ignore[arg-type]
            jobs.append((b, meta.tokens, bk.state_descs(manifest.caches, n), runs))
        else:
            runs = [_runs(a, b.start, b.end) for a in spanned_dest]
            jobs.append((b, meta.tokens[b.start : b.end], bk.span_descs(manifest.caches, n, b.start, b.end), runs))

    def read(job: tuple[bk.BlockRef, Sequence[int], tuple[ff.CacheDesc, ...], list[list[memoryview]]]) -> float:
        return _read_block(store, meta.namespace, *job, verify=verify)

    if store.readers <= 1 or len(jobs) <= 1:
        return tuple(full), sum(read(job) for job in jobs)
    pool = _thread_pool(store.readers, "mlxd-block-read")
    futures = [pool.submit(read, job) for job in jobs]  # several files in flight (see READERS)
    try:
        verify_s = sum(future.result() for future in futures)
    finally:  # after a failure: blocks not started yet are not read, and none is still landing
        for future in futures:
            future.cancel()
        wait(futures)
    return tuple(full), verify_s


_pools: dict[tuple[int, str], ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    with _pool_lock:
        pool = _pools.get((workers, name))
        if pool is None:
            pool = _pools[(workers, name)] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        return pool


_HUGE = 2 << 20


def _allocate(tensors: Sequence[ff.TensorDesc]) -> list[np.ndarray]:
    """The checkpoint's tensors in one anonymous mapping, on huge pages where the kernel allows.

    Reading into fresh memory faults once per page; with 2 MiB pages (THP in
    "madvise" mode, the common default) that is 512x fewer faults, and the
    faults were a large share of a restore (docs/benchmarks.md).
    """
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ff.PAGE) * ff.PAGE
    if total == 0:
        return [np.zeros(t.shape, dtype=_NP_DTYPES[t.dtype]) for t in tensors]
    arena = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if total >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            arena.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        dtype = np.dtype(_NP_DTYPES[t.dtype])  # type: ignore[call-overload]
        out.append(np.frombuffer(arena, dtype=dtype, count=math.prod(t.shape), offset=off).reshape(t.shape))
    return out


def _landed(tensors: Sequence[ff.TensorDesc], landing: ff.Landing) -> list[np.ndarray]:
    """The checkpoint's tensors as arrays over the landing's views (one per tensor, writable, exact size)."""
    if len(landing.views) != len(tensors):
        raise ValueError(f"landing has {len(landing.views)} views for {len(tensors)} tensors")
    out = []
    for t, view in zip(tensors, landing.views, strict=True):
        dest = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if dest.nbytes != t.nbytes or dest.readonly:
            raise ValueError(
                f"landing view of {dest.nbytes} bytes (writable: {not dest.readonly}) for a {t.nbytes}-byte tensor"
            )
        dtype = np.dtype(_NP_DTYPES[t.dtype])  # type: ignore[call-overload]
        out.append(np.frombuffer(dest, dtype=dtype).reshape(t.shape) if t.nbytes else np.zeros(t.shape, dtype=dtype))
    return out


def _runs(a: np.ndarray, start: int, end: int) -> list[memoryview]:
    """The contiguous runs of a[..., start:end, :] in C order (one per leading index)."""
    if a.size == 0 or start == end:
        return []
    rows = a.reshape(-1, a.shape[-2], a.shape[-1])
    return [memoryview(rows[i, start:end, :]).cast("B") for i in range(rows.shape[0])]  # type: ignore[arg-type]


def _read_block(
    store: BlockStore,
    namespace: str,
    ref: bk.BlockRef,
    tokens: Sequence[int],
    want: tuple[ff.CacheDesc, ...],
    runs: list[list[memoryview]],
    *,
    verify: bool,
) -> float:
    """Read one block (same checks as a whole file) with its tensor rows going straight into place;
    returns the seconds its checks took.

    After the header, the rest of the block (padding, then every tensor's
    rows) is one scatter read (`preadv`) into the destination rows: the
    kernel sees the whole block as one request and reads ahead at full size
    from its first byte, where row-sized reads restart its readahead ramp in
    every block file.
    """
    path = store.block_path(ref.name)
    try:
        with open(path, "rb", buffering=0) as f:
            try:
                header = _read_header(f)
            except ff.CorruptFile as exc:
                raise _BadBlock(ref.name, str(exc)) from exc
            meta, ident = header.meta, store.identity
            tensors = [t for _, t in header.tensors()]
            if (
                header.file_size != ref.file_bytes
                or meta.tokens != tuple(tokens)
                or meta.namespace != namespace
                or meta.config_fingerprint != ident.fingerprint
                or meta.model_id != ident.model_id
                or meta.tokenizer_hash != ident.tokenizer_hash
                or bk.blank(header.caches) != want
                or len(tensors) != len(runs)
            ):
                raise _BadBlock(ref.name, "block does not match its manifest")
            start = f.tell()
            ends = [start, *(t.offset + t.nbytes for t in tensors)]
            gaps = [t.offset - end for t, end in zip(tensors, ends, strict=False)]
            if any(g < 0 for g in gaps):
                raise _BadBlock(ref.name, "tensors out of order")
            pad = memoryview(bytearray(sum(gaps)))  # read too, so the request stays one range
            views: list[memoryview] = []
            at = 0
            for gap, rows in zip(gaps, runs, strict=True):
                views.append(pad[at : at + gap])
                views.extend(rows)
                at += gap
            _preadv_all(f.fileno(), views, start, ref.name)
    except FileNotFoundError as exc:
        raise _BadBlock(ref.name, "block file is missing") from exc
    except OSError as exc:
        raise ff.storage_error(exc, f"reading {path}") from exc
    if not verify:
        return 0.0
    t0 = time.perf_counter()
    if pad.tobytes().count(0) != pad.nbytes:
        raise _BadBlock(ref.name, "nonzero padding between tensors")
    for t, rows in zip(tensors, runs, strict=True):
        crc = 0
        for row in rows:
            crc = zlib.crc32(row, crc)
        if f"{crc:08x}" != t.crc32:
            raise _BadBlock(ref.name, f"tensor at offset {t.offset} fails its CRC-32")
    return time.perf_counter() - t0


_IOV_MAX = 1024  # Linux's UIO_MAXIOV: buffers per preadv call


def _preadv_all(fd: int, views: list[memoryview], offset: int, name: str) -> None:
    """Fill `views`, in order, from the file at `offset` (scatter reads; short reads resumed)."""
    todo = [v for v in views if v.nbytes]
    i = 0
    while i < len(todo):
        n = os.preadv(fd, todo[i : i + _IOV_MAX], offset)
        if not n:
            raise _BadBlock(name, "block file ends early")
        offset += n
        while n:
            head = todo[i]
            if n < head.nbytes:
                todo[i] = head[n:]
                break
            n -= head.nbytes
            i += 1


def _touch(record: SsdRecord) -> None:
    """A hit: the manifest's mtime is the LRU clock across restarts (as a whole file's is)."""
    now = time.time()
    try:
        os.utime(record.path, (now, now))  # type: ignore[arg-type]
    except OSError:
        return


def _payload(descs: Sequence[ff.CacheDesc]) -> int:
    """KV bytes of a block's tensors (what the cap counts)."""
    return sum(t.nbytes for c in descs for t in c.tensors if t is not None)


def _namespace_dir(namespace: str) -> str:
    from mlxd.kv.ssd_store import namespace_dir  # ssd_store imports this module

    return namespace_dir(namespace)





def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("ssd_unlink_failed", path=str(path), error=str(exc))


__all__ = [
    "BLOCK_EXT",
    "MANIFEST_EXT",
    "BlockScan",
    "BlockStore",
    "BlocksWritten",
    "GcReport",
    "ScanReport",
    "decode_manifest",
    "encode_manifest",
    "read_manifest",
]
