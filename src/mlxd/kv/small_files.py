"""A small file beside the SSD tier's, written so a crash leaves the old one or the new one whole.

The pins file (kv/pins.py) and the restore advisor's calibration (kv/advisor_file.py) are
rewritten whole when a server stops, a stored response (http/response_store.py) when it is made: tmp + fsync + rename + directory fsync. No trio, no MLX.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_durably(path: Path, body: bytes) -> None:
    """(worker thread) Replace `path` with `body` atomically and durably; OSError on failure.

    The tmp is this save's own (random): replicas on one --ssd-shared directory save the same file (the
    grammar list, the probe), and through one tmp name two saves wrote into each other's; a pid and thread
    id repeat across the hosts sharing it (containers: PID 1 on each)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            view = memoryview(body)
            while view:  # write(2) may take part of it (a nearly full disk): the rest, or its error
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the old file stays; a full disk is not left fuller
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
