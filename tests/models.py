"""Test helpers: a tiny random-weight qwen3 model built directly; a model mlxd must refuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
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


def chunked_llama4_dir(tokenizer_dir: Path, dest: Path) -> Path:
    """A random 2-layer llama4 model directory: its make_cache() gives ChunkedKVCache layers."""
    from mlx_lm.models import llama4

    text = {
        "attention_bias": False, "attention_chunk_size": 16, "head_dim": 16, "hidden_size": 64,
        "interleave_moe_layer_step": 2, "intermediate_size": 64, "intermediate_size_mlp": 128,
        "max_position_embeddings": 4096, "model_type": "llama4_text", "num_attention_heads": 4,
        "num_experts_per_tok": 1, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 2,
        "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000.0, "use_qk_norm": True, "vocab_size": 1024,
    }
    config = {"model_type": "llama4", "text_config": text}
    dest.mkdir(parents=True, exist_ok=True)
    model = llama4.Model(llama4.ModelArgs.from_dict(config))
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def falcon_h1_dir(tokenizer_dir: Path, dest: Path, *, seed: int = 7) -> Path:
    """A random 2-layer falcon_h1 model directory: each layer's cache is a CacheList(ArraysCache, KVCache)."""
    from mlx_lm.models import falcon_h1

    config = {
        "model_type": "falcon_h1", "hidden_size": 64, "intermediate_size": 128, "head_dim": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024,
        "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16,
        "max_position_embeddings": 4096, "rope_theta": 10000.0,
    }
    dest.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = falcon_h1.Model(falcon_h1.ModelArgs.from_dict(config))
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest
