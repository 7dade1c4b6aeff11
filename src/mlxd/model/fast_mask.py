"""Fused causal attention for unpadded prefill chunks in mlx-lm's BatchGenerator.

mlx-lm's `BatchKVCache.make_mask` always builds a boolean mask array
(batch x 1 x new x context) so that left-padded rows of a batch stay apart.
Handed an array, MLX's `scaled_dot_product_attention` cannot use its fused
causal kernel, and long prefills are many times slower on a GPU
(docs/benchmarks.md, H200: prefill). When no row of the
batch is padded (every single-row prefill, the common case) the array says
exactly what "causal" says: each new token sees the whole cached prefix and
the new tokens up to itself (MLX aligns "causal" to the end of the keys, as
mlx-lm's own `KVCache` relies on). So for such chunks this returns "causal";
padded batches, windows and single-token steps keep mlx-lm's array.

`install()` wraps the method once per process (idempotent); `uninstall()`
restores it (benchmarks compare both).
"""

from __future__ import annotations

from typing import Any

_ORIGINAL: Any = None


def install() -> None:
    """Route unpadded multi-token chunks of BatchKVCache to the fused causal kernel."""
    global _ORIGINAL
    from mlx_lm.models.cache import BatchKVCache

    if _ORIGINAL is not None:
        return
    original = BatchKVCache.make_mask

    def make_mask(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N > 1 and not return_array and kwargs.get("window_size") is None and not _padded(self):
            return "causal"
        return original(self, N, return_array=return_array, **kwargs)

    make_mask.__doc__ = original.__doc__
    BatchKVCache.make_mask = make_mask
    _ORIGINAL = original


def uninstall() -> None:
    global _ORIGINAL
    from mlx_lm.models.cache import BatchKVCache

    if _ORIGINAL is not None:
        BatchKVCache.make_mask = _ORIGINAL
        _ORIGINAL = None


def _padded(cache: Any) -> bool:
    """Whether any row of the batch has left padding (one tiny evaluated reduction)."""
    import mlx.core as mx

    padding = getattr(cache, "left_padding", None)
    if padding is None:
        return False
    return bool(mx.any(padding > 0).item())
