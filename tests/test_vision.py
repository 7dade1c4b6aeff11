"""Images over HTTP on the test-vlm preset: content parts, limits, media prefix identity, encoder cache."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from serving import ServerThread, config_for


def png(seed: int, size: tuple[int, int] = (84, 56)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, **extra: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data), **extra}}


def user(text: str, *images: bytes) -> dict:
    return {"role": "user", "content": [*(image_part(i) for i in images), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def server(vlm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png(7))
    ssd = tmp_path_factory.mktemp("ssd")
    with ServerThread(config_for(vlm_model_dir, ssd_cache_dir=ssd, allow_media_dir=media)) as s:
        s.media_dir = media  # type: ignore[attr-defined]
        s.ssd_dir = ssd  # type: ignore[attr-defined]
        yield s


def chat(server: ServerThread, messages: list[dict], max_tokens: int = 4) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)


def post(server: ServerThread, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)


def engine_stats(server: ServerThread) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["engine"]


def test_image_turn_then_follow_up_reuses_everything(server: ServerThread) -> None:
    first = [user("What is in this picture?", png(1))]
    r1 = chat(server, first)
    assert r1.usage.prompt_tokens > 12  # the image's span counts as prompt tokens
    follow = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And the colours?"}]
    r2 = chat(server, follow)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1


def test_same_image_same_place_hits_and_a_different_image_hits_only_up_to_it(server: ServerThread) -> None:
    system = {"role": "system", "content": "You describe pictures. " * 8}
    a = chat(server, [system, user("Describe it.", png(2))])
    # The same image in the same place, in a new conversation: everything before the new text is reused.
    same = chat(server, [system, user("Describe it.", png(2))])
    assert same.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens - 1
    # A different image (same size, so the same span length): only the text before it is reused.
    other = chat(server, [system, user("Describe it.", png(3))])
    assert other.usage.prompt_tokens == a.usage.prompt_tokens
    cached = other.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < a.usage.prompt_tokens - 12  # stops where the image's span starts
    before = engine_stats(server)
    again = chat(server, [system, user("Describe it again.", png(2))])  # a RAM hit through the image
    assert again.usage.prompt_tokens_details.cached_tokens > cached + 12
    assert engine_stats(server)["media_encoded"] == before["media_encoded"]


def test_the_same_image_is_encoded_once(server: ServerThread) -> None:
    before = engine_stats(server)
    # Two conversations that differ before the image: the KV cannot be shared, the encoder output is.
    chat(server, [{"role": "system", "content": "first"}, user("What?", png(4))])
    chat(server, [{"role": "system", "content": "second"}, user("What?", png(4))])
    after = engine_stats(server)
    assert after["media_encoded"] == before["media_encoded"] + 1
    assert after["media_encoder_ram_hits"] == before["media_encoder_ram_hits"] + 1


def test_file_urls_only_under_the_allowed_dir(server: ServerThread, tmp_path: Path) -> None:
    inside = (server.media_dir / "cat.png").as_uri()  # type: ignore[attr-defined]
    ok = post(server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": inside}}]}])
    assert ok.status_code == 200, ok.text
    (tmp_path / "dog.png").write_bytes(png(8))
    outside = post(server, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": (tmp_path / "dog.png").as_uri()}}]}])
    assert outside.status_code == 400 and "outside" in outside.json()["error"]["message"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,not-base64!!", "base64"),
        (data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "could not be decoded"),
        (data_url(b"hello, world"), "not an image format Pillow reads"),
        (data_url(png(5)[:200]), "could not be decoded"),  # truncated
        ("ftp://host/x.png", "unsupported"),
    ],
)
def test_bad_images_are_400s_and_the_server_keeps_serving(server: ServerThread, url: str, says: str) -> None:
    r = post(server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    assert " at 0x" not in r.json()["error"]["message"]  # no object's memory address
    assert chat(server, [user("still there?", png(1))]).choices[0].finish_reason in ("length", "stop")


def test_a_bad_image_names_the_field_of_the_route_it_came_by(server: ServerThread) -> None:
    """The chat route names `messages[i].content[j]`; /v1/responses its own `input[i].content[j]` (the
    item's index in `input`, whatever instructions or merged assistant items come before it)."""
    bad = data_url(b"hello, world")
    chat_reply = post(server, [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                            {"type": "image_url", "image_url": {"url": bad}}]}])
    assert chat_reply.json()["error"]["message"].startswith("messages[0].content[1]: "), chat_reply.text
    base = server.base_url
    r = httpx.post(f"{base}/responses", timeout=120, json={
        "model": "tiny", "max_output_tokens": 2, "instructions": "Be brief.", "input": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},  # one assistant turn
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "function_call_output", "call_id": "c2", "output": "ok"},
            {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                         {"type": "input_image", "image_url": bad}]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # the chat messages' index would be 5 (instructions first, three items merged)
    assert error["param"] == "input" and error["message"].startswith("input[6].content[1]: "), error
    assert "not an image format Pillow reads" in error["message"]


