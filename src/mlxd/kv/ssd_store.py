"""The SSD tier: `.mlxkv` files are the database (seed §5.1 D4, §5.3).

Layout: `<root>/<fingerprint>/<ns-hash>/<writer id + random hex>.mlxkv`, dirs 0700, files
0600. The fingerprint names everything a file's numbers depend on (model
config and weights, tokenizer, KV scheme, MLX version and backend), so a
change of any of them selects another directory and old files stay intact.

`SsdStore` is file I/O with no index, meant for worker threads: `scan()` reads
every header and returns the records, `write()` stores one snapshot and
returns `Stored(record)` or `Failed(error)`, `load()` reads one back (None
when it cannot), `unlink()` deletes one. What the tier holds, and which files
to delete, is decided by the cache owner's `mlxd.kv.tiers.CacheTiers`.
Its one piece of state: `scan()` first locks the directory (`mlxd.kv.dir_lock`),
so a second server on it is refused unless all of them share it.

Two layouts share the directory: whole files (one `.mlxkv` per checkpoint)
and content-addressed blocks (`layout="blocks"`: `mlxd.kv.block_store`, one
manifest per checkpoint naming shared blocks). New checkpoints are written in
the configured layout; both kinds are scanned and read, so a directory
written by either keeps serving after the layout changes.

Every failure degrades to "miss" or "not stored": corrupt files are unlinked
on sight, and a storage error carries its cause (the OS's errno text). Every
restored byte is checked by default (`load(verify=True)`: each tensor's CRC-32
and the zero padding), so a damaged file is a miss, never an answer.

The store never follows a symbolic link below the cache root: a link in place
of the fingerprint directory, a namespace directory, `blocks/` or a file is
logged (`ssd_symlink_ignored`) and left alone, never read, indexed or
unlinked through, so nothing outside the cache directory is ever deleted.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs

from mlxd.kv import file_format as ff
from mlxd.kv import page_cache_warmup as warmup
from mlxd.kv.block_store import MANIFEST_EXT, WRITERS, BlockStore
from mlxd.kv.dir_lock import DirLock, lock_dir
from mlxd.kv.listing import listdir, real_dir
from mlxd.kv.pacing import Pacer
from mlxd.kv.page_cache_warmup import Warmed
from mlxd.kv.shared_dir import fresh_stem, new_writer_id
from mlxd.kv.small_files import STORE_FILES, sweep_tmps
from mlxd.kv.tiers import SsdRecord
from mlxd.runtime.logging import get_logger
from mlxd.vision.tensor_store import (
    TensorPlan,
    is_tensor_record,
    scan_tensors,
    unlink_tensor,
    write_plan,
)

log = get_logger(__name__)

TMP_SUFFIX = ff.EXTENSION + ".tmp"


def compute_fingerprint(parts: Mapping[str, str]) -> str:
    """A stable hash of everything that decides a cache file's numbers.

    Pass e.g. {"config": sha256(config.json), "weights": sha256 of safetensors
    names+sizes+hashes, "tokenizer": ..., "kv_scheme": ..., "mlx": mx.__version__,
    "backend": "cpu"}. Key order does not matter; the result is 32 hex chars.
    """
    blob = json.dumps({str(k): str(v) for k, v in parts.items()}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def namespace_dir(namespace: str) -> str:
    """The directory name of a namespace: a hash, so adapter names never reach the path."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


@attrs.frozen
class StoreIdentity:
    """What every file in this store must say about itself (checked on scan and load)."""

    model_id: str
    fingerprint: str
    tokenizer_hash: str

    def meta(self, tokens: Sequence[int], namespace: str) -> ff.SnapshotMeta:
        """The header metadata for a new snapshot of `tokens` in `namespace`."""
        return ff.SnapshotMeta(
            model_id=self.model_id,
            config_fingerprint=self.fingerprint,
            namespace=namespace,
            tokenizer_hash=self.tokenizer_hash,
            tokens=tokens,
        )

    def mismatch(self, meta: ff.SnapshotMeta, ns_name: str) -> str | None:
        """Why a file with `meta`, found in namespace directory `ns_name`, is not ours (None: it is)."""
        if meta.config_fingerprint != self.fingerprint:
            return "config fingerprint mismatch"
        if meta.model_id != self.model_id or meta.tokenizer_hash != self.tokenizer_hash:
            return "model or tokenizer mismatch"
        if namespace_dir(meta.namespace) != ns_name:
            return "namespace does not match its directory"
        return None


