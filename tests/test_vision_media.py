"""kv/media.py: images in prefix keys by the hash of their pixels (pure)."""

from __future__ import annotations

import pytest

from mlxd.kv.media import MEDIA_BASE, check_spans, expand, media_end, model_tokens, span_ids
from mlxd.kv.prefix_index import key_tokens, token_key


def test_expand_widens_each_placeholder_to_its_images_span() -> None:
    key, spans = expand([5, 9, 6, 9, 7], 9, [("aa", 3), ("bb", 2)])
    assert key == (5, *span_ids("aa", 3), 6, *span_ids("bb", 2), 7)
    assert [(s.start, s.length) for s in spans] == [(1, 3), (5, 2)]
    assert media_end(spans) == 7
    assert model_tokens(key, 9) == [5, 9, 9, 9, 6, 9, 9, 7]
    assert check_spans(key, spans, vocab_size=16) is None
    assert key_tokens(token_key(key)) == key  # media ids fit the prefix index's int32 keys


def test_a_different_image_differs_from_its_first_position_only() -> None:
    a, _ = expand([1, 2, 9, 3], 9, [("one", 4)])
    b, _ = expand([1, 2, 9, 3], 9, [("two", 4)])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(t >= MEDIA_BASE for t in a[2:6])


def test_bad_keys_are_refused() -> None:
    key, spans = expand([1, 9, 2], 9, [("x", 2)])
    assert "does not spell" in check_spans((1, key[1] + 1, key[2], 2), spans, 16)
    assert "in [0, 16)" in check_spans((1, *key[1:3], MEDIA_BASE), spans, 16)  # a media id outside a span
    with pytest.raises(ValueError, match="placeholders"):
        expand([1, 9, 9], 9, [("x", 2)])
