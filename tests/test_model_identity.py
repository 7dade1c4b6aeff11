"""Model identity is a content hash of the weights; the served name never decides what the SSD cache holds."""

from __future__ import annotations

import json
import shutil
import signal

from mlxd.model.identity import HashMemo, model_identity

from procs import ServeProcess
from ssd_files import checkpoint_files

SYSTEM = "You are a meticulous assistant. Always answer in full sentences. " * 10


def flip_a_weight_byte(model_dir) -> None:
    weights = sorted(model_dir.glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: same size, same file
    weights.write_bytes(bytes(data))


def test_identity_is_the_content_and_is_memoized(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    memo_file = tmp_path / "memo.json"

    first = HashMemo.load(memo_file)
    ident = model_identity(model, memo=first)
    assert first.hashed_bytes > 0 and json.loads(memo_file.read_text())  # every file hashed once, remembered
    assert model_identity(tiny_model_dir, memo=HashMemo.load(None)) == ident  # same bytes elsewhere, same id

    again = HashMemo.load(memo_file)
    assert model_identity(model, memo=again) == ident
    assert again.hashed_bytes == 0  # a restart reads no weights

    flip_a_weight_byte(model)
    changed = HashMemo.load(memo_file)
    assert model_identity(model, memo=changed) != ident  # the memo noticed the write and rehashed
    assert changed.hashed_bytes > 0
    assert model_identity(model, memo=HashMemo.load(None)) == model_identity(model, memo=HashMemo.load(memo_file))


def chat(http, name: str) -> dict:
    body = {"model": name, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            "temperature": 0, "max_tokens": 4}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_renaming_the_model_keeps_its_ssd_cache(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "user-cache"))  # the hash memo goes here
    model, cache = tmp_path / "model", tmp_path / "ssd"
    shutil.copytree(tiny_model_dir, model)

    def serve(name: str, log: str) -> ServeProcess:
        return ServeProcess("--model", str(model), "--model-name", name, "--ssd-cache", str(cache),
                            log_path=tmp_path / f"{log}.log")

    with serve("first-name", "first") as first, first.client() as http:
        prompt_tokens = chat(http, "first-name")["usage"]["prompt_tokens"]
        assert http.post("/admin/cache/flush").json()["durable"] is True
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    files = [p.name for p in checkpoint_files(cache)]
    assert files

    with serve("another-name", "renamed") as renamed, renamed.client() as http:
        usage = chat(http, "another-name")["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 1  # restored from SSD
        assert http.get("/stats").json()["ssd_cache"]["corrupt_removed"] == 0
        renamed.signal(signal.SIGTERM)
        assert renamed.wait() == 0
    assert set(files) <= {p.name for p in checkpoint_files(cache)}  # nothing deleted or orphaned

    # Other weights under the same name are another model: its files are not served to them.
    flip_a_weight_byte(model)
    with serve("another-name", "changed") as changed, changed.client() as http:
        assert chat(http, "another-name")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        changed.signal(signal.SIGTERM)
        assert changed.wait() == 0
