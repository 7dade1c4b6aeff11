"""The `.mlxkv` file format: one KV-cache snapshot per file (see docs/file-format.md).

Layout: a 64-byte preamble (magic, format version, header length, header
sha256), a JSON header, then every tensor at a 4096-byte aligned offset, in
header order. The header hash is always checked on read; per-tensor CRC-32
checksums (and the zero padding between tensors) only with `verify=True`.
Tensors carry a CRC-32 rather than a sha256 since format 2: the writer runs
beside decode, and CRC-32 costs it ~0.24 ms/MB against sha256's ~0.55 ms/MB
(with SHA-NI); it detects the damage a cache can meet (bit rot, torn or
truncated writes), and the header's sha256 still covers every descriptor.

The work splits by thread:

- engine thread (MLX calls): `plan_snapshot()` turns mlx-lm caches into
  descriptors plus zero-copy `memoryview`s of evaluated arrays; `adopt()`
  turns loaded bytes back into mlx-lm caches.
- writer / reader worker threads (no MLX calls): `write_snapshot()`,
  `read_header()`, `read_snapshot()`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlc

from mlxd.kv.pacing import Pacer, WriteInterrupted

MAGIC = b"MLXDKV\r\n"  # \r\n catches text-mode mangling, like PNG's magic
FORMAT_VERSION = 2  # 2: per-tensor CRC-32 instead of sha256
EXTENSION = ".mlxkv"
PAGE = 4096  # tensor alignment in the file
_PREAMBLE = struct.Struct("<8sIIQ32s8x")  # magic, version, flags, header_len, sha256, reserved
_HASHED_PREAMBLE = 24  # magic..header_len are covered by the header hash
_CHUNK = 16 << 20  # write granularity: one bounce buffer, one paced slice
_MAX_HEADER = 256 << 20
_ZERO_CRC = "0" * 8  # placeholder of the same width as a CRC-32 hex digest

# dtype name in the file -> numpy dtype used to hold its bytes (bf16 as raw uint16)
_NP_DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float64": np.dtype("<f8"),
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "bool": np.dtype("?"),
}
_MX_DTYPES = {name: getattr(mx, "bool_" if name == "bool" else name) for name in _NP_DTYPES}
_MX_NAMES = {dt: name for name, dt in _MX_DTYPES.items()}


# ----------------------------------------------------------------- errors


class SnapshotError(Exception):
    """Base of every error this module raises."""


class UnsupportedCache(SnapshotError, TypeError):
    """A cache class (or cache state) the format cannot describe: unknown is a bug, not a route."""


class StorageError(SnapshotError):
    """Writing or reading a snapshot file failed; `errno` is set when the OS said why."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class DiskFull(StorageError):
    """No space or quota left (ENOSPC, EDQUOT, EFBIG)."""


class CorruptFile(StorageError):
    """The file is not a valid snapshot: bad magic, hash, layout or size."""


class UnsupportedVersion(CorruptFile):
    """A valid magic but a format version this code does not read (regenerate it)."""


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def storage_error(exc: OSError, what: str) -> StorageError:
    """Wrap an OSError in the matching StorageError subclass."""
    cls = DiskFull if exc.errno in _FULL_ERRNOS else StorageError
    return cls(f"{what}: {exc.strerror or exc}", errno=exc.errno)


# ---------------------------------------------------------------- header


