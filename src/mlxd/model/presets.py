"""Shapes of the random-weight models mlxd builds offline.

Every preset is a Qwen3-shaped decoder so `mlx_lm.models.qwen3` loads it. Weights
are fp32: on the Linux CPU backend bf16 matmuls are ~40x slower than fp32 ones.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class ModelPreset:
    """Everything that defines one model build (hashed into its cache dir name)."""

    name: str
    vocab_size: int  # tokenizer size, special tokens included
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    # Std of the logits at init: large enough that sampling is not uniform noise.
    logit_scale: float = 4.0

    def param_count(self) -> int:
        """Parameters of the built model (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_hidden_layers * layer + h


PRESETS: dict[str, ModelPreset] = {
    # Tiny, for the test suite: builds and loads in a couple of seconds.
    "test": ModelPreset(
        name="test",
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # What `mlxd serve` serves with no --model: responsive on 2 CPU cores.
    "default": ModelPreset(
        name="default",
        vocab_size=8192,
        hidden_size=384,
        num_hidden_layers=8,
        intermediate_size=1024,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # For benchmarks: prefill of thousands of tokens takes seconds on CPU.
    "bench": ModelPreset(
        name="bench",
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=12,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


def get_preset(name: str) -> ModelPreset:
    """The preset called `name`, or a ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r} (known: {known})") from None
