"""The .mlxkv format: round trips of every cache kind, corruption, restored logits."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlc
from mlx_lm.models import qwen3

import mlxd  # noqa: F401  (before mlx: OpenBLAS preload)
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.file_format import write as ffw

from models import tiny_qwen3 as _tiny_qwen3

META = dict(model_id="tiny", config_fingerprint="fp", namespace="", tokenizer_hash="tok")


def meta(tokens=(1, 2, 3), **kw) -> ff.SnapshotMeta:
    return ff.SnapshotMeta(**{**META, **kw}, tokens=tokens)


def filled_kv(n: int, dtype=mx.float32, heads: int = 2, dim: int = 8) -> mlc.KVCache:
    c = mlc.KVCache()
    k = mx.random.normal((1, heads, n, dim)).astype(dtype)
    v = mx.random.normal((1, heads, n, dim)).astype(dtype)
    c.update_and_fetch(k, v)
    mx.eval(c.keys, c.values)
    return c


def round_trip(tmp_path: Path, caches, *, verify=True, tokens=(1, 2, 3)):
    plan = kinds.plan_snapshot(caches, meta=meta(tokens))
    written = ff.write_snapshot(plan, tmp_path / "a.mlxkv")
    loaded = ff.read_snapshot(written.path, verify=verify)
    return written, kinds.adopt(loaded)


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_kv_round_trip_keeps_bytes_and_offset_without_slack(tmp_path, dtype):
    c = filled_kv(300, dtype)  # capacity 512 in the original
    written, (r,) = round_trip(tmp_path, [c])
    assert r.offset == 300 and r.keys.dtype == dtype
    # Exactly `offset` tokens come back: serving merges restored caches into its
    # batch arrays (a copy anyway), so capacity slack would only waste memory.
    assert r.keys.shape[2] == 300
    assert same(r.keys, c.keys[..., :300, :])
    assert same(r.values, c.values[..., :300, :])
    # only `offset` tokens are stored, at page-aligned offsets
    tensors = [t for _, t in written.header.tensors()]
    assert [t.shape for t in tensors] == [(1, 2, 300, 8)] * 2
    assert all(t.offset % ff.PAGE == 0 for t in tensors)
    assert (
        written.nbytes == os.path.getsize(written.path) == tensors[-1].offset + tensors[-1].nbytes
    )


def test_restored_kv_keeps_decoding_in_place(tmp_path):
    c = filled_kv(256)
    _, (r,) = round_trip(tmp_path, [c])
    assert r.offset == 256 and r.keys.shape[2] == 256
    k, v = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
    a, b = c.update_and_fetch(k, v), r.update_and_fetch(k, v)  # the restored one grows a step
    assert same(a[0], b[0]) and same(a[1], b[1]) and r.offset == 257


def test_rotating_round_trip_keeps_ring_state(tmp_path):
    c = mlc.RotatingKVCache(max_size=16, keep=4)
    c.update_and_fetch(mx.random.normal((1, 2, 10, 8)), mx.random.normal((1, 2, 10, 8)))
    for _ in range(13):  # decode past max_size: the ring wraps
        c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    mx.eval(c.keys, c.values)
    written, (r,) = round_trip(tmp_path, [c])
    assert (r.offset, r._idx, r.keep, r.max_size) == (c.offset, c._idx, c.keep, c.max_size)
    assert same(r.keys, c.keys) and same(r.values, c.values)
    assert not written.header.trimmable  # offset >= max_size
    # the next decode step gives the same attention inputs
    k, v = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
    a, b = c.update_and_fetch(k, v), r.update_and_fetch(k, v)
    assert same(a[0], b[0]) and same(a[1], b[1])


def test_rotating_before_wrap_is_sliced_and_trimmable(tmp_path):
    c = mlc.RotatingKVCache(max_size=64)
    c.update_and_fetch(mx.random.normal((1, 2, 5, 8)), mx.random.normal((1, 2, 5, 8)))
    c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    written, (r,) = round_trip(tmp_path, [c])
    assert written.header.trimmable and r.offset == 6 and r._idx == c._idx
    assert same(r.keys, c.keys[..., :6, :])


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_round_trip(tmp_path, bits):
    c = mlc.QuantizedKVCache(group_size=32, bits=bits)
    c.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
    mx.eval(c.keys, c.values)
    written, (r,) = round_trip(tmp_path, [c])
    assert (r.offset, r.bits, r.group_size) == (40, bits, 32)
    assert written.header.caches[0].signature == f"quant:{bits}:32"
    for got, want in zip([*r.keys, *r.values], [*c.keys, *c.values], strict=True):
        assert got.shape[2] == 40  # exactly `offset` tokens, no slack
        assert same(got[..., :40, :], want[..., :40, :])


def test_arrays_and_cache_list_round_trip(tmp_path):
    a = mlc.ArraysCache(3)
    a[0] = mx.random.normal((1, 3, 5)).astype(mx.bfloat16)
    a[2] = mx.arange(6, dtype=mx.int32).reshape(2, 3)
    nested = mlc.CacheList(filled_kv(7), mlc.ArraysCache(1))
    written, (ra, rl) = round_trip(tmp_path, [a, nested])
    assert ra.cache[1] is None and same(ra.cache[0], a[0]) and same(ra.cache[2], a[2])
    assert isinstance(rl, mlc.CacheList) and rl.caches[0].offset == 7
    assert same(rl.caches[0].keys[..., :7, :], nested.caches[0].keys[..., :7, :])
    assert rl.caches[1].cache == [None]
    assert written.header.signature == ["arrays:3", "list(kv,arrays:1)"]
    assert not written.header.trimmable


def test_empty_caches_round_trip(tmp_path):
    _, (kv, q) = round_trip(tmp_path, [mlc.KVCache(), mlc.QuantizedKVCache()])
    assert kv.keys is None and kv.offset == 0 and q.keys is None


def test_a_tmp_file_of_another_writer_is_left_alone(tmp_path):
    """Two processes writing the same name: the one that finds the tmp taken fails, and
    leaves the other's tmp in place (removing it broke the other's rename)."""
    theirs = tmp_path / "a.mlxkv.tmp"
    theirs.write_bytes(b"another writer, mid-write")
    plan = kinds.plan_snapshot([filled_kv(4)], meta=meta((1, 2, 3, 4)))
    with pytest.raises(ff.StorageError) as info:
        ff.write_snapshot(plan, tmp_path / "a.mlxkv")
    assert info.value.errno == errno.EEXIST
    assert theirs.read_bytes() == b"another writer, mid-write"
    assert not (tmp_path / "a.mlxkv").exists()


def test_unknown_cache_class_is_an_error(tmp_path):
    with pytest.raises(ff.UnsupportedCache):
        kinds.plan_snapshot([mlc.ChunkedKVCache(16)], meta=meta())
    with pytest.raises(ff.UnsupportedCache):
        kinds.plan_snapshot([object()], meta=meta())


def test_writer_is_unaffected_by_later_in_place_decode(tmp_path):
    """The plan holds new array objects: the cache may trim and decode before the write."""
    c = filled_kv(10)
    want = np.array(c.keys[..., :10, :])
    plan = kinds.plan_snapshot([c], meta=meta())
    c.trim(3)
    c.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))  # overwrites slot 7
    mx.eval(c.keys)
    loaded = ff.read_snapshot(ff.write_snapshot(plan, tmp_path / "a.mlxkv").path, verify=True)
    assert np.array_equal(loaded.buffers[0][..., :10, :], want)


def test_header_carries_identity_and_tokens(tmp_path):
    plan = kinds.plan_snapshot([filled_kv(3)], meta=meta((5, 6, 7), namespace="lora-a"))
    written = ff.write_snapshot(plan, tmp_path / "a.mlxkv")
    h = ff.read_header(written.path)
    assert h.tokens == (5, 6, 7) and h.namespace == "lora-a"
    assert (h.meta.model_id, h.meta.config_fingerprint, h.meta.tokenizer_hash) == (
        "tiny",
        "fp",
        "tok",
    )
    assert h.digest == written.digest and h.format_version == ff.FORMAT_VERSION
    assert not (tmp_path / "a.mlxkv.tmp").exists()
    assert oct(os.stat(written.path).st_mode & 0o777) == "0o600"


def tiny_qwen3() -> qwen3.Model:
    return _tiny_qwen3()


def test_restored_cache_gives_identical_next_token_logits(tmp_path):
    model = tiny_qwen3()
    prompt = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    cache = mlc.make_prompt_cache(model)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    _, restored = round_trip(tmp_path, cache, tokens=prompt[0].tolist())
    nxt = mx.array([[46]])
    want = model(nxt, cache=cache)
    got = model(nxt, cache=restored)
    mx.eval(want, got)
    assert restored[0].offset == cache[0].offset == 11
    assert np.array_equal(np.array(want), np.array(got))
    # and a second step, now that both decoded in place
    want, got = model(mx.array([[7]]), cache=cache), model(mx.array([[7]]), cache=restored)
    assert np.array_equal(np.array(want), np.array(got))


# ----------------------------------------------------------- corruption


def small_file(tmp_path: Path) -> Path:
    plan = kinds.plan_snapshot([filled_kv(5), filled_kv(3, mx.bfloat16)], meta=meta())
    return ff.write_snapshot(plan, tmp_path / "a.mlxkv").path


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupt_header_byte_is_always_detected(tmp_path):
    path = small_file(tmp_path)
    flip(path, 100)  # inside the JSON header
    with pytest.raises(ff.CorruptFile):
        ff.read_header(path)
    with pytest.raises(ff.CorruptFile):
        ff.read_snapshot(path, verify=False)


def test_corrupt_tensor_byte_is_detected_only_with_verify(tmp_path):
    path = small_file(tmp_path)
    first = ff.read_header(path).tensors()[0][1]
    flip(path, first.offset + 3)
    ff.read_header(path)
    ff.read_snapshot(path, verify=False)  # not checked: fast path
    with pytest.raises(ff.CorruptFile, match="CRC-32"):
        ff.read_snapshot(path, verify=True)


def test_truncated_and_extended_files_are_corrupt(tmp_path):
    path = small_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ff.CorruptFile):
        ff.read_header(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(ff.CorruptFile):
        ff.read_header(path)
    path.write_bytes(data[:30])
    with pytest.raises(ff.CorruptFile):
        ff.read_header(path)


def test_other_version_is_unsupported(tmp_path):
    path = small_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[8] = 99  # little-endian format version right after the magic
    path.write_bytes(bytes(data))
    with pytest.raises(ff.UnsupportedVersion):
        ff.read_header(path)


_PRISTINE: dict[str, object] = {}


def pristine() -> tuple[bytes, list[np.ndarray]]:
    """One small file's bytes and its tensors, built once for the property test."""
    if not _PRISTINE:
        with tempfile.TemporaryDirectory() as d:
            path = small_file(Path(d))
            _PRISTINE["data"] = path.read_bytes()
            _PRISTINE["buffers"] = list(ff.read_snapshot(path, verify=True).buffers)
    return _PRISTINE["data"], _PRISTINE["buffers"]  # type: ignore[return-value]


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 5000), st.integers(0, 255)),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_files_never_crash_the_reader(tmp_path, mutations):
    data, buffers = pristine()
    bad = bytearray(data)
    for op, a, b in mutations:
        if op == "flip" and bad:
            bad[a % len(bad)] ^= b
        elif op == "truncate":
            del bad[a % (len(bad) + 1) :]
        elif op == "extend":
            bad += bytes([b]) * a
    path = tmp_path / "m.mlxkv"
    path.write_bytes(bytes(bad))
    try:
        ff.read_header(path)
        loaded = ff.read_snapshot(path, verify=True)
    except ff.CorruptFile:
        return
    # verify=True accepted it: then every byte was as written
    assert bytes(bad) == data
    assert all(np.array_equal(x, y) for x, y in zip(loaded.buffers, buffers, strict=True))