@attrs.frozen
class TensorDesc:
    """One tensor's place in the file. `offset` and `crc32` (8 hex digits) are set by the writer."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0
    crc32: str = _ZERO_CRC


@attrs.frozen
class CacheDesc:
    """One mlx-lm cache object: its kind, token offset, kind parameters and tensors.

    kinds: "kv" (keys, values), "rotating" (keys, values + max_size, keep, idx),
    "quant" (key parts then value parts + bits, group_size), "arrays" (one slot
    per state array, None for an empty slot), "list" (children only).
    """

    kind: str
    offset: int = 0
    tensors: tuple[TensorDesc | None, ...] = ()
    children: tuple[CacheDesc, ...] = ()
    max_size: int | None = None
    keep: int | None = None
    idx: int | None = None
    bits: int | None = None
    group_size: int | None = None

    @property
    def signature(self) -> str:
        """The kind signature of docs/seams.md (kinds.signature)."""
        if self.kind == "rotating":
            return f"rotating:{self.max_size}:{self.keep}"
        if self.kind == "quant":
            return f"quant:{self.bits}:{self.group_size}"
        if self.kind == "arrays":
            return f"arrays:{len(self.tensors)}"
        if self.kind == "list":
            return "list(" + ",".join(c.signature for c in self.children) + ")"
        return self.kind

    @property
    def trimmable(self) -> bool:
        """Can this cache drop trailing tokens (seed §2)?"""
        if self.kind == "rotating":
            return self.offset < (self.max_size or 0)
        if self.kind == "arrays":
            return False
        if self.kind == "list":
            return all(c.trimmable for c in self.children)
        return True


@attrs.frozen
class SnapshotMeta:
    """Identity of a snapshot: what it was computed from and which tokens it encodes."""

    model_id: str
    config_fingerprint: str
    namespace: str
    tokenizer_hash: str
    tokens: tuple[int, ...] = attrs.field(converter=lambda t: tuple(int(x) for x in t))
    created_at: float = attrs.field(factory=time.time)
    # An in-flight generation checkpoint's record (kv.gen_checkpoint); None for a prefix snapshot.
    generation: dict[str, Any] | None = attrs.field(default=None, eq=False)


@attrs.frozen
class FileHeader:
    """Everything before the tensor bytes of a `.mlxkv` file."""

    meta: SnapshotMeta
    caches: tuple[CacheDesc, ...]
    data_offset: int
    file_size: int
    format_version: int = FORMAT_VERSION
    digest: str = ""  # sha256 of the header as read or written

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.meta.tokens

    @property
    def namespace(self) -> str:
        return self.meta.namespace

    @property
    def trimmable(self) -> bool:
        return all(c.trimmable for c in self.caches)

    @property
    def signature(self) -> list[str]:
        return [c.signature for c in self.caches]

    def tensors(self) -> list[tuple[CacheDesc, TensorDesc]]:
        """Every present tensor in file order, with the cache that owns it."""
        return [(c, t) for c in _walk(self.caches) for t in c.tensors if t is not None]


def _walk(caches: Sequence[CacheDesc]) -> Iterator[CacheDesc]:
    """Depth-first, the file order of tensors."""
    for c in caches:
        yield c
        yield from _walk(c.children)


def _header_json(header: FileHeader) -> bytes:
    m = header.meta
    doc = {
        "format_version": header.format_version,
        "model_id": m.model_id,
        "config_fingerprint": m.config_fingerprint,
        "namespace": m.namespace,
        "tokenizer_hash": m.tokenizer_hash,
        "created_at": m.created_at,
        "tokens": list(m.tokens),
        "data_offset": header.data_offset,
        "file_size": header.file_size,
        "caches": [_cache_doc(c) for c in header.caches],
    }
    if m.generation is not None:
        doc["generation"] = m.generation
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def _cache_doc(c: CacheDesc) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": c.kind, "signature": c.signature, "offset": c.offset}
    for name in ("max_size", "keep", "idx", "bits", "group_size"):
        if getattr(c, name) is not None:
            doc[name] = getattr(c, name)
    doc["tensors"] = [None if t is None else attrs.asdict(t) for t in c.tensors]
    if c.kind == "list":
        doc["caches"] = [_cache_doc(x) for x in c.children]
    return doc


def _parse_header(blob: bytes, digest: str) -> FileHeader:
    """Decode a hash-verified header; any structural surprise is CorruptFile."""
    try:
        doc = json.loads(blob)
        meta = SnapshotMeta(
            model_id=_str(doc["model_id"]),
            config_fingerprint=_str(doc["config_fingerprint"]),
            namespace=_str(doc["namespace"]),
            tokenizer_hash=_str(doc["tokenizer_hash"]),
            tokens=[_int(t) for t in doc["tokens"]],
            created_at=float(doc["created_at"]),
            generation=_dict_or_none(doc.get("generation")),
        )
        caches = tuple(_parse_cache(c) for c in doc["caches"])
        return FileHeader(
            meta=meta,
            caches=caches,
            data_offset=_int(doc["data_offset"]),
            file_size=_int(doc["file_size"]),
            format_version=_int(doc["format_version"]),
            digest=digest,
        )
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise CorruptFile(f"malformed header: {exc!r}") from exc


def _parse_cache(doc: dict[str, Any]) -> CacheDesc:
    kind = _str(doc["kind"])
    if kind not in ("kv", "rotating", "quant", "arrays", "list"):
        raise ValueError(f"unknown cache kind {kind!r}")
    opt = {k: _int(doc[k]) for k in ("max_size", "keep", "idx", "bits", "group_size") if k in doc}
    tensors = tuple(None if t is None else _parse_tensor(t) for t in doc["tensors"])
    children = tuple(_parse_cache(c) for c in doc.get("caches", ()))
    return CacheDesc(
        kind=kind, offset=_int(doc["offset"]), tensors=tensors, children=children, **opt
    )


def _parse_tensor(doc: dict[str, Any]) -> TensorDesc:
    dtype = _str(doc["dtype"])
    shape = tuple(_int(s) for s in doc["shape"])
    nbytes = _int(doc["nbytes"])
    if dtype not in _NP_DTYPES or min(shape, default=0) < 0:
        raise ValueError(f"bad tensor {dtype} {shape}")
    if nbytes != math.prod(shape) * _NP_DTYPES[dtype].itemsize:  # type: ignore[attr-defined]
        raise ValueError("tensor nbytes does not match its shape")
    return TensorDesc(dtype, shape, nbytes, _int(doc["offset"]), _str(doc["crc32"]))


def _int(x: Any) -> int:
    if type(x) is not int:
        raise TypeError(f"expected int, got {type(x).__name__}")
    return x


def _dict_or_none(x: Any) -> dict[str, Any] | None:
    if x is not None and type(x) is not dict:
        raise TypeError(f"expected an object, got {type(x).__name__}")
    return x


def _str(x: Any) -> str:
    if type(x) is not str:
        raise TypeError(f"expected str, got {type(x).__name__}")
    return x


def _check_layout(header: FileHeader, header_end: int) -> None:
    """Tensors must be page aligned, in order, non-overlapping and inside the file."""
    pos = header_end
    for i, (_, t) in enumerate(header.tensors()):
        if t.offset % PAGE or t.offset < pos or (i == 0 and t.offset != header.data_offset):
            raise CorruptFile(f"tensor {i} at bad offset {t.offset}")
        pos = t.offset + t.nbytes
    if header.data_offset < header_end or header.data_offset % PAGE:
        raise CorruptFile("bad data offset")
    if header.file_size != max(pos, header.data_offset):
        raise CorruptFile("header file_size does not match its tensors")
    if header.format_version != FORMAT_VERSION:
        raise CorruptFile("format version mismatch between preamble and header")


# ------------------------------------------------ engine thread: planning


@attrs.frozen
class SnapshotPlan:
    """What the writer needs: descriptors plus one buffer per tensor, in file order.

    Buffers are memoryviews of evaluated MLX arrays (zero-copy, possibly
    strided); each keeps its array alive. Nothing here needs MLX any more.
    """

    meta: SnapshotMeta
    caches: tuple[CacheDesc, ...]
    buffers: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def trimmable(self) -> bool:
        return all(c.trimmable for c in self.caches)


def plan_snapshot(caches: Sequence[Any], *, meta: SnapshotMeta) -> SnapshotPlan:
    """Describe mlx-lm caches for writing (engine thread: evaluates arrays).

    Plain and quantized KV tensors are sliced to `offset`. Every array handed
    to the writer is a *new* array object (a slice), so the cache can keep
    decoding in place without touching the bytes being written.
    """
    arrays: list[mx.array] = []
    descs = tuple(_plan_cache(c, arrays) for c in caches)
    mx.eval(arrays)
    buffers = tuple(memoryview(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in arrays)  # type: ignore[arg-type]
    return SnapshotPlan(meta=meta, caches=descs, buffers=buffers)


def _plan_cache(c: Any, out: list[mx.array]) -> CacheDesc:
    kind = type(c)
    if kind is mlc.KVCache:
        return _plan_kv(c, out)
    if kind is mlc.RotatingKVCache:
        return _plan_rotating(c, out)
    if kind is mlc.QuantizedKVCache:
        return _plan_quant(c, out)
    if kind is mlc.ArraysCache:
        return _plan_arrays(c, out)
    if kind is mlc.CacheList:
        return CacheDesc(kind="list", children=tuple(_plan_cache(x, out) for x in c.caches))
    raise UnsupportedCache(f"cannot snapshot cache class {kind.__module__}.{kind.__qualname__}")


def _tensor(a: mx.array, out: list[mx.array]) -> TensorDesc:
    if a.dtype not in _MX_NAMES:
        raise UnsupportedCache(f"unsupported dtype {a.dtype}")
    out.append(a)
    return TensorDesc(dtype=_MX_NAMES[a.dtype], shape=tuple(a.shape), nbytes=a.nbytes)


def _plan_kv(c: mlc.KVCache, out: list[mx.array]) -> CacheDesc:
    if c.keys is None or c.offset == 0:
        return CacheDesc(kind="kv")
    n = c.offset
    tensors = (_tensor(c.keys[..., :n, :], out), _tensor(c.values[..., :n, :], out))
    return CacheDesc(kind="kv", offset=n, tensors=tensors)


def _plan_rotating(c: mlc.RotatingKVCache, out: list[mx.array]) -> CacheDesc:
    params = {"max_size": c.max_size, "keep": c.keep, "idx": c._idx}
    if c.keys is None:
        return CacheDesc(kind="rotating", offset=c.offset, **params)
    # Before the ring wraps, slots past `offset` are slack; after, the whole ring is live.
    n = c.offset if c._idx == c.offset and c.offset <= c.keys.shape[2] else c.keys.shape[2]
    tensors = (_tensor(c.keys[..., :n, :], out), _tensor(c.values[..., :n, :], out))
    return CacheDesc(kind="rotating", offset=c.offset, tensors=tensors, **params)


def _plan_quant(c: mlc.QuantizedKVCache, out: list[mx.array]) -> CacheDesc:
    params = {"bits": c.bits, "group_size": c.group_size}
    if c.keys is None or c.offset == 0:
        return CacheDesc(kind="quant", **params)  # type: ignore[arg-type]
    n = c.offset
    parts = [*c.keys, *c.values]
    tensors = tuple(_tensor(p[..., :n, :], out) for p in parts)
    return CacheDesc(kind="quant", offset=n, tensors=tensors, **params)


def _plan_arrays(c: mlc.ArraysCache, out: list[mx.array]) -> CacheDesc:
    if c.left_padding is not None or c.lengths is not None:
        raise UnsupportedCache("ArraysCache carries batch state (left_padding/lengths)")
    tensors = tuple(None if a is None else _tensor(a[...], out) for a in c.cache)
    return CacheDesc(kind="arrays", tensors=tensors)


# ------------------------------------------------ writer thread: no MLX


@attrs.frozen
class WrittenFile:
    """A snapshot that is durably on disk under its final name."""

    path: Path
    nbytes: int  # file size
    header: FileHeader
    seconds: float

    @property
    def digest(self) -> str:
        return self.header.digest


def _layout(plan: SnapshotPlan) -> FileHeader:
    """Assign page-aligned offsets; hashes stay placeholders of their final width."""
    caches, data_offset = plan.caches, PAGE
    for _ in range(8):  # offsets change the header length, which can move the data start
        caches, end = _place(plan.caches, data_offset)
        size = max(end, data_offset)  # a file without tensors ends at the data offset
        draft = FileHeader(meta=plan.meta, caches=caches, data_offset=data_offset, file_size=size)
        header_end = _PREAMBLE.size + len(_header_json(draft))
        if header_end <= data_offset:
            return draft
        data_offset = _align(header_end)
    raise AssertionError("header layout did not converge")


def _place(caches: Sequence[CacheDesc], start: int) -> tuple[tuple[CacheDesc, ...], int]:
    """Offsets for every tensor from `start`; returns the placed caches and the data end."""
    pos, end = start, 0

    def place(c: CacheDesc) -> CacheDesc:
        nonlocal pos, end
        tensors = []
        for t in c.tensors:
            if t is not None:
                t = attrs.evolve(t, offset=_align(pos), crc32=_ZERO_CRC)
                pos = end = t.offset + t.nbytes
            tensors.append(t)
        children = tuple(place(x) for x in c.children)
        return attrs.evolve(c, tensors=tuple(tensors), children=children)

    placed = tuple(place(c) for c in caches)
    return placed, end


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _with_digests(caches: Sequence[CacheDesc], digests: Iterator[str]) -> tuple[CacheDesc, ...]:
    def fill(c: CacheDesc) -> CacheDesc:
        tensors = tuple(
            None if t is None else attrs.evolve(t, crc32=next(digests)) for t in c.tensors
        )
        return attrs.evolve(c, tensors=tensors, children=tuple(fill(x) for x in c.children))

    return tuple(fill(c) for c in caches)


def encode_header(header: FileHeader) -> tuple[bytes, str]:
    """The preamble + JSON bytes of a header, and the header's sha256."""
    blob = _header_json(header)
    head = _PREAMBLE.pack(MAGIC, header.format_version, 0, len(blob), b"\0" * 32)
    h = hashlib.sha256(head[:_HASHED_PREAMBLE])
    h.update(blob)
    head = _PREAMBLE.pack(MAGIC, header.format_version, 0, len(blob), h.digest())
    return head + blob, h.hexdigest()


