"""Small random-weight models built offline (no weights are ever downloaded).

Names load on first use (PEP 562), so importing a light submodule such as
`mlxd.model.identity` does not import MLX or mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxd.model.detok import ByteLevelStreamingDetokenizer, load_model
    from mlxd.model.presets import PRESETS, ModelPreset, get_preset
    from mlxd.model.tiny import (
        build_model,
        default_model_dir,
        ensure_model,
        main_build_model,
        stderr_progress,
    )

_HOME = {
    "ByteLevelStreamingDetokenizer": "detok",
    "load_model": "detok",
    "PRESETS": "presets",
    "ModelPreset": "presets",
    "get_preset": "presets",
    "build_model": "tiny",
    "default_model_dir": "tiny",
    "ensure_model": "tiny",
    "main_build_model": "tiny",
    "stderr_progress": "tiny",
}

__all__ = [
    "PRESETS",
    "ByteLevelStreamingDetokenizer",
    "ModelPreset",
    "build_model",
    "default_model_dir",
    "ensure_model",
    "get_preset",
    "load_model",
    "main_build_model",
    "stderr_progress",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mlxd.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mlxd.model.{home}"), name)
