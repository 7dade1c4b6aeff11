"""What a runtime's own memory is, measured at load on the engine thread (admission by KV bytes).

`kv/admission.py` admits a request when its KV fits the memory budget beside
the memory no request frees. Counting only the weights' files missed most of
it (MLX held 120 MiB after load against 60 MiB of files), and MLX's active
memory is the process's (a second runtime in one process would count the
first one's). So the engine measures its own share as deltas on its thread:

- `resident`: active memory after load and warm-up minus before the load
  (weights as loaded, casts, the draft model, the vision tower, buffers the
  warm-up kept);
- `PrefillCost`: the transient memory a prefill chunk takes beside its KV
  (activations, attention scores), fitted from two measured single-row
  prefills as `per_token * S + per_token_context * S * L` for a chunk of `S`
  new tokens attending to `L` tokens (`L = S` from an empty cache).

Runs on the engine's MLX thread only. Measurements are floored at 0: a
concurrent free elsewhere in the process can only make them smaller, never
refuse a request for another runtime's memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class PrefillCost:
    """Transient bytes of one prefill chunk beside its KV (see module docstring)."""

    per_token: float = 0.0
    per_token_context: float = 0.0

    def chunk_bytes(self, new_tokens: int, context: int) -> int:
        return int(self.per_token * new_tokens + self.per_token_context * new_tokens * max(context, new_tokens))


def active_bytes() -> int:
    """MLX's active memory once every queued op ran and unreferenced arrays are gone."""
    import mlx.core as mx

    gc.collect()
    mx.synchronize()
    return int(mx.get_active_memory())


def prefill_cost(model: Any, make_caches: Callable[[], list[Any]], *, sizes: tuple[int, int] = (128, 512)) -> PrefillCost:
    """Fit `PrefillCost` from two single-row prefills from an empty cache (only the caches are evaluated,
    as a prefill chunk does; logits are not)."""
    import mlx.core as mx

    extra = []
    for n in sizes:
        caches = make_caches()
        active_bytes()  # settle: the peak counts from what is live now
        mx.reset_peak_memory()
        model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
        held = active_bytes()  # the caches as allocated (the lazy logits were never computed)
        extra.append(max(0, int(mx.get_peak_memory()) - held))
        del caches
    (n1, n2), (p1, p2) = sizes, extra
    # p = a n + b n^2 at both sizes
    b = max(0.0, (p2 * n1 - p1 * n2) / (n1 * n2 * (n2 - n1)))
    a = max(0.0, (p1 - b * n1 * n1) / n1)
    return PrefillCost(per_token=a, per_token_context=b)


def kv_growth(model: Any, make_caches: Callable[[], list[Any]]) -> int:
    """Cache bytes one more token costs (two short prefills): e.g. the draft model's KV per token."""
    import mlx.core as mx

    from mlxd.kv import kinds

    sizes = []
    for n in (32, 64):
        caches = make_caches()
        model(mx.zeros((1, n), dtype=mx.int32), cache=caches)
        mx.eval([c.state for c in caches])
        sizes.append(kinds.nbytes(caches))
    return max(0, (sizes[1] - sizes[0]) // 32)


@attrs.frozen
class OwnMemory:
    """This runtime's memory beside its rows' KV (`EngineInfo.own_memory`; measured with --kv-admission)."""

    resident_bytes: int = 0  # active memory after load and warm-up minus before it
    prefill: PrefillCost = PrefillCost()
    draft_kv_bytes_per_token: int = 0  # --draft-model: the draft's own KV per token of a row


def measure_own(before: int, model: Any, make_caches: Callable[[], list[Any]], draft_model: Any = None) -> OwnMemory:
    """(MLX thread) `before`: `active_bytes()` taken before the load began."""
    from mlx_lm.models.cache import make_prompt_cache

    resident = max(0, active_bytes() - before)
    draft = kv_growth(draft_model, lambda: make_prompt_cache(draft_model)) if draft_model is not None else 0
    return OwnMemory(resident_bytes=resident, prefill=prefill_cost(model, make_caches), draft_kv_bytes_per_token=draft)
