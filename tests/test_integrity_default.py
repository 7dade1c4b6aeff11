"""Integrity by default: every restored byte is verified unless `--ssd-cache-verify off`.

A damaged file is a miss, never an answer: a prompt-cache file (whole or
blocks) whose tensor bytes were flipped is removed and the request is a full
prefill with the cold reply, under the default flags of a real `mlxd serve`;
a generation checkpoint with a flipped tensor byte is removed and the retry
runs without it, to the uninterrupted text.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.cli import build_parser, serve_config
from mlxd.kv import file_format as ff
from mlxd.kv.block_store import BLOCK_EXT, MANIFEST_EXT
from mlxd.runtime.kernel.messages import TokenGenerated

from procs import ServeProcess

SYSTEM = "You restore caches and check every byte of them before trusting one. " * 10
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is this file sound?"}]
NO_EOS = ((0, -100.0), (2, -100.0))


def _flip_tensor_bytes(path: Path) -> None:
    """Flip one byte in the middle of every tensor: the header (and its sha256) stays intact."""
    data = bytearray(path.read_bytes())
    for _, t in ff.read_header(path).tensors():
        if t.nbytes:
            data[t.offset + t.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _serve(tmp_path: Path, model_dir: Path, cache: Path, name: str, *extra: str) -> ServeProcess:
    return ServeProcess("--model", str(model_dir), "--model-name", "tiny", "--ssd-cache", str(cache), *extra,
                        log_path=tmp_path / f"{name}.log")


def _chat(http) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "temperature": 0,
                                                "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("layout", "suffix", "holder"),
                         [(("--ssd-layout", "whole"), ff.EXTENSION, ff.EXTENSION), ((), BLOCK_EXT, MANIFEST_EXT)],
                         ids=["whole", "blocks-default"])
def test_a_flipped_payload_byte_is_a_miss_under_default_flags(tmp_path, tiny_model_dir, layout, suffix, holder):
    cache = tmp_path / "ssd"
    with _serve(tmp_path, tiny_model_dir, cache, "first", *layout) as first, first.client() as http:
        cold = _chat(http)
        assert http.post("/admin/cache/flush").json()["durable"] is True
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    victims = sorted(cache.rglob(f"*{suffix}"))
    holders = sorted(cache.rglob(f"*{holder}"))  # the files that make a checkpoint (blocks: its manifest)
    assert victims and holders
    for path in victims:
        _flip_tensor_bytes(path)
    damaged = {p: p.read_bytes() for p in (*victims, *holders)}

    def still_there(path: Path) -> bool:
        """The damaged file is still on disk (a healthy rewrite under the same name is not it:
        block and checkpoint names come from their contents and tokens, so the second server's
        own checkpoint of the same conversation can reuse them)."""
        return path.exists() and path.read_bytes() == damaged[path]

    # No verify flag: the default checks every tensor's CRC-32.
    with _serve(tmp_path, tiny_model_dir, cache, "second", *layout) as second, second.client() as http:
        again = _chat(http)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "a damaged file was restored"
        assert again["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        assert http.get("/stats").json()["ssd_cache"]["corrupt_removed"] >= 1
    # The damaged checkpoint is removed (blocks: its manifest and the first damaged block read;
    # the other blocks it named go with the next collection).
    assert not any(still_there(p) for p in holders), "the damaged checkpoint is removed"
    assert not all(still_there(p) for p in victims)
    assert "ssd_corrupt" in second.log()


def test_the_cli_verifies_by_default_and_keeps_an_opt_out():
    parser = build_parser()

    def verify(*flags: str) -> bool:
        return serve_config(parser.parse_args(["serve", "--ssd-cache", "/tmp/x", *flags])).ssd_cache_verify

    assert RuntimeConfig().ssd_cache_verify is True
    assert RuntimeConfig().ssd_layout == "blocks"  # the default layout is verified above
    assert serve_config(parser.parse_args(["serve", "--ssd-cache", "/tmp/x"])).ssd_layout == "blocks"
    assert verify() is True
    assert verify("--ssd-cache-verify") is True  # the old spelling still means on
    assert verify("--ssd-cache-verify", "on") is True
    assert verify("--ssd-cache-verify", "off") is False


async def test_a_flipped_generation_checkpoint_is_never_resumed(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    sampling = SamplingParams(max_tokens=300, logit_bias=NO_EOS)
    async with open_runtime(config) as rt:
        ckpt = rt.cold.checkpointer
        prompt = rt.encode("A checkpoint whose numbers rot on the disk. " * 3)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            full = await stream.tokens()  # the uninterrupted text (completion removes its checkpoint)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            async for event in stream:
                if isinstance(event, TokenGenerated) and ckpt.snapshot_stats()["entries"]:
                    break  # the client goes away: its last checkpoint stays
        await _settled(ckpt)
        (path,) = ckpt.directory.glob("*.mlxgen")
    _flip_tensor_bytes(path)

    async with open_runtime(config) as rt:
        ckpt = rt.cold.checkpointer
        assert ckpt.snapshot_stats()["entries"] == 1, "the header is intact: the scan indexes it"
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            tokens = await stream.tokens()
            assert stream.accepted.cache_tier != "checkpoint", "a damaged checkpoint was resumed"
        assert ckpt.stats["resumed"] == 0 and ckpt.stats["read_failures"] == 1
        assert tokens == full
        await _settled(ckpt)
        assert not path.exists()


async def _settled(ckpt) -> None:
    """Nothing queued, nothing on the checkpointer's thread, no live owner."""
    import trio

    def busy() -> bool:
        s = ckpt.snapshot_stats()
        return bool(s["pending"] or s["owned"] or s["writing"])

    with trio.fail_after(60):
        while busy():  # noqa: ASYNC110
            await trio.sleep(0.02)
