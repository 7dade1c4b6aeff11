"""The constraints a server compiled lately, kept beside the SSD tier's files so a restart compiles them first.

llguidance cannot serialize a compiled grammar (structured/matcher.py), so what survives a restart
is the list of constraints (kind and source): the engine writes it when it compiles a new grammar
and when it closes, and at load compiles its entries before serving, within a time budget.

The file says which vocabulary it was written for (the SSD store's model id and tokenizer hash): a
list another model wrote is ignored, as are a missing, unreadable or other-version file. Replicas on
one --ssd-shared directory share the file: the last save wins, whole (each writer has its own tmp).
No trio, no MLX (structured/spec.py's Constraint only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from mlxd.kv.small_files import write_durably
from mlxd.runtime.logging import get_logger
from mlxd.structured.spec import Constraint, Kind

log = get_logger("mlxd.grammar_list")

FILE_NAME = "grammars.json"
VERSION = 1
MAX_ENTRIES = 64
MAX_SOURCE_BYTES = 4 << 20  # all sources together
_KINDS = frozenset(get_args(Kind))


def list_path(directory: Path) -> Path:
    """The list in a store's fingerprint directory (this model's)."""
    return directory / FILE_NAME


def kept(constraints: Sequence[Constraint]) -> list[Constraint]:
    """The most recent of `constraints` (most recent last) within the caps: 64 entries, 4 MB of source."""
    out: list[Constraint] = []
    total = 0
    for c in reversed(constraints):
        size = len(c.source.encode())
        if len(out) >= MAX_ENTRIES or total + size > MAX_SOURCE_BYTES:
            break
        out.append(c)
        total += size
    out.reverse()
    return out


def save(path: Path, constraints: Sequence[Constraint], vocabulary: str) -> None:
    """Write the most recent `constraints` for `vocabulary` atomically (kv/small_files.py); OSError on failure."""
    entries = [{"kind": c.kind, "source": c.source} for c in kept(constraints)]
    body = {"version": VERSION, "vocabulary": vocabulary, "constraints": entries}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_durably(path, json.dumps(body, ensure_ascii=False).encode())


def load(path: Path, vocabulary: str) -> list[Constraint]:
    """The constraints saved for `vocabulary` (most recent last); [] when the file is missing, another
    version's or another model's, or unreadable (logged). Never raises."""
    try:
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return []
        if data.get("vocabulary") != vocabulary:
            return []
        return kept([_constraint(e) for e in data["constraints"]])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("grammars.saved_unreadable", path=str(path), error=str(exc))
        return []


def _constraint(entry: Any) -> Constraint:
    kind, source = entry["kind"], entry["source"]
    if kind not in _KINDS or not isinstance(source, str):
        raise ValueError(f"not a saved constraint: {str(entry)[:80]}")
    return Constraint(kind, source)
