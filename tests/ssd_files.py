"""What an SSD cache directory holds, in either layout: whole files or blocks + manifests."""

from __future__ import annotations

from pathlib import Path

from mlxd.kv import file_format as ff
from mlxd.kv.block_store import BLOCK_EXT, MANIFEST_EXT, read_manifest


def checkpoint_files(root: Path) -> list[Path]:
    """Every checkpoint under `root`: whole files and manifests (each in its namespace's directory)."""
    return sorted([*root.rglob("*" + ff.EXTENSION), *root.rglob("*" + MANIFEST_EXT)])


def checkpoint_tokens(root: Path) -> list[tuple[int, ...]]:
    """The tokens of every checkpoint under `root`."""
    return [tuple(read_manifest(p).tokens if p.suffix == MANIFEST_EXT else ff.read_header(p).tokens)
            for p in checkpoint_files(root)]


def tensor_headers(root: Path) -> list[ff.FileHeader]:
    """The headers of every file holding tensors: whole files and blocks (each block an .mlxkv-format file)."""
    return [ff.read_header(p) for ext in (ff.EXTENSION, BLOCK_EXT) for p in sorted(root.rglob("*" + ext))]


def stored_bytes(root: Path) -> int:
    """Bytes on disk of whole files, blocks and manifests."""
    return sum(p.stat().st_size for ext in (ff.EXTENSION, BLOCK_EXT, MANIFEST_EXT) for p in root.rglob("*" + ext))