# ------------------------------------------------------------- failures


_EFBIG_SCRIPT = """
import resource, sys
import mlxd, mlx.core as mx
from mlx_lm.models import cache as mlc
from mlxd.kv import file_format as ff, kinds
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # SIGXFSZ is ignored by Python: EFBIG
c = mlc.KVCache()
c.update_and_fetch(mx.zeros((1, 2, 600, 8)), mx.zeros((1, 2, 600, 8)))
plan = kinds.plan_snapshot([c], meta=ff.SnapshotMeta("m", "fp", "", "tok", [1]))
try:
    ff.write_snapshot(plan, sys.argv[1])
except ff.DiskFull as exc:
    print("DiskFull", exc.errno)
"""


def test_file_size_limit_is_disk_full_and_leaves_no_tmp(tmp_path):
    target = tmp_path / "big.mlxkv"
    out = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "DiskFull 27", out.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_is_a_storage_error(tmp_path):
    plan = kinds.plan_snapshot([filled_kv(2)], meta=meta())
    with pytest.raises(ff.StorageError) as info:
        ff.write_snapshot(plan, tmp_path / "nope" / "a.mlxkv")
    assert not isinstance(info.value, ff.DiskFull)
    with pytest.raises(ff.StorageError):
        ff.read_header(tmp_path / "missing.mlxkv")


