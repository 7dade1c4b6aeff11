"""Restored bytes read straight into MLX arrays (`read_snapshot(land=kinds.landing)`): no copy, same tensors."""

from __future__ import annotations

import time

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxd.kv import file_format, kinds

from serving import ServerThread, config_for


def snapshot(tmp_path, dtype) -> tuple:
    caches = []
    for layer in range(3):
        c = KVCache()
        k = mx.random.normal((1, 2, 37, 8), key=mx.random.key(layer)).astype(dtype)
        c.update_and_fetch(k, -k)
        caches.append(c)
    meta = file_format.SnapshotMeta(model_id="m", config_fingerprint="f", namespace="", tokenizer_hash="t",
                                    tokens=range(37))
    path = tmp_path / f"s{file_format.EXTENSION}"
    file_format.write_snapshot(kinds.plan_snapshot(caches, meta=meta), path, direct=False)
    return caches, path


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_landed_tensors_are_the_files_and_adopt_takes_them_without_a_copy(tmp_path, dtype):
    caches, path = snapshot(tmp_path, dtype)
    for verify in (False, True):
        loaded = file_format.read_snapshot(path, verify=verify, land=kinds.landing)
        assert loaded.landed is not None and len(loaded.landed) == 6
        landed_at = {device_addr(a) for a in loaded.landed}
        seen: list[memoryview] = []
        adopted = kinds.adopt(loaded, landed=seen.extend)
        assert {device_addr_of_view(v) for v in seen} == landed_at  # the arrays read into are the cache's own
        host = kinds.adopt(file_format.read_snapshot(path, verify=verify))  # the host-buffer path, for comparison
        for a, h, c in zip(adopted, host, caches, strict=True):
            assert a.keys.dtype == dtype and a.offset == c.offset == 37
            assert mx.array_equal(a.keys, h.keys) and mx.array_equal(a.values, h.values)
            assert mx.array_equal(a.keys, c.keys[..., :37, :]) and mx.array_equal(a.values, c.values[..., :37, :])


def test_a_read_reports_the_seconds_its_landing_and_its_checks_took(tmp_path):
    """`LoadedSnapshot.land_s` / `verify_s` (recorded per SSD hit, `parts` of a trace line): a landing that takes
    50 ms shows as such, and the CRC checks take time only when they run."""
    _, path = snapshot(tmp_path, mx.float32)

    def slow_landing(header):
        time.sleep(0.05)
        return kinds.landing(header)

    for verify in (False, True):
        loaded = file_format.read_snapshot(path, verify=verify, land=slow_landing)
        assert 0.05 <= loaded.land_s <= loaded.seconds
        assert (loaded.verify_s > 0) == verify and loaded.land_s + loaded.verify_s <= loaded.seconds
        host = file_format.read_snapshot(path, verify=verify)  # into a host buffer: no landing
        assert host.land_s == 0 and (host.verify_s > 0) == verify and host.verify_s <= host.seconds


def device_addr(a: mx.array) -> int:
    return np.asarray(memoryview(a)).ctypes.data


def device_addr_of_view(v: memoryview) -> int:
    return np.frombuffer(v.cast("B"), dtype=np.uint8).ctypes.data


def test_a_landed_read_checks_every_tensor_and_the_padding(tmp_path):
    _, path = snapshot(tmp_path, mx.float32)
    header = file_format.read_header(path)
    (_, first), (_, second) = list(header.tensors())[:2]
    for where in (first.offset + 5, first.offset + first.nbytes + 1 if second.offset > first.offset + first.nbytes
                  else header.file_size - 1):
        bad = tmp_path / f"bad{where}{file_format.EXTENSION}"
        data = bytearray(path.read_bytes())
        data[where] ^= 0x40
        bad.write_bytes(bytes(data))
        with pytest.raises(file_format.CorruptFile):
            file_format.read_snapshot(bad, verify=True, land=kinds.landing)
    # A landing that does not fit the file is refused before any byte is read into it.
    with pytest.raises(ValueError, match="landing"):
        file_format.read_snapshot(path, verify=False, land=lambda h: file_format.Landing((memoryview(bytearray(4)),), None))
    with pytest.raises(ValueError, match="writable"):
        file_format.read_snapshot(path, verify=False, land=lambda h: file_format.Landing(
            tuple(memoryview(bytes(t.nbytes)) for _, t in h.tensors()), None))


