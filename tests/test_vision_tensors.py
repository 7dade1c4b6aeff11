"""Encoder outputs are SSD records like checkpoints: flushed, capped, scanned, verified, in /stats."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from mlxd.kv.media import ENCODER_NAMESPACE, encoder_key
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity
from mlxd.kv.tiers import CacheTiers, SsdRecord, Unlink
from mlxd.vision.encoder import encoder_identity
from mlxd.vision.tensor_store import TensorPlan, find_tensor, read_tensor

from serving import ServerThread, config_for


def png(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(server: ServerThread, system: str, seed: int) -> dict:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(seed)}},
                                             {"type": "text", "text": "What is this?"}]}]
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def root_of(server: ServerThread) -> str:
    return server.base_url.removesuffix("/v1")


def flush(server: ServerThread) -> dict:
    r = httpx.post(root_of(server) + "/admin/cache/flush", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stats(server: ServerThread) -> dict:
    return httpx.get(root_of(server) + "/stats", timeout=30).json()


def tensor_files(ssd: Path) -> list[Path]:
    return sorted((ssd / "tensors").glob("*/*/*.mlxt"))


def test_flush_scan_bit_flip_and_stats(vlm_model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    config = config_for(vlm_model_dir, ssd_cache_dir=ssd)
    identity = encoder_identity(vlm_model_dir)
    with ServerThread(config) as a:
        first = ask(a, "You look at pictures.", 1)
        report = flush(a)  # the encoder output is written before the flush answers
        assert report["durable"] and report["encoder_outputs"] == 1
        [path] = tensor_files(ssd)
        digest = path.parent.name
        saved = read_tensor(path, digest=digest, identity=identity)
        assert saved is not None and saved.dtype == np.float32
        assert report["encoder_output_bytes"] == saved.nbytes
        s = stats(a)
        assert s["ssd_cache"]["encoder_outputs"] == {"entries": 1, "bytes": saved.nbytes}
        assert s["cache"]["ssd"]["encoder_outputs"] == {"entries": 1, "bytes": saved.nbytes}
    # Between runs: an interrupted write's temporary file and a stray file in the identity's directory.
    orphan = path.parent / f".{path.name}.tmp-1-2"
    orphan.write_bytes(b"half")
    stray = ssd / "tensors" / identity / "stray.mlxt"
    stray.write_bytes(b"not a tensor")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # one flipped bit in the tensor bytes (the header still reads)
    path.write_bytes(bytes(raw))
    with ServerThread(config) as b:
        s = stats(b)  # the startup scan indexed it (header only) and reaped the rest
        assert s["ssd_cache"]["encoder_outputs"]["entries"] == 1
        assert not orphan.exists() and not stray.exists()
        # The same conversation: its KV prefix is restored and covers the image (no tower at all).
        again = ask(b, "You look at pictures.", 1)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        # Another conversation with the image: the damaged file is read, fails its CRC, and is a re-encode.
        other = ask(b, "Something else entirely.", 1)
        engine = stats(b)["engine"]
        assert engine["media_encoded"] == 1 and engine["media_encoder_ssd_hits"] == 0
        assert flush(b)["durable"]
        [rewritten] = tensor_files(ssd)
        assert rewritten != path and not path.exists()
        assert np.array_equal(read_tensor(rewritten, digest=digest, identity=identity), saved)  # identical output
        assert stats(b)["ssd_cache"]["encoder_outputs"]["entries"] == 1  # the damaged record was replaced
    with ServerThread(config) as c:  # and that copy serves the next start, verified
        assert ask(c, "Something else entirely.", 1)["choices"] == other["choices"]
        engine = stats(c)["engine"]
        assert engine["media_encoded"] == 0 and engine["media_encoder_ssd_hits"] == 0  # KV restored: no tower
        ask(c, "A third conversation.", 1)
        engine = stats(c)["engine"]
        assert engine["media_encoded"] == 0 and engine["media_encoder_ssd_hits"] == 1


def _plan(digest: str, seed: int) -> TensorPlan:
    rng = np.random.default_rng(seed)
    return TensorPlan(digest, "enc", rng.standard_normal((16, 64)).astype(np.float32))  # 4 KiB


def test_the_ssd_cap_counts_encoder_outputs_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = SsdStore(tmp_path, StoreIdentity("m", "f" * 32, "t"), encoder_identity="enc")
    size = _plan("x", 0).nbytes
    kv = SsdRecord("", tuple(range(40)), 2 * size, 1.0)  # a KV checkpoint's record (simulated)
    tiers = CacheTiers(PromptCache(max_bytes=1 << 20), ssd=True, ssd_max_bytes=kv.nbytes + 3 * size)
    tiers.durable(kv)

    def write(digest: str, seed: int) -> list[Unlink]:
        outcome = store.write(_plan(digest, seed))
        assert isinstance(outcome, Stored)
        effects = [e for e in tiers.durable(outcome.record) if isinstance(e, Unlink)]
        for e in effects:  # the cache owner's part: delete on the store
            store.unlink(e.record, e.garbage)
        return effects

    for i, digest in enumerate("abc"):
        assert write(digest, i) == []
    assert tiers.stats().ssd_bytes == kv.nbytes + 3 * size
    tiers.touch_ssd(encoder_key("a"), ENCODER_NAMESPACE)  # "a" reused: "b" is now the least recent image
    tiers.touch_ssd(tuple(range(40)), "")  # and the checkpoint too
    gone = write("d", 3)
    assert [e.record.namespace for e in gone] == [ENCODER_NAMESPACE]
    root = store.tensors_dir
    assert find_tensor(root, "enc", "b") is None and not (root / "enc" / "b").exists()  # evicted: a re-encode
    for digest, seed in (("a", 0), ("c", 2), ("d", 3)):
        assert np.array_equal(find_tensor(root, "enc", digest), _plan(digest, seed).array)
    # A restart's scan indexes the three files; the cap holds them and a smaller one evicts the oldest.
    store.close()
    again = SsdStore(tmp_path, StoreIdentity("m", "f" * 32, "t"), encoder_identity="enc")
    scan = again.scan()
    assert sorted(r.tokens for r in scan.records) == sorted(encoder_key(d) for d in "acd")
    smaller = CacheTiers(PromptCache(max_bytes=1 << 20), ssd=True, ssd_max_bytes=2 * size)
    evicted = [e for e in smaller.load_records(scan.records) if isinstance(e, Unlink)]
    assert len(evicted) == 1 and smaller.stats().ssd_bytes == 2 * size
    # Another identity's files (another model) are never indexed.
    other = SsdStore(tmp_path, StoreIdentity("m2", "e" * 32, "t"), encoder_identity="another")
    assert other.scan().records == ()
    again.close()
    other.close()
