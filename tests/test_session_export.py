"""A session's KV exported from one server as a verified .mlxkv file and imported into another (issue 25)."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from mlxd.kv import file_format as ff

from serving import ServerThread, config_for

SYSTEM = "You are a terse assistant. Answer every question in one short sentence, naming colours. " * 3
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which colour is the sea at noon?"}]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """Server A (the source) and server B (a fresh one of the same model), both with an SSD tier."""
    root = tmp_path_factory.mktemp("export")
    a = config_for(tiny_model_dir, ssd_cache_dir=root / "a")
    b = config_for(tiny_model_dir, ssd_cache_dir=root / "b", max_body_bytes=256 * 1024)
    with ServerThread(a) as sa, ServerThread(b) as sb:
        yield sa, sb


def admin(server) -> str:
    return server.base_url.removesuffix("/v1") + "/admin/sessions"


def chat(server, session: str | None) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True}
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(reply: dict) -> list[tuple[str, float]]:
    return [(c["token"], c["logprob"]) for c in reply["choices"][0]["logprobs"]["content"]]


def cache_state(server) -> tuple[int, int, int]:
    stats = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()
    return stats["cache"]["ram"]["entries"], stats["cache"]["ram"]["bytes"], ssd_files(server)


def ssd_files(server) -> int:
    return len(list(Path(server.config.ssd_cache_dir).glob("*/*/*.mlxkv")))


def rewrite(data: bytes, tmp: Path, **meta) -> bytes:
    """The same tensors under another header (a valid file, hash and CRCs recomputed)."""
    src, out = tmp / "src.mlxkv", tmp / "out.mlxkv"
    src.write_bytes(data)
    loaded = ff.read_snapshot(src)
    import attrs

    plan = ff.SnapshotPlan(meta=attrs.evolve(loaded.header.meta, **meta), caches=loaded.header.caches,
                           buffers=tuple(memoryview(b).cast("B") for b in loaded.buffers))
    ff.write_snapshot(plan, out, direct=False)
    return out.read_bytes()


@pytest.fixture(scope="module")
def exported(servers) -> tuple[bytes, dict]:
    a, _ = servers
    chat(a, "s1")
    again = chat(a, "s1")  # served from A's cache: the reply B must reproduce from the imported KV
    r = httpx.get(f"{admin(a)}/s1/export", timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.content[:8] == ff.MAGIC and int(r.headers["content-length"]) == len(r.content)
    return r.content, again


def test_an_exported_session_imported_into_a_fresh_server_hits_with_identical_logprobs(servers, exported):
    _, b = servers
    data, on_a = exported
    r = httpx.post(f"{admin(b)}/s1/import", content=data, timeout=120)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["ram"] and done["ssd"] and done["tokens"] > 0
    reply = chat(b, "s1")
    usage = reply["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
    assert len(logprobs(reply)) == 4 and logprobs(reply) == logprobs(on_a)
    # The prefix is the cache's, not only the session's: an anonymous request hits it too.
    anon = chat(b, None)["usage"]
    assert anon["prompt_tokens_details"]["cached_tokens"] >= anon["prompt_tokens"] - 1


def test_a_corrupted_or_foreign_file_is_refused_and_the_cache_is_unchanged(servers, exported, tmp_path):
    _, b = servers
    data, _ = exported
    before = cache_state(b)
    damaged = bytearray(data)
    damaged[-100] ^= 0x01  # one bit of a tensor: its CRC-32 no longer matches
    r = httpx.post(f"{admin(b)}/corrupt/import", content=bytes(damaged), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_kv_file", r.text
    r = httpx.post(f"{admin(b)}/junk/import", content=b"not a cache file at all", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_kv_file", r.text
    foreign = rewrite(data, tmp_path, model_id="0" * 64)  # a valid file of another model
    r = httpx.post(f"{admin(b)}/foreign/import", content=foreign, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "kv_identity_mismatch", r.text
    assert cache_state(b) == before
    assert not list(Path(b.config.ssd_cache_dir, "transfers").iterdir()), "uploads are removed"
    assert httpx.get(f"{admin(b)}/nobody/export", timeout=30).status_code == 404


def test_an_oversized_upload_is_refused(servers):
    _, b = servers
    before = cache_state(b)
    info = b.runtime.info
    limit = 2 * info.max_context * info.kv_bytes_per_token + 16 * info.max_context + 256 * 1024
    # A declared length past the limit: refused before a byte of the body is read.
    url = urlsplit(admin(b))
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(f"POST {url.path}/big/import HTTP/1.1\r\nHost: x\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
        assert s.recv(64).startswith(b"HTTP/1.1 413")

    # No length given (chunked): refused once the bytes pass the limit.
    def chunks():
        for _ in range(limit // (1 << 20) + 2):
            yield b"\0" * (1 << 20)

    r = httpx.post(f"{admin(b)}/big/import", content=chunks(), timeout=120)
    assert r.status_code == 413, r.text
    assert cache_state(b) == before


def test_a_session_on_ssd_only_is_exported_after_a_restart_and_imported_into_a_ram_only_server(
    tiny_model_dir, tmp_path, exported
):
    _, on_a = exported
    ssd = tmp_path / "ssd"
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd)) as first:
        chat_body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                     "prompt_cache_retention": "24h"}  # a pinned session: it is known again after the restart
        r = httpx.post(first.base_url + "/chat/completions", json=chat_body, headers={"X-Session-Id": "p"},
                       timeout=120)
        assert r.status_code == 200, r.text
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd)) as second:
        stats = httpx.get(second.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["cache"]
        assert stats["ram"]["entries"] == 0 and stats["pins"]["restored"] == 1
        r = httpx.get(f"{admin(second)}/p/export", timeout=120)  # read from its SSD file
        assert r.status_code == 200, r.text
        data = r.content
    with ServerThread(config_for(tiny_model_dir)) as ram_only:
        r = httpx.post(f"{admin(ram_only)}/p/import", content=data, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["ram"] and not r.json()["ssd"]
        reply = chat(ram_only, "p")
        usage = reply["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
        assert [t for t, _ in logprobs(reply)] == [t for t, _ in logprobs(on_a)]
        assert [lp for _, lp in logprobs(reply)] == pytest.approx([lp for _, lp in logprobs(on_a)], abs=1e-4)


def test_an_adapters_session_moves_only_to_a_server_with_that_adapter(tiny_model_dir, tmp_path, servers):
    from mlxd.model.lora import build_adapter

    config = config_for(tiny_model_dir, adapters=(("one", str(build_adapter(tiny_model_dir, tmp_path / "one",
                                                                            seed=1, rank=4))),))
    body = {"model": "one", "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True}

    def adapted(server) -> dict:
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers={"X-Session-Id": "ad"},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ServerThread(config) as source:
        adapted(source)
        on_source = adapted(source)
        assert httpx.get(f"{admin(source)}/ad/export", timeout=60).status_code == 404  # not in the base namespace
        assert httpx.get(f"{admin(source)}/ad/export?model=nope", timeout=60).status_code == 404
        r = httpx.get(f"{admin(source)}/ad/export?model=one", timeout=120)
        assert r.status_code == 200, r.text
        data = r.content
    _, without_adapter = servers
    r = httpx.post(f"{admin(without_adapter)}/ad/import", content=data, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "kv_identity_mismatch", r.text
    with ServerThread(config) as target:
        assert httpx.post(f"{admin(target)}/ad/import", content=data, timeout=120).status_code == 200
        reply = adapted(target)
        usage = reply["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1
        assert logprobs(reply) == logprobs(on_source)


def test_a_crashed_transfers_leftovers_are_removed_at_first_use(tmp_path):
    import os
    import time
    from types import SimpleNamespace

    from mlxd.runtime import session_files

    transfers = tmp_path / "transfers"
    transfers.mkdir()
    old, recent = transfers / "a.upload", transfers / "b.upload"
    old.write_bytes(b"x")
    recent.write_bytes(b"y")  # maybe another replica's transfer in flight: kept
    os.utime(old, (time.time() - 2 * session_files.STALE_TRANSFER_S,) * 2)
    assert session_files.transfer_dir(SimpleNamespace(root=tmp_path)) == transfers
    assert not old.exists() and recent.exists()