def test_limits_are_400s(server: ServerThread) -> None:
    many = post(server, [user("many", *[png(1)] * 17)])
    assert many.status_code == 400 and "limit of 16" in many.json()["error"]["message"]
    bomb = io.BytesIO()
    Image.new("RGB", (9000, 9000)).save(bomb, format="PNG")  # 81M pixels, a small file
    r = post(server, [user("big", bomb.getvalue())])
    assert r.status_code == 400 and "pixels" in r.json()["error"]["message"]
    bad_detail = post(server, [{"role": "user", "content": [image_part(png(1), detail="huge")]}])
    assert bad_detail.status_code == 400


def test_low_detail_is_a_shorter_span_and_another_key(server: ServerThread) -> None:
    big = png(6, size=(280, 280))
    high = chat(server, [user("x", big)])
    low = chat(server, [{"role": "user", "content": [image_part(big, detail="low"), {"type": "text", "text": "x"}]}])
    assert low.usage.prompt_tokens < high.usage.prompt_tokens


def test_a_text_only_model_refuses_images(tiny_model_dir: Path) -> None:
    with ServerThread(config_for(tiny_model_dir)) as s:
        r = post(s, [user("what is this?", png(1))])
        assert r.status_code == 400 and "does not read images" in r.json()["error"]["message"]
        ok = post(s, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert ok.status_code == 200


def test_image_and_text_rows_batch_together(server: ServerThread) -> None:
    from concurrent.futures import ThreadPoolExecutor

    convs = [
        [{"role": "system", "content": f"batch {i}"}, user(f"Row {i}: what is it?", png(20 + i))] if i % 2 else
        [{"role": "system", "content": f"batch {i}"}, {"role": "user", "content": f"Row {i}: text only."}]
        for i in range(4)
    ]
    before = engine_stats(server)
    with ThreadPoolExecutor(4) as pool:  # cold, at once: media prefills, then one decoding batch
        together = list(pool.map(lambda c: chat(server, c, max_tokens=8).choices[0].message.content, convs))
    during = engine_stats(server)
    assert during["media_prefills"] == before.get("media_prefills", 0) + 2
    assert during["steps"] - before.get("steps", 0) < 4 * 8  # fewer steps than one row after another
    alone = [chat(server, c, max_tokens=8).choices[0].message.content for c in convs]  # one by one
    assert together == alone


def test_a_session_with_images_takes_its_checkpoint(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                           default_headers={"X-Session-Id": "vision-session"})
    first = [user("Look at this.", png(30))]
    r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=4, temperature=0)
    follow = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "More?"}]
    r2 = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1


def test_a_fresh_vision_server_reports_its_media_counters_at_zero(vlm_model_dir) -> None:
    """Before any request, /stats already has the vision counters (0), as after a step."""
    with ServerThread(config_for(vlm_model_dir)) as fresh:
        engine = engine_stats(fresh)
        assert engine["media_encoded"] == 0 and engine["media_encoder_ram_hits"] == 0


def media_stats(server: ServerThread) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["media"]


def test_a_follow_up_does_not_decode_its_images_again_and_a_changed_one_invalidates_from_it(
    server: ServerThread,
) -> None:
    big = [png(40, (224, 224)), png(41, (224, 224))]  # a body over the lift threshold (64 KiB)
    span = chat(server, [user("x", big[0])]).usage.prompt_tokens - chat(server, [user("x")]).usage.prompt_tokens
    first = [user("Compare these.", *big)]
    r1 = chat(server, first)
    before = media_stats(server)
    follow = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And?"}]
    r2 = chat(server, follow)
    after = media_stats(server)
    assert after["images_decoded"] == before["images_decoded"]  # both known: not decoded again
    assert after["urls_lifted"] == before["urls_lifted"] + 2  # nor parsed again (found in the raw body)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1
    # The second image changed (same size): it alone is decoded, and the cache is reused up to it only.
    changed = [user("Compare these.", big[0], png(42, (224, 224))), *follow[1:]]
    r3 = chat(server, changed)
    assert media_stats(server)["images_decoded"] == after["images_decoded"] + 1
    assert r3.usage.prompt_tokens == r2.usage.prompt_tokens
    cached = r3.usage.prompt_tokens_details.cached_tokens
    assert span <= cached <= r1.usage.prompt_tokens - span, (span, cached, r1.usage.prompt_tokens)
    assert r3.choices[0].message.content is not None


def test_a_responses_follow_up_sends_no_images_and_reuses_their_prefix(server: ServerThread) -> None:
    """/v1/responses: an image turn (input_image, stored), then a follow-up of new text only through
    previous_response_id: the server's stored conversation brings the images back, already known
    (not decoded, not encoded again), and the cache covers the whole first turn, image spans included."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    images = [png(50, (112, 112)), png(51, (112, 112))]
    first = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, store=True, input=[
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [*({"type": "input_image", "image_url": data_url(i)} for i in images),
                                     {"type": "input_text", "text": "Compare these."}]}])
    assert first.usage.input_tokens > 2 * 12  # both images' spans count as input tokens
    media, engine = media_stats(server), engine_stats(server)
    follow = client.responses.create(model="tiny", max_output_tokens=2, temperature=0,
                                     previous_response_id=first.id, input="And which is brighter?")
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    after = media_stats(server)
    assert after["images_decoded"] == media["images_decoded"]  # the stored images are known: not decoded
    assert after["images_known"] == media["images_known"] + 2
    assert engine_stats(server)["media_encoded"] == engine["media_encoded"]  # nor run through the tower
