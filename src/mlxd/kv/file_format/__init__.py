"""The `.mlxkv` file format: one KV-cache snapshot per file (see docs/file-format.md).

Layout: a 64-byte preamble (magic, format version, header length, header
sha256), a JSON header, then every tensor at a 4096-byte aligned offset, in
header order. The header hash is always checked on read; per-tensor CRC-32
checksums (and the zero padding between tensors) with `verify=True`, the
default of every restore (`verify=False` is the `--ssd-cache-verify off` opt-out).
Tensors carry a CRC-32 rather than a sha256 since format 2: the writer runs
beside decode, and CRC-32 takes it less CPU per byte (docs/benchmarks.md,
write-behind); it detects the damage a cache can meet (bit rot, torn or
truncated writes), and the header's sha256 still covers every descriptor.

Three modules, none of which imports MLX (a test asserts it):

- `header`: constants, errors, descriptors, the hashed JSON header;
- `write` (writer worker thread): `write_snapshot()` of a `SnapshotPlan`;
- `read` (reader worker threads): `read_header()`, `read_snapshot()`.

The MLX side lives in `mlxd.kv.kinds`, one table per cache kind: on the
engine thread `kinds.plan_snapshot()` turns mlx-lm caches into descriptors
plus zero-copy `memoryview`s of evaluated arrays, and `kinds.adopt()` turns
loaded bytes back into mlx-lm caches.
"""

from mlxd.kv.file_format.header import (
    EXTENSION,
    FORMAT_VERSION,
    MAGIC,
    PAGE,
    CacheDesc,
    CorruptFile,
    DiskFull,
    FileHeader,
    SnapshotError,
    SnapshotMeta,
    StorageError,
    TensorDesc,
    UnsupportedCache,
    UnsupportedVersion,
    encode_header,
    storage_error,
)
from mlxd.kv.file_format.read import Landing, LoadedSnapshot, read_header, read_snapshot
from mlxd.kv.file_format.write import SnapshotPlan, WrittenFile, fsync_dir, write_snapshot

__all__ = [
    "EXTENSION",
    "FORMAT_VERSION",
    "MAGIC",
    "PAGE",
    "CacheDesc",
    "CorruptFile",
    "DiskFull",
    "FileHeader",
    "Landing",
    "LoadedSnapshot",
    "SnapshotError",
    "SnapshotMeta",
    "SnapshotPlan",
    "StorageError",
    "TensorDesc",
    "UnsupportedCache",
    "UnsupportedVersion",
    "WrittenFile",
    "encode_header",
    "fsync_dir",
    "read_header",
    "read_snapshot",
    "storage_error",
    "write_snapshot",
]
