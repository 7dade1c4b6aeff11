"""MLXD_PLAN_PACK_MB (kinds.plan_snapshot `pack_max_bytes`, issue 28): a small checkpoint's write plan made from
one packed copy of its tensors writes the same file as the plan made from the caches' own arrays, for every cache
kind; bigger plans and single tensors are planned as before; served, a packed checkpoint restores after a restart."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

import mlxd  # noqa: F401  (before mlx: OpenBLAS preload)
from mlxd.engine.features import plan_pack_bytes
from mlxd.kv import file_format as ff
from mlxd.kv import kinds

from procs import ServeProcess

META = dict(model_id="tiny", config_fingerprint="fp", namespace="", tokenizer_hash="tok")


def every_kind() -> list:
    """One cache of each kind kinds plans, bfloat16 among them; the KV caches with capacity past their offset,
    so the unpacked plan's tensors are strided views."""
    kv = mlc.KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, 300, 8)).astype(mx.bfloat16),
                        mx.random.normal((1, 2, 300, 8)).astype(mx.bfloat16))
    kv.update_and_fetch(mx.random.normal((1, 2, 1, 8)).astype(mx.bfloat16),
                        mx.random.normal((1, 2, 1, 8)).astype(mx.bfloat16))
    rotating = mlc.RotatingKVCache(max_size=16, keep=4)
    for n in (10, *[1] * 9):  # past max_size: a wrapped ring
        rotating.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    quant = mlc.QuantizedKVCache(group_size=32, bits=4)
    quant.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
    arrays = mlc.ArraysCache(3)
    arrays[0] = mx.random.normal((1, 3, 5)).astype(mx.float16)
    arrays[2] = mx.arange(6, dtype=mx.int32).reshape(2, 3)
    nested = mlc.CacheList(mlc.KVCache(), mlc.ArraysCache(1))
    nested.caches[0].update_and_fetch(mx.random.normal((1, 2, 7, 8)), mx.random.normal((1, 2, 7, 8)))
    caches = [kv, rotating, quant, arrays, nested]
    mx.eval([c.state for c in caches if not isinstance(c, mlc.CacheList)])
    return caches


def test_a_packed_plan_writes_the_same_file_for_every_cache_kind(tmp_path):
    caches = every_kind()
    meta = ff.SnapshotMeta(**META, tokens=tuple(range(301)))
    plain = kinds.plan_snapshot(caches, meta=meta)
    packed = kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=1 << 30)
    assert packed.packed and not plain.packed and len(packed.buffers) == len(plain.buffers) > 10
    for got, want in zip(packed.buffers, plain.buffers, strict=True):
        assert np.asarray(got).dtype == np.asarray(want).dtype and (got.shape, got.nbytes) == (want.shape, want.nbytes)
        assert got.c_contiguous
    # one packed allocation behind every buffer, in file order, back to back
    starts = [np.asarray(b).ctypes.data for b in packed.buffers]
    assert starts == sorted(starts) and starts[-1] + packed.buffers[-1].nbytes - starts[0] == packed.nbytes
    a = ff.write_snapshot(plain, tmp_path / "plain.mlxkv")
    b = ff.write_snapshot(packed, tmp_path / "packed.mlxkv")
    assert (tmp_path / "plain.mlxkv").read_bytes() == (tmp_path / "packed.mlxkv").read_bytes()
    assert a.nbytes == b.nbytes
    # the caches' own arrays are untouched by packing: they keep decoding in place
    k = mx.ones((1, 2, 1, 8), dtype=mx.bfloat16)
    before = np.array(caches[0].keys[..., :301, :].astype(mx.float32))
    caches[0].update_and_fetch(k, k)
    assert np.array_equal(np.array(caches[0].keys[..., :301, :].astype(mx.float32)), before)
    restored = kinds.adopt(ff.read_snapshot(tmp_path / "packed.mlxkv"))
    assert bool(mx.array_equal(restored[0].keys, caches[0].keys[..., :301, :]).item())
    # tensors of one dtype (the usual KV plan) take the single-copy path: the same file too
    kv_only = [caches[0], every_kind()[0]]
    meta2 = ff.SnapshotMeta(**META, tokens=tuple(range(302)))
    ff.write_snapshot(kinds.plan_snapshot(kv_only, meta=meta2), tmp_path / "kv.mlxkv")
    one_dtype = kinds.plan_snapshot(kv_only, meta=meta2, pack_max_bytes=1 << 30)
    assert one_dtype.packed and len({np.asarray(b).dtype for b in one_dtype.buffers}) == 1
    ff.write_snapshot(one_dtype, tmp_path / "kv-packed.mlxkv")
    assert (tmp_path / "kv.mlxkv").read_bytes() == (tmp_path / "kv-packed.mlxkv").read_bytes()


