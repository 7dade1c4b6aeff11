"""A vision server restarted on the same --ssd-cache: the KV through the image and its encoder output come back."""

from __future__ import annotations

import base64
import io
import zlib
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from mlxd.vision.tensor_store import read_tensor, write_tensor

from procs import ServeProcess


def png(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(client: httpx.Client, system: str) -> dict:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(1)}},
                                             {"type": "text", "text": "What is this?"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_restart_restores_the_image_prefix_and_its_encoder_output(tmp_path: Path, vlm_model_dir: Path) -> None:
    model = vlm_model_dir
    ssd = tmp_path / "ssd"
    args = ("--model", str(model), "--ssd-cache", str(ssd))
    with ServeProcess(*args, log_path=tmp_path / "a.log") as a:
        first = ask(a.client(), "You look at pictures.")
        a.signal()
        assert a.wait() == 0, a.log()
    assert list((ssd / "tensors").glob("*/*/*.mlxt"))  # the encoder output is on disk
    with ServeProcess(*args, log_path=tmp_path / "b.log") as b:
        client = b.client()
        again = ask(client, "You look at pictures.")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        # Another conversation with the same image: the KV differs before it, the encoder output is on SSD.
        ask(client, "Something else entirely.")
        engine = client.get("/stats").json()["engine"]
        assert engine["media_encoded"] == 0
        assert engine["media_encoder_ssd_hits"] == 1


def test_a_corrupt_tensor_file_is_a_miss_and_goes(tmp_path: Path) -> None:
    path = tmp_path / "id" / "d.mlxt"
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_tensor(path, arr, digest="d", identity="id")
    assert np.array_equal(read_tensor(path, digest="d", identity="id"), arr)
    assert read_tensor(path, digest="e", identity="id") is None  # another image's name: not served
    write_tensor(path, arr, digest="d", identity="id")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit of payload
    path.write_bytes(bytes(raw))
    assert zlib.crc32(bytes(raw[-48:])) != zlib.crc32(arr.tobytes())
    assert read_tensor(path, digest="d", identity="id") is None
    assert not path.exists()
