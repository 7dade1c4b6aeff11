"""The restore advisor's calibration across a restart: one small JSON file beside the SSD tier's files.

A restarted server's advisor would otherwise start from its startup probe alone, and the probe
times neither the served prefill (slicer chunks, the engine's steps) nor the disk as serving reads
it: its first choices after a restart were the ones most often wrong (docs/benchmarks.md, H200).
The cache owner writes `RestoreAdvisor.calibration()` here when it stops (kv/small_files.py, on
a worker thread); the next server on the same device reads it at startup (`RestoreAdvisor.resume`).
A file that cannot be read, or that another device wrote, is no calibration, never an error.
No trio, no MLX.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mlxd.kv.small_files import write_durably
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.advisor_file")

FILE_NAME = "restore-advisor.json"
VERSION = 1


def advisor_path(directory: Path) -> Path:
    """The calibration file of a store's fingerprint directory (this model's)."""
    return directory / FILE_NAME


def save(path: Path, calibration: dict[str, Any], device: str) -> None:
    """(worker thread) Write atomically (kv/small_files.py); OSError on failure."""
    write_durably(path, json.dumps({"version": VERSION, "device": device, "calibration": calibration}).encode())


def load(path: Path, device: str) -> dict[str, Any]:
    """(worker thread) The calibration a server on this `device` saved; {} when missing, unreadable
    (logged) or another device's."""
    try:
        data = json.loads(path.read_bytes())
        if data.get("version") != VERSION or not isinstance(data.get("calibration"), dict):
            raise ValueError("not a restore advisor calibration")
        # Every figure a finite number (`RestoreAdvisor.resume` converts them; json reads NaN and Infinity):
        # a damaged one is no calibration.
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                   for v in data["calibration"].values()):
            raise ValueError("a calibration figure is not a finite number")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("advisor.calibration_unreadable", path=str(path), error=str(exc))
        return {}
    if data.get("device") != device:
        return {}
    return dict(data["calibration"])
