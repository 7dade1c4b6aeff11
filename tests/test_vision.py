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

from mlxd.model import build_model

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
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "vlm", "test-vlm", seed=0)


@pytest.fixture(scope="module")
def server(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png(7))
    ssd = tmp_path_factory.mktemp("ssd")
    with ServerThread(config_for(vlm_dir, ssd_cache_dir=ssd, allow_media_dir=media)) as s:
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
