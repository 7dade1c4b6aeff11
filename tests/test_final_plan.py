"""MLXD_FINAL_PLAN=after-token and after-forward (engine/core.py `_leave_late`), served end to end: a reply's final
checkpoint is taken in the step after its last token, and serving goes on as with the default: the reply ends, a flush right
after it finds that checkpoint durable, the next turn hits it. (The ordering itself, the checkpoint in the notes
of the step that ends the reply, is tests/test_engine_core.py's: over HTTP the next step runs before any client
could flush, either way.)"""

from __future__ import annotations

import httpx
import pytest
from tests.serving import ServerThread, config_for


@pytest.mark.parametrize("mode", ["with-token", "after-token", "after-forward"])
def test_a_flush_right_after_the_reply_finds_its_final_checkpoint(tmp_path, tiny_model_dir, monkeypatch, mode):
    monkeypatch.setenv("MLXD_FINAL_PLAN", mode)
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd")) as s:
        root = s.base_url.removesuffix("/v1")
        messages = [{"role": "user", "content": "tell me about caches, at some length please " * 4}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            text = "".join(r.iter_text())
        assert "[DONE]" in text
        report = httpx.post(root + "/admin/cache/flush", timeout=60).json()
        assert report["durable"] is True and report["pending"] == 0
        first = httpx.post(s.base_url + "/chat/completions", json={**body, "stream": False}, timeout=120).json()
        prompt, completion = first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]
        assert completion == 6
        # the reply's whole KV (its prompt and the tokens fed back) was durable when the flush answered
        assert report["longest_durable_prefix_tokens"] >= prompt + completion - 1
        follow = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and then?"}]
        nxt = httpx.post(s.base_url + "/chat/completions",
                         json={**body, "messages": follow, "stream": False}, timeout=120).json()
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt


def test_after_forward_without_the_ssd_tier_still_hands_the_next_turn_its_reply(tiny_model_dir, monkeypatch):
    """after-forward with the RAM tier alone: the final checkpoint is taken a step late, and a client's next turn,
    sent the moment the reply ended, finds the whole reply cached (the checkpoint reached the cache owner first)."""
    monkeypatch.setenv("MLXD_FINAL_PLAN", "after-forward")
    with ServerThread(config_for(tiny_model_dir)) as s:
        root = s.base_url.removesuffix("/v1")
        messages = [{"role": "user", "content": "tell me about caches, at some length please " * 4}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0.0}
        first = httpx.post(s.base_url + "/chat/completions", json=body, timeout=120).json()
        prompt = first["usage"]["prompt_tokens"]
        follow = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and then?"}]
        nxt = httpx.post(s.base_url + "/chat/completions", json={**body, "messages": follow}, timeout=120).json()
        assert nxt["usage"]["prompt_tokens_details"]["cached_tokens"] > prompt  # past the first prompt: the reply's
        assert httpx.get(root + "/stats", timeout=30).json()["engine"]["late_final_checkpoints"] == 2
