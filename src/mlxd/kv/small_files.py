"""A small file beside the SSD tier's, written so a crash leaves the old one or the new one whole.

The pins file (kv/pins.py) and the restore advisor's calibration (kv/advisor_file.py) are
rewritten whole when a server stops, a stored response (http/response_store.py) when it is made: tmp + fsync + rename + directory fsync. No trio, no MLX.

A process killed mid-save leaves its tmp (`<name>.<32 hex digits>.tmp`); `sweep_tmps` removes those
older than an hour when the directory is opened again (the SSD store's scan, the response store).
"""

from __future__ import annotations

import os
import re
import stat
import time
import uuid
from pathlib import Path

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.kv.small_files")

# A tmp younger than this may be a save in progress: another replica's on a shared --ssd-shared
# directory, or a slow disk's. A save takes milliseconds to seconds; an hour leaves no doubt.
TMP_GRACE_S = 3600.0
_TMP = re.compile(r"(?P<target>.+)\.[0-9a-f]{32}\.tmp")  # write_durably's: <name>.<uuid4().hex>.tmp
# The files saved beside the SSD tier's (kv/pins.py, advisor_file.py, probe_file.py, grammar_list.py).
STORE_FILES = re.compile(r"pins\.json|restore-advisor\.json|device-probe\.json|grammars\.json")


def write_durably(path: Path, body: bytes) -> None:
    """(worker thread) Replace `path` with `body` atomically and durably; OSError on failure.

    The tmp is this save's own (random): replicas on one --ssd-shared directory save the same file (the
    grammar list, the probe), and through one tmp name two saves wrote into each other's; a pid and thread
    id repeat across the hosts sharing it (containers: PID 1 on each)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(body)
            while view:  # write(2) may take part of it (a nearly full disk): the rest, or its error
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the old file stays; a full disk is not left fuller
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sweep_tmps(directory: Path, targets: re.Pattern[str], *, grace_s: float = TMP_GRACE_S,
               now: float | None = None) -> int:
    """(worker thread) Remove the tmps of killed saves in `directory`: regular files named as write_durably
    names them for a file `targets` matches whole, last modified more than `grace_s` ago. Nothing else
    (no other name, no link, no directory); a file that cannot be removed is logged and left. The count
    removed."""
    cutoff = (time.time() if now is None else now) - grace_s
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("small_files.tmp_sweep_failed", path=str(directory), error=str(exc))
        return 0
    removed = 0
    for entry in entries:
        match = _TMP.fullmatch(entry.name)
        if match is None or not targets.fullmatch(match["target"]):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_mtime >= cutoff:
                continue
            os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:
            continue  # another replica's sweep took it
        except OSError as exc:
            log.warning("small_files.tmp_sweep_failed", path=entry.path, error=str(exc))
    if removed:
        log.info("small_files.tmps_removed", dir=str(directory), files=removed)
    return removed
