"""A chat request's images, from content parts to the engine's `ImageInput`s (a worker thread).

The HTTP layer renders the chat with one placeholder per image, then calls
`MediaPreparer.prepare` off the event loop: each image is read (data: URL, or
file:// under --allow-media-dir), checked against the limits, decoded, run
through the model's image processor and hashed; its encoder output is read
from the SSD tier when a verified copy is there. `widen` turns the rendered
ids into the request's key (kv/media.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from mlxd.kv.media import expand
from mlxd.vision.encoder import ImageInput, encoder_identity, has_vision
from mlxd.vision.images import (
    ImageLimits,
    ImageProcessor,
    ImageRejected,
    PreparedImage,
    decode,
    image_part,
    read_url,
)
from mlxd.vision.tensor_store import find_tensor


def image_refs(messages: Sequence[dict[str, Any]]) -> list[tuple[Any, str, str]]:
    """(url, detail, where) of every image part, in prompt order."""
    refs = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    where = f"messages[{i}].content[{j}]"
                    url, detail = image_part(part, where)
                    refs.append((url, detail, where))
    return refs


@attrs.define
class MediaPreparer:
    """The model's processor, placeholder id and limits; reads encoder outputs from SSD."""

    processor: ImageProcessor
    placeholder: int
    limits: ImageLimits
    tensors_root: Path | None = None
    identity: str = ""
    ssd_reads: int = 0  # verified encoder outputs found on SSD
    # A conversation re-sends its images every turn: processed images by their data: URL (a
    # file's by the hash of its bytes) and detail, so a known image is not decoded and processed again.
    max_prepared_bytes: int = 256 << 20
    prepared_hits: int = 0
    _prepared: OrderedDict[tuple[str, str], PreparedImage] = attrs.Factory(OrderedDict)
    _prepared_bytes: int = 0
    # Encoder outputs read from SSD (verified; an output depends only on its digest and identity).
    max_features_bytes: int = 64 << 20
    _features: OrderedDict[str, Any] = attrs.Factory(OrderedDict)
    _features_bytes: int = 0
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    @classmethod
    def for_model(cls, model_dir: Path, *, limits: ImageLimits, ssd_dir: Path | None) -> MediaPreparer | None:
        """None for a text-only model."""
        import json

        if not has_vision(model_dir):
            return None
        cfg = json.loads((model_dir / "config.json").read_text())
        return cls(ImageProcessor.from_dir(model_dir), int(cfg["image_token_id"]), limits,
                   ssd_dir / "tensors" if ssd_dir is not None else None, encoder_identity(model_dir))

    def prepare(self, refs: Sequence[tuple[Any, str, str]]) -> list[tuple[PreparedImage, Any]]:
        """Each image processed and hashed, with its SSD encoder output (or None); ImageRejected on bad input."""
        if len(refs) > self.limits.max_images:
            raise ImageRejected(f"{len(refs)} images in one request, over this server's limit of "
                                f"{self.limits.max_images}")
        out = []
        for url, detail, where in refs:
            try:
                prepared = self._prepare(url, detail)
            except ImageRejected as exc:
                raise ImageRejected(f"{where}: {exc}") from None
            features = None if self.tensors_root is None else self._ssd_features(prepared.digest)
            out.append((prepared, features))
        return out

    def known(self, refs: Sequence[tuple[Any, str, str]]) -> list[tuple[PreparedImage, Any]] | None:
        """`prepare(refs)` when every image is known already (no I/O, no decoding: fine on the event
        loop, a follow-up's usual case); None when any needs work (`prepare` on a worker thread)."""
        if len(refs) > self.limits.max_images:
            return None
        out = []
        with self._lock:
            for url, detail, _ in refs:
                if not (isinstance(url, str) and url[:5].lower() == "data:"):
                    return None
                prepared = self._prepared.get((url, detail))
                if prepared is None:
                    return None
                features = None
                if self.tensors_root is not None:
                    features = self._features.get(prepared.digest)
                    if features is None:
                        return None  # maybe on SSD: read it on the worker thread
                out.append((prepared, features))
            for url, detail, _ in refs:
                self._prepared.move_to_end((url, detail))
            self.prepared_hits += len(out)
        return out

    def _ssd_features(self, digest: str) -> Any:
        """An image's encoder output from the SSD tier, verified; read once, then kept (a follow-up
        re-sends every image, and most of them need no tower: its KV prefix covers them)."""
        with self._lock:
            known = self._features.get(digest)
            if known is not None:
                self._features.move_to_end(digest)
                return known
        assert self.tensors_root is not None
        features = find_tensor(self.tensors_root, self.identity, digest)
        if features is None:
            return None  # not written yet, evicted or damaged: the engine encodes it
        with self._lock:
            self.ssd_reads += 1
            if digest not in self._features:
                self._features[digest] = features
                self._features_bytes += features.nbytes
            while self._features_bytes > self.max_features_bytes and self._features:
                _, old = self._features.popitem(last=False)
                self._features_bytes -= old.nbytes
        return features

    def _prepare(self, url: Any, detail: str) -> PreparedImage:
        # A data: URL is its image: known by its very text (a dict lookup compares it whole, no
        # digest to compute), it is not even base64-decoded again (a follow-up re-sends every
        # image of the conversation). A file is known by the hash of its bytes.
        if isinstance(url, str) and url[:5].lower() == "data:":
            key, data = (url, detail), None
        else:
            data = read_url(url, self.limits)
            key = ("\x00file:" + hashlib.sha256(data).hexdigest(), detail)
        with self._lock:
            known = self._prepared.get(key)
            if known is not None:
                self._prepared.move_to_end(key)
                self.prepared_hits += 1
                return known
        if data is None:
            data = read_url(url, self.limits)
        prepared = self.processor.prepare(decode(data, self.limits), detail)
        with self._lock:
            if key not in self._prepared:
                self._prepared[key] = prepared
                self._prepared_bytes += _cost(key, prepared)
            while self._prepared_bytes > self.max_prepared_bytes and self._prepared:
                old_key, old = self._prepared.popitem(last=False)
                self._prepared_bytes -= _cost(old_key, old)
        return prepared

    def widen(self, ids: Sequence[int], images: Sequence[tuple[PreparedImage, Any]]) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The request's key tokens and its ImageInputs from the rendered ids (one placeholder per image)."""
        try:
            key, spans = expand(ids, self.placeholder, [(p.digest, p.tokens) for p, _ in images])
        except ValueError as exc:
            raise ImageRejected(f"{exc} (an image placeholder written as text?)") from None
        media = tuple(ImageInput(span, p.patches, p.grid, f) for span, (p, f) in zip(spans, images, strict=True))
        return key, media


def _cost(key: tuple[str, str], prepared: PreparedImage) -> int:
    """What a processed image holds: its patches and its key (a data: URL's text)."""
    return prepared.patches.nbytes + len(key[0])