@attrs.frozen
class ScanReport:
    """What startup recovery found in our fingerprint dir."""

    indexed: int = 0
    corrupt: int = 0  # unreadable files and metadata mismatches, unlinked
    orphans: int = 0  # *.tmp files of interrupted writes, unlinked
    duplicates: int = 0  # older copies of the same tokens, unlinked


@attrs.frozen
class Scan:
    records: tuple[SsdRecord, ...]
    report: ScanReport


@attrs.frozen
class Stored:
    """A snapshot is durably on disk under its final name."""

    record: SsdRecord
    seconds: float
    written_bytes: int | None = None  # bytes this write put on disk (blocks: only new ones); None = the record's
    reused_blocks: int = 0

    @property
    def written(self) -> int:
        return self.record.nbytes if self.written_bytes is None else self.written_bytes


@attrs.frozen
class Failed:
    """Nothing was stored; `error` says why (with the OS's errno text)."""

    error: str
    disk_full: bool = False


WriteOutcome = Stored | Failed


@attrs.define
class SsdStore:
    """File I/O for the SSD cold tier over one fingerprint directory (no index; its scan locks it)."""

    root: Path = attrs.field(converter=Path)
    identity: StoreIdentity
    clock: Callable[[], float] = time.time
    # Several replicas share the directory (kv/shared_dir.py): the scan deletes no
    # duplicate, and no temporary file younger than this (another replica may be writing it).
    shared_grace_s: float | None = None
    layout: str = attrs.field(default="whole", validator=attrs.validators.in_(("whole", "blocks")))
    block_tokens: int = 256  # the blocks layout's span (fixed per directory: names depend on it)
    # A vision model's encoder identity: its encoder outputs under `tensors/` are records too
    # (vision/tensor_store.py); not with a shared directory.
    encoder_identity: str | None = None
    # The first hex digits of every file name this store publishes (kv/shared_dir.py: a replica's own files).
    writer: str = attrs.field(factory=new_writer_id)
    _blocks: BlockStore = attrs.field(init=False)
    # Taken by the first scan, before it touches a file, and held for the store's life (kv/dir_lock.py).
    _lock: DirLock | None = attrs.field(init=False, default=None)
    # The reads `load` has in flight: the page-cache warm-up waits for none (kv/page_cache_warmup.py).
    _reads: warmup.ForegroundReads = attrs.field(init=False, factory=warmup.ForegroundReads)

    def __attrs_post_init__(self) -> None:
        self._blocks = BlockStore(self.root, self.identity, block_tokens=self.block_tokens, writer=self.writer)

    @property
    def directory(self) -> Path:
        """Our fingerprint dir; other fingerprints' dirs are never touched."""
        return self.root / self.identity.fingerprint

    @property
    def blocks(self) -> BlockStore:
        return self._blocks

    @property
    def tensors_dir(self) -> Path:
        """Encoder outputs: `<root>/tensors/<encoder identity>/<digest>/` (vision/tensor_store.py)."""
        return self.root / "tensors"

    # ------------------------------------------------------- startup scan

    def scan(self) -> Scan:
        """Header-only scan of our fingerprint dir; damaged files, orphans and duplicates are unlinked.

        Raises `DirLocked` when another server uses the directory and not both share it.
        """
        self._lock_directory()
        sweep_tmps(self.directory, STORE_FILES)  # the pins, advisor, probe and grammar saves a kill cut short
        counts = {"indexed": 0, "corrupt": 0, "orphans": 0, "duplicates": 0, "other": 0}
        found: dict[tuple[str, tuple[int, ...]], SsdRecord] = {}
        seen = 0
        for ns_dir in self._ns_dirs():
            for path in listdir(ns_dir):
                outcome = self._scan_file(path, ns_dir.name)
                seen += 1
                if isinstance(outcome, SsdRecord):
                    key = (outcome.namespace, tuple(outcome.tokens))
                    old = found.get(key)
                    if old is None:
                        found[key] = outcome
                        counts["indexed"] += 1
                    else:
                        loser = old if old.mtime <= outcome.mtime else outcome
                        found[key] = outcome if loser is old else old
                        if self.shared_grace_s is None:  # shared: the collector deletes it
                            self.unlink(loser)
                        counts["duplicates"] += 1
                else:
                    counts[outcome] += 1
                if seen % 1000 == 0:  # progress on a large cache directory
                    log.info("ssd_scan_progress", files=seen, indexed=counts["indexed"])
        whole_files = len(found)
        blocks = self._blocks.scan() if (self._blocks.blocks_dir.is_dir() or self.layout == "blocks") else None
        for record in blocks.records if blocks is not None else ():
            key = (record.namespace, tuple(record.tokens))
            old = found.get(key)
            if old is None:
                found[key] = record
                continue
            loser = old if old.mtime <= record.mtime else record
            found[key] = record if loser is old else old
            if self.shared_grace_s is None:  # shared: the collector deletes it
                self.unlink(loser)
            counts["duplicates"] += 1
        if blocks is not None:
            counts["corrupt"] += blocks.report.corrupt
            counts["orphans"] += blocks.report.orphans
            if counts["duplicates"]:
                self._blocks.collect()
        if self.encoder_identity is not None and self.shared_grace_s is None:
            tensors = scan_tensors(self.tensors_dir, self.encoder_identity)  # a vision model's encoder outputs
            found.update({(r.namespace, tuple(r.tokens)): r for r in tensors.records})
            counts["corrupt"] += tensors.corrupt
            counts["orphans"] += tensors.orphans
            counts["duplicates"] += tensors.duplicates
        counts.pop("other", None)
        counts["indexed"] = len(found)
        report = ScanReport(**counts)
        log.info("ssd_scan", dir=str(self.directory), layout=self.layout, **attrs.asdict(report))
        if whole_files and self.layout == "blocks":
            log.info("ssd_whole_files_kept", files=whole_files,
                     note="checkpoints written as whole files stay readable; new ones are written as blocks")
        return Scan(tuple(found.values()), report)

    def close(self) -> None:
        """Let the directory go (its server has stopped); the lock goes with the last store of this process
        that holds it (kv/dir_lock.py), so the next server can take it, in either mode."""
        self._lock = None

    def _lock_directory(self) -> None:
        """Exclusive, or shared with other replicas (`shared_grace_s`); DirLocked if someone else objects."""
        if self._lock is not None:
            return
        try:
            _make_dirs(self.root, self.directory)
            self._lock = lock_dir(self.directory, shared=self.shared_grace_s is not None)
        except (OSError, ff.StorageError) as exc:  # a filesystem without locks, say: scan as before
            log.warning("ssd_dir_not_locked", dir=str(self.directory), error=str(exc))

    def _ns_dirs(self) -> Iterator[Path]:
        if real_dir(self.directory):
            yield from (p for p in listdir(self.directory) if p.is_dir() and p.name != "blocks")

    def _scan_file(self, path: Path, ns_name: str) -> SsdRecord | str:
        if path.name.endswith(TMP_SUFFIX):
            if self.shared_grace_s is not None and not _older_than(path, self.clock() - self.shared_grace_s):
                return "other"  # maybe another replica's write in progress
            _unlink(path)
            return "orphans"
        if path.suffix != ff.EXTENSION:
            return "other"
        try:
            header = ff.read_header(path)
            mtime, _size = _stat(path)
        except ff.CorruptFile as exc:
            return self._drop_corrupt(path, str(exc))
        except (ff.StorageError, OSError) as exc:
            log.warning("ssd_scan_unreadable", path=str(path), error=str(exc))
            return "other"
        problem = self.identity.mismatch(header.meta, ns_name)
        if problem:
            return self._drop_corrupt(path, problem)
        return SsdRecord(header.namespace, header.tokens, payload_bytes(header), mtime, header.trimmable, path)

    def read_record(self, path: Path) -> SsdRecord | None:
        """Header-only read of one published file (e.g. another replica's); deletes nothing.

        A link (the file or its namespace directory) is no record: what is indexed may be
        deleted later, and nothing is ever deleted through a link. A block manifest's record
        comes from the manifest alone (its blocks are checked when it is loaded).
        """
        if path.is_symlink() or path.parent.is_symlink():
            return None
        if path.suffix == MANIFEST_EXT:
            return self._blocks.read_record(path)
        if path.suffix != ff.EXTENSION:
            return None
        try:
            header = ff.read_header(path)
            mtime, _size = _stat(path)
        except (ff.CorruptFile, ff.StorageError, OSError):
            return None
        if self.identity.mismatch(header.meta, path.parent.name):
            return None
        return SsdRecord(header.namespace, header.tokens, payload_bytes(header), mtime, header.trimmable, path)

    def _drop_corrupt(self, path: Path, why: str) -> str:
        log.warning("ssd_corrupt_file_removed", path=str(path), reason=why)
        _unlink(path)
        return "corrupt"

    def resident_bytes(self, record: SsdRecord) -> tuple[int, ...]:
        """The bytes of each of the record's blocks (a whole file: one number) in the page cache now
        (mincore: no read), for the restore advisor; an unreadable file counts none."""
        if record.path is None:
            return ()
        if record.blocks:
            return tuple(_resident_share(self._blocks.block_path(b.name), b.nbytes) for b in record.blocks)
        return (_resident_share(record.path, record.nbytes),)

    def warm_page_cache(
        self, records: Iterable[SsdRecord], budget_bytes: int, stop: threading.Event | None = None
    ) -> Warmed:
        """Read the most recently used files into the page cache, up to `budget_bytes`, stepping
        aside while a `load` is in flight (kv/page_cache_warmup.py; a worker thread's work: it
        returns when done or at `stop`)."""
        newest = sorted(records, key=lambda r: r.mtime, reverse=True)
        files = [(r.nbytes, self._blocks.block_paths(r) if r.blocks else [r.path]) for r in newest if r.path is not None]
        return warmup.warm(files, budget_bytes, self._reads, stop=stop, resident=resident_pages)

    # ------------------------------------------------------------- writes

    @property
    def concurrent_writes(self) -> int:
        """Snapshot writes an unpaced flush may run at once: whole files are independent (fresh
        names), while a blocks-layout write already commits its blocks `WRITERS` at a time."""
        return WRITERS if self.layout == "whole" else 1

    def reserve_path(self, namespace: str = "") -> Path:
        """A fresh file path in the namespace dir (created 0700). Raises StorageError."""
        ns_dir = self.directory / namespace_dir(namespace)
        _make_dirs(self.root, self.directory, ns_dir)
        return ns_dir / (fresh_stem(self.writer) + ff.EXTENSION)

    def write(
        self,
        plan: ff.SnapshotPlan | TensorPlan,
        pacer: Pacer | None = None,
        *,
        prepare: Callable[[ff.SnapshotPlan], ff.SnapshotPlan] | None = None,
    ) -> WriteOutcome:
        """Write one snapshot (tmp + fsync + rename); `Stored` or `Failed` with the cause.

        `prepare`: applied to each piece just before it is written (the blocks the
        store does not hold yet, or the whole file): the SSD writer's staging to host
        memory, so only the bytes written are copied."""
        if isinstance(plan, TensorPlan):  # a vision encoder output
            t0 = time.perf_counter()
            try:
                record = write_plan(self.tensors_dir, plan, now=self.clock())
            except OSError as exc:
                err = ff.storage_error(exc, "writing an encoder output")
                return Failed(str(err), disk_full=isinstance(err, ff.DiskFull))
            return Stored(record, time.perf_counter() - t0)
        meta = plan.meta
        if self.layout == "blocks":
            try:
                done = self._blocks.write(plan, pacer, prepare=prepare)
            except ff.StorageError as exc:
                return Failed(str(exc), disk_full=isinstance(exc, ff.DiskFull))
            return Stored(done.record, done.seconds, done.written_bytes, done.reused_blocks)
        try:
            written = ff.write_snapshot(plan if prepare is None else prepare(plan), self.reserve_path(meta.namespace), pacer=pacer)
        except ff.StorageError as exc:
            return Failed(str(exc), disk_full=isinstance(exc, ff.DiskFull))
        record = SsdRecord(
            meta.namespace, tuple(meta.tokens), plan.nbytes, self.clock(), plan.trimmable, written.path
        )
        self._utime(record)
        return Stored(record, written.seconds)

    # --------------------------------------------------- reads and upkeep

    def load(
        self,
        record: SsdRecord,
        *,
        verify: bool = True,
        land: Callable[[ff.FileHeader], ff.Landing] | None = None,
        upto: int = 0,
        start: int = 0,
    ) -> ff.LoadedSnapshot | None:
        """Read a file for adoption (and touch its mtime); None when it cannot be used.

        A corrupt or mismatched file is unlinked; either way the caller reports
        the record lost to the cache owner. `verify` (the default) checks every
        tensor's CRC-32 and the padding: `verify=False` (`--ssd-cache-verify off`)
        checks only the hashed header, layout and size. `land`: where the tensors
        are read to (`read_snapshot`; a block checkpoint's tensors likewise, `BlockStore.load`).
        `upto`: a block checkpoint's first `upto` tokens only (`BlockStore.load`); a whole file is
        read whole (its CRC-32s cover every token). `start`: a block checkpoint's tokens from `start`
        on only (an overlapped split's tail, `BlockStore.load`); a whole file has no such part (None).
        """
        with self._reads.reading():  # the start-up warm-up steps aside meanwhile
            return self._load(record, verify=verify, land=land, upto=upto, start=start)

    def _load(
        self, record: SsdRecord, *, verify: bool, land: Callable[[ff.FileHeader], ff.Landing] | None, upto: int,
        start: int,
    ) -> ff.LoadedSnapshot | None:
        assert record.path is not None
        if record.blocks:
            return self._blocks.load(record, verify=verify, land=land, upto=upto, start=start)
        if start:
            return None
        try:
            loaded = ff.read_snapshot(record.path, verify=verify, land=land)
        except ff.CorruptFile as exc:
            self._drop_corrupt(record.path, str(exc))
            return None
        except ff.StorageError as exc:
            log.warning("ssd_read_failed", path=str(record.path), error=str(exc))
            return None
        header = loaded.header
        problem = self.identity.mismatch(header.meta, record.path.parent.name)
        if problem is None and (tuple(header.tokens) != tuple(record.tokens) or header.namespace != record.namespace):
            problem = "file no longer matches its index entry"
        if problem:
            self._drop_corrupt(record.path, problem)
            return None
        self._utime(record)
        return loaded

    def _utime(self, record: SsdRecord) -> None:
        """The file's mtime is the LRU clock across restarts."""
        if record.path is None:
            return  # a simulated record: no file
        now = self.clock()
        try:
            os.utime(record.path, (now, now))
        except OSError as exc:
            log.warning("ssd_touch_failed", path=str(record.path), error=str(exc))

    def unlink(self, record: SsdRecord, garbage: Sequence[str] = ()) -> None:
        """Delete a file or manifest, then the blocks it leaves unnamed (`Unlink.garbage`)."""
        if record.path is not None and is_tensor_record(record):
            unlink_tensor(record.path)  # and its image's directory when empty
            return
        if record.path is not None:
            _unlink(record.path)
        if garbage:
            self._blocks.collect(garbage)


