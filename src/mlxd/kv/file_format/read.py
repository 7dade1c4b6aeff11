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
from collections.abc import Callable
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

    The arrays are views of one page-aligned private buffer the file was read
    into: the only copy left is the engine's copy into MLX memory (seed §5.2:
    a streamed copy; nothing outlives the adoption but the MLX arrays).
    """

    header: FileHeader
    buffers: tuple[np.ndarray, ...]
    seconds: float
    # The memory the tensors were read into when a `Landing` was given (e.g. MLX
    # arrays: `adopt()` then takes them as they are, without a copy).
    landed: Any = None
    # Of `seconds`: making that memory (the `land` call: on CUDA, allocating the MLX arrays), and
    # checking CRC-32s and padding (summed over reader threads, so with blocks read in parallel it
    # can exceed their share of `seconds`). The rest is the reads themselves and the file opens.
    land_s: float = 0.0
    verify_s: float = 0.0

    @property
    def nbytes(self) -> int:
        return self.header.file_size


@attrs.frozen
class Landing:
    """Where a file's tensors are read to instead of a private host buffer.

    `views`: one writable byte view per tensor, in file order, each exactly the
    tensor's size; `owner`: what holds that memory (kept as `LoadedSnapshot.landed`).
    """

    views: tuple[memoryview, ...]
    owner: Any


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and hash-check the header only (plus the file size). No MLX calls."""
    try:
        with open(path, "rb", buffering=0) as f:
            return read_open_header(f)
    except OSError as exc:
        raise storage_error(exc, f"reading {path}") from exc


def read_open_header(f: Any) -> FileHeader:
    """The header of a file open for reading at offset 0; leaves `f` just past it."""
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


def read_snapshot(
    path: str | os.PathLike[str], *, verify: bool = True, land: Callable[[FileHeader], Landing] | None = None
) -> LoadedSnapshot:
    """Read a whole file for adoption (reader thread; no MLX calls).

    The file is read sequentially once, in large reads, straight into one
    page-aligned anonymous buffer (hashing each tensor and checking that
    padding is zero when `verify`, the default: a damaged file raises
    `CorruptFile` rather than restoring wrong numbers). The tensors are views of that buffer, so
    adopting them is one copy into MLX memory. Reading into private memory
    rather than mapping the file avoids a page fault per 4 KiB page at adopt
    time, which capped restore bandwidth (docs/benchmarks.md, H200).

    With `land`, called once with the checked header, each tensor is read
    straight into the memory it returns instead (the runtime passes MLX
    arrays, `kinds.landing`: no copy is left at all).
    """
    t0 = time.perf_counter()
    landing = None
    try:
        with open(path, "rb", buffering=0) as f:
            header = read_open_header(f)
            header_end = f.tell()
            if land is not None and header.file_size:
                t_land = time.perf_counter()
                landing = land(header)
                land_s = time.perf_counter() - t_land
                verify_s = _read_landed(f, header, header_end, landing, verify=verify)
                buffer = None
            else:
                buffer = _aligned_buffer(header.file_size) if header.file_size else None
                if buffer is not None:
                    f.seek(0)
                    _readinto_chunks(f, memoryview(buffer))
    except OSError as exc:
        raise storage_error(exc, f"reading {path}") from exc
    if landing is not None:
        buffers = tuple(_view(v, t, 0) for v, (_, t) in zip(landing.views, header.tensors(), strict=True))
        return LoadedSnapshot(header, buffers, time.perf_counter() - t0, landing.owner, land_s, verify_s)
    verify_s = 0.0
    if verify and buffer is not None:
        t_verify = time.perf_counter()
        _verify(memoryview(buffer), header, header_end)
        verify_s = time.perf_counter() - t_verify
    buffers = tuple(_view(buffer, t, t.offset) for _, t in header.tensors())
    return LoadedSnapshot(header, buffers, time.perf_counter() - t0, verify_s=verify_s)


def _read_landed(f: Any, header: FileHeader, pos: int, landing: Landing, *, verify: bool) -> float:
    """The tensors into their landing views, in file order; padding read past (checked when `verify`).
    Returns the seconds spent checking CRC-32s."""
    tensors = [t for _, t in header.tensors()]
    if len(landing.views) != len(tensors):
        raise ValueError(f"landing has {len(landing.views)} views for {len(tensors)} tensors")
    verify_s = 0.0
    for view, t in zip(landing.views, tensors, strict=True):
        dest = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if dest.nbytes != t.nbytes or dest.readonly:
            raise ValueError(f"landing view of {dest.nbytes} bytes (writable: {not dest.readonly}) for a {t.nbytes}-byte tensor")
        _skip_padding(f, t.offset - pos, verify=verify)
        _readinto_chunks(f, dest)
        if verify:
            t_crc = time.perf_counter()
            crc = zlib.crc32(dest)
            verify_s += time.perf_counter() - t_crc
            if f"{crc:08x}" != t.crc32:
                raise CorruptFile(f"tensor at offset {t.offset} fails its CRC-32")
        pos = t.offset + t.nbytes
    _skip_padding(f, header.file_size - pos, verify=verify)
    return verify_s


def _skip_padding(f: Any, n: int, *, verify: bool) -> None:
    if n < 0:
        raise CorruptFile("tensors overlap")
    if not n:
        return
    if verify:
        _check_zero(memoryview(_read_exact(f, n)))
    else:
        f.seek(n, os.SEEK_CUR)


_READ_CHUNK = 64 << 20  # bytes per read() call: full disk speed, bounded syscall size


def _aligned_buffer(size: int) -> mmap.mmap:
    """Private anonymous memory (page-aligned), faulted in at once where the OS allows.

    One MAP_POPULATE call instead of a page fault per 4 KiB page during the
    read, whose faults slowed the whole restore (docs/benchmarks.md).
    """
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate
        try:
            return mmap.mmap(-1, size, flags=flags)
        except OSError:
            pass
    return mmap.mmap(-1, size)


def _readinto_chunks(f: Any, dest: memoryview) -> None:
    for start in range(0, dest.nbytes, _READ_CHUNK):
        _readinto_all(f, dest[start : start + _READ_CHUNK])


def _verify(data: memoryview, header: FileHeader, pos: int) -> None:
    """Each tensor's CRC-32, and zero padding after the header, between tensors and at the tail."""
    for _, t in header.tensors():
        _check_zero(data[pos : t.offset])
        if f"{zlib.crc32(data[t.offset : t.offset + t.nbytes]):08x}" != t.crc32:
            raise CorruptFile(f"tensor at offset {t.offset} fails its CRC-32")
        pos = t.offset + t.nbytes
    _check_zero(data[pos : header.file_size])


def _check_zero(pad: memoryview) -> None:
    if bytes(pad).count(0) != pad.nbytes:
        raise CorruptFile("nonzero padding between tensors")


def _view(buffer: Any, t: TensorDesc, offset: int) -> np.ndarray:
    """Tensor `t` as a numpy view of `buffer` (the file's, or its own landing view) from `offset`."""
    dtype = np.dtype(NP_DTYPES[t.dtype])  # type: ignore[call-overload]
    count = math.prod(t.shape)
    if buffer is None or count == 0:
        return np.zeros(t.shape, dtype=dtype)
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(t.shape)
