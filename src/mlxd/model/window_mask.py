"""The mask of a multi-token chunk on a rotated sliding-window batch cache, aligned with its keys.

mlx-lm's `BatchRotatingKVCache` takes one-token steps in place: once the
window is full it writes round the buffer, `rotated` set and `_idx` the write
position. A multi-token chunk after that (`_update_concat`) first puts the
keys back in temporal order (`_idx` becomes the buffer length), then trims
`_idx - max_size + 1` of the oldest and shifts `left_padding` by as much. But
`make_mask`, which the model calls before the update, computes that trim from
the write position: no shift, so a left-padded row's oldest key still inside
the window is masked out (its queries see window - 1 keys). Rows of a
batch are left-padded when they joined at different points; one-token steps
come from decoding and from prefill time slices while a row waits for its
first token (engine/prefill_slices.py): the exactness harness's gemma3
logprob excursions of 0.02-0.38 under time-sliced prefill.

`install()` makes `make_mask` put a rotated cache in temporal order first,
for multi-token chunks only: the same thing `update_and_fetch` does next, so
the keys, the trim and the mask agree, at no extra cost. Idempotent.
"""

from __future__ import annotations

from typing import Any

_ORIGINAL: Any = None


def install() -> None:
    global _ORIGINAL
    from mlx_lm.models.cache import BatchRotatingKVCache

    if _ORIGINAL is not None:
        return
    original = BatchRotatingKVCache.make_mask

    def make_mask(self: Any, N: int, *args: Any, **kwargs: Any) -> Any:
        if N > 1 and self.rotated:
            self._temporal_order()  # as _update_concat will, before it trims
        return original(self, N, *args, **kwargs)

    make_mask.__doc__ = original.__doc__
    BatchRotatingKVCache.make_mask = make_mask
    _ORIGINAL = original


def uninstall() -> None:
    global _ORIGINAL
    from mlx_lm.models.cache import BatchRotatingKVCache

    if _ORIGINAL is not None:
        BatchRotatingKVCache.make_mask = _ORIGINAL
        _ORIGINAL = None
