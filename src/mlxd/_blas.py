"""Route MLX's CPU matmuls to an optimized BLAS on Linux.

MLX's Linux CPU wheel links the reference BLAS.  Loading OpenBLAS with
RTLD_GLOBAL *before* ``mlx.core`` is imported makes the dynamic linker resolve
MLX's ``cblas_*`` symbols to OpenBLAS instead, which is an order of magnitude faster
for fp32 matmuls (figures in ``docs/benchmarks.md``).  This module must therefore be imported before anything imports ``mlx``; ``mlxd/__init__``
does that first thing.

Set ``MLXD_BLAS=reference`` to keep MLX's own BLAS, or ``MLXD_BLAS=/path/to/lib.so``
to choose a library.  With MLX's CUDA backend installed (``mlxd[cuda]``) matmuls
run on the GPU through cuBLAS, so nothing is preloaded unless ``MLXD_BLAS`` names
a library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# What happened, for /stats and the startup log.
status: dict[str, str | None] = {"library": None, "reason": "not attempted"}


def _find_openblas() -> str | None:
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    return ctypes.util.find_library("openblas")


def cuda_backend() -> str | None:
    """The installed MLX CUDA backend distribution (e.g. ``mlx-cuda-13``), if any; no MLX import."""
    from importlib import metadata

    for name in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


def preload() -> dict[str, str | None]:
    """Load an optimized BLAS globally, once; report what was loaded."""
    if status["reason"] != "not attempted":
        return status
    choice = os.environ.get("MLXD_BLAS", "auto")
    if not sys.platform.startswith("linux"):
        status.update(library=None, reason="not linux: MLX uses its platform BLAS")
        return status
    if choice == "reference":
        status.update(library=None, reason="MLXD_BLAS=reference")
        return status
    if choice == "auto" and (cuda := cuda_backend()) is not None:
        status.update(library=None, reason=f"{cuda} installed: MLX runs matmuls on the GPU (cuBLAS)")
        return status
    if "mlx.core" in sys.modules:
        status.update(library=None, reason="mlx was imported before mlxd; reference BLAS in use")
        return status
    path = choice if choice != "auto" else _find_openblas()
    if path is None:
        status.update(
            library=None,
            reason="no OpenBLAS found (install libopenblas0-pthread); reference BLAS in use",
        )
        return status
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        status.update(library=None, reason=f"could not load {path}: {exc}")
        return status
    status.update(library=path, reason="loaded")
    return status
