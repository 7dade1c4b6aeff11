"""One server per SSD cache directory, unless every server on it shares it (`--ssd-shared`).

A server that keeps its fingerprint directory to itself takes an exclusive
`flock` on it; replicas that share it take a shared one. So a second server
without `--ssd-shared`, or a mix of sharing and not, is refused at startup
with `DirLocked`, which names the holders. The kernel drops a lock when its
process dies (SIGKILL included), so a dead server never blocks a restart.

The lock is on the directory itself, so it adds no file. Each holder leaves a
note saying who it is in its name, `.holder.<ex|sh>.<since>.<pid>.<host>`: a
symlink to /dev/null, read for the refusal message. It is never taken for a
cache file (it is not a regular file, and the scans only look inside
namespace directories), and tools that copy the directory copy it harmlessly.

Within one process the lock is reentrant: stores that scan one directory in
the same mode share one lock, released when the last of them is gone.
No trio here: the store takes it on its scan's worker thread.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import attrs

NOTE_PREFIX = ".holder."
_MODES = {True: "sh", False: "ex"}
SHARED_PATIENCE_S = 1.0  # how long a sharer waits out another sharer's brief exclusive lock

_HELD: weakref.WeakValueDictionary[str, DirLock] = weakref.WeakValueDictionary()
_HELD_GUARD = threading.Lock()


@attrs.frozen
class Holder:
    """Who holds a lock on a directory, as its note says."""

    pid: int
    host: str
    since: float  # when it took the lock (unix time)
    shared: bool

    @classmethod
    def me(cls, *, shared: bool) -> Holder:
        return cls(os.getpid(), socket.gethostname(), time.time(), shared)

    @property
    def note_name(self) -> str:
        host = self.host.replace("/", "_")
        return f"{NOTE_PREFIX}{_MODES[self.shared]}.{int(self.since)}.{self.pid}.{host}"

    @classmethod
    def from_note(cls, name: str) -> Holder | None:
        """The holder a note's name describes (None: not a note)."""
        fields = name.removeprefix(NOTE_PREFIX).split(".", 3)
        if not name.startswith(NOTE_PREFIX) or len(fields) != 4 or fields[0] not in _MODES.values():
            return None
        mode, since, pid, host = fields
        try:
            return cls(int(pid), host, float(since), mode == "sh")
        except ValueError:
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host} (since {when})"

    def maybe_alive(self) -> bool:
        """False only when surely gone: a process of this host that no longer exists."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # another user's process, say
            return True
        return True


class DirLocked(Exception):
    """Another process uses the directory in a way that excludes us."""

    def __init__(self, directory: Path, *, shared: bool, holders: Sequence[Holder]) -> None:
        self.directory = directory
        self.shared = shared
        self.holders = tuple(holders)
        super().__init__(refusal(directory, shared=shared, holders=self.holders))


def refusal(directory: Path, *, shared: bool, holders: Sequence[Holder]) -> str:
    """The operator's message: who holds `directory`, and which flag to set."""
    owners = [h for h in holders if not h.shared]
    where = f"SSD cache directory {directory}"
    if shared:  # someone keeps it to itself
        who = _names(owners or holders)
        return (f"{where} is in use by mlxd {who}, started without --ssd-shared. Restart that server "
                f"with --ssd-shared too, or give this one another --ssd-cache directory")
    if holders and not owners:
        return (f"{where} is shared by mlxd {_names(holders)}, started with --ssd-shared. Start this "
                f"server with --ssd-shared too, or give it another --ssd-cache directory")
    return (f"{where} is in use by mlxd {_names(holders)}. Servers on one directory must all run "
            f"with --ssd-shared; or give this one another --ssd-cache directory")


def _names(holders: Sequence[Holder]) -> str:
    return "; ".join(h.describe() for h in holders) or "(another process: it left no note of who it is)"


@attrs.define(eq=False)
class DirLock:
    """A lock held on a directory; `release()` lets it go, as does dropping the last reference."""

    directory: Path
    shared: bool
    _fd: int
    _note: Path | None
    _finalizer: weakref.finalize = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _let_go, self._fd, self._note)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()


def lock_dir(directory: Path, *, shared: bool) -> DirLock:
    """Lock an existing directory for this process, shared or exclusive, without waiting.

    Raises DirLocked when another lock excludes ours (one of this process's own
    in the other mode too), and OSError when the OS cannot lock it at all.
    """
    key = os.path.realpath(directory)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None and held.held and held.shared == shared:
            return held  # another store of this process holds it already
        lock = _take(Path(directory), shared=shared)
        _HELD[key] = lock
        return lock


def holders(directory: Path) -> list[Holder]:
    """The notes of `directory`'s holders, oldest first, less those of processes surely gone."""
    found = (Holder.from_note(path.name) for path in _notes(directory))
    return sorted((h for h in found if h is not None and h.maybe_alive()), key=lambda h: h.since)


def _take(directory: Path, *, shared: bool) -> DirLock:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not _flock(fd, directory, shared=shared):
            raise DirLocked(directory, shared=shared, holders=holders(directory))
    except BaseException:
        os.close(fd)
        raise
    return DirLock(directory, shared, fd, _leave_note(directory, Holder.me(shared=shared)))


def _flock(fd: int, directory: Path, *, shared: bool) -> bool:
    """Take the lock; False when another process's lock excludes ours."""
    if not shared:
        if not _try(fd, fcntl.LOCK_EX):
            return False
        _clear_notes(directory)  # alone: every note left is from a process that is gone
        return True
    if _alone(fd):
        _clear_notes(directory)
    # Another sharer may hold it exclusively for a moment, while it clears old notes.
    deadline = time.monotonic() + SHARED_PATIENCE_S
    while not _try(fd, fcntl.LOCK_SH):  # from exclusive, this converts our own lock
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _alone(fd: int) -> bool:
    try:
        return _try(fd, fcntl.LOCK_EX)
    except OSError:  # some filesystems lock a read-only descriptor shared only
        return False


def _leave_note(directory: Path, holder: Holder) -> Path | None:
    """Say who holds the lock (best effort: a full or read-only disk leaves no note)."""
    for path in _notes(directory):  # a note of a gone process that had our pid
        old = Holder.from_note(path.name)
        if old is not None and (old.pid, old.host) == (holder.pid, holder.host):
            _unlink(path)
    path = directory / holder.note_name
    try:
        os.symlink(os.devnull, path)
    except OSError:
        return None
    return path


def _clear_notes(directory: Path) -> None:
    for path in _notes(directory):
        _unlink(path)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _notes(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.name.startswith(NOTE_PREFIX)]
    except OSError:
        return []


def _let_go(fd: int, note: Path | None) -> None:
    if note is not None:
        _unlink(note)
    os.close(fd)  # the kernel drops the lock with the last descriptor
