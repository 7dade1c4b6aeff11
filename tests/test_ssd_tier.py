"""The SSD tier inside a live server: restored state, damaged files, failing storage."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.kv import file_format, kinds

from serving import ServerThread, config_for, mount_tmpfs
from ssd_files import checkpoint_files

SYSTEM = "Answer like a librarian who loves prefix caches. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which shelf?"}]


def chat(server: ServerThread, **kw) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 6, **kw}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def flush(server: ServerThread) -> httpx.Response:
    return httpx.post(f"{server.base_url.removesuffix('/v1')}/admin/cache/flush", timeout=120)


def files(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.mlxkv"))


async def test_restored_tensors_equal_the_ram_entry(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", snapshot_min_tokens=16,
                           device_probe="off")
    async with open_runtime(config) as rt:
        prompt = await rt.render_chat(MESSAGES)
        async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=4))) as stream:
            await stream.tokens()
        report = await rt.flush()
        assert report["durable"] and report["entries"] >= 1
        ram = list(rt.cache_owner.cache.entries())
        assert ram
        for entry in ram:
            assert entry.durable, "every RAM checkpoint is durable after a flush"
            match = rt.cache_owner.tiers.ssd_find(entry.tokens, entry.namespace, limit=len(entry.tokens))
            assert tuple(match.record.tokens) == tuple(entry.tokens)
            restored = kinds.adopt(rt.cold.store.load(match.record, verify=True))
            assert len(restored) == len(entry.payload)
            for a, b in zip(entry.payload, restored, strict=True):
                assert a.offset == b.offset
                n = a.offset
                assert mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item()
                assert mx.array_equal(a.values[..., :n, :], b.values[..., :n, :]).item()


def _populate(model_dir: Path, cache: Path, **config) -> dict:
    with ServerThread(config_for(model_dir, ssd_cache_dir=cache, **config)) as server:
        first = chat(server)
        assert flush(server).status_code == 200
    assert checkpoint_files(cache)
    return first


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_header(cache: Path) -> list[Path]:
    victims = files(cache)
    for p in victims:
        _flip(p, 40)  # inside the hashed header
    return victims


def _damage_tensor(cache: Path) -> list[Path]:
    victims = files(cache)
    for p in victims:
        header = file_format.read_header(p)
        _, tensor = header.tensors()[0]
        _flip(p, tensor.offset + 3)
    return victims


def _truncate(cache: Path) -> list[Path]:
    victims = files(cache)
    for p in victims:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return victims


@pytest.mark.parametrize(
    ("damage", "verify"),
    [(_damage_header, False), (_damage_tensor, True), (_truncate, False)],
    ids=["header-byte", "tensor-byte-verified", "truncated"],
)
def test_damaged_files_degrade_to_a_miss(tiny_model_dir, tmp_path, damage, verify):
    """Whole files (damaged blocks and manifests: tests/test_block_store.py, tests/test_integrity_default.py)."""
    cache = tmp_path / "ssd"
    first = _populate(tiny_model_dir, cache, ssd_layout="whole")
    victims = damage(cache)
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=cache, ssd_cache_verify=verify,
                                 ssd_layout="whole")) as server:
        again = chat(server)
        # A damaged file is never served: the request is a full prefill with the
        # same result, the file is gone, and the server keeps serving and persisting.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert not any(p.exists() for p in victims)
        assert chat(server)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert flush(server).status_code == 200
        stats = httpx.get(f"{server.base_url.removesuffix('/v1')}/stats").json()["ssd_cache"]
        assert stats["entries"] >= 1


def test_tmp_orphans_reaped_and_foreign_dirs_untouched(tiny_model_dir, tmp_path):
    cache = tmp_path / "ssd"
    _populate(tiny_model_dir, cache)
    good = checkpoint_files(cache)  # (manifests, in the default layout: the orphan sits beside them)
    orphan = good[0].with_name("deadbeef.mlxkv.tmp")
    orphan.write_bytes(b"half a write")
    foreign = cache / "0123456789abcdef-foreign" / "ns"
    foreign.mkdir(parents=True)
    (foreign / "other.mlxkv").write_bytes(b"someone else's model")
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=cache)) as server:
        again = chat(server)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
    assert not orphan.exists()
    assert (foreign / "other.mlxkv").read_bytes() == b"someone else's model"
    assert all(p.exists() for p in good)




def test_flush_is_not_durable_when_storage_turns_read_only(tiny_model_dir, tmp_path):
    mnt = tmp_path / "mnt"
    mount_tmpfs(mnt, "size=32m,mode=0700")
    try:
        with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=mnt / "ssd")) as server:
            chat(server)
            assert flush(server).status_code == 200
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True, timeout=30)
            other = chat(server, messages=[{"role": "user", "content": "a brand new conversation " * 20}])
            assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= 1  # only <|im_start|> is shared
            r = flush(server)
            assert r.status_code == 503
            report = r.json()
            assert report["durable"] is False and report["failed"] >= 1 and report["reason"]
            # Serving goes on from RAM.
            again = chat(server, messages=[{"role": "user", "content": "a brand new conversation " * 20}])
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


async def test_idle_entries_demote_to_ssd_and_come_back(tiny_model_dir, tmp_path):
    import trio

    config = RuntimeConfig(
        model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", ssd_demote_idle_s=0.4, snapshot_min_tokens=16,
        device_probe="off",
    )
    async with open_runtime(config) as rt:
        prompt = await rt.render_chat(MESSAGES)
        sampling = SamplingParams(max_tokens=4, logprobs=True)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            first = [e.logprob async for e in stream if hasattr(e, "logprob")]
        assert (await rt.flush())["durable"]
        with trio.fail_after(60):  # idle demotion after 0.4 s; this only bounds a hang
            while len(rt.cache_owner.cache):  # noqa: ASYNC110 - polling an actor from a test
                await trio.sleep(0.1)
        stats = await rt.stats()
        assert stats.ssd.demotions >= 1
        assert stats.cache.tiers.ram.bytes == 0
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            again = [e.logprob async for e in stream if hasattr(e, "logprob")]
        assert stream.accepted.cache_tier == "ssd"
        assert stream.accepted.cached_tokens == len(prompt) - 1
        assert again == first


async def test_over_capacity_ram_spills_and_restores_without_loss(tiny_model_dir, tmp_path):
    """A RAM tier that holds about one conversation: the others live on SSD and come back."""
    config = RuntimeConfig(
        model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", prompt_cache_bytes=600_000,
        snapshot_min_tokens=16,
        # No startup probe: measured on a loaded machine it can make recompute the faster arm for
        # these short prompts, and this test checks that they are restored.
        device_probe="off",
    )
    async with open_runtime(config) as rt:
        prompts = [
            await rt.render_chat([{"role": "system", "content": f"Conversation {i}. " + SYSTEM},
                                  {"role": "user", "content": "Hello"}])
            for i in range(4)
        ]
        sampling = SamplingParams(max_tokens=4, logprobs=True)
        first = []
        for p in prompts:
            async with rt.submit(rt.request(p, sampling=sampling)) as stream:
                first.append([e.logprob async for e in stream if hasattr(e, "logprob")])
        assert (await rt.flush())["durable"]
        stats = await rt.stats()
        assert stats.cache.tiers.ram.bytes <= config.prompt_cache_bytes + 300_000
        assert stats.ssd.demotions >= 1
        assert stats.ssd.dropped_spills == 0
        # Every conversation comes back (from RAM or SSD) with the same logprobs.
        tiers = []
        for p, expected in zip(prompts, first, strict=True):
            async with rt.submit(rt.request(p, sampling=sampling)) as stream:
                again = [e.logprob async for e in stream if hasattr(e, "logprob")]
            assert stream.accepted.cached_tokens == len(p) - 1
            tiers.append(stream.accepted.cache_tier)
            assert again == expected
        assert "ssd" in tiers