def write_snapshot(
    plan: SnapshotPlan, path: str | os.PathLike[str], *, pacer: Pacer | None = None, direct: bool | None = None
) -> WrittenFile:
    """Write `<path>.tmp`, checksumming as it goes; fsync; rename onto `path`; fsync the dir.

    No MLX calls. With a `pacer`, bytes go out in its slices at its rate.
    `direct` chooses O_DIRECT (True), the page cache (False), or (None) O_DIRECT
    exactly while the pacer is pacing (see `_Sink`). Raises DiskFull or
    StorageError (or the pacer's WriteInterrupted); the tmp file is removed on
    any failure.
    """
    t0 = time.perf_counter()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    layout = _layout(plan)
    try:
        header = _write_tmp(plan, layout, tmp, pacer, direct)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise storage_error(exc, f"writing {path}") from exc
    except WriteInterrupted:
        _unlink_quietly(tmp)
        raise
    return WrittenFile(path, header.file_size, header, time.perf_counter() - t0)


def _write_tmp(
    plan: SnapshotPlan, layout: FileHeader, tmp: Path, pacer: Pacer | None, direct: bool | None
) -> FileHeader:
    if direct is not None:
        want_direct: Callable[[], bool] = lambda: direct  # noqa: E731
    else:
        want_direct = pacer.pacing if pacer is not None else (lambda: False)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        size = pacer.slice_bytes if pacer is not None else _CHUNK
        sink = _Sink(fd, start=layout.data_offset, size=size, want_direct=want_direct)
        digests = []
        for (_, desc), buf in zip(layout.tensors(), plan.buffers, strict=True):
            sink.zeros(desc.offset - sink.position)  # padding up to the tensor's page
            crc = 0
            for piece in _byte_pieces(buf, _CHUNK):
                crc = zlib.crc32(piece, crc)
                sink.write(piece, pacer)
            digests.append(f"{crc:08x}")
        sink.finish(pacer)
        caches = _with_digests(layout.caches, iter(digests))
        header = attrs.evolve(layout, caches=caches)
        blob, digest = encode_header(header)
        head = _Sink(fd, start=0, size=header.data_offset, want_direct=lambda: False)
        head.write(memoryview(blob), None)
        head.finish(None)  # zero-pads the header block up to data_offset
        os.ftruncate(fd, header.file_size)  # the last block was padded to the page
        os.fsync(fd)
    finally:
        os.close(fd)
    return attrs.evolve(header, digest=digest)


