"""The `.mlxkv` header: constants, errors, descriptors and the hashed JSON header.

No MLX here (nor in `write` and `read`): the SSD index, the writer and the
reader threads, and the simulator use these modules without loading MLX.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

MAGIC = b"MLXDKV\r\n"  # \r\n catches text-mode mangling, like PNG's magic
FORMAT_VERSION = 2  # 2: per-tensor CRC-32 instead of sha256
EXTENSION = ".mlxkv"
PAGE = 4096  # tensor alignment in the file
PREAMBLE = struct.Struct("<8sIIQ32s8x")  # magic, version, flags, header_len, sha256, reserved
HASHED_PREAMBLE = 24  # magic..header_len are covered by the header hash
MAX_HEADER = 256 << 20
ZERO_CRC = "0" * 8  # placeholder of the same width as a CRC-32 hex digest

# dtype name in the file -> numpy dtype used to hold its bytes (bf16 as raw uint16)
NP_DTYPES = {
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
    crc32: str = ZERO_CRC


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
        return [(c, t) for c in walk(self.caches) for t in c.tensors if t is not None]


def walk(caches: Sequence[CacheDesc]) -> Iterator[CacheDesc]:
    """Depth-first, the file order of tensors."""
    for c in caches:
        yield c
        yield from walk(c.children)


def header_json(header: FileHeader) -> bytes:
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
        "caches": [cache_doc(c) for c in header.caches],
    }
    if m.generation is not None:
        doc["generation"] = m.generation
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def cache_doc(c: CacheDesc) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": c.kind, "signature": c.signature, "offset": c.offset}
    for name in ("max_size", "keep", "idx", "bits", "group_size"):
        if getattr(c, name) is not None:
            doc[name] = getattr(c, name)
    doc["tensors"] = [None if t is None else attrs.asdict(t) for t in c.tensors]
    if c.kind == "list":
        doc["caches"] = [cache_doc(x) for x in c.children]
    return doc


def parse_header(blob: bytes, digest: str) -> FileHeader:
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
        caches = tuple(parse_cache(c) for c in doc["caches"])
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


def parse_cache(doc: dict[str, Any]) -> CacheDesc:
    kind = _str(doc["kind"])
    if kind not in ("kv", "rotating", "quant", "arrays", "list"):
        raise ValueError(f"unknown cache kind {kind!r}")
    opt = {k: _int(doc[k]) for k in ("max_size", "keep", "idx", "bits", "group_size") if k in doc}
    tensors = tuple(None if t is None else _parse_tensor(t) for t in doc["tensors"])
    children = tuple(parse_cache(c) for c in doc.get("caches", ()))
    return CacheDesc(
        kind=kind, offset=_int(doc["offset"]), tensors=tensors, children=children, **opt
    )


def _parse_tensor(doc: dict[str, Any]) -> TensorDesc:
    dtype = _str(doc["dtype"])
    shape = tuple(_int(s) for s in doc["shape"])
    nbytes = _int(doc["nbytes"])
    if dtype not in NP_DTYPES or min(shape, default=0) < 0:
        raise ValueError(f"bad tensor {dtype} {shape}")
    if nbytes != math.prod(shape) * NP_DTYPES[dtype].itemsize:  # type: ignore[attr-defined]
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


def check_layout(header: FileHeader, header_end: int) -> None:
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



def encode_header(header: FileHeader) -> tuple[bytes, str]:
    """The preamble + JSON bytes of a header, and the header's sha256."""
    blob = header_json(header)
    head = PREAMBLE.pack(MAGIC, header.format_version, 0, len(blob), b"\0" * 32)
    h = hashlib.sha256(head[:HASHED_PREAMBLE])
    h.update(blob)
    head = PREAMBLE.pack(MAGIC, header.format_version, 0, len(blob), h.digest())
    return head + blob, h.hexdigest()



def align(n: int) -> int:
    """`n` rounded up to a whole page."""
    return -(-n // PAGE) * PAGE
