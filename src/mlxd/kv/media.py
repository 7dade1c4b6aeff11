"""Media spans in prefix keys (seed §5.14): an image is part of the key by the hash of its pixels.

An image enters the prompt as a span of placeholder tokens. In the request's
token key (what the prefix index, block chains, SSD files and KV events all
see) each placeholder is replaced by a *media id*: an id at or above
`MEDIA_BASE`, derived from the image's content digest and the position within
its span. So the same image at the same place gives the same key; a different
image differs from its first placeholder on, and text after an unchanged image
keeps every key token before it. The engine maps media ids back to the
placeholder id and feeds the encoder's output for those rows.

Pure: no trio, no MLX.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import attrs

MEDIA_BASE = 1 << 30  # far above any vocabulary; ids stay below 2**31 (int32 token arrays)
_MEDIA_RANGE = 1 << 30


@attrs.frozen
class MediaSpan:
    """Where one image sits in a prompt: `length` placeholder positions from `start`."""

    start: int
    length: int
    digest: str  # hex content hash of its decoded pixels and processing parameters

    @property
    def end(self) -> int:
        return self.start + self.length


def is_media_id(token: int) -> bool:
    return token >= MEDIA_BASE


@functools.lru_cache(maxsize=4096)  # a conversation's images come back every turn
def span_ids(digest: str, length: int) -> tuple[int, ...]:
    """The key ids of an image's span: position i hashes (digest, i) into the media range."""
    out = []
    for i in range(length):
        h = hashlib.blake2b(f"{digest}:{i}".encode(), digest_size=8).digest()
        out.append(MEDIA_BASE + int.from_bytes(h, "little") % _MEDIA_RANGE)
    return tuple(out)


def expand(tokens: Sequence[int], placeholder: int, images: Sequence[tuple[str, int]]) -> tuple[tuple[int, ...], tuple[MediaSpan, ...]]:
    """Widen each single `placeholder` in `tokens` to its image's span of key ids.

    `images` are (digest, span length) in the order the placeholders appear; the
    counts must agree (a ValueError otherwise).
    """
    found = [i for i, t in enumerate(tokens) if t == placeholder]
    if len(found) != len(images):
        raise ValueError(f"the prompt has {len(found)} image placeholders for {len(images)} images")
    out: list[int] = []
    spans: list[MediaSpan] = []
    last = 0
    for pos, (digest, length) in zip(found, images, strict=True):
        out.extend(tokens[last:pos])
        spans.append(MediaSpan(len(out), length, digest))
        out.extend(span_ids(digest, length))
        last = pos + 1
    out.extend(tokens[last:])
    return tuple(out), tuple(spans)


def check_spans(tokens: Sequence[int], spans: Sequence[MediaSpan], vocab_size: int) -> str | None:
    """Why `tokens` with `spans` is not a valid media key (None when it is)."""
    inside: set[int] = set()
    for s in spans:
        if s.start < 0 or s.length < 1 or s.end > len(tokens):
            return f"a media span [{s.start}, {s.end}) lies outside the prompt"
        if tuple(tokens[s.start : s.end]) != span_ids(s.digest, s.length):
            return f"the prompt's media span at {s.start} does not spell its image's key"
        inside.update(range(s.start, s.end))
    for i, t in enumerate(tokens):
        if i not in inside and not 0 <= t < vocab_size:
            return f"prompt token ids must be in [0, {vocab_size})"
    return None


def model_tokens(tokens: Sequence[int], placeholder: int) -> list[int]:
    """The ids the model reads: every media id back to the placeholder."""
    return [placeholder if t >= MEDIA_BASE else t for t in tokens]


def media_end(spans: Sequence[MediaSpan]) -> int:
    """The position just past the last image (0 with none)."""
    return max((s.end for s in spans), default=0)


# Encoder outputs (vision/tensor_store.py) are SSD records in a namespace of their own,
# one no request can name, keyed by two ids from the image's digest.
ENCODER_NAMESPACE = "\x00mlxd-encoder-outputs"


def encoder_key(digest: str) -> tuple[int, int]:
    """The SSD index key of an image's encoder output (two media-range ids)."""
    h = hashlib.blake2b(f"encoder:{digest}".encode(), digest_size=16).digest()
    a, b = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")
    return MEDIA_BASE + a % _MEDIA_RANGE, MEDIA_BASE + b % _MEDIA_RANGE
