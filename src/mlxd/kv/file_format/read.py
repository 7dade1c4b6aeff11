"""Reading `.mlxkv` files (reader worker threads; no MLX calls).

`read_header` is the startup scan's cheap check; `read_snapshot` brings a
whole file in for `kinds.adopt` on the engine thread.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import time
import zlib
from typing import Any

import attrs
import numpy as np

from mlxd.kv.file_format.header import (
    FORMAT_VERSION,
    HASHED_PREAMBLE,
    MAGIC,
    MAX_HEADER,
    NP_DTYPES,
    PREAMBLE,
    CorruptFile,
    FileHeader,
    TensorDesc,
    UnsupportedVersion,
    check_layout,
    parse_header,
    storage_error,
)


@attrs.frozen
class LoadedSnapshot:
    """A header plus one numpy array per tensor (file order, exact shapes), ready for `adopt()`.

    Without verification the arrays are read-only views of a private mapping of
    the file, whose pages the reader already brought into the page cache: the
    only copy left is the engine's copy into MLX memory (seed §5.2: a streamed
    copy; nothing outlives the adoption but the MLX arrays).
    """

    header: FileHeader
    buffers: tuple[np.ndarray, ...]
    seconds: float

    @property
    def nbytes(self) -> int:
        return self.header.file_size


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and hash-check the header only (plus the file size). No MLX calls."""
    try:
        with open(path, "rb", buffering=0) as f:
            return _read_header(f)
    except OSError as exc:
        raise storage_error(exc, f"reading {path}") from exc


def _read_header(f: Any) -> FileHeader:
    size = os.fstat(f.fileno()).st_size
    head = _read_exact(f, PREAMBLE.size)
    magic, version, flags, header_len, digest = PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise CorruptFile("not an .mlxkv file (bad magic)")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {version}, this build reads {FORMAT_VERSION}")
    if flags or head[-8:] != b"\0" * 8 or header_len > min(MAX_HEADER, size - PREAMBLE.size):
        raise CorruptFile("bad preamble")
    blob = _read_exact(f, header_len)
    h = hashlib.sha256(head[:HASHED_PREAMBLE])
    h.update(blob)
    if h.digest() != digest:
        raise CorruptFile("header hash mismatch")
    header = parse_header(blob, h.hexdigest())
    check_layout(header, PREAMBLE.size + header_len)
    if size != header.file_size:
        raise CorruptFile(f"file is {size} bytes, header says {header.file_size}")
    return header


def _read_exact(f: Any, n: int) -> bytes:
    buf = bytearray(n)
    _readinto_all(f, memoryview(buf))
    return bytes(buf)


def _readinto_all(f: Any, dest: memoryview) -> None:
    dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
    while dest.nbytes:
        n = f.readinto(dest)
        if not n:
            raise CorruptFile("file ends early")
        dest = dest[n:]


def read_snapshot(path: str | os.PathLike[str], *, verify: bool) -> LoadedSnapshot:
    """Read a whole file for adoption (reader thread; no MLX calls).

    The file is read sequentially once, at disk speed, into a small reused
    buffer: that brings it into the page cache (and hashes each tensor when
    `verify`, checking that padding is zero). The tensors are then views of a
    read-only mapping of those cached pages, so adopting them is one copy into
    MLX memory, not two.
    """
    t0 = time.perf_counter()
    try:
        with open(path, "rb", buffering=0) as f:
            header = _read_header(f)
            _read_through(f, header, verify=verify)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if header.file_size else None
    except OSError as exc:
        raise storage_error(exc, f"reading {path}") from exc
    buffers = tuple(_view(mapping, t) for _, t in header.tensors())
    return LoadedSnapshot(header, buffers, time.perf_counter() - t0)


_READ_CHUNK = 8 << 20  # read size: large enough for full disk speed, small enough to stay in cache


def _read_through(f: Any, header: FileHeader, *, verify: bool) -> None:
    """Read every tensor byte once (page cache warm-up), hashing each tensor when verifying."""
    scratch = memoryview(bytearray(_READ_CHUNK))
    pos = f.tell()
    for _, t in header.tensors():
        _skip_padding(f, t.offset - pos, verify=verify)
        crc = 0
        left = t.nbytes
        while left:
            chunk = scratch[: min(left, _READ_CHUNK)]
            _readinto_all(f, chunk)
            if verify:
                crc = zlib.crc32(chunk, crc)
            left -= chunk.nbytes
        if verify and f"{crc:08x}" != t.crc32:
            raise CorruptFile(f"tensor at offset {t.offset} fails its CRC-32")
        pos = t.offset + t.nbytes
    _skip_padding(f, header.file_size - pos, verify=verify)  # a tensorless file's tail


def _view(mapping: mmap.mmap | None, t: TensorDesc) -> np.ndarray:
    dtype = np.dtype(NP_DTYPES[t.dtype])  # type: ignore[call-overload]
    count = math.prod(t.shape)
    if mapping is None or count == 0:
        return np.zeros(t.shape, dtype=dtype)
    return np.frombuffer(mapping, dtype=dtype, count=count, offset=t.offset).reshape(t.shape)


def _skip_padding(f: Any, n: int, *, verify: bool) -> None:
    if not verify:
        f.seek(n, os.SEEK_CUR)
        return
    pad = _read_exact(f, n)
    if pad.count(0) != n:
        raise CorruptFile("nonzero padding between tensors")

