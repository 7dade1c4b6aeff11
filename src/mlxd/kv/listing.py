"""Directory listings of the cache directory that never follow a symbolic link out of it.

A link found in the cache directory is logged and treated as absent: never
followed, never unlinked through (the directory lock's notes, links to
/dev/null, are skipped without a word).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxd.kv.dir_lock import NOTE_PREFIX
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.kv.listing")

_NOTE = "links in the cache directory are never followed"


def listdir(d: Path) -> list[Path]:
    """The entries of `d`, sorted, without symbolic links; [] when `d` is missing or unreadable (logged)."""
    try:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("ssd_scan_failed", dir=str(d), error=str(exc))
        return []
    out = []
    for entry in entries:
        if entry.is_symlink():
            if not entry.name.startswith(NOTE_PREFIX):
                log.warning("ssd_symlink_ignored", path=entry.path, note=_NOTE)
            continue
        out.append(Path(entry.path))
    return out


def is_link(d: Path) -> bool:
    """`d` is a symbolic link (logged: it is treated as absent, never followed)."""
    if d.is_symlink():
        log.warning("ssd_symlink_ignored", path=str(d), note=_NOTE)
        return True
    return False


def real_dir(d: Path) -> bool:
    """`d` is a directory and not a link to one (a link is logged and treated as absent)."""
    return not is_link(d) and d.is_dir()