def test_plans_past_the_limit_and_single_tensors_are_not_packed():
    caches = every_kind()
    meta = ff.SnapshotMeta(**META, tokens=tuple(range(301)))
    whole = kinds.plan_snapshot(caches, meta=meta).nbytes
    assert kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=whole).packed
    assert not kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=whole - 1).packed
    assert not kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=0).packed
    one = mlc.ArraysCache(1)
    one[0] = mx.ones((1, 4))
    assert not kinds.plan_snapshot([one], meta=meta, pack_max_bytes=1 << 30).packed


def test_the_setting_reads_megabytes_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("MLXD_PLAN_PACK_MB", raising=False)
    assert plan_pack_bytes() == 0
    monkeypatch.setenv("MLXD_PLAN_PACK_MB", "64")
    assert plan_pack_bytes() == 64 << 20
    monkeypatch.setenv("MLXD_PLAN_PACK_MB", "0.5")
    assert plan_pack_bytes() == 1 << 19
    for bad in ("lots", "-1", "nan", "inf"):
        monkeypatch.setenv("MLXD_PLAN_PACK_MB", bad)
        with pytest.raises(ValueError, match="MLXD_PLAN_PACK_MB"):
            plan_pack_bytes()


def test_served_packed_checkpoints_restore_after_a_restart(tmp_path, tiny_model_dir):
    """A server with MLXD_PLAN_PACK_MB writes its checkpoints from packed copies (/stats counts them); a server
    without it, started on the same directory, restores that conversation from the files and answers as the
    first one did (greedy)."""
    ssd = tmp_path / "ssd"
    args = ("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(ssd), "--prompt-cache-gb", "1")
    messages = [{"role": "user", "content": "tell me about caches, at some length please " * 4}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    with ServeProcess(*args, log_path=tmp_path / "a.log", env={"MLXD_PLAN_PACK_MB": "64"}) as proc, \
            proc.client() as http:
        first = http.post("/v1/chat/completions", json=body).json()
        assert http.post("/admin/cache/flush").json()["durable"] is True
        engine = http.get("/stats").json()["engine"]
        assert engine["packed_plans"] >= 1, engine
    with ServeProcess(*args, log_path=tmp_path / "b.log") as proc, proc.client() as http:
        again = http.post("/v1/chat/completions", json=body).json()
        assert "packed_plans" not in http.get("/stats").json()["engine"]  # off: absent
    prompt = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt - 1  # restored from the files
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_a_bad_setting_stops_the_server_at_start(tmp_path, tiny_model_dir):
    proc = ServeProcess("--model", str(tiny_model_dir), "--ssd-cache", str(tmp_path / "ssd"),
                        log_path=tmp_path / "bad.log", env={"MLXD_PLAN_PACK_MB": "lots"})
    with pytest.raises(RuntimeError, match="MLXD_PLAN_PACK_MB"):
        proc.start(timeout=120)


def test_packing_keeps_each_tensor_s_dtype_shape_and_bytes_scalars_too():
    arrays = [mx.array(3, dtype=mx.int32), mx.arange(6, dtype=mx.float16).reshape(2, 3),
              mx.array([7, 8], dtype=mx.uint32)]
    mx.eval(arrays)
    views = [np.asarray(b) for b in kinds.packed_buffers(arrays)]
    for got, want in zip(views, arrays, strict=True):
        assert got.dtype == np.dtype(str(want.dtype).rsplit(".", 1)[-1]) and got.shape == tuple(want.shape)
        assert np.array_equal(got, np.array(want))
