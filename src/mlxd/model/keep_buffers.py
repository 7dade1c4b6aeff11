"""mlx-lm's prompt phase without a buffer-cache clear after every chunk (`MLXD_KEEP_BUFFERS`).

mlx-lm's `PromptProcessingBatch.prompt` calls `mx.clear_cache()` after each prefill chunk, so MLX hands
every buffer the chunk freed back to the device, and the next chunk, of the same shapes, allocates them
afresh. On CUDA MLX's buffers are managed memory: giving them back and taking them again costs
synchronizing frees and new page mappings on every chunk. The engine's own prefill outside the batch
(`prefill_slices.prefill_step`: a short prompt joining others, an overlapped split's head) never clears,
and the same prompt went through it faster than through the batch on an H100
(`benchmarks/gpu/probe_apart_vs_batch.py`, docs/benchmarks.md). With this installed, a chunk's freed
buffers stay in MLX's cache for the next one, as they do between decode steps; the cache is not active
memory (the memory budget measures active memory); under a budget it is held to an eighth of it
(`engine/loading.py` `keep_buffer_cache_to`), and MLX's allocator gives cached buffers back by itself before
an allocation would pass its limit.

Only the prompt phase changes: mlx-lm's other clears (every 512 decode steps) and mlxd's own (a reset after
a failed step) stay. On by default since a GPU run measured it (the probe's arm `batch_keep`, `wave3.sh
apartbatch`: a prompt through the batch takes less time kept than cleared; on the CPU within noise;
docs/benchmarks.md); `MLXD_KEEP_BUFFERS=0` gives mlx-lm's clears back.
"""

from __future__ import annotations

import importlib
from typing import Any

ENV = "MLXD_KEEP_BUFFERS"

_ORIGINAL: dict[str, Any] = {}


class _Keeping:
    """`mlx.core` as mlx-lm's generate module sees it while a prompt chunk runs: `clear_cache` does nothing."""

    def __init__(self, mx: Any) -> None:
        self._mx = mx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)

    @staticmethod
    def clear_cache() -> None:
        return None


def wanted() -> bool:
    """Whether it is on: unset, "" (the default), "1", "on" or "true"; "0", "off" or "false": off. Another value
    is a ValueError (`runtime.config.env_switch`)."""
    from mlxd.runtime.config import env_switch

    return env_switch(ENV, default=True)


def install(*, force: bool = False) -> bool:
    """Wrap mlx-lm's `PromptProcessingBatch.prompt` once per process when asked for (`force`: regardless of the
    environment, for tests); returns whether it is wrapped."""
    import mlx.core as mx

    generate: Any = importlib.import_module("mlx_lm.generate")  # the module (the package exports a function by its name)
    if _ORIGINAL:
        return True
    if not force and not wanted():
        return False
    prompt, keeping = generate.PromptProcessingBatch.prompt, _Keeping(mx)

    def prompt_keeping_buffers(self: Any, tokens: Any) -> Any:
        # mlx-lm's module reads `mx` at call time: for this call (the engine thread's), its clears do nothing
        generate.mx = keeping
        try:
            return prompt(self, tokens)
        finally:
            generate.mx = mx

    prompt_keeping_buffers.__doc__ = prompt.__doc__
    generate.PromptProcessingBatch.prompt = prompt_keeping_buffers
    _ORIGINAL.update(prompt=prompt)
    return True


def uninstall() -> None:
    if _ORIGINAL:
        importlib.import_module("mlx_lm.generate").PromptProcessingBatch.prompt = _ORIGINAL.pop("prompt")
