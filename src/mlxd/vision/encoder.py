"""The engine's half of images: the encoder-output cache and the media prefill (engine thread).

A row whose prompt holds images joins the batch after its *media prefill*: the
positions from its cached prefix to the end of its last image run through the
model once, with the image spans' rows of the input embeddings replaced by the
vision tower's output (seed §5.14: an uncached input performs its atomic media
prefill; a cached one resumes text after it). The rest of the prompt, text
only, prefills in the batch with every other row. A prefix that already covers
every image needs no tower at all.

Encoder outputs are tensor objects (seed §5.13): kept by image digest in a
byte-capped LRU in RAM (MLX arrays are immutable values: a lookup lends the
array); with an SSD tier each new output leaves with the step's notes for the
cache owner, which writes it through the durability coordinator like a
checkpoint (vision/tensor_store.py), and the request reads it back from SSD
before it reaches the engine (`ImageInput.features`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from mlxd.kv.media import MediaSpan, media_end, model_tokens
from mlxd.runtime.kernel.messages import EncoderOutputs
from mlxd.vision.tensor_store import TensorPlan

ENCODER_SCHEMA = "mlxd-encoder-v1"


@attrs.frozen(eq=False)
class ImageInput:
    """One image of a request: where its span sits, its patches, and its cached output if on SSD."""

    span: MediaSpan
    patches: np.ndarray
    grid: tuple[int, int, int]
    features: np.ndarray | None = None  # read from the SSD tier (verified) before the engine


def has_vision(model_dir: Path) -> bool:
    """Whether a model directory has a vision tower (config.json `vision_config`)."""
    import json

    try:
        return "vision_config" in json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False


def vision_identity(model_dir: Path) -> str | None:
    """A vision model's encoder identity (what its SSD encoder outputs are filed under); None without a tower."""
    return encoder_identity(model_dir) if has_vision(model_dir) else None


def encoder_identity(model_dir: Path) -> str:
    """What an encoder output depends on beyond the image: tower weights, processor, schema."""
    h = hashlib.sha256(ENCODER_SCHEMA.encode())
    for name in ("vision.safetensors", "preprocessor_config.json"):
        with (model_dir / name).open("rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:24]


@attrs.define
class EncoderCounters:
    encoded: int = 0  # images run through the tower
    ram_hits: int = 0  # outputs lent from RAM
    ssd_hits: int = 0  # outputs read from SSD
    media_prefills: int = 0  # rows that ran a media prefill


@attrs.define
class Vision:
    """The tower, the placeholder id and the RAM tensor cache (engine thread).

    `persist` (an SSD tier): new outputs and reused digests go out with the step (`notes`).
    """

    tower: Any
    placeholder: int
    identity: str = ""
    persist: bool = False
    max_bytes: int = 256 << 20
    counters: EncoderCounters = attrs.Factory(EncoderCounters)
    _cache: OrderedDict[str, Any] = attrs.Factory(OrderedDict)
    _bytes: int = 0
    _encoded: list[TensorPlan] = attrs.Factory(list)
    _used: dict[str, None] = attrs.Factory(dict)

    def stats(self) -> dict[str, int]:
        """EngineStats' media fields."""
        c = self.counters
        return {"media_encoded": c.encoded, "media_encoder_ram_hits": c.ram_hits,
                "media_encoder_ssd_hits": c.ssd_hits, "media_prefills": c.media_prefills}

    def notes(self) -> list[EncoderOutputs]:
        """What this step encoded (to write) and reused (to refresh on SSD); [] when nothing."""
        if not (self._encoded or self._used):
            return []
        note = EncoderOutputs(tuple(self._encoded), tuple(self._used))
        self._encoded.clear()
        self._used.clear()
        return [note]

    def features(self, image: ImageInput, dtype: Any) -> Any:
        """The tower's output for `image`: from RAM, else from the SSD copy it brought, else encoded."""
        import mlx.core as mx

        digest = image.span.digest
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            self.counters.ram_hits += 1
            if self.persist:
                self._used[digest] = None
            return cached
        if image.features is not None and image.features.shape[0] == image.span.length:
            out = mx.array(image.features).astype(dtype)
            self.counters.ssd_hits += 1
            if self.persist:
                self._used[digest] = None
        else:
            out = self.tower(mx.array(image.patches)).astype(dtype)
            mx.eval(out)
            self.counters.encoded += 1
            if out.shape[0] != image.span.length:
                raise ValueError(f"the tower gave {out.shape[0]} rows for a span of {image.span.length}")
            if self.persist:
                self._encoded.append(TensorPlan(digest, self.identity, np.array(out.astype(mx.float32))))
        self._remember(digest, out)
        return out

    def _remember(self, digest: str, out: Any) -> None:
        self._cache[digest] = out
        self._bytes += out.nbytes
        while self._bytes > self.max_bytes and self._cache:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.nbytes

    def prefill(self, model: Any, prompt: Sequence[int], media: Sequence[ImageInput], caches: list[Any],
                start: int, *, step: int) -> int:
        """Run positions [start, end of the last image) into `caches`; returns that end."""
        import mlx.core as mx

        end = media_end([m.span for m in media])
        if start >= end:
            return start
        embed = _embedding(model)
        dtype = embed.weight.dtype if hasattr(embed, "weight") else mx.float32
        ids = model_tokens(prompt[start:end], self.placeholder)
        pieces, pos = [], start
        for image in sorted(media, key=lambda m: m.span.start):
            s = image.span
            if s.end <= start:
                continue
            lo = max(s.start, start)
            if lo > pos:
                pieces.append(embed(mx.array(ids[pos - start : lo - start])))
            pieces.append(self.features(image, dtype)[lo - s.start :])
            pos = s.end
        if end > pos:
            pieces.append(embed(mx.array(ids[pos - start :])))
        rows = mx.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        tokens = mx.array(ids)
        for a in range(0, end - start, step):
            b = min(a + step, end - start)
            model(tokens[a:b][None], cache=caches, input_embeddings=rows[a:b][None])
            mx.eval([c.state for c in caches])
        self.counters.media_prefills += 1
        return end


def _embedding(model: Any) -> Any:
    inner = getattr(model, "language_model", model)
    inner = getattr(inner, "model", inner)
    return inner.embed_tokens


def load_vision(model_dir: Path, model: Any, *, persist: bool, dtype: Any = None) -> Vision | None:
    """The Vision part of a model dir with a vision tower (None for a text-only model).

    `persist`: there is an SSD tier to keep the encoder outputs on."""
    import json

    from mlxd.vision.tower import load_tower

    if not has_vision(model_dir):
        return None
    cfg = json.loads((model_dir / "config.json").read_text())
    tower = load_tower(model_dir, dtype=dtype)
    return Vision(tower, int(cfg["image_token_id"]), encoder_identity(model_dir), persist)
