"""Encoder outputs on the SSD tier (seed §5.13): one CRC-verified file per image digest.

`<ssd-dir>/tensors/<encoder identity>/<digest>.mlxt`: an 8-byte magic, a
4-byte header length, a JSON header (digest, identity, dtype, shape, crc32)
and the raw little-endian tensor bytes. Written tmp + fsync + rename by one
writer thread; read on the request's worker thread before it enters the
engine. A file that fails its CRC or header is unlinked and read as a miss;
every failure degrades to "not cached". No MLX, no trio.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import struct
import threading
import zlib
from pathlib import Path

import attrs
import numpy as np

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.vision")

MAGIC = b"MLXDTNS1"
SUFFIX = ".mlxt"


def tensor_path(root: Path, identity: str, digest: str) -> Path:
    return root / identity / f"{digest}{SUFFIX}"


def write_tensor(path: Path, array: np.ndarray, *, digest: str, identity: str) -> int:
    """Write `array` atomically (tmp, fsync, rename); returns the bytes written."""
    data = np.ascontiguousarray(array)
    payload = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
    header = json.dumps({"digest": digest, "identity": identity, "dtype": data.dtype.str.lstrip("<>|="),
                         "shape": list(data.shape), "crc32": zlib.crc32(payload)}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with tmp.open("wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return len(payload)


def read_tensor(path: Path, *, digest: str, identity: str) -> np.ndarray | None:
    """The tensor in `path`, verified; None when absent; a corrupt file is unlinked (None)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        if raw[:8] != MAGIC:
            raise ValueError("bad magic")
        (n,) = struct.unpack("<I", raw[8:12])
        head = json.loads(raw[12 : 12 + n])
        if head["digest"] != digest or head["identity"] != identity:
            raise ValueError("header names another tensor")
        payload = raw[12 + n :]
        if zlib.crc32(payload) != head["crc32"]:
            raise ValueError("crc32 mismatch")
        dtype = np.dtype("<" + head["dtype"]) if head["dtype"][0] in "fiu" else np.dtype(head["dtype"])
        arr = np.frombuffer(payload, dtype=dtype).reshape(head["shape"])
        return arr
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        log.warning("vision.tensor_corrupt", path=str(path), error=str(exc))
        with contextlib.suppress(OSError):
            path.unlink()
        return None


@attrs.define
class TensorWriter:
    """One thread writing encoder outputs; a full queue or a failed write is a "not stored"."""

    root: Path
    identity: str
    depth: int = 64
    written: int = 0
    dropped: int = 0
    failed: int = 0
    _queue: queue.Queue[tuple[str, np.ndarray] | None] = attrs.field(init=False)
    _thread: threading.Thread | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlxd-tensor-writer", daemon=True)
        self._thread.start()

    def put(self, digest: str, array: np.ndarray) -> None:
        try:
            self._queue.put_nowait((digest, array))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop (bounded by `timeout`)."""
        if self._thread is None:
            return
        try:
            self._queue.put((None), timeout=timeout)  # type: ignore[arg-type]
        except queue.Full:
            return
        self._thread.join(timeout)
        self._thread = None

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every queued tensor is written (tests, shutdown)."""
        if self._thread is None:
            return
        done = threading.Event()
        try:
            self._queue.put(("", done), timeout=timeout)  # type: ignore[arg-type]
        except queue.Full:
            return
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            digest, array = item
            if isinstance(array, threading.Event):
                array.set()
                continue
            path = tensor_path(self.root, self.identity, digest)
            if path.exists():
                continue
            try:
                write_tensor(path, array, digest=digest, identity=self.identity)
                self.written += 1
            except OSError as exc:
                self.failed += 1
                log.warning("vision.tensor_write_failed", path=str(path), error=str(exc))
