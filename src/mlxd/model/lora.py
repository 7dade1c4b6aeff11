"""A random LoRA adapter for a local model, written as `mlx_lm.lora` writes a trained one.

mlx-lm's own tuner converts the layers (`linear_to_lora_layers`); lora_b, which
training starts at zero, gets random values so the adapter changes the outputs.
The directory then holds `adapter_config.json` + `adapters.safetensors`, for
`--adapter NAME=DIR` and for `mlx_lm.load(model, adapter_path=DIR)` alike.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def build_adapter(
    model_dir: str | Path,
    dest: str | Path,
    *,
    seed: int = 0,
    rank: int = 4,
    scale: float = 4.0,
    num_layers: int = -1,
    keys: Sequence[str] | None = None,
    magnitude: float = 0.2,
) -> Path:
    """Write a random rank-`rank` adapter for the model at `model_dir` into `dest` (made if missing)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.lora import LoRALinear
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, **({"keys": list(keys)} if keys is not None else {})}
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.lora_b = magnitude * mx.random.normal(module.lora_b.shape)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    config = {"model": str(model_dir), "fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": params, "seed": seed}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=4))
    return dest
