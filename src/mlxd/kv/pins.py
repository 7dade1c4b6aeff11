"""Pins that survive a restart: the live pins as one small JSON file beside the SSD tier's files.

The tier core (`CacheTiers.pin_set`) describes its live pins with wall-clock
deadlines: each pinned session with its latest checkpoints (namespace and
exact tokens), and each pinned prefix (a `cache_control` breakpoint's tokens,
with the session that asked for it). The cache owner writes that set here
whenever it changes (kv/small_files.py, on a worker thread), and the next
server reads it at startup and re-applies what has not expired
(`CacheTiers.restore_pins`). A file that cannot be read is no pins, never an
error. No trio, no MLX.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from mlxd.kv.small_files import write_durably
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.pins")

FILE_NAME = "pins.json"
VERSION = 1


@attrs.frozen
class SessionPin:
    """A pinned session: its deadline (wall clock) and its latest checkpoint in each namespace."""

    session: str
    deadline: float
    checkpoints: tuple[tuple[str, tuple[int, ...]], ...] = ()


@attrs.frozen
class PrefixPin:
    """A pinned prefix (a breakpoint): its exact tokens, deadline (wall clock) and the session it belongs to."""

    session: str
    namespace: str
    tokens: tuple[int, ...]
    deadline: float


@attrs.frozen
class PinSet:
    sessions: tuple[SessionPin, ...] = ()
    prefixes: tuple[PrefixPin, ...] = ()

    def live(self, now: float) -> PinSet:
        """The pins whose deadline is still ahead of `now` (wall clock)."""
        return PinSet(tuple(p for p in self.sessions if p.deadline > now),
                      tuple(p for p in self.prefixes if p.deadline > now))

    def __len__(self) -> int:
        return len(self.sessions) + len(self.prefixes)


def pins_path(directory: Path) -> Path:
    """The pins file of a store's fingerprint directory (its tokens are this model's)."""
    return directory / FILE_NAME


def _pack(tokens: tuple[int, ...]) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode("ascii")


def _unpack(text: str) -> tuple[int, ...]:
    return tuple(np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4").tolist())


def encode(pins: PinSet) -> bytes:
    doc = {
        "version": VERSION,
        "sessions": [{"session": p.session, "deadline": p.deadline,
                      "checkpoints": [{"namespace": ns, "tokens": _pack(t)} for ns, t in p.checkpoints]}
                     for p in pins.sessions],
        "prefixes": [{"session": p.session, "namespace": p.namespace, "tokens": _pack(p.tokens),
                      "deadline": p.deadline} for p in pins.prefixes],
    }
    return json.dumps(doc).encode()


def decode(raw: bytes) -> PinSet:
    """Parse a pins file; ValueError (or KeyError/TypeError) when it is not one."""
    doc: Any = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError("not a version-1 pins file")
    sessions = tuple(
        SessionPin(str(s["session"]), float(s["deadline"]),
                   tuple((str(c["namespace"]), _unpack(c["tokens"])) for c in s["checkpoints"]))
        for s in doc["sessions"]
    )
    prefixes = tuple(PrefixPin(str(p["session"]), str(p["namespace"]), _unpack(p["tokens"]), float(p["deadline"]))
                     for p in doc["prefixes"])
    return PinSet(sessions, prefixes)


def save(path: Path, pins: PinSet) -> None:
    """(worker thread) Write the pins atomically (kv/small_files.py); OSError on failure."""
    write_durably(path, encode(pins))


def load(path: Path, now: float) -> tuple[PinSet, int]:
    """(worker thread) The pins still live at `now` (wall clock) and how many had expired; none when the
    file is missing or unreadable (logged)."""
    try:
        pins = decode(path.read_bytes())
    except FileNotFoundError:
        return PinSet(), 0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("pins.unreadable", path=str(path), error=str(exc))
        return PinSet(), 0
    live = pins.live(now)
    return live, len(pins) - len(live)
