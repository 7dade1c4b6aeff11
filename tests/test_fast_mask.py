"""Unpadded prefill chunks use the fused causal kernel; padded batches keep mlx-lm's mask."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxd.model import fast_mask


def _chunked_logits(model, prompt: list[int], left_padding: list[int], step: int) -> mx.array:
    rows = len(left_padding)
    caches = [BatchKVCache(left_padding) for _ in model.layers]
    tokens = mx.array([[0] * pad + prompt[: len(prompt) - pad] for pad in left_padding])
    outs = []
    for s in range(0, tokens.shape[1], step):
        outs.append(model(tokens[:, s : s + step], cache=caches))
    assert outs[0].shape[0] == rows
    return mx.concatenate(outs, axis=1)


def test_unpadded_chunks_get_causal_and_the_same_logits(tiny_model):
    model, _ = tiny_model
    prompt = [(i * 37) % 900 + 5 for i in range(96)]
    try:
        fast_mask.uninstall()
        assert isinstance(BatchKVCache([0]).make_mask(32), mx.array)  # mlx-lm's own mask
        reference = _chunked_logits(model, prompt, [0], 32)
        fast_mask.install()
        cache = BatchKVCache([0])
        assert cache.make_mask(32) == "causal"
        fast = _chunked_logits(model, prompt, [0], 32)
    finally:
        fast_mask.install()
    assert mx.allclose(reference, fast, atol=1e-4, rtol=1e-4).item()


def test_padded_batches_and_single_tokens_keep_the_mask_array(tiny_model):
    fast_mask.install()
    padded = BatchKVCache([3, 0])
    assert isinstance(padded.make_mask(8), mx.array)
    assert not isinstance(BatchKVCache([0]).make_mask(8, return_array=True), str)
    model, _ = tiny_model
    prompt = [(i * 11) % 900 + 5 for i in range(40)]
    try:
        fast_mask.uninstall()
        reference = _chunked_logits(model, prompt, [4, 0], 16)
        fast_mask.install()
        fast = _chunked_logits(model, prompt, [4, 0], 16)
    finally:
        fast_mask.install()
    assert mx.allclose(reference, fast, atol=1e-4, rtol=1e-4).item()