def chat(base: str, messages: list[dict]) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, "logprobs": True}
    r = httpx.post(base + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_server_restores_into_mlx_memory_with_the_same_tokens(tiny_model_dir, tmp_path):
    ssd = tmp_path / "ssd"
    convo = [{"role": "system", "content": "You answer briefly and exactly. " * 12},
             {"role": "user", "content": "Name three colours."}]
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd)) as first:
        warm = chat(first.base_url, convo)
        warm = chat(first.base_url, convo)  # the RAM tier's answer
        assert httpx.post(first.base_url.removesuffix("/v1") + "/admin/cache/flush", timeout=120).json()["durable"]
    answers = {}
    for landing in ("mlx", "host"):
        with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd, restore_landing=landing)) as server:
            again = chat(server.base_url, convo)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - 1
            stats = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()
            assert stats["ssd_cache"]["restores"] == 1
            assert stats["ssd_cache"]["prefetch"]["reads_into_mlx"] == (1 if landing == "mlx" else 0)
            answers[landing] = again
    for again in answers.values():
        assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]
        got = [c["logprob"] for c in again["choices"][0]["logprobs"]["content"]]
        want = [c["logprob"] for c in warm["choices"][0]["logprobs"]["content"]]
        assert got == pytest.approx(want, abs=1e-4)


async def test_the_prefetcher_reads_the_host_way_when_no_mlx_memory_can_be_had(tmp_path):
    """A landing that fails (no memory, shutting down) is not the file's fault: read to the host instead."""
    import trio

    from mlxd.actors.prefetcher import PrefetcherActor
    from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity, compute_fingerprint
    from mlxd.runtime.kernel.channels import Reply
    from mlxd.runtime.kernel.messages import FetchSnapshot, PrefetchSnapshot, PrefetchStats

    identity = StoreIdentity(model_id="m", fingerprint=compute_fingerprint({"c": "landing"}), tokenizer_hash="t")
    store = SsdStore(tmp_path, identity)
    (tmp_path / "x").mkdir()
    caches, _ = snapshot(tmp_path / "x", mx.float32)
    written = store.write(kinds.plan_snapshot(caches, meta=identity.meta(list(range(37)), "")))
    assert isinstance(written, Stored)
    calls = []

    async def no_memory(header):
        calls.append(header)
        raise MemoryError("no room for the landing")

    inbox_send, inbox = trio.open_memory_channel(8)
    cache_send, cache_inbox = trio.open_memory_channel(8)
    actor = PrefetcherActor(store, inbox=inbox, cache=cache_send, verify=True, land=no_memory)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        reply: Reply = Reply()
        await inbox_send.send(FetchSnapshot(written.record, reply))
        loaded = await reply.wait()
        stats: Reply[PrefetchSnapshot] = Reply()
        await inbox_send.send(PrefetchStats(stats))
        counts = await stats.wait()
        nursery.cancel_scope.cancel()
    assert len(calls) == 1 and loaded is not None and loaded.landed is None
    assert counts.reads == 1 and counts.read_failures == 0 and counts.reads_into_mlx == 0
    with pytest.raises(trio.EndOfChannel):  # closed by the actor with nothing in it
        cache_inbox.receive_nowait()  # no RecordLost: the record stays indexed
    for a, c in zip(kinds.adopt(loaded), caches, strict=True):
        assert mx.array_equal(a.keys, c.keys[..., :37, :])