def test_direct_and_buffered_writes_produce_the_same_bytes(tmp_path):
    """O_DIRECT (through the aligned bounce buffer) and page-cache writes give identical files."""
    caches = [filled_kv(300), filled_kv(5000, heads=1, dim=4)]  # strided slices, odd tensor sizes
    plan = kinds.plan_snapshot(caches, meta=meta(tokens=range(5000)))
    direct = ff.write_snapshot(plan, tmp_path / "direct.mlxkv", direct=True)
    plain = ff.write_snapshot(plan, tmp_path / "plain.mlxkv", direct=False)
    assert direct.path.read_bytes() == plain.path.read_bytes()
    assert direct.nbytes == direct.path.stat().st_size == direct.header.file_size
    loaded = ff.read_snapshot(direct.path, verify=True)
    for (_, t), buf in zip(loaded.header.tensors(), loaded.buffers, strict=True):
        assert buf.nbytes == t.nbytes


def _o_direct_works(directory: Path) -> bool:
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        sink = ffw._Sink(fd, start=0, size=4096, want_direct=lambda: True)
        sink.write(memoryview(b"x" * 5000), None)
        sink.finish(None)
        return sink.direct_bytes == 8192
    finally:
        os.close(fd)
        assert (directory / "probe").read_bytes() == b"x" * 5000 + bytes(8192 - 5000)
        (directory / "probe").unlink()


