"""Every cache family through real HTTP: plain, sliding-window, hybrid and pure-recurrent models.

Per architecture (random-weight mlx-lm models built offline): a follow-up turn
hits the RAM tier, gives the logprobs a cold prefill gives, and a new process
state restores it from SSD with the same tokens and logprobs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from mlxd.model import build_model

from models import chunked_llama4_dir
from procs import ServeProcess
from serving import ServerThread, config_for
from ssd_files import tensor_headers

SYSTEM = "You answer briefly and keep every cached prefix. " * 8
NO_EOS = {"0": -100, "1": -100, "2": -100}  # random weights: keep generating to max_tokens

# (preset, KV bits): plain attention, sliding window, hybrid, pure recurrent, quantized KV8 / KV4
CASES = [("test", None), ("test-gemma3", None), ("test-qwen3next", None), ("test-mamba2", None),
         ("test-wide", 8), ("test-wide", 4)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(root / name, name, seed=0) for name in dict(CASES)}


def chat(server: ServerThread, messages: list[dict], **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "top_logprobs": 3, "logit_bias": NO_EOS, **kw}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def logprobs(response: dict) -> list[float]:
    return [c["logprob"] for c in response["choices"][0]["logprobs"]["content"]]


def top(response: dict) -> list[list[tuple[str, float]]]:
    return [[(t["token"], t["logprob"]) for t in c["top_logprobs"]]
            for c in response["choices"][0]["logprobs"]["content"]]


def flush(server: ServerThread) -> None:
    r = httpx.post(f"{server.base_url.removesuffix('/v1')}/admin/cache/flush", timeout=120)
    assert r.status_code == 200, r.text


def same(a: dict, b: dict) -> None:
    """Same tokens and the same logprobs (greedy random models repeat tokens: compare logits too)."""
    assert text(a) == text(b)
    assert logprobs(a) == pytest.approx(logprobs(b), abs=2e-4)
    for x, y in zip(top(a), top(b), strict=True):
        assert [t for t, _ in x] == [t for t, _ in y], (x, y)
        assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=2e-4)


def conversation(reply: str | None = None) -> list[list[dict]]:
    """Three turns; turn 2 quotes a fixed reply (tokenized alike by every process)."""
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prefix?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "The start of a sequence."},
             {"role": "user", "content": "And a suffix?"}]
    turn3 = [*turn2, {"role": "assistant", "content": reply or ""}, {"role": "user", "content": "Thanks."}]
    return [turn1, turn2, turn3]


@pytest.mark.parametrize(("preset", "kv_bits"), CASES, ids=[f"{p}-kv{b}" if b else p for p, b in CASES])
def test_follow_up_turns_hit_and_restore_exactly(
    model_dirs: dict[str, Path], preset: str, kv_bits: int | None, tmp_path: Path
) -> None:
    arch_model_dir = model_dirs[preset]
    scheme = {"kv_bits": kv_bits}
    turn1, turn2, _ = conversation()
    with ServerThread(config_for(arch_model_dir, prompt_cache_bytes=0, **scheme)) as cold:
        cold1, cold2 = chat(cold, turn1), chat(cold, turn2)
        # turn 3 quotes turn 2's generated reply: its exact ids come from the reply history
        cold3 = chat(cold, conversation(text(cold2))[2])
        assert cached(cold3) == 0

    ssd = tmp_path / "ssd"
    with ServerThread(config_for(arch_model_dir, ssd_cache_dir=ssd, **scheme)) as server:
        same(chat(server, turn1), cold1)
        warm2 = chat(server, turn2)  # turn 1's prompt-boundary checkpoint serves it
        assert cached(warm2) >= warm2["usage"]["prompt_tokens"] - 40
        same(warm2, cold2)
        warm3 = chat(server, conversation(text(warm2))[2])  # turn 2's end-of-turn checkpoint serves it
        assert cached(warm3) >= warm2["usage"]["prompt_tokens"] + warm2["usage"]["completion_tokens"] - 1
        same(warm3, cold3)
        ram = httpx.get(f"{server.base_url.removesuffix('/v1')}/stats").json()["cache"]["ram"]
        if preset in ("test", "test-wide"):
            assert ram["superseded"] > 0  # a trimmable checkpoint covers its ancestors
        else:
            # window rings wrapped, recurrent state: no checkpoint can stand in for a shorter one
            assert ram["superseded"] == 0 and ram["entries"] == ram["inserts"] - ram["replaced"]
        flush(server)

    with ServerThread(config_for(arch_model_dir, ssd_cache_dir=ssd, **scheme)) as restarted:
        restored = chat(restarted, turn2)  # no RAM state: restored from the SSD tier
        assert cached(restored) == warm2["usage"]["prompt_tokens"] - 1
        same(restored, cold2)
        stats = httpx.get(f"{restarted.base_url.removesuffix('/v1')}/stats").json()["ssd_cache"]
        assert stats["restores"] >= 1


def test_kv_schemes_have_their_own_ssd_files(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    ssd, wide = tmp_path / "ssd", model_dirs["test-wide"]
    turn1, turn2, _ = conversation()
    with ServerThread(config_for(wide, ssd_cache_dir=ssd, kv_bits=8)) as server:
        chat(server, turn1)
        flush(server)
    headers = tensor_headers(ssd)  # whole files and blocks alike
    assert headers and all(set(h.signature) == {"quant:8:64"} for h in headers)
    with ServerThread(config_for(wide, ssd_cache_dir=ssd, kv_bits=4)) as server:
        assert cached(chat(server, turn2)) == 0  # another scheme's files are foreign
    with ServerThread(config_for(wide, ssd_cache_dir=ssd)) as server:
        assert cached(chat(server, turn2)) == 0  # and so to the model's own precision
    with ServerThread(config_for(wide, ssd_cache_dir=ssd, kv_bits=8)) as server:
        assert cached(chat(server, turn2)) > 0


def test_concurrent_quantized_rows_batch_and_match_sequential(model_dirs: dict[str, Path]) -> None:
    """KV4 rows of different lengths, some from cache hits, decode together; none fails."""
    prompts = [conversation()[0], conversation()[1],
               [{"role": "user", "content": "Short."}], [{"role": "user", "content": "Another short one, please."}]]
    with ServerThread(config_for(model_dirs["test-wide"], kv_bits=4, prompt_cache_bytes=0)) as server:
        sequential = [chat(server, p, max_tokens=12) for p in prompts]
    with ServerThread(config_for(model_dirs["test-wide"], kv_bits=4)) as server:
        chat(server, prompts[0])  # a checkpoint that the second prompt's row borrows
        results: list[dict] = [{}] * len(prompts)

        def run(i: int) -> None:
            results[i] = chat(server, prompts[i], max_tokens=12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert cached(results[1]) > 0
    for got, want in zip(results, sequential, strict=True):
        same(got, want)


def test_unsupported_cache_classes_are_refused_at_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    """llama4 makes ChunkedKVCache layers: `mlxd serve` exits 2 naming them, before serving anything."""
    model = chunked_llama4_dir(tiny_model_dir, tmp_path / "llama4")
    out = subprocess.run([sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxd serve: cannot serve") and "ChunkedKVCache (layers 0, 1)" in last, last
    assert "Traceback" not in out.stderr


def test_kv_scheme_the_model_cannot_run_is_refused_at_load(tiny_model_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mlxd.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
                          "--kv-bits", "4"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "cannot run KV scheme affine4-g64" in out.stderr  # head_dim 16: no group of 64 fits


def test_recurrent_preset_restarts_through_real_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mlxd serve --preset test-mamba2`: a follow-up hit, flush, SIGTERM, and a new process restores."""
    monkeypatch.setenv("MLXD_CACHE_DIR", str(tmp_path / "models"))
    # over the default 256 new tokens: turn 1's prompt boundary is checkpointed too
    turn1 = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "What is a prefix?"}]
    body = {"model": "tiny", "temperature": 0, "max_tokens": 6, "logprobs": True, "logit_bias": NO_EOS}

    def serve(name: str) -> ServeProcess:
        return ServeProcess("--preset", "test-mamba2", "--model-name", "tiny", "--ssd-cache", str(tmp_path / "ssd"),
                            log_path=tmp_path / f"{name}.log")

    with serve("first") as first, first.client() as http:
        first_reply = http.post("/v1/chat/completions", json={**body, "messages": turn1}).json()
        # the client sends the reply back: its exact ids meet turn 1's end-of-turn checkpoint
        turn2 = [*turn1, {"role": "assistant", "content": text(first_reply)}, {"role": "user", "content": "More?"}]
        warm = http.post("/v1/chat/completions", json={**body, "messages": turn2}).json()
        assert cached(warm) >= first_reply["usage"]["prompt_tokens"] - 1
        assert http.post("/admin/cache/flush").status_code == 200
        first.signal(signal.SIGTERM)
        first.wait()  # the exit status contract is tests/test_ssd_restart.py's (issue 10: clean exit)
    with serve("second") as second, second.client() as http:
        # a new process tokenizes the reply itself, so its ids may part from the generated ones
        # there: turn 1's prompt-boundary checkpoint (exact, restored from SSD) serves the prefix
        again = http.post("/v1/chat/completions", json={**body, "messages": turn2}).json()
        assert cached(again) >= first_reply["usage"]["prompt_tokens"] - 1
        assert http.get("/stats").json()["ssd_cache"]["restores"] == 1
        second.signal(signal.SIGTERM)
        second.wait()


def test_sliding_window_reuses_a_trimmed_prefix_before_the_ring_wraps(model_dirs: dict[str, Path]) -> None:
    """Window 32: a 20-odd-token checkpoint is a plain prefix cache, trimmed to serve a diverging turn."""
    turn1 = [{"role": "user", "content": "Hi."}]
    with ServerThread(config_for(model_dirs["test-gemma3"], prompt_cache_bytes=0)) as cold:
        first = chat(cold, turn1, max_tokens=4)
        turn2 = [*turn1, {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye."}]
        want = chat(cold, turn2, max_tokens=4)
    with ServerThread(config_for(model_dirs["test-gemma3"])) as server:
        end_of_turn = first["usage"]["total_tokens"] - 1  # the checkpoint's tokens: prompt + 3 generated
        assert end_of_turn < 32
        chat(server, turn1, max_tokens=4)
        got = chat(server, turn2, max_tokens=4)
        # the turn-1 checkpoint (prompt + reply ids) diverges from turn 2 inside the reply: trimmed, not refused
        assert first["usage"]["prompt_tokens"] <= cached(got) < end_of_turn
        same(got, want)