class _Sink:
    """Streams bytes to a file from `start` on, through a page-aligned buffer.

    Each full buffer is one slice (one paced step). Before each slice the sink
    asks `want_direct()` whether to bypass the page cache:

    - O_DIRECT while write-behind is being paced beside a decoding engine:
      buffered writes cost this VM ~2.7 ms of kernel CPU per MB (writeback),
      O_DIRECT from the aligned buffer ~0.05 ms/MB plus the copy into it
      (~0.1 ms/MB), and every millisecond is taken from decode
      (docs/benchmarks.md, write-behind);
    - buffered when the engine is idle or a flush is waiting: the CPU is free
      then, and the pages stay in the page cache, so the checkpoint a
      returning conversation (or a restart right after a flush) needs is read
      from memory. A buffered slice is written back at once (fdatasync), so no
      writeback burst is left for a decoding moment later.

    Falls back to buffered writes where the filesystem refuses O_DIRECT
    (tmpfs, some FUSE and network filesystems).
    """

    def __init__(self, fd: int, *, start: int, size: int, want_direct: Callable[[], bool]) -> None:
        self.fd = fd
        self.position = start  # file offset of the next byte
        self._flushed = start  # file offset of the buffer's first byte
        self._size = _align(max(size, PAGE))
        self._buf = _bounce(self._size)
        self._fill = 0
        self._want_direct = want_direct
        self._refused = False  # the filesystem said no to O_DIRECT: stop asking
        self.direct = False
        self.direct_bytes = 0  # bytes written with O_DIRECT (for tests and stats)

    def write(self, data: memoryview, pacer: Pacer | None) -> None:
        while data.nbytes:
            n = min(data.nbytes, self._size - self._fill)
            self._buf[self._fill : self._fill + n] = data[:n]
            self._fill += n
            self.position += n
            data = data[n:]
            if self._fill == self._size:
                self._flush(pacer)

    def zeros(self, n: int) -> None:
        if n < 0:
            raise AssertionError("tensors out of file order")
        while n:
            k = min(n, self._size - self._fill)
            self._buf[self._fill : self._fill + k] = bytes(k)
            self._fill += k
            self.position += k
            n -= k
            if self._fill == self._size:
                self._flush(None)

    def finish(self, pacer: Pacer | None) -> None:
        """Flush the rest, zero-padded to a whole page (the caller truncates the file)."""
        if self._fill:
            pad = _align(self._fill) - self._fill
            self._buf[self._fill : self._fill + pad] = bytes(pad)
            self._fill += pad
            self._flush(pacer)

    def _flush(self, pacer: Pacer | None) -> None:
        want = self._want_direct() and not self._refused
        if want != self.direct:
            self.direct = _set_direct(self.fd, want)
            self._refused = want and not self.direct
        data = self._buf[: self._fill]
        offset = self._flushed
        while data.nbytes:
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self.direct = _set_direct(self.fd, False)  # accepted by fcntl, refused on write
                self._refused = True
                continue
            data = data[n:]
            offset += n
        if self.direct:
            self.direct_bytes += self._fill
        elif self._fill >= _SYNC_SLICE:
            os.fdatasync(self.fd)  # write back now, while the CPU is free
        self._flushed += self._fill
        written, self._fill = self._fill, 0
        if pacer is not None:
            pacer.done(written)


