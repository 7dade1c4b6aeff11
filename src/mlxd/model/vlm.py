"""The vision half of the `test-vlm` preset: tokens, template, tower weights, image processor.

A `test-vlm` build is a Qwen3-shaped `test` language model plus a Qwen2-VL-shaped
vision tower (mlxd/vision/tower.py) and Qwen2-VL's real image processor config,
all made offline. The tokenizer gains Qwen2-VL's three vision tokens at its last
ids, and the chat template writes `<|vision_start|><|image_pad|><|vision_end|>`
for each image part; the server widens the one `<|image_pad|>` to the image's span.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from mlxd.model import bpe

VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)  # the last three ids

# bpe's template, with image parts written as Qwen2-VL writes them.
IMAGE_PART = f"{{%- elif part['type'] in ('image', 'image_url') -%}}{{{{- '{VISION_START}{IMAGE_PAD}{VISION_END}' -}}}}"
CHAT_TEMPLATE = bpe.CHAT_TEMPLATE.replace(
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}",
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}" + IMAGE_PART + "{%- endif -%}",
)
assert CHAT_TEMPLATE != bpe.CHAT_TEMPLATE

PATCH, MERGE, TEMPORAL = 14, 2, 2
WINDOW = PATCH * MERGE  # pixels per placeholder token, each side


def processor_config(*, min_tokens: int = 4, max_tokens: int = 64) -> dict[str, Any]:
    """preprocessor_config.json of Qwen2-VL's image processor, sized for a small test model."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "min_pixels": WINDOW * WINDOW * min_tokens,
        "max_pixels": WINDOW * WINDOW * max_tokens,
        "size": {"shortest_edge": WINDOW * WINDOW * min_tokens, "longest_edge": WINDOW * WINDOW * max_tokens},
    }


def train_tokenizer(vocab_size: int) -> Any:
    """bpe's tokenizer with the three vision tokens added as special tokens (exactly `vocab_size`)."""
    tokenizer = bpe.train_tokenizer(vocab_size - len(VISION_TOKENS))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"vision tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


def write_tokenizer(dest: Path, vocab_size: int, *, model_max_length: int) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json with the vision tokens; returns their ids."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(dest / "tokenizer.json"), pretty=False)
    config = bpe.tokenizer_config(model_max_length, vocab_size - len(VISION_TOKENS))
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    for tok, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {**config["added_tokens_decoder"]["0"], "content": tok}
    config["chat_template"] = CHAT_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids


def write_vision_files(
    dest: Path, *, hidden_size: int, vocab_size: int, model_max_length: int, seed: int, extra: dict[str, Any] | None = None
) -> None:
    """Replace a built text model's tokenizer with the vision one, add the tower and the processor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxd.vision.tower import WEIGHTS_FILE, VisionConfig, VisionTower

    ids = write_tokenizer(dest, vocab_size, model_max_length=model_max_length)
    extra = extra or {}
    # A preset's "vision_*" extras size the tower (the defaults are test-vlm's).
    names = {"vision_embed_dim": "embed_dim", "vision_depth": "depth", "vision_heads": "num_heads"}
    shape = {field: extra[key] for key, field in names.items() if key in extra}
    cfg = VisionConfig(out_hidden_size=hidden_size, **shape)
    mx.random.seed(seed + 1)
    tower = VisionTower(cfg)
    weights = dict(tree_flatten(tower.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(dest / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    processor = processor_config(max_tokens=int(extra.get("vision_max_tokens", 64)))
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    config = json.loads((dest / "config.json").read_text())
    import attrs

    config["vision_config"] = attrs.asdict(cfg)
    config["image_token_id"] = ids[IMAGE_PAD]
    config["vision_start_token_id"] = ids[VISION_START]
    config["vision_end_token_id"] = ids[VISION_END]
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