def payload_bytes(header: ff.FileHeader) -> int:
    """The KV bytes a file holds: what the SSD cap counts (headers and page padding excluded).

    The same number as the RAM entry's `nbytes`, so the tier core accounts a
    checkpoint identically in RAM, on SSD and in the simulator.
    """
    return sum(t.nbytes for _, t in header.tensors())


def _make_dirs(root: Path, *dirs: Path) -> None:
    """Create the missing ones, 0700. Raises StorageError, also for a link below `root`
    (the root may be a link: the operator chose it; nothing below it is followed)."""
    for d in (root, *dirs):
        if d != root and d.is_symlink():
            raise ff.storage_error(OSError(errno.ELOOP, "a symbolic link in the cache directory (never followed)"), str(d))
        if d.is_dir():
            continue
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            raise ff.storage_error(exc, f"creating {d}") from exc


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("ssd_unlink_failed", path=str(path), error=str(exc))




def _older_than(path: Path, when: float) -> bool:
    try:
        return path.stat().st_mtime < when
    except OSError:
        return False


def _stat(path: Path) -> tuple[float, int]:
    st = path.stat()
    return st.st_mtime, st.st_size


def _resident_share(path: Path, nbytes: int) -> int:
    """`nbytes` times the share of the file's pages in the page cache."""
    try:
        resident, total = resident_pages(path)
    except OSError:
        return 0
    return nbytes * resident // total if total else 0


_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0 of a page's byte when resident; the rest is reserved


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_pages(path: Path) -> tuple[int, int]:
    """(resident, total) pages of a file in the page cache, via mmap + mincore (Linux).

    Counted in C (a byte table), not a Python loop: a restarted server checks a 16k-token record's
    1.9 GB (460k pages) on every lookup and prefetch, on the cache owner's thread; the loop took
    30-60 ms a check on the H200 host (the returning turns' 121-127 ms `lookup_ms`, 16:17 UTC)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return bytes(vec).translate(_LOW_BIT).count(1), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
