"""Speculation across a SIGKILL: `mlxd serve --speculative ...` killed mid-generation, restarted, resumes exactly.

A real server process with generation checkpoints is SIGKILLed while it
speculates; a new process over the same SSD directory resumes the same request
from the checkpoint and must give, token for token, the text a server with
speculation off gives uninterrupted (greedy and seeded; n-grams and a draft
model). The same request once more, after the restart (a prompt cache hit), gives it again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.kv import file_format as ff

from procs import ServeProcess, kill_mid_request

# The kill lands after two checkpoints (16 tokens; 20-52 emitted here), far short of the end: the resumed
# generation, its reference and the request once more each decode all of it, so it is kept this long only.
MAX_TOKENS = 400
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 1234, "top_k": 50}}


def _serve(tmp_path: Path, model_dir: Path, cache: Path, name: str, *spec: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                        "--generation-checkpoint", "8", *spec, log_path=tmp_path / f"{name}.log")


def _body(sampling: str) -> dict:
    return {"model": "tiny", "prompt": "Repeat the story of a cache that survived a crash, again and again. " * 3,
            "max_tokens": MAX_TOKENS, "logit_bias": {"0": -100, "2": -100}, **SAMPLING[sampling]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    """Speculation off, uninterrupted: the text each sampling must give."""
    where = tmp_path_factory.mktemp("reference")
    with _serve(where, tiny_model_dir, where / "ssd", "off") as off, off.client() as http:
        replies = {s: http.post("/v1/completions", json=_body(s)).json() for s in SAMPLING}
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in replies.values())
    return {s: r["choices"][0]["text"] for s, r in replies.items()}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_a_speculating_server_sigkilled_mid_generation_resumes_to_speculation_off_s_text(
        tmp_path: Path, tiny_model_dir: Path, reference: dict[str, str], mode: str, sampling: str) -> None:
    # The draft: the model itself (tests/conftest.py prices it at 0, so the engine's price check lets it verify).
    spec = ("--speculative", "ngram") if mode == "ngram" else (
        "--speculative", "draft", "--draft-model", str(tiny_model_dir))
    body, cache = _body(sampling), tmp_path / "ssd"
    kill_mid_request(_serve(tmp_path, tiny_model_dir, cache, "first", *spec).start(), "/v1/completions", body)
    (checkpoint,) = cache.rglob("*.mlxgen")
    assert 0 < ff.read_header(checkpoint).meta.generation["emitted"] < MAX_TOKENS  # 20-52 here: killed early

    with _serve(tmp_path, tiny_model_dir, cache, "second", *spec) as second, second.client() as http:
        again = http.post("/v1/completions", json=body).json()
        stats = http.get("/stats").json()
        assert stats["generation_checkpoints"]["resumed"] == 1
        assert again["choices"][0]["text"] == reference[sampling]
        assert again["usage"]["completion_tokens"] == MAX_TOKENS
        speculation = stats["engine"]["speculation"]
        assert speculation["active"] and speculation["proposed"] > 0, speculation
        once_more = http.post("/v1/completions", json=body).json()  # after the restart, no checkpoint left
        assert once_more["choices"][0]["text"] == reference[sampling]
        assert once_more["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "a prompt cache hit"
        assert http.get("/stats").json()["generation_checkpoints"]["resumed"] == 1
    assert "gen_checkpoint.resume" in second.log()
