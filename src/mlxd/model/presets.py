"""Shapes of the random-weight models mlxd builds offline.

Most presets are Qwen3-shaped decoders (`mlx_lm.models.qwen3`); the `test-*`
architecture presets build mlx-lm's own sliding-window (`gemma3_text`), hybrid
linear + full attention (`qwen3_next`) and pure recurrent (`mamba2`) classes,
so every cache kind a real model creates is served by the test suite. Weights
are fp32: on the Linux CPU backend bf16 matmuls are far slower (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

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
    architecture: str = "qwen3"  # the mlx_lm.models module that builds and loads it
    extra: tuple[tuple[str, Any], ...] = ()  # architecture-specific config.json fields

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

_TEST = PRESETS["test"]

# One small preset per cache family, as small as "test": layer 0 is the special one.
PRESETS.update(
    {
        # "test" with head_dim 64: the quantized KV schemes need head_dim % group size == 0.
        "test-wide": attrs.evolve(_TEST, name="test-wide", head_dim=64),
        # Sliding window: layer 0 a RotatingKVCache of 32 tokens, layer 1 global (KVCache).
        "test-gemma3": attrs.evolve(
            _TEST,
            name="test-gemma3",
            architecture="gemma3_text",
            extra=(
                ("sliding_window", 32),
                ("sliding_window_pattern", 2),
                ("query_pre_attn_scalar", 16),
                ("rope_local_base_freq", 10_000.0),
            ),
        ),
        # Hybrid: layer 0 gated delta-net (ArraysCache), layer 1 full attention (KVCache).
        "test-qwen3next": attrs.evolve(
            _TEST,
            name="test-qwen3next",
            architecture="qwen3_next",
            extra=(
                ("linear_num_value_heads", 2),
                ("linear_num_key_heads", 2),
                ("linear_key_head_dim", 16),
                ("linear_value_head_dim", 16),
                ("linear_conv_kernel_dim", 4),
                ("num_experts", 0),
                ("num_experts_per_tok", 1),
                ("decoder_sparse_step", 1),
                ("shared_expert_intermediate_size", 128),
                ("mlp_only_layers", ()),
                ("moe_intermediate_size", 128),
                ("partial_rotary_factor", 0.25),
                ("full_attention_interval", 2),
            ),
        ),
        # Vision: "test" plus a Qwen2-VL-shaped vision tower and Qwen2-VL's image processor (model/vlm.py).
        "test-vlm": attrs.evolve(_TEST, name="test-vlm", extra=(("vision", True),)),
        # For benchmarks/bench_vision.py: "default"'s decoder, a tower of 6 blocks x 256, up to 256 tokens an image.
        "bench-vlm": attrs.evolve(
            PRESETS["default"],
            name="bench-vlm",
            extra=(("vision", True), ("vision_embed_dim", 256), ("vision_depth", 6), ("vision_heads", 4),
                   ("vision_max_tokens", 256)),
        ),
        # Pure recurrent: every layer an ArraysCache (conv + SSM state); no layer counts tokens.
        "test-mamba2": attrs.evolve(
            _TEST,
            name="test-mamba2",
            architecture="mamba2",
            extra=(
                ("num_heads", 4),
                ("expand", 1),  # transformers checks hidden_size * expand == num_heads * head_dim
                ("state_size", 16),
                ("n_groups", 1),
                ("conv_kernel", 4),
                ("use_bias", False),
                ("use_conv_bias", True),
                ("layer_norm_epsilon", 1e-5),
                ("time_step_limit", (0.0, 1000.0)),
                ("time_step_rank", "auto"),
            ),
        ),
    }
)


def get_preset(name: str) -> ModelPreset:
    """The preset called `name`, or a ValueError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model preset {name!r} (known: {known})") from None
