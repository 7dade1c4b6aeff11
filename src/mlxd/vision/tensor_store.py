"""Encoder outputs on the SSD tier (seed §5.13): CRC-verified tensor files that the tier indexes.

`<ssd-dir>/tensors/<encoder identity>/<digest>/<name>.mlxt`: an 8-byte magic,
a 4-byte header length, a JSON header (digest, identity, dtype, shape, crc32)
and the raw little-endian tensor bytes. Each write gets a fresh name in its
image's directory, so a rewrite never deletes the file that replaced it.

The files are SSD records like KV files (`kv/tiers.py`): namespace
`ENCODER_NAMESPACE`, key `encoder_key(digest)`, their tensor bytes counted by
`--ssd-cache-max`. The engine hands a new output to the cache owner as a
`TensorPlan`; the durability coordinator queues it like a checkpoint and the
SSD writer writes it (tmp, fsync, rename), so a flush waits for it; the cap
evicts it with the KV files, least recently used first; the startup scan
indexes it (header only) and reaps damaged files and orphans. A request reads
its images' files on its worker thread (`find_tensor`, every byte checked): a
missing, evicted or damaged file is a re-encode, never a wrong answer.
No MLX, no trio.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path

import attrs
import numpy as np

from mlxd.kv.listing import listdir
from mlxd.kv.media import ENCODER_NAMESPACE, encoder_key
from mlxd.kv.tiers import SsdRecord
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.vision")

MAGIC = b"MLXDTNS1"
SUFFIX = ".mlxt"
TMP_MARK = ".tmp-"


@attrs.frozen(eq=False)
class TensorPlan:
    """One encoder output to write: the SSD writer's job for an image (host memory, float32)."""

    digest: str
    identity: str
    array: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@attrs.frozen
class TensorScan:
    """What the startup scan found in our encoder identity's directory."""

    records: tuple[SsdRecord, ...] = ()
    corrupt: int = 0  # unreadable, mismatched or misplaced files, unlinked
    orphans: int = 0  # temporary files of interrupted writes, unlinked
    duplicates: int = 0  # older copies of the same image, unlinked


def is_tensor_record(record: SsdRecord) -> bool:
    return record.namespace == ENCODER_NAMESPACE


def image_dir(root: Path, identity: str, digest: str) -> Path:
    return root / identity / digest


def write_tensor(path: Path, array: np.ndarray, *, digest: str, identity: str) -> int:
    """Write `array` atomically (tmp, fsync, rename); returns the tensor bytes written."""
    data = np.ascontiguousarray(array)
    payload = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
    header = json.dumps({"digest": digest, "identity": identity, "dtype": data.dtype.str.lstrip("<>|="),
                         "shape": list(data.shape), "crc32": zlib.crc32(payload)}).encode()
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
    for attempt in (0, 1):  # the eviction of an older copy may remove the (empty) directory meanwhile
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
            break
        except FileNotFoundError:
            if attempt:
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    _fsync_dir(path.parent)
    return len(payload)


def write_plan(root: Path, plan: TensorPlan, *, now: float | None = None) -> SsdRecord:
    """Write one encoder output under a fresh name; its SSD record. Raises OSError."""
    name = f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}{SUFFIX}"
    path = image_dir(root, plan.identity, plan.digest) / name
    nbytes = write_tensor(path, plan.array, digest=plan.digest, identity=plan.identity)
    mtime = time.time() if now is None else now
    return SsdRecord(ENCODER_NAMESPACE, encoder_key(plan.digest), nbytes, mtime, trimmable=False, path=path)


