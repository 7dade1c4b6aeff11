"""mlxd: an async, actor-based LLM serving runtime on MLX with a durable tiered prompt cache."""

from mlxd import _blas

_blas.preload()  # before anything imports mlx

__version__ = "0.1.0"

__all__ = ["__version__"]
