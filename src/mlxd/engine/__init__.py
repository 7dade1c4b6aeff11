"""The engine core (synchronous, on the MLX thread) and the values it takes and gives."""

from mlxd.engine.ops import EngineInfo, EngineStats, ModelRefused, RowStart, StepOps, StepResult

__all__ = ["EngineInfo", "EngineStats", "ModelRefused", "RowStart", "StepOps", "StepResult"]
