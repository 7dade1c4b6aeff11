"""Stored Responses (`store: true`): kept in memory, and as files beside the SSD tier.

A stored response is a JSON record: the response object as returned, the
conversation it ends (chat messages, its own output included) that a request
naming it in `previous_response_id` continues, and the cache session of that
conversation. With an SSD tier the records are written to
`<ssd-cache>/responses/<id>.json` (tmp + fsync + rename + directory fsync:
kv/small_files.py), so they survive a restart or a power loss; a record that
cannot be read back is a miss (404), never a 500. Without an SSD tier they
live in this process only. Synchronous file I/O: callers run it on a worker
thread; building the store sweeps the tmps of saves a kill cut short
(kv/small_files.sweep_tmps), once, before the server serves.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlxd.kv.small_files import sweep_tmps, write_durably
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.http.responses")

_ID = re.compile(r"^resp_[0-9a-f]{32}$")
_FILE = re.compile(r"resp_[0-9a-f]{32}\.json")  # a record's file; its save's tmp is swept when left
MAX_IN_MEMORY = 4096  # records kept in RAM; older ones are read back from their files


class ResponseStore:
    """id -> record; `directory` None keeps them in memory only (the newest MAX_IN_MEMORY)."""

    def __init__(self, directory: Path | None, *, max_in_memory: int = MAX_IN_MEMORY) -> None:
        self.directory = directory
        self._max = max_in_memory
        self._recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        if directory is not None:  # (once, before serving) the tmps of saves a kill cut short
            sweep_tmps(directory, _FILE)

    def _path(self, rid: str) -> Path | None:
        if self.directory is None or not _ID.match(rid):
            return None
        return self.directory / f"{rid}.json"

    def put(self, rid: str, record: dict[str, Any]) -> None:
        self._remember(rid, record)
        path = self._path(rid)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_durably(path, json.dumps(record).encode())  # tmp + fsync + rename + directory fsync
        except OSError as exc:  # kept in memory: a full disk costs the restart, not the request
            log.warning("response_store_write_failed", id=rid, error=str(exc))  # write_durably removed its tmp

    def get(self, rid: str) -> dict[str, Any] | None:
        if rid in self._recent:
            self._recent.move_to_end(rid)
            return self._recent[rid]
        path = self._path(rid)
        if path is None or path.is_symlink():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("response_store_read_failed", id=rid, error=str(exc))
            return None
        if not isinstance(record, dict) or not isinstance(record.get("response"), dict):
            return None
        self._remember(rid, record)
        return record

    def delete(self, rid: str) -> bool:
        known = self._recent.pop(rid, None) is not None
        path = self._path(rid)
        if path is not None and not path.is_symlink():
            try:
                path.unlink()
                known = True
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("response_store_delete_failed", id=rid, error=str(exc))
        return known

    def _remember(self, rid: str, record: dict[str, Any]) -> None:
        self._recent[rid] = record
        self._recent.move_to_end(rid)
        while len(self._recent) > self._max:
            self._recent.popitem(last=False)
