"""Test helper: a tiny random-weight qwen3 model built directly (no files, no tokenizer)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3


def tiny_qwen3(*, head_dim: int = 16, max_position_embeddings: int = 512) -> qwen3.Model:
    """2 layers, hidden 64, vocab 256, fp32, seeded: the same weights every call."""
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        head_dim=head_dim,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    mx.random.seed(0)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model
