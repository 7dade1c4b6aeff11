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
import re
import secrets
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


def image_refs(messages: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> list[tuple[Any, str, str]]:
    """(url, detail, where) of every image part, in prompt order; `where` names the part as the request
    did: `messages[i].content[j]`, or with `names` (each message's field in another protocol's body,
    e.g. /v1/responses' `input[3]`) `names[i].content[j]`."""
    refs = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.get("type") == "image_url":
                    named = names[i] if names is not None and i < len(names) else f"messages[{i}]"
                    where = f"{named}.content[{j}]"
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
    decoded: int = 0  # images read, decoded and processed (not known before)
    lifted: int = 0  # known data: URLs taken out of a raw body before its JSON parse (`lift`)
    _prepared: OrderedDict[tuple[str, str], PreparedImage] = attrs.Factory(OrderedDict)
    _prepared_bytes: int = 0
    # The known data: URLs by a cheap fingerprint of their text (`lift`), and how many keys hold each.
    _by_print: dict[tuple[int, str], list[str]] = attrs.Factory(dict)
    _url_keys: dict[str, int] = attrs.Factory(dict)
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
            self.decoded += 1
            if key not in self._prepared:
                self._prepared[key] = prepared
                self._prepared_bytes += _cost(key, prepared)
                self._index(key[0], +1)
            while self._prepared_bytes > self.max_prepared_bytes and self._prepared:
                old_key, old = self._prepared.popitem(last=False)
                self._prepared_bytes -= _cost(old_key, old)
                self._index(old_key[0], -1)
        return prepared

    def _index(self, url: str, step: int) -> None:
        """Count a key for `url`; a data: URL that `lift` may substitute is indexed while any key holds it."""
        if not _LIFTABLE.match(url):
            return  # a file's key, or a URL whose JSON literal may need escapes: never lifted
        n = self._url_keys.get(url, 0) + step
        fp = _print(url)
        if n > 0:
            self._url_keys[url] = n
            if n == 1:
                self._by_print.setdefault(fp, []).append(url)
            return
        self._url_keys.pop(url, None)
        same = [u for u in self._by_print.get(fp, ()) if u != url]
        if same:
            self._by_print[fp] = same
        else:
            self._by_print.pop(fp, None)

    def lift(self, raw: bytes) -> tuple[bytes, dict[str, str]]:
        """`raw` (a JSON body) with each known data: URL's string literal replaced by a short token,
        and {token: the known URL}: the body parses without scanning those megabytes again, and
        `restore_lifted` puts the URLs back (equal strings, the very objects the preparer's keys hold, so
        `known` finds them without hashing their text). A literal is replaced only when its bytes
        equal a known URL's (compared whole: never a false hit); anything else is left to the parse."""
        if not self._by_print or len(raw) < LIFT_MIN_BYTES or not raw.startswith((b"{", b"[")):
            return raw, {}  # (a UTF-16/32 or BOM-led body is left alone too: it does not start so)
        nonce = secrets.token_hex(8)  # chosen after the body arrived: no literal in it can spell a token
        out: list[bytes] = []
        tokens: dict[str, str] = {}
        done = 0
        at = raw.find(b'"')
        while at != -1:
            if raw.startswith(b"data:", at + 1) and raw[at - 1 : at] != b"\\":  # (an escaped quote is text)
                end = raw.find(b'"', at + 1)
                if end == -1:
                    break
                url = None if _KEY_AFTER.match(raw, end + 1) else self._known_literal(raw, at + 1, end)
                if url is not None:  # (an object key is left alone: `restore_lifted` puts back values only)
                    token = f"mlxd-lifted-{nonce}-{len(tokens)}"
                    tokens[token] = url
                    out += (raw[done : at + 1], token.encode())
                    done = end
                at = end  # the closing quote: the search goes on after it
            at = raw.find(b'"', at + 1)
        if not tokens:
            return raw, {}
        out.append(raw[done:])
        with self._lock:
            self.lifted += len(tokens)
        return b"".join(out), tokens

    def _known_literal(self, raw: bytes, start: int, end: int) -> str | None:
        """The known URL whose text is exactly raw[start:end], or None."""
        n = end - start
        mid = start + n // 2
        fp = (n, raw[mid : mid + _PRINT].decode("latin-1"))
        with self._lock:
            candidates = list(self._by_print.get(fp, ()))
        if not candidates:
            return None
        try:
            text = raw[start:end].decode("ascii")
        except UnicodeDecodeError:
            return None
        return next((u for u in candidates if u == text), None)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"images_decoded": self.decoded, "images_known": self.prepared_hits,
                    "urls_lifted": self.lifted, "prepared": len(self._prepared),
                    "encoder_ssd_reads": self.ssd_reads}

    def widen(self, ids: Sequence[int], images: Sequence[tuple[PreparedImage, Any]]) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The request's key tokens and its ImageInputs from the rendered ids (one placeholder per image)."""
        try:
            key, spans = expand(ids, self.placeholder, [(p.digest, p.tokens) for p, _ in images])
        except ValueError as exc:
            raise ImageRejected(f"{exc} (an image placeholder written as text?)") from None
        media = tuple(ImageInput(span, p.patches, p.grid, f) for span, (p, f) in zip(spans, images, strict=True))
        return key, media


def restore_lifted(body: Any, tokens: dict[str, str]) -> Any:
    """`body` parsed from a lifted raw body, with each token string replaced by its URL (in place)."""
    if not tokens:
        return body
    stack = [body]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(v, str):
                if v in tokens:
                    node[k] = tokens[v]
            elif isinstance(v, dict | list):
                stack.append(v)
    if isinstance(body, str) and body in tokens:
        return tokens[body]
    return body


LIFT_MIN_BYTES = 64 << 10  # smaller bodies parse in well under a millisecond: not worth a scan
_PRINT = 32  # characters from a URL's middle in its fingerprint (a PNG's base64 ends alike in every image)
# A data: URL whose JSON literal is its own text (printable ASCII, no quote or backslash to escape).
_LIFTABLE = re.compile(r'data:[ !#-\[\]-~]*\Z')
_KEY_AFTER = re.compile(rb"[ \t\r\n]*:")  # a literal followed by a colon is an object key


def _print(url: str) -> tuple[int, str]:
    """A known URL's fingerprint: its length and 32 characters from its middle."""
    mid = len(url) // 2
    return len(url), url[mid : mid + _PRINT]


def _cost(key: tuple[str, str], prepared: PreparedImage) -> int:
    """What a processed image holds: its patches and its key (a data: URL's text)."""
    return prepared.patches.nbytes + len(key[0])
