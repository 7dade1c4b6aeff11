"""The offline model build: determinism, loading, tokenizer, generation, caching."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import qwen3
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from mlxd.model import (
    PRESETS,
    ByteLevelStreamingDetokenizer,
    build_model,
    default_model_dir,
    ensure_model,
    get_preset,
    main_build_model,
)
from mlxd.model.tiny import MANIFEST, is_complete

TEXTS = [
    "Hello, world!",
    "  two leading spaces, a trailing one ",
    " one leading space",
    "tabs\tand\nnewlines\r\n\n",
    "Grüße aus München — ¿qué tal? 中文 日本語 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈",
    "nul \x00 byte and digits 12345",
    "def f(x):\n    return x ** 2  # square\n",
]


def stream_text(tokenizer, ids: list[int]) -> str:
    """Text streamed segment by segment, as a server would send it."""
    detok = tokenizer.detokenizer
    parts = []
    for token in ids:
        detok.add_token(token)
        parts.append(detok.last_segment)
    detok.finalize()
    parts.append(detok.last_segment)
    assert detok.text == "".join(parts)
    return detok.text


def counting_progress():
    calls: list[tuple[str, float]] = []
    return calls, lambda stage, fraction: calls.append((stage, fraction))


# -- build ----------------------------------------------------------------------


def test_build_is_deterministic(tmp_path, tiny_model_dir):
    again = build_model(tmp_path / "again", "test", seed=0)
    other = build_model(tmp_path / "other", "test", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_build_leaves_no_temp_dirs_and_reports_progress(tmp_path):
    calls, progress = counting_progress()
    dest = build_model(tmp_path / "m", "test", progress=progress)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert is_complete(dest)
    assert {stage for stage, _ in calls} == {"tokenizer", "weights", "save"}
    assert all(0.0 <= f <= 1.0 for _, f in calls) and calls[-1] == ("save", 1.0)


def test_build_replaces_existing_dest(tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "junk.txt").write_text("old")
    build_model(dest, "test")
    assert not (dest / "junk.txt").exists() and is_complete(dest)


def test_config_is_qwen3_fp32_long_context(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["max_position_embeddings"] >= 32768
    weights = mx.load(str(tiny_model_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.float32}


def test_unknown_preset_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset"):
        build_model(tmp_path / "m", "huge")


def test_preset_sizes():
    assert PRESETS["test"].param_count() < 200_000
    assert 10e6 <= PRESETS["default"].param_count() <= 20e6
    assert 35e6 <= PRESETS["bench"].param_count() <= 50e6
    for preset in PRESETS.values():
        assert preset.max_position_embeddings >= 32768


# -- loading, tokenizer ---------------------------------------------------------


def test_mlx_lm_loads_it(tiny_model, tiny_model_dir):
    model, tokenizer = tiny_model
    assert isinstance(model, qwen3.Model)
    n_params = sum(v.size for _, v in mlx_lm.utils.tree_flatten(model.parameters()))
    assert n_params == get_preset("test").param_count()
    assert len(tokenizer._tokenizer) == get_preset("test").vocab_size
    assert tokenizer.eos_token == "<|im_end|>"
    # eos is <|im_end|>; generation_config.json adds <|endoftext|> as a stop token.
    stops = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert tokenizer.eos_token_ids == stops


def test_chat_template_renders_chatml(tiny_model):
    _, tokenizer = tiny_model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    assert ids[0] == specials[0] and ids.count(specials[1]) == 2


def test_chat_template_renders_tools_calls_results_and_thinking(tiny_model):
    _, tokenizer = tiny_model
    # mlx-lm infers the Hermes-style JSON tool parser and <think> reasoning.
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    assert tokenizer.has_thinking and tokenizer.think_start == "<think>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "reasoning_content": "hm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert text.count("<|im_start|>system") == 1
    assert ('<|im_start|>assistant\n<think>hm</think><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    off = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer.encode("<think>x</think><tool_call>", add_special_tokens=False)
    assert len(ids) == 4  # the markers are single tokens


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tiny_model, text):
    _, tokenizer = tiny_model
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert stream_text(tokenizer, ids) == text


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tiny_model, text):
    _, tokenizer = tiny_model
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert stream_text(tokenizer, ids) == text


def test_stream_detokenizer_matches_decode_on_arbitrary_ids(tiny_model):
    _, tokenizer = tiny_model
    ids = mx.random.randint(0, len(tokenizer._tokenizer), (3000,), key=mx.random.key(7))
    ids = ids.tolist()
    assert stream_text(tokenizer, ids) == tokenizer.decode(ids)


def test_mlx_lm_picks_its_bpe_detokenizer_which_load_model_replaces(tiny_model, tiny_model_dir):
    # mlx-lm's own choice for a ByteLevel decoder drops a leading space.
    _, plain = mlx_lm.load(str(tiny_model_dir))
    assert isinstance(plain._detokenizer, BPEStreamingDetokenizer)
    assert isinstance(tiny_model[1]._detokenizer, ByteLevelStreamingDetokenizer)


# -- the model runs ---------------------------------------------------------------


def test_logits_are_finite_and_not_constant(tiny_model):
    model, tokenizer = tiny_model
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(tokenizer._tokenizer))
    assert mx.all(mx.isfinite(logits)).item()
    assert logits[0, -1].std().item() > 1.0
    assert not mx.allclose(logits[0, 0], logits[0, -1]).item()


def test_generation_produces_tokens(tiny_model):
    model, tokenizer = tiny_model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=8))
    assert 1 <= len(responses) <= 8
    assert all(0 <= r.token < len(tokenizer._tokenizer) for r in responses)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=8)
    assert text == "".join(r.text for r in responses)


# -- cache dir and ensure_model -------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_model_dir_names_preset_and_recipe(cache_dir, monkeypatch):
    path = default_model_dir("test")
    assert path.parent == cache_dir / "models"
    assert path.name.startswith("test-") and len(path.name) > len("test-") + 8
    assert default_model_dir("test", seed=1) != path
    assert default_model_dir("default").name.startswith("default-")
    monkeypatch.delenv("MLXD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir / "xdg"))
    assert default_model_dir("test").parent == cache_dir / "xdg" / "mlxd" / "models"


def test_ensure_model_builds_once_then_reuses(cache_dir):
    calls, progress = counting_progress()
    path = ensure_model("test", progress=progress)
    assert path == default_model_dir("test") and is_complete(path) and calls
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    calls.clear()
    assert ensure_model("test", progress=progress) == path
    assert calls == [] and (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "drop_manifest", "drop_tokenizer"])
def test_ensure_model_rebuilds_a_damaged_dir(cache_dir, damage):
    path = ensure_model("test", progress=None)
    weights = path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "flip_byte":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "drop_manifest":
        (path / MANIFEST).unlink()
    else:
        (path / "tokenizer.json").unlink()
    assert not is_complete(path)
    calls, progress = counting_progress()
    assert ensure_model("test", progress=progress) == path
    assert calls and is_complete(path)
    mlx_lm.load(str(path))


def test_ensure_model_reaps_crashed_temp_dirs(cache_dir):
    dest = default_model_dir("test")
    stale = dest.parent / f".{dest.name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    ensure_model("test", progress=None)
    assert not stale.exists()


def test_two_processes_build_once(cache_dir):
    code = "import mlxd; from mlxd.model import ensure_model; print(ensure_model('test'))"
    env = {**os.environ, "MLXD_CACHE_DIR": str(cache_dir)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {Path(out.decode().strip()) for out, _ in outs}
    assert paths == {default_model_dir("test")}
    builders = [err for _, err in outs if b"building model" in err]
    assert len(builders) == 1


def test_main_build_model_out(tmp_path, capsys):
    assert main_build_model(["--preset", "test", "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr()
    assert Path(out.out.strip()) == (tmp_path / "m").absolute()
    assert "building model" in out.err
    assert is_complete(tmp_path / "m")
