"""Small random-weight models built offline (no weights are ever downloaded)."""

from mlxd.model.detok import ByteLevelStreamingDetokenizer, load_model
from mlxd.model.presets import PRESETS, ModelPreset, get_preset
from mlxd.model.tiny import (
    build_model,
    default_model_dir,
    ensure_model,
    main_build_model,
    stderr_progress,
)

__all__ = [
    "ByteLevelStreamingDetokenizer",
    "PRESETS",
    "ModelPreset",
    "build_model",
    "default_model_dir",
    "ensure_model",
    "get_preset",
    "load_model",
    "main_build_model",
    "stderr_progress",
]
