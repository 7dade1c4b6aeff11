"""MLXD_BATCH_FILTER (model/batch_filter.py): rows leave mlx-lm's batch cache as mlx-lm's own filter leaves it (the
same keys, values, offsets, padding and trim), without a device op on the padding to wait for; served rows that end
in different steps decode the same tokens either way. Both of mlxd's mlx-lm patches (this and
MLXD_BATCH_HANDOVER) are on unless the environment turns them off."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache
from tests.serving import rows_ending_apart, served_with_patch

from mlxd.kv.quantized_batch import kept_padding
from mlxd.model import batch_filter, batch_handover


def batch(lengths: list[int], steps: int = 3) -> BatchKVCache:
    """Rows of these prompt lengths merged (left-padded to the longest), then `steps` decode steps."""
    rows = []
    for i, n in enumerate(lengths):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 8), key=mx.random.key(i)),
                           mx.random.normal((1, 2, n, 8), key=mx.random.key(100 + i)))
        rows.append(c)
    cache = BatchKVCache.merge(rows)
    for s in range(steps):
        cache.update_and_fetch(mx.full((len(lengths), 2, 1, 8), float(s)), mx.full((len(lengths), 2, 1, 8), -float(s)))
    mx.eval(cache.keys, cache.values, cache.offset, cache.left_padding)
    return cache


def state(c: BatchKVCache) -> tuple:
    keys, values = c.keys_and_values()
    return (keys.tolist(), values.tolist(), c.offset.tolist(), c.left_padding.tolist(), c._idx)


@pytest.mark.parametrize("keep", [[0, 2], [1], [2, 0], [0, 1, 2], [1, 2]])
def test_the_filter_leaves_the_cache_as_mlx_lms_does(keep):
    lengths = [40, 7, 19]  # padding 0, 33, 21: dropping row 0 leaves padding every kept row shares (trimmed)
    theirs, ours = batch(lengths), batch(lengths)
    batch_filter.uninstall()  # (an engine loaded earlier in this process installed it)
    theirs.filter(keep)
    try:
        assert batch_filter.install(force=True)
        ours.filter(keep)
    finally:
        batch_filter.uninstall()
    assert state(ours) == state(theirs)
    if keep == [1, 2]:
        assert ours._idx == 40 + 3 - 21 and ours.left_padding.tolist() == [12, 0]  # the shared 21 columns trimmed
    # and it goes on decoding the same: one more step on each
    for c in (ours, theirs):
        c.update_and_fetch(mx.ones((len(keep), 2, 1, 8)), mx.ones((len(keep), 2, 1, 8)))
    assert state(ours) == state(theirs)


class Padding:
    """A left-padding stand-in that can be read as it stands but not used in a device op (a gather)."""

    dtype = mx.int32

    def __init__(self, values: list[int]) -> None:
        self.values, self.reads = values, 0

    def tolist(self) -> list[int]:
        self.reads += 1
        return list(self.values)

    def __getitem__(self, index):
        raise AssertionError("the padding was gathered on the device (a read queued behind the forward in flight)")


def test_the_padding_is_read_as_it_stands_and_left_as_a_fresh_array():
    cache = batch([40, 7, 19])
    cache.left_padding = padding = Padding([0, 33, 21])
    try:
        assert batch_filter.install(force=True)
        cache.filter([1, 2])
    finally:
        batch_filter.uninstall()
    assert padding.reads == 1
    assert isinstance(cache.left_padding, mx.array) and cache.left_padding.tolist() == [12, 0]
    # mlx-lm's own filter gathers it on the device first (what the stand-in refuses)
    cache.left_padding = Padding([12, 0])
    with pytest.raises(AssertionError, match="gathered on the device"):
        cache.filter([0])


def test_kept_padding_picks_on_the_host():
    pads, shared = kept_padding(mx.array([5, 3, 9]), [2, 0])
    assert (pads.tolist(), shared) == ([4, 0], 5)
    with pytest.raises(ValueError):
        kept_padding(mx.array([1]), [])


@pytest.mark.parametrize("patch", [batch_filter, batch_handover], ids=["filter", "handover"])
def test_each_mlx_lm_patch_is_on_unless_turned_off(monkeypatch, patch):
    monkeypatch.delenv(patch.ENV, raising=False)
    assert patch.wanted()
    monkeypatch.setenv(patch.ENV, "0")
    assert not patch.wanted()


def test_served_rows_ending_in_different_steps_decode_the_same_with_it(tiny_model_dir, monkeypatch):
    rows = rows_ending_apart(tiny_model_dir, [4, 7, 10, 13], spread=7)  # ends 3 steps apart, padded prompts
    plain = served_with_patch(batch_filter, monkeypatch, rows, False)
    ours = served_with_patch(batch_filter, monkeypatch, rows, True)
    batch_filter.uninstall()
    assert [len(r) for r in ours] == [4, 7, 10, 13]
    assert ours == plain
