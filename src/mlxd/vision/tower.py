"""A Qwen2-VL-shaped vision tower in MLX: patch embedding, ViT blocks, a 2x2 patch merger.

It reads the patches Qwen2-VL's image processor makes (each row one 2x14x14x3
patch, the four patches of a merge window next to each other) and returns one
language-model embedding per merged window: the image's placeholder span.
Run on the engine's MLX thread only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

WEIGHTS_FILE = "vision.safetensors"  # not model*.safetensors: mlx_lm.load leaves it alone


@attrs.frozen(kw_only=True)
class VisionConfig:
    """The tower's shape (config.json's `vision_config`)."""

    in_features: int = 3 * 2 * 14 * 14  # channels x temporal x patch x patch
    embed_dim: int = 32
    depth: int = 2
    num_heads: int = 2
    mlp_ratio: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 64  # the language model's hidden size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        names = {a.name for a in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.attn = nn.MultiHeadAttention(cfg.embed_dim, cfg.num_heads, bias=True)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.embed_dim * cfg.mlp_ratio)
        self.fc2 = nn.Linear(cfg.embed_dim * cfg.mlp_ratio, cfg.embed_dim)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.norm1(x)
        x = x + self.attn(h, h, h)
        return x + self.fc2(nn.gelu(self.fc1(self.norm2(x))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        merged = cfg.embed_dim * cfg.spatial_merge_size**2
        self.patch_embed = nn.Linear(cfg.in_features, cfg.embed_dim, bias=False)
        self.blocks = [Block(cfg) for _ in range(cfg.depth)]
        self.merger_norm = nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, cfg.out_hidden_size)

    def __call__(self, patches: mx.array) -> mx.array:
        """(num_patches, in_features) of one image -> (num_patches / merge^2, out_hidden_size)."""
        cfg = self.config
        x = self.patch_embed(patches.astype(self.patch_embed.weight.dtype))[None]
        for block in self.blocks:  # full attention over the image's patches
            x = block(x)
        x = self.merger_norm(x[0]).reshape(-1, cfg.embed_dim * cfg.spatial_merge_size**2)
        return self.merger_fc2(nn.gelu(self.merger_fc1(x)))


def load_tower(model_dir: Path, *, dtype: Any = None) -> VisionTower:
    """The tower of a test-vlm-style model directory (config.json `vision_config` + vision.safetensors)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tower = VisionTower(VisionConfig.from_dict(cfg["vision_config"]))
    tower.load_weights(str(model_dir / WEIGHTS_FILE))
    if dtype is not None:
        tower.set_dtype(dtype)
    mx.eval(tower.parameters())
    return tower