def test_paced_slices_bypass_the_page_cache_and_idle_ones_stay_in_it(tmp_path):
    """While pacing (engine decoding) the writer uses O_DIRECT; at full speed it leaves the file cached."""
    from mlxd.kv.pacing import Pacer, WriteGovernor
    from mlxd.kv.ssd_store import resident_pages

    if not _o_direct_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT; every write takes the buffered path")
    plan = kinds.plan_snapshot([filled_kv(20_000, heads=4, dim=16)], meta=meta(tokens=range(20_000)))  # 10 MB
    governor = WriteGovernor(busy_rate_bytes_per_s=1 << 40)  # paces, but never waits
    governor.set_busy(True)
    paced = ff.write_snapshot(plan, tmp_path / "paced.mlxkv", pacer=Pacer(governor, slice_bytes=1 << 20))
    governor.set_busy(False)
    idle = ff.write_snapshot(plan, tmp_path / "idle.mlxkv", pacer=Pacer(governor, slice_bytes=1 << 20))
    resident, total = resident_pages(paced.path)
    assert resident <= 2  # only the header page went through the page cache
    resident, total = resident_pages(idle.path)
    assert resident == total
    assert ff.read_snapshot(paced.path, verify=True).header.caches == idle.header.caches  # same CRCs
    # The SSD writer's pacer (MLXD_SSD_DIRECT, on by default): full-speed slices bypass the page cache too...
    direct = Pacer(governor, slice_bytes=1 << 20, direct_unless_flush=True)
    always = ff.write_snapshot(plan, tmp_path / "always.mlxkv", pacer=direct)
    assert not governor.busy and resident_pages(always.path)[0] <= 2
    assert ff.read_snapshot(always.path, verify=True).header.caches == idle.header.caches
    governor.set_urgent("flush", True)  # ...unless a flush waits: its slices stay in the page cache
    flushed = ff.write_snapshot(plan, tmp_path / "flushed.mlxkv", pacer=direct)
    resident, total = resident_pages(flushed.path)
    assert resident == total


def test_file_format_modules_import_no_mlx():
    """header / write / read run on worker threads and in the simulator: no MLX."""
    code = (
        "import sys; import mlxd.kv.file_format.header, mlxd.kv.file_format.write, mlxd.kv.file_format.read;"
        " import mlxd.kv.file_format;"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("kind", ["kv", "rotating", "wrapped", "quant", "arrays", "list"])
def test_descriptor_signature_and_trimmability_match_the_live_cache(kind):
    """The header's pure view of a cache agrees with kinds' table for the live one."""
    state = mlc.ArraysCache(2)
    state[0] = mx.ones((1, 3, 4))
    made = {
        "kv": filled_kv(5),
        "rotating": _fed(mlc.RotatingKVCache(max_size=8, keep=2), 5),
        "wrapped": _fed(mlc.RotatingKVCache(max_size=8, keep=2), 12),
        "quant": _fed(mlc.QuantizedKVCache(group_size=32, bits=4), 5),
        "arrays": state,
        "list": mlc.CacheList(filled_kv(5), state),
    }[kind]
    (desc,) = kinds.plan_snapshot([made], meta=meta()).caches
    assert desc.signature == kinds.signature(made)
    assert desc.trimmable == kinds.is_trimmable([made])


def _fed(cache, n: int):
    cache.update_and_fetch(mx.ones((1, 2, n, 32)), mx.ones((1, 2, n, 32)))
    return cache
