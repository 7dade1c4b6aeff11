"""A model's identity: a content hash of its weights, config and tokenizer.

sha256 over the bytes of every ``*.safetensors`` file and of ``config.json``,
``tokenizer.json`` and ``tokenizer_config.json``. Hashing gigabytes takes
seconds, so each file's digest is memoized by (path, size, mtime, ctime,
inode) in a small JSON file under the user's cache directory: a restart with
the same files rehashes nothing, and any write to a file (its mtime and ctime
move) makes it hashed again. The served name (``--model-name``) is no part of
it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs

METADATA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_CHUNK = 8 << 20  # hashlib releases the GIL on large buffers


@attrs.frozen
class FileKey:
    """What must stay equal for a memoized digest to still describe a file."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileKey:
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def memo_path() -> Path:
    """$MLXD_CACHE_DIR/weight-hashes.json (else under $XDG_CACHE_HOME/mlxd or ~/.cache/mlxd)."""
    from mlxd.model.tiny import cache_root

    return cache_root() / "weight-hashes.json"


@attrs.define
class HashMemo:
    """Digests by resolved path, each valid while its file's `FileKey` holds."""

    path: Path | None
    _entries: dict[str, dict[str, object]] = attrs.Factory(dict)
    _dirty: bool = False
    hashed_bytes: int = 0  # bytes read this time (0 on a fully memoized start)

    @classmethod
    def load(cls, path: Path | None) -> HashMemo:
        entries: dict[str, dict[str, object]] = {}
        if path is not None:
            try:
                raw = json.loads(path.read_text())
                entries = {k: v for k, v in raw.items() if isinstance(v, dict)} if isinstance(raw, dict) else {}
            except (OSError, ValueError):
                entries = {}  # missing or unreadable: hash again
        return cls(path, entries)

    def digest(self, file: Path) -> str:
        file = file.resolve()
        key = attrs.asdict(FileKey.of(file))
        known = self._entries.get(str(file))
        if known is not None and known.get("key") == key and isinstance(known.get("sha256"), str):
            return str(known["sha256"])
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                self.hashed_bytes += len(chunk)
        self._entries[str(file)] = {"key": key, "sha256": h.hexdigest()}
        self._dirty = True
        return h.hexdigest()

    def save(self) -> None:
        """Write the memo atomically; a memo that cannot be written only costs a rehash later."""
        if self.path is None or not self._dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._entries, sort_keys=True, indent=0))
            os.replace(tmp, self.path)
            self._dirty = False
        except OSError:
            pass


def identity_files(model_dir: Path) -> list[Path]:
    """The files whose bytes decide the identity, in a fixed order."""
    meta = [model_dir / name for name in METADATA_FILES if (model_dir / name).is_file()]
    return meta + sorted(model_dir.glob("*.safetensors"))


def model_identity(model_dir: Path, *, memo: HashMemo | None = None) -> str:
    """sha256 over (name, sha256 of bytes) of every identity file of `model_dir`."""
    memo = memo if memo is not None else HashMemo.load(memo_path())
    h = hashlib.sha256()
    for file in identity_files(Path(model_dir)):
        h.update(f"{file.name}\0{memo.digest(file)}\n".encode())
    memo.save()
    return h.hexdigest()[:32]
