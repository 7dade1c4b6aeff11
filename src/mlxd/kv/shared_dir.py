"""One `--ssd-cache` directory shared by several replicas (`--ssd-shared`).

Files are published atomically (tmp + fsync + rename), never modified after,
and named by their writer's id and random digits (`fresh_stem`), so replicas
never write over each other and each knows its own. What sharing adds is
discovery and deletion discipline:

- Discovery (`DirWatch`): a replica lists its fingerprint directory and reads
  the header of every `.mlxkv` file and `.mlxmf` block manifest it has not
  seen, so a conversation another replica flushed becomes restorable here
  (its own files it skips: they are indexed when committed).
  The `blocks/` directory is never listed: blocks are found through the
  manifests that name them. Listing is skipped while no
  namespace directory changed its mtime, so an idle poll costs a few `stat`s.
- Deletion (`DeletionGuard`): only the replica holding the directory's
  garbage-collector lock (`flock` on `.gc.lock`, released by the kernel when
  its process dies) deletes anything: cap evictions, superseded and duplicate
  files. And it deletes only files nobody touched for `grace_s` (a restore
  refreshes a file's mtime), never a file its own index still references.
  Another replica's read in progress is safe anyway (an open file outlives its
  name on POSIX); a replica that indexed a file which is later deleted finds
  it gone when it reads it or at its next poll, and counts a miss. Blocks
  are collected only after the manifest that named them is deleted, and only
  those no manifest on disk names (`BlockStore.collect`, under the blocks
  lock that every writer holds shared from its probes to its manifest).
- Caps: every replica indexes every file, so each sees the directory's total
  and enforces the same `--ssd-cache-max` on it (give all replicas the same).

No trio here: the cache owner runs these on worker threads.
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

GC_LOCK = ".gc.lock"
DEFAULT_GRACE_S = 60.0


def new_writer_id() -> str:
    """A process's writer id: the first 8 hex digits of each file name it publishes."""
    return uuid.uuid4().hex[:8]


def fresh_stem(writer: str) -> str:
    """A new file's name (without its suffix): `writer`, then random hex digits, 32 in all (a uuid4's)."""
    return writer + uuid.uuid4().hex[len(writer):]


@attrs.define
class DeletionGuard:
    """Decides whether this replica may delete a file of the shared directory, and does it."""

    directory: Path  # the fingerprint directory
    grace_s: float = DEFAULT_GRACE_S
    clock: Callable[[], float] = time.time
    _fd: int | None = None
    refused: int = 0  # deletions skipped (not the collector, or too recently used)
    retried: int = 0  # refused deletions carried out later, once the grace had passed
    _pending: dict[Path, None] = attrs.field(factory=dict)  # refused as the collector: retry

    @property
    def is_collector(self) -> bool:
        """This replica holds the collector lock."""
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the collector lock if it is free (then keep it until the process exits); True if held."""
        if self._fd is None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.directory / GC_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._fd = fd
        return True

    def may_delete(self, path: Path) -> bool:
        if not self.acquire():
            return False
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return False
        except OSError:
            return False
        return self.clock() - mtime >= self.grace_s

    def unlink(self, path: Path) -> bool:
        """Delete `path` if allowed; True when it was deleted."""
        if not self.may_delete(path):
            self.refused += 1
            if self.is_collector and path.exists():
                self._pending[path] = None  # too recently used: `retry` deletes it after the grace
            return False
        try:
            path.unlink(missing_ok=True)
        except OSError:
            return False
        self._pending.pop(path, None)
        return True

    @property
    def pending(self) -> int:
        """Refused deletions waiting for their grace to pass."""
        return len(self._pending)

    def forget_indexed(self, indexed: Callable[[Path], bool]) -> int:
        """Forget the refused deletions of files indexed again; returns how many (no I/O).

        Call it where the index cannot change meanwhile (the owner's own thread), not
        from `retry`'s worker thread: a file evicted and refused after the index was read
        would be forgotten as "indexed" and stay on disk for good.
        """
        again = [path for path in list(self._pending) if indexed(path)]
        for path in again:
            self._pending.pop(path, None)
        return len(again)

    def retry(self) -> int:
        """(I/O) Delete the refused files whose grace has passed; returns how many went.

        Without this the cap would hold in the index only: a file evicted while
        fresh would stay on disk for good. A file someone used since waits for its
        grace again; one already gone is forgotten. The ones indexed again are the
        caller's to drop first (`forget_indexed`).
        """
        deleted = 0
        for path in list(self._pending):
            if not path.exists():
                self._pending.pop(path, None)
                continue
            if self.may_delete(path):
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    continue
                self._pending.pop(path, None)
                self.retried += 1
                deleted += 1
        return deleted

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


@attrs.frozen
class DirChanges:
    found: tuple[Any, ...]  # records of files not seen before
    gone: frozenset[Path]  # files seen before that are no longer there


@attrs.define
class DirWatch:
    """Finds the files other replicas published (and those deleted) since the last poll."""

    directory: Path  # the fingerprint directory
    read: Callable[[Path], Any | None]  # header-only read of one file -> a record, or None
    suffix: str | tuple[str, ...] = (".mlxkv", ".mlxmf")  # whole files and block manifests
    # Every this many polls, list every directory even if its mtime did not move
    # (filesystems with coarse timestamps can hide a second change within one tick).
    full_every: int = 30
    # This replica's writer id (`fresh_stem`): its own files are indexed when it commits them, never
    # "discovered" (one found between its rename and that commit, or after its eviction, would be
    # indexed again as the newest file, evicting a fresher one).
    own: str = ""
    _seen: set[Path] = attrs.Factory(set)
    _dir_mtimes: dict[Path, float] = attrs.Factory(dict)
    _polls: int = 0

    def know(self, paths: Iterable[Path]) -> None:
        """Files this replica already knows (its startup scan, its own writes)."""
        self._seen.update(paths)

    def poll(self) -> DirChanges:
        try:
            ns_dirs = [p for p in self.directory.iterdir() if p.is_dir() and p.name != "blocks"]
        except OSError:
            return DirChanges((), frozenset())
        self._polls += 1
        full = self._polls % self.full_every == 0
        changed = []
        for d in ns_dirs:
            try:
                mtime = d.stat().st_mtime_ns / 1e9
            except OSError:
                continue
            if full or self._dir_mtimes.get(d) != mtime:
                changed.append((d, mtime))
        found = []
        gone: set[Path] = set()
        for d, mtime in changed:
            try:
                names = {p for p in d.iterdir() if p.name.endswith(self.suffix)}
            except OSError:
                continue
            self._dir_mtimes[d] = mtime
            gone |= {p for p in self._seen if p.parent == d and p not in names}
            for path in sorted(names - self._seen):
                if self.own and path.name.startswith(self.own):
                    self._seen.add(path)
                    continue
                record = self.read(path)
                if record is not None:
                    found.append(record)
                    self._seen.add(path)
        self._seen -= gone
        return DirChanges(tuple(found), frozenset(gone))
