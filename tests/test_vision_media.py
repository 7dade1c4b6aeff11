"""kv/media.py: images in prefix keys by the hash of their pixels (pure)."""

from __future__ import annotations

import pytest

from mlxd.kv.media import MEDIA_BASE, check_spans, expand, media_end, model_tokens, span_ids
from mlxd.kv.prefix_index import key_tokens, token_key


def test_expand_widens_each_placeholder_to_its_images_span() -> None:
    key, spans = expand([5, 9, 6, 9, 7], 9, [("aa", 3), ("bb", 2)])
    assert key == (5, *span_ids("aa", 3), 6, *span_ids("bb", 2), 7)
    assert [(s.start, s.length) for s in spans] == [(1, 3), (5, 2)]
    assert media_end(spans) == 7
    assert model_tokens(key, 9) == [5, 9, 9, 9, 6, 9, 9, 7]
    assert check_spans(key, spans, vocab_size=16) is None
    assert key_tokens(token_key(key)) == key  # media ids fit the prefix index's int32 keys


def test_a_different_image_differs_from_its_first_position_only() -> None:
    a, _ = expand([1, 2, 9, 3], 9, [("one", 4)])
    b, _ = expand([1, 2, 9, 3], 9, [("two", 4)])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(t >= MEDIA_BASE for t in a[2:6])


def test_bad_keys_are_refused() -> None:
    key, spans = expand([1, 9, 2], 9, [("x", 2)])
    assert "does not spell" in check_spans((1, key[1] + 1, key[2], 2), spans, 16)
    assert "in [0, 16)" in check_spans((1, *key[1:3], MEDIA_BASE), spans, 16)  # a media id outside a span
    with pytest.raises(ValueError, match="placeholders"):
        expand([1, 9, 9], 9, [("x", 2)])


def test_a_repeated_data_url_is_not_decoded_again(vlm_model_dir) -> None:
    import base64
    import io

    import numpy as np
    from PIL import Image

    from mlxd.vision.images import ImageLimits
    from mlxd.vision.prepare import MediaPreparer

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    prep = MediaPreparer.for_model(vlm_model_dir, limits=ImageLimits(), ssd_dir=None)
    assert prep is not None
    [(first, _)] = prep.prepare([(url, "auto", "here")])
    [(again, _)] = prep.prepare([("".join([url[:9], url[9:]]), "auto", "here")])  # an equal string, another object
    assert again is first and prep.prepared_hits == 1
    # The same bytes under another media type: another key, processed again, the same image digest.
    [(other, _)] = prep.prepare([(url.replace("image/png", "image/x-png", 1), "auto", "here")])
    assert other is not first and other.digest == first.digest and prep.prepared_hits == 1
    [(low, _)] = prep.prepare([(url, "low", "here")])  # the detail is part of the key
    assert low is not first
    # All known: the event loop takes them without a thread hop; anything new goes to `prepare`.
    known = prep.known([(url, "auto", "a"), (url, "low", "b")])
    assert known is not None and [p for p, _ in known] == [first, low]
    assert prep.known([(url, "auto", "a"), (url.replace("image/png", "image/gif", 1), "auto", "b")]) is None


def test_only_a_body_that_may_hold_a_lone_surrogate_is_re_checked() -> None:
    import json

    from mlxd.http.app import _may_hold_surrogates, _parse_json
    from mlxd.http.schemas import ApiError

    images = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 50_000}},
        {"type": "text", "text": "line\nbreak, a \"quote\", a \\ud800 backslash and \u00e9"}]}]}).encode()
    assert not _may_hold_surrogates(images)
    assert _parse_json(images)["messages"][0]["content"][1]["text"].endswith("\\ud800 backslash and \u00e9")
    bad = [b'{"p": "\\ud800"}', b'{"p": "x\\uDFFF"}', '{"p": "\ud800"}'.encode("utf-8", "surrogatepass"),
           b'{"p": "\\\\\\udc00"}', json.dumps({"p": "\ud800"}).encode("utf-16")]
    for raw in bad:
        assert _may_hold_surrogates(raw)
        with pytest.raises(ApiError, match="surrogate"):
            _parse_json(raw)


def _noise_url(seed: int, size: tuple[int, int] = (84, 56)) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_known_data_urls_are_lifted_out_of_a_raw_body_and_put_back_exactly(vlm_model_dir) -> None:
    import json

    from mlxd.vision.images import ImageLimits
    from mlxd.vision.prepare import LIFT_MIN_BYTES, MediaPreparer, image_refs, restore_lifted

    prep = MediaPreparer.for_model(vlm_model_dir, limits=ImageLimits(), ssd_dir=None)
    assert prep is not None
    url = _noise_url(11, (300, 300))
    assert len(url) > LIFT_MIN_BYTES
    [(first, _)] = prep.prepare([(url, "auto", "here")])
    assert prep.decoded == 1
    other = _noise_url(12, (300, 300))  # not known: parsed as usual
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": 'a "data:" quote \\ and ' + url[:40]}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": other, "detail": "low"}}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    raw = json.dumps({"messages": messages, url: "a key is left alone"}).encode()
    lifted, tokens = prep.lift(raw)
    assert len(tokens) == 2 and len(lifted) < len(raw) - 2 * len(url) + 200
    body = restore_lifted(json.loads(lifted), tokens)
    assert body == json.loads(raw)
    refs = image_refs(body["messages"])
    assert refs[0][0] is refs[2][0] is next(iter(tokens.values()))  # the preparer's own key object
    known = prep.known([refs[0], refs[2]])
    assert known is not None and [p for p, _ in known] == [first, first] and prep.decoded == 1
    assert prep.stats()["urls_lifted"] == 2
    # Never a false hit: the same length and middle with one character changed, or the URL spelled
    # with a JSON escape, is parsed as usual (and a changed image is decoded).
    near = url[:-8] + ("A" if url[-8] != "A" else "B") + url[-7:]
    for text in (json.dumps({"u": near}), json.dumps({"u": url}).replace("data:", "data\\u003a", 1),
                 json.dumps({"u": url}).replace("/", "\\/")):
        again, none = prep.lift(text.encode() + b" " * LIFT_MIN_BYTES)
        assert none == {} and json.loads(again) == json.loads(text)
    # A small body is not scanned; an evicted URL is no longer lifted.
    assert prep.lift(json.dumps({"u": url}).encode()[: LIFT_MIN_BYTES - 1]) == (
        json.dumps({"u": url}).encode()[: LIFT_MIN_BYTES - 1], {})
    prep.max_prepared_bytes = 0
    prep.prepare([(other, "auto", "x")])  # evicts everything (the cap is 0)
    assert prep.lift(raw) == (raw, {})
