"""The startup probe's measurements across a restart: one small JSON file beside the SSD tier's files.

The probe times prefills, decode steps and restores before the server listens (8.4 s on the H200's
1.7B shape, a third of a restarted server's start), and it writes and reads GBs of its own snapshot
files on the disk serving restores from. A server restarted on the same device and setup measures
the same again, while the restore advisor resumes what the last server served (kv/advisor_file.py):
so the last probe is saved here and reused (`--device-probe auto`; `on` measures afresh).

`setup` is what the measurements depend on: the device (its name, memory, MLX's version, the host),
and the probe's own options (restore path, budget, tuning). A file that cannot be read, or that
another setup wrote, is no probe, never an error. No trio, no MLX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxd.kv.device_costs import DeviceProbe
from mlxd.kv.small_files import write_durably
from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.probe_file")

FILE_NAME = "device-probe.json"
VERSION = 1


def probe_path(directory: Path) -> Path:
    """The probe file of a store's fingerprint directory (this model's)."""
    return directory / FILE_NAME


def save(path: Path, probe: DeviceProbe, setup: dict[str, Any]) -> None:
    """Write atomically (kv/small_files.py); OSError on failure."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_durably(path, json.dumps({"version": VERSION, "setup": setup, "probe": probe.saved()}).encode())


def load(path: Path, setup: dict[str, Any]) -> DeviceProbe | None:
    """The probe a server with this `setup` saved (marked `reused`); None when missing, unreadable
    (logged) or another setup's."""
    try:
        data = json.loads(path.read_bytes())
        if data.get("version") != VERSION or not isinstance(data.get("probe"), dict):
            raise ValueError("not a saved device probe")
        if data.get("setup") != json.loads(json.dumps(setup)):
            return None
        return DeviceProbe.from_saved(data["probe"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:  # 1e400: int(inf)
        log.warning("probe.saved_unreadable", path=str(path), error=str(exc))
        return None