_SYNC_SLICE = 1 << 20  # buffered slices this large are written back at once


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is now on."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        return False
    return on


_bounces = threading.local()


def _bounce(size: int) -> memoryview:
    """A page-aligned buffer of at least `size` bytes, reused per thread (an anonymous mapping)."""
    cached = getattr(_bounces, "buf", None)
    if cached is None or len(cached) < size:
        cached = mmap.mmap(-1, size)
        _bounces.buf = cached
    return memoryview(cached)[:size]


def _byte_pieces(buf: memoryview, size: int) -> Iterator[memoryview]:
    """A tensor's bytes in C order: direct slices (at most `size`) if contiguous, else packed rows."""
    if buf.c_contiguous:
        raw = buf.cast("B") if buf.ndim else memoryview(buf.tobytes())
        for start in range(0, raw.nbytes, size):
            yield raw[start : start + size]
        return
    arr = np.asarray(buf)  # strided view; pack one leading index at a time
    for idx in np.ndindex(arr.shape[:-2] if arr.ndim > 2 else ()):
        yield memoryview(np.ascontiguousarray(arr[idx])).cast("B")  # type: ignore[arg-type]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# ------------------------------------------------ reader thread: no MLX


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
    head = _read_exact(f, _PREAMBLE.size)
    magic, version, flags, header_len, digest = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise CorruptFile("not an .mlxkv file (bad magic)")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {version}, this build reads {FORMAT_VERSION}")
    if flags or head[-8:] != b"\0" * 8 or header_len > min(_MAX_HEADER, size - _PREAMBLE.size):
        raise CorruptFile("bad preamble")
    blob = _read_exact(f, header_len)
    h = hashlib.sha256(head[:_HASHED_PREAMBLE])
    h.update(blob)
    if h.digest() != digest:
        raise CorruptFile("header hash mismatch")
    header = _parse_header(blob, h.hexdigest())
    _check_layout(header, _PREAMBLE.size + header_len)
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
    dtype = np.dtype(_NP_DTYPES[t.dtype])  # type: ignore[call-overload]
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


