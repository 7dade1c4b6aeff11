"""Images from OpenAI content parts: fetch (no network), limits, decoding, processing, hashing.

Everything here is CPU work with numpy and Pillow, run on a worker thread
before a request enters the engine (no MLX, no trio). A bad image raises
`ImageRejected`, which the HTTP layer answers with a 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import threading
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np

SCHEMA = "mlxd-image-v1"  # bump when what the digest covers changes
DETAILS = ("auto", "low", "high")
LOW_DETAIL_TOKENS = 16  # "low" caps an image at this many placeholder tokens


class ImageRejected(ValueError):
    """An image a request may not use; the message says why (an HTTP 400)."""


@attrs.frozen(kw_only=True)
class ImageLimits:
    max_bytes: int = 20 << 20  # encoded bytes of one image
    max_pixels: int = 40_000_000  # decoded width x height of one image (a decompression bomb guard)
    max_images: int = 16  # per request
    allow_dir: Path | None = None  # file:// URLs only under this directory


@attrs.frozen(eq=False)
class PreparedImage:
    """One processed image: its patches, grid, span length and content digest."""

    digest: str
    patches: np.ndarray  # (num_patches, in_features) float32, Qwen2-VL's patch order
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # placeholder tokens: t * h * w / merge^2


_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


def read_url(url: Any, limits: ImageLimits) -> bytes:
    """The encoded bytes an `image_url.url` names: a data: URL, or file:// under the allowed dir."""
    if not isinstance(url, str) or not url:
        raise ImageRejected("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ImageRejected("image URLs are not fetched: send the image inline as a data: URL "
                            "(data:image/png;base64,...)")
    if scheme == "data":
        m = _DATA_URL.match(url)
        if m is None or not m.group("b64"):
            raise ImageRejected("an image data: URL must be base64 (data:image/png;base64,...)")
        payload = url[m.end():]
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise ImageRejected(f"the image is larger than this server's limit of {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRejected("the image data: URL is not valid base64") from None
    if scheme == "file":
        return _read_file(url, limits)
    raise ImageRejected(f"unsupported image URL scheme {scheme or url[:16]!r}: use a data: URL")


def _read_file(url: str, limits: ImageLimits) -> bytes:
    if limits.allow_dir is None:
        raise ImageRejected("file:// image URLs are off (the operator allows a directory with --allow-media-dir)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageRejected("a file:// image URL must name a local path")
    root = limits.allow_dir.resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise ImageRejected("the file:// image is outside the directory this server allows")
    try:
        if path.stat().st_size > limits.max_bytes:
            raise ImageRejected(f"the image is larger than this server's limit of {limits.max_bytes} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise ImageRejected(f"cannot read the file:// image: {exc.strerror or exc}") from None


def decode(data: bytes, limits: ImageLimits) -> Any:
    """A Pillow RGB image of `data`, checked whole; corrupt or too many pixels: ImageRejected."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ImageRejected(f"the image is larger than this server's limit of {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > limits.max_pixels:
                raise ImageRejected(f"the image has {w}x{h} pixels, over this server's limit of {limits.max_pixels}")
            img.load()  # decodes it all: a truncated or corrupt file fails here
            return img.convert("RGB")
    except ImageRejected:
        raise
    except Image.UnidentifiedImageError:  # its message names a BytesIO object at a memory address
        raise ImageRejected("the image could not be decoded: not an image format Pillow reads "
                            "(PNG, JPEG, WebP, GIF, BMP, ...)") from None
    except Exception as exc:  # Pillow raises many types for bad input
        raise ImageRejected(f"the image could not be decoded: {type(exc).__name__}: {exc}") from None


@attrs.define
class ImageProcessor:
    """The model's image processor (Qwen2-VL's, from preprocessor_config.json) and the digest."""

    config: dict[str, Any]
    _processor: Any = None
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ImageProcessor:
        return cls(json.loads((model_dir / "preprocessor_config.json").read_text()))

    @property
    def merge(self) -> int:
        return int(self.config.get("merge_size", 2))

    def _get(self) -> Any:
        with self._lock:
            if self._processor is None:  # transformers takes seconds to import: on first use
                try:  # transformers 5: the numpy + Pillow processor (no torch)
                    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                        Qwen2VLImageProcessorPil as Processor,
                    )
                except ImportError:  # transformers 4: the same processor under its plain name
                    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # type: ignore[no-redef]
                        Qwen2VLImageProcessor as Processor,
                    )
                self._processor = Processor(**self.config)
            return self._processor

    def size(self, detail: str) -> dict[str, int]:
        size = dict(self.config["size"])
        if detail == "low":
            window = int(self.config["patch_size"]) * self.merge
            size["longest_edge"] = min(size["longest_edge"], window * window * LOW_DETAIL_TOKENS)
        return size

    def prepare(self, img: Any, detail: str) -> PreparedImage:
        size = self.size(detail)
        out = self._get()(images=[img], return_tensors="np", size=size)
        patches = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        t, h, w = grid
        h_ = hashlib.sha256(SCHEMA.encode())
        h_.update(json.dumps({"size": size, "config": self.config}, sort_keys=True).encode())
        h_.update(np.asarray(grid, dtype="<i8").tobytes())
        h_.update(patches.tobytes())  # the exact pixels the tower reads
        return PreparedImage(h_.hexdigest(), patches, (t, h, w), t * h * w // self.merge**2)


def image_part(part: dict[str, Any], where: str) -> tuple[Any, str]:
    """(url, detail) of an OpenAI `image_url` content part, checked."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, dict):
        raise ImageRejected(f"{where}.image_url must be an object with a 'url'")
    detail = spec.get("detail", "auto")
    if detail not in DETAILS:
        raise ImageRejected(f"{where}.image_url.detail must be one of {list(DETAILS)}")
    return spec.get("url"), detail
