"""A multi-token chunk on a rotated sliding-window batch cache sees its whole window (model/window_mask.py).

mlx-lm's BatchRotatingKVCache.make_mask computed the chunk's trim from the
write position of a cache that one-token steps had rotated, so a left-padded
row's oldest key inside the window was masked out: the gemma3 logprob
excursions under time-sliced prefill (tests/test_prefill_slices_windows.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache

from mlxd.model import window_mask

WINDOW, PAD, FIRST, STEPS, CHUNK = 8, 3, 6, 4, 4


def _visible_after_rotation() -> list[int]:
    """Keys each query of the left-padded row sees in a CHUNK after one-token steps rotated the cache."""
    mx.random.seed(0)

    def kv(s: int) -> tuple[mx.array, mx.array]:
        return mx.random.normal((2, 1, s, 4)), mx.random.normal((2, 1, s, 4))

    cache = BatchRotatingKVCache(WINDOW, left_padding=[0, PAD])  # row 1: PAD tokens shorter
    cache.update_and_fetch(*kv(FIRST))
    for _ in range(STEPS):  # one-token steps: the window fills and the buffer rotates
        cache.update_and_fetch(*kv(1))
    assert cache.rotated and cache._idx < WINDOW  # the state the chunk meets
    mask = cache.make_mask(CHUNK)
    keys, _ = cache.update_and_fetch(*kv(CHUNK))
    assert mask.shape[-1] == keys.shape[2]
    return mask[1, 0].sum(-1).tolist()


@pytest.fixture
def unpatched():
    window_mask.uninstall()
    yield
    window_mask.install()


def test_mlx_lm_alone_hides_a_key_of_the_padded_row(unpatched):
    # Row 1 has FIRST - PAD + STEPS = 7 tokens before the chunk: its first query sees them and itself.
    assert _visible_after_rotation()[0] == WINDOW - 1  # mlx-lm's own mask: one key short


def test_every_query_sees_its_whole_window():
    window_mask.install()
    assert _visible_after_rotation() == [WINDOW] * CHUNK
