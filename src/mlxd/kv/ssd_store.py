"""The SSD tier: `.mlxkv` files are the database (seed §5.1 D4, §5.3).

Layout: `<root>/<fingerprint>/<ns-hash>/<uuid4 hex>.mlxkv`, dirs 0700, files
0600. The fingerprint names everything a file's numbers depend on (model
config and weights, tokenizer, KV scheme, MLX version and backend), so a
change of any of them selects another directory and old files stay intact.

`SsdStore` is synchronous and keeps an in-memory index (one PrefixIndex per
namespace) built by a header-only `scan()` at startup. Methods marked
"(I/O)" touch the disk and belong on a worker thread; the rest are index-only
and cheap. A lock guards the index, so an I/O method may run on a worker
thread while the owner keeps calling `find()`.

Every failure degrades to "miss" or "not stored": corrupt files are unlinked,
disk-full is logged once. Only the low-level `reserve_path` raises
(StorageError); `write()` wraps reserve + write + commit + cap and returns
None when nothing was stored.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs
import structlog

from mlxd.kv import file_format as ff
from mlxd.kv.pacing import Pacer
from mlxd.kv.prefix_index import PrefixIndex

log = structlog.get_logger(__name__)

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


@attrs.define(eq=False)
class SsdEntry:
    """One committed file: the state after exactly `tokens` in `namespace`."""

    path: Path
    namespace: str
    tokens: tuple[int, ...]
    nbytes: int
    mtime: float  # LRU clock: updated on every hit
    trimmable: bool


@attrs.frozen
class SsdMatch:
    """A file that can serve `usable` tokens of a prompt (<= len(prompt) - 1)."""

    entry: SsdEntry
    usable: int

    @property
    def needs_trim(self) -> bool:
        return self.usable < len(self.entry.tokens)


@attrs.frozen
class CommitOutcome:
    """What `commit` indexed and which older files it deleted."""

    entry: SsdEntry
    replaced: SsdEntry | None = None
    superseded: tuple[SsdEntry, ...] = ()


@attrs.frozen
class ScanReport:
    """What startup recovery found in our fingerprint dir."""

    indexed: int = 0
    corrupt: int = 0  # unreadable files and metadata mismatches, unlinked
    orphans: int = 0  # *.tmp files of interrupted writes, unlinked
    duplicates: int = 0  # older copies of the same tokens, unlinked


@attrs.frozen
class SsdStoreStats:
    entries: int
    bytes: int
    max_bytes: int  # 0 = no cap
    longest_durable_prefix_tokens: int
    corrupt_removed: int
    evictions: int
    write_failures: int
    disk_full: bool  # a write hit ENOSPC/EDQUOT/EFBIG (warned once)


@attrs.define
class SsdStore:
    """The SSD cold tier over one fingerprint directory."""

    root: Path = attrs.field(converter=Path)
    identity: StoreIdentity
    max_bytes: int = 0  # 0 = unlimited, as in the seed
    clock: Callable[[], float] = time.time
    _indexes: dict[str, PrefixIndex] = attrs.field(factory=dict, init=False)
    _entries: dict[Path, SsdEntry] = attrs.field(factory=dict, init=False)
    _bytes: int = attrs.field(default=0, init=False)
    _lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    _corrupt_removed: int = attrs.field(default=0, init=False)
    _evictions: int = attrs.field(default=0, init=False)
    _write_failures: int = attrs.field(default=0, init=False)
    _warned_full: bool = attrs.field(default=False, init=False)

    @property
    def directory(self) -> Path:
        """Our fingerprint dir; other fingerprints' dirs are never touched."""
        return self.root / self.identity.fingerprint

    # ------------------------------------------------------- startup scan

    def scan(self) -> ScanReport:
        """(I/O) Header-only scan of our fingerprint dir into a fresh index."""
        with self._lock:
            self._indexes.clear()
            self._entries.clear()
            self._bytes = 0
        counts = {"indexed": 0, "corrupt": 0, "orphans": 0, "duplicates": 0, "other": 0}
        seen = 0
        for ns_dir in self._ns_dirs():
            for path in _listdir(ns_dir):
                counts[self._scan_file(path, ns_dir.name)] += 1
                seen += 1
                if seen % 1000 == 0:  # progress on a large cache directory
                    log.info("ssd_scan_progress", files=seen, indexed=counts["indexed"])
        counts.pop("other", None)
        report = ScanReport(**counts)
        log.info("ssd_scan", dir=str(self.directory), **attrs.asdict(report))
        return report

    def _ns_dirs(self) -> Iterator[Path]:
        if self.directory.is_dir():
            yield from (p for p in _listdir(self.directory) if p.is_dir())

    def _scan_file(self, path: Path, ns_name: str) -> str:
        if path.name.endswith(TMP_SUFFIX):
            self._unlink(path)
            return "orphans"
        if path.suffix != ff.EXTENSION:
            return "other"
        try:
            header = ff.read_header(path)
            mtime, size = _stat(path)
        except ff.CorruptFile as exc:
            return self._drop_corrupt(path, str(exc))
        except (ff.StorageError, OSError) as exc:
            log.warning("ssd_scan_unreadable", path=str(path), error=str(exc))
            return "other"
        problem = self._mismatch(header, ns_name)
        if problem:
            return self._drop_corrupt(path, problem)
        entry = SsdEntry(path, header.namespace, header.tokens, size, mtime, header.trimmable)
        return "duplicates" if self._index_scanned(entry) else "indexed"

    def _mismatch(self, header: ff.FileHeader, ns_name: str) -> str | None:
        want = self.identity
        meta = header.meta
        if meta.config_fingerprint != want.fingerprint:
            return "config fingerprint mismatch"
        if meta.model_id != want.model_id or meta.tokenizer_hash != want.tokenizer_hash:
            return "model or tokenizer mismatch"
        if namespace_dir(meta.namespace) != ns_name:
            return "namespace does not match its directory"
        return None

    def _index_scanned(self, entry: SsdEntry) -> bool:
        """Index a scanned file; of two files with the same tokens keep the newer."""
        with self._lock:
            old = self._index(entry.namespace).get(entry.tokens)
            if old is None:
                self._add(entry)
                return False
            loser = old if old.mtime <= entry.mtime else entry
            if loser is old:
                self._forget(old)
                self._add(entry)
        self._unlink(loser.path)
        return True

    def _drop_corrupt(self, path: Path, why: str) -> str:
        log.warning("ssd_corrupt_file_removed", path=str(path), reason=why)
        self._unlink(path)
        self._corrupt_removed += 1
        return "corrupt"

    # ------------------------------------------------------------ lookups

    def find(self, tokens: Sequence[int], namespace: str = "") -> SsdMatch | None:
        """The file serving the longest usable prefix (<= len(tokens) - 1); index only."""
        return self._longest(tokens, namespace, limit=len(tokens) - 1)

    def find_exact(self, tokens: Sequence[int], namespace: str = "") -> SsdEntry | None:
        with self._lock:
            index = self._indexes.get(namespace)
            return None if index is None else index.get(tokens)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str = "") -> bool:
        """Does a file cover exactly `tokens` (itself, or a trimmable descendant)?"""
        return self.longest_durable_prefix(tokens, namespace) == len(tokens)

    def longest_durable_prefix(self, tokens: Sequence[int], namespace: str = "") -> int:
        """How many leading tokens of `tokens` some file can restore."""
        match = self._longest(tokens, namespace, limit=len(tokens))
        return 0 if match is None else match.usable

    def _longest(self, tokens: Sequence[int], namespace: str, *, limit: int) -> SsdMatch | None:
        if limit <= 0:
            return None
        with self._lock:
            index = self._indexes.get(namespace)
            hit = None if index is None else index.longest_usable(tokens, limit=limit)
        return None if hit is None else SsdMatch(hit.value, hit.usable)

    def entries(self) -> list[SsdEntry]:
        with self._lock:
            return list(self._entries.values())

    def warm_page_cache(self, budget_bytes: int) -> int:
        """(I/O) Ask the kernel to read the most recently used files into the page cache.

        Files are written with O_DIRECT, so after a restart they are on disk
        only; the conversations that return first are the ones used last. This
        only queues readahead (posix_fadvise WILLNEED: no copy into this
        process, and the pages stay reclaimable). Returns the bytes asked for.
        """
        advise = getattr(os, "posix_fadvise", None)
        if advise is None or budget_bytes <= 0:
            return 0
        asked = 0
        for entry in sorted(self.entries(), key=lambda e: e.mtime, reverse=True):
            if asked + entry.nbytes > budget_bytes:
                break
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # vanished or unreadable: the restore will treat it as a miss
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                asked += entry.nbytes
            except OSError:
                pass
            finally:
                os.close(fd)
        return asked

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> SsdStoreStats:
        with self._lock:
            longest = max((len(e.tokens) for e in self._entries.values()), default=0)
            return SsdStoreStats(
                entries=len(self._entries),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                longest_durable_prefix_tokens=longest,
                corrupt_removed=self._corrupt_removed,
                evictions=self._evictions,
                write_failures=self._write_failures,
                disk_full=self._warned_full,
            )

    # ------------------------------------------------------------- writes

    def reserve_path(self, namespace: str = "") -> Path:
        """(I/O) A fresh file path in the namespace dir (created 0700). Raises StorageError."""
        ns_dir = self.directory / namespace_dir(namespace)
        try:
            for d in (self.root, self.directory, ns_dir):
                if not d.is_dir():
                    d.mkdir(mode=0o700, exist_ok=True)
                    os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            raise ff.storage_error(exc, f"creating {d}") from exc
        return ns_dir / (uuid.uuid4().hex + ff.EXTENSION)

    def commit(
        self, written: ff.WrittenFile, tokens: Sequence[int], namespace: str, *, trimmable: bool
    ) -> CommitOutcome:
        """(I/O: unlinks replaced files) Index a finished write, superseding as RAM put does.

        An exact duplicate is replaced; strict ancestors are deleted only when
        the new file is trimmable (it can serve them by trimming).
        """
        tokens = tuple(tokens)
        if written.header.tokens != tokens or written.header.namespace != namespace:
            raise ValueError("commit: tokens/namespace differ from the written header")
        entry = SsdEntry(written.path, namespace, tokens, written.nbytes, 0.0, trimmable)
        self.touch(entry)  # the LRU clock starts now
        with self._lock:
            replaced = self._index(namespace).get(tokens)
            if replaced is not None:
                self._forget(replaced)
            superseded = tuple(self._index(namespace).strict_ancestors(tokens)) if trimmable else ()
            for old in superseded:
                self._forget(old)
            self._add(entry)
        for old in (replaced, *superseded):
            if old is not None:
                self._unlink(old.path)
        return CommitOutcome(entry, replaced, superseded)

    def write(self, plan: ff.SnapshotPlan, pacer: Pacer | None = None) -> CommitOutcome | None:
        """(I/O) reserve + write + commit + enforce_cap; None when not stored (logged)."""
        meta = plan.meta
        try:
            written = ff.write_snapshot(plan, self.reserve_path(meta.namespace), pacer=pacer)
        except ff.StorageError as exc:
            self.note_write_failure(exc)
            return None
        outcome = self.commit(written, meta.tokens, meta.namespace, trimmable=plan.trimmable)
        self.enforce_cap()
        return outcome

    def note_write_failure(self, exc: ff.StorageError) -> None:
        """Count a failed write; disk-full warns once, other errors every time."""
        self._write_failures += 1
        if isinstance(exc, ff.DiskFull):
            if not self._warned_full:
                self._warned_full = True
                log.warning("ssd_disk_full", dir=str(self.directory), error=str(exc))
            return
        log.warning("ssd_write_failed", dir=str(self.directory), error=str(exc))

    # --------------------------------------------------- reads and upkeep

    def load(self, entry: SsdEntry, *, verify: bool = False) -> ff.LoadedSnapshot | None:
        """(I/O) Read a file for adoption; a corrupt or vanished file is removed: a miss."""
        try:
            loaded = ff.read_snapshot(entry.path, verify=verify)
        except ff.CorruptFile as exc:
            self._remove_corrupt(entry, str(exc))
            return None
        except ff.StorageError as exc:
            log.warning("ssd_read_failed", path=str(entry.path), error=str(exc))
            if not entry.path.exists():
                self._drop(entry)
            return None
        header = loaded.header
        problem = self._mismatch(header, entry.path.parent.name)
        if problem is None and (
            header.tokens != entry.tokens or header.namespace != entry.namespace
        ):
            problem = "file no longer matches its index entry"
        if problem:
            self._remove_corrupt(entry, problem)
            return None
        self.touch(entry)
        return loaded

    def touch(self, entry: SsdEntry) -> None:
        """(I/O) Mark a hit: the file's mtime is the LRU clock."""
        now = self.clock()
        try:
            os.utime(entry.path, (now, now))
        except FileNotFoundError:
            self._drop(entry)
            return
        except OSError as exc:
            log.warning("ssd_touch_failed", path=str(entry.path), error=str(exc))
            return
        entry.mtime = now

    def remove(self, entry: SsdEntry) -> None:
        """(I/O) Drop a file from the index and the disk."""
        self._drop(entry)
        self._unlink(entry.path)

    def enforce_cap(self, max_bytes: int | None = None) -> list[SsdEntry]:
        """(I/O) Delete oldest-mtime files until under the cap (0 = no cap)."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap <= 0:
            return []
        victims = []
        with self._lock:
            for entry in sorted(self._entries.values(), key=lambda e: e.mtime):
                if self._bytes <= cap:
                    break
                self._forget(entry)
                victims.append(entry)
            self._evictions += len(victims)
        for entry in victims:
            self._unlink(entry.path)
        if victims:
            log.info("ssd_cap_evicted", files=len(victims), bytes=sum(e.nbytes for e in victims))
        return victims

    # ------------------------------------------------------------ helpers

    def _index(self, namespace: str) -> PrefixIndex:
        index = self._indexes.get(namespace)
        if index is None:
            index = self._indexes[namespace] = PrefixIndex()
        return index

    def _add(self, entry: SsdEntry) -> None:
        self._index(entry.namespace).insert(entry.tokens, entry, trimmable=entry.trimmable)
        self._entries[entry.path] = entry
        self._bytes += entry.nbytes

    def _forget(self, entry: SsdEntry) -> None:
        """Take an entry out of the index (caller holds the lock)."""
        if self._entries.pop(entry.path, None) is None:
            return
        index = self._indexes[entry.namespace]
        if index.get(entry.tokens) is entry:
            index.remove(entry.tokens)
        if not len(index):
            del self._indexes[entry.namespace]
        self._bytes -= entry.nbytes

    def _drop(self, entry: SsdEntry) -> None:
        with self._lock:
            self._forget(entry)

    def _remove_corrupt(self, entry: SsdEntry, why: str) -> None:
        self._drop(entry)
        self._drop_corrupt(entry.path, why)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("ssd_unlink_failed", path=str(path), error=str(exc))


def _listdir(d: Path) -> list[Path]:
    try:
        return sorted(d.iterdir())
    except OSError as exc:
        log.warning("ssd_scan_failed", dir=str(d), error=str(exc))
        return []


def _stat(path: Path) -> tuple[float, int]:
    st = path.stat()
    return st.st_mtime, st.st_size


def resident_pages(path: Path) -> tuple[int, int]:
    """(resident, total) pages of a file in the page cache, via mmap + mincore (Linux)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
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
            return sum(v & 1 for v in vec), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