# ------------------------------------------------ engine thread: adopting


def adopt(loaded: LoadedSnapshot) -> list[Any]:
    """Build mlx-lm cache objects from loaded bytes (engine thread; one copy into MLX)."""
    arrays = iter(zip(loaded.header.tensors(), loaded.buffers, strict=True))
    made: list[mx.array] = []

    def take(t: TensorDesc | None) -> mx.array | None:
        if t is None:
            return None
        (_, desc), buf = next(arrays)
        a = mx.array(memoryview(buf))  # type: ignore[arg-type]  # the buffer protocol path: ~7x faster than from numpy
        if desc.dtype == "bfloat16":
            a = a.view(mx.bfloat16)
        made.append(a)
        return a

    caches = [_adopt_cache(c, take) for c in loaded.header.caches]
    mx.eval(made)
    return caches


def _adopt_cache(c: CacheDesc, take: Any) -> Any:
    parts = [take(t) for t in c.tensors]
    if c.kind == "kv":
        cache = mlc.KVCache()
        if parts:
            cache.keys, cache.values = parts
            cache.offset = c.offset
        return cache
    if c.kind == "rotating":
        cache = mlc.RotatingKVCache(max_size=c.max_size, keep=c.keep or 0)  # type: ignore[assignment]
        if parts:
            cache.keys, cache.values = parts
        cache.offset, cache._idx = c.offset, c.idx or 0  # type: ignore[attr-defined]
        return cache
    if c.kind == "quant":
        cache = mlc.QuantizedKVCache(group_size=c.group_size, bits=c.bits)  # type: ignore[assignment]
        if parts:
            half = len(parts) // 2
            cache.keys, cache.values = tuple(parts[:half]), tuple(parts[half:])
            cache.offset = c.offset
        return cache
    if c.kind == "arrays":
        cache = mlc.ArraysCache(len(parts))  # type: ignore[assignment]
        cache.cache = parts  # type: ignore[attr-defined]
        return cache
    return mlc.CacheList(*(_adopt_cache(x, take) for x in c.children))