def read_tensor(path: Path, *, digest: str, identity: str) -> np.ndarray | None:
    """The tensor in `path`, verified; None when absent; a corrupt file is unlinked (None)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        head, payload = _split(raw)
        if head["digest"] != digest or head["identity"] != identity:
            raise ValueError("header names another tensor")
        if zlib.crc32(payload) != head["crc32"]:
            raise ValueError("crc32 mismatch")
        dtype = np.dtype("<" + head["dtype"]) if head["dtype"][0] in "fiu" else np.dtype(head["dtype"])
        arr = np.frombuffer(payload, dtype=dtype).reshape(head["shape"])
        return arr
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        log.warning("vision.tensor_corrupt", path=str(path), error=str(exc))
        unlink_tensor(path)
        return None


def find_tensor(root: Path, identity: str, digest: str) -> np.ndarray | None:
    """The newest verified copy of an image's encoder output (its mtime refreshed: the LRU clock), or None."""
    for path in reversed(listdir(image_dir(root, identity, digest))):
        if path.suffix != SUFFIX or path.name.startswith("."):
            continue
        arr = read_tensor(path, digest=digest, identity=identity)
        if arr is not None:
            with contextlib.suppress(OSError):
                os.utime(path)
            return arr
    return None


def unlink_tensor(path: Path) -> None:
    """Delete a tensor file, and its image's directory when that leaves it empty."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("vision.tensor_unlink_failed", path=str(path), error=str(exc))
        return
    with contextlib.suppress(OSError):  # not empty (a newer copy), or already gone
        path.parent.rmdir()


def scan_tensors(root: Path, identity: str) -> TensorScan:
    """Header-only scan of `<root>/<identity>`: records of good files; damaged files, orphans,
    older duplicates and stray files unlinked. Other identities' directories are left alone."""
    records: list[SsdRecord] = []
    corrupt = orphans = duplicates = 0
    for entry in listdir(root / identity):
        if not entry.is_dir():
            corrupt += 1  # not in an image's directory: never read, never indexed
            unlink_tensor(entry)
            continue
        found: list[SsdRecord] = []
        for path in listdir(entry):
            if TMP_MARK in path.name:
                orphans += 1
                unlink_tensor(path)
                continue
            record = _scan_file(path, identity, entry.name)
            if isinstance(record, SsdRecord):
                found.append(record)
            elif record == "corrupt":
                corrupt += 1
                unlink_tensor(path)
        found.sort(key=lambda r: (r.mtime, str(r.path)))
        for old in found[:-1]:
            duplicates += 1
            assert old.path is not None
            unlink_tensor(old.path)
        records.extend(found[-1:])
        with contextlib.suppress(OSError):  # an image directory left empty
            entry.rmdir()
    if corrupt or orphans or duplicates:
        log.info("vision.tensor_scan", dir=str(root / identity), indexed=len(records), corrupt=corrupt,
                 orphans=orphans, duplicates=duplicates)
    return TensorScan(tuple(records), corrupt, orphans, duplicates)


def _scan_file(path: Path, identity: str, digest: str) -> SsdRecord | str:
    """The record of a tensor file from its header and size (the payload is checked when read);
    "corrupt" (to unlink) or "unreadable" (left alone: an I/O error is no proof of damage)."""
    if path.suffix != SUFFIX:
        return "corrupt"
    try:
        with path.open("rb") as f:
            start = f.read(12)
            if len(start) != 12 or start[:8] != MAGIC:
                return "corrupt"
            (n,) = struct.unpack("<I", start[8:12])
            head = json.loads(f.read(n))
            st = os.fstat(f.fileno())
        nbytes = int(np.prod(head["shape"], dtype=np.int64)) * np.dtype(head["dtype"]).itemsize
        if head["digest"] != digest or head["identity"] != identity or st.st_size != 12 + n + nbytes:
            return "corrupt"
    except OSError as exc:
        log.warning("vision.tensor_scan_unreadable", path=str(path), error=str(exc))
        return "unreadable"
    except (ValueError, KeyError, TypeError, struct.error):
        return "corrupt"
    return SsdRecord(ENCODER_NAMESPACE, encoder_key(digest), nbytes, st.st_mtime, trimmable=False, path=path)


def _split(raw: bytes) -> tuple[dict, bytes]:
    if raw[:8] != MAGIC:
        raise ValueError("bad magic")
    (n,) = struct.unpack("<I", raw[8:12])
    return json.loads(raw[12 : 12 + n]), raw[12 + n :]


def _fsync_dir(d: Path) -> None:
    """The rename itself durable: fsync the directory (best effort; some filesystems refuse)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
