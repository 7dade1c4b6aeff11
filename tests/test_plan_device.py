"""MLXD_PLAN_DEVICE (issue 28): with the SSD tier on CUDA, a checkpoint's write plan hands the SSD writer (or the
generation checkpointer) its arrays' device addresses (`runtime/device_pointers.py`: a custom CUDA kernel reads them), which the writer's
staging copies by DMA, instead of host views whose first access converts the row's whole KV to managed memory.

There is no CUDA device here, so the addresses are the CPU arrays' own (the same memory MLX computed into) and
the CUDA runtime is `tests/fake_cuda.py` (real copies by address, recorded). What is checked: the kernel's source
and the views over an address; which plans are made by address (the SSD writer's and
the generation checkpointer's, none with the switch off); a plan of addresses is never read by a write (a
StorageError, no tmp file), only staged, and the staged files (one file, blocks, a generation checkpoint) are byte
for byte those of an ordinary plan; off CUDA no address is read (`addresses()` is None) and plans stay memoryviews.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
import trio
from mlx_lm.models import cache as mlc
from tests import fake_cuda
from tests.test_engine_core import CACHE_ON, make, run, start

from mlxd.actors import gen_checkpointer, ssd_writer
from mlxd.actors.ssd_writer import SsdWriterActor
from mlxd.engine.features import plan_device
from mlxd.engine.ops import StepOps
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.pacing import Pacer
from mlxd.kv.ssd_store import Failed, SsdStore, Stored, StoreIdentity
from mlxd.kv.write_queue import WriteQueue
from mlxd.runtime import device_pointers, host_memory
from mlxd.runtime.kernel.messages import DurabilityMessage, SnapshotWritten, WriteSnapshot

IDENTITY = StoreIdentity(model_id="m", fingerprint="f" * 32, tokenizer_hash="t")
lib = fake_cuda.lib  # the fake runtime, as a fixture


@pytest.fixture
def addresses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`device_views` as on CUDA, over the CPU arrays' own memory: each array's address and strides from its
    buffer (as the kernel reports them), wrapped by the real `view_at`. Returns the count of arrays addressed."""
    made: list[int] = []

    def host_views(arrays, *, stream=None):
        out = []
        for a in arrays:
            h = np.asarray(memoryview(a))
            out.append(device_pointers.view_at(h.ctypes.data, a.shape, h.dtype,
                                               [s // h.itemsize for s in h.strides]))
        made.append(len(out))
        return out

    monkeypatch.setattr(device_pointers, "device_views", host_views)
    return made


def _kv(tokens: int, heads: int = 4, dim: int = 16) -> mlc.KVCache:
    """A cache of `tokens` tokens whose buffer runs past them (sliced by the plan: a strided view)."""
    c = mlc.KVCache()
    pos = mx.arange(tokens, dtype=mx.float32)[None, None, :, None]
    k = (pos * 1000 + mx.arange(heads, dtype=mx.float32)[None, :, None, None] * 16
         + mx.arange(dim, dtype=mx.float32)).astype(mx.bfloat16)
    c.update_and_fetch(k, -k)
    mx.eval(c.keys, c.values)
    return c


def _meta(n: int) -> ff.SnapshotMeta:
    return IDENTITY.meta(tuple(range(n)), "")


def test_the_setting_is_on_unless_off_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("MLXD_PLAN_DEVICE", raising=False)
    assert plan_device() is True
    monkeypatch.setenv("MLXD_PLAN_DEVICE", "0")
    assert plan_device() is False
    monkeypatch.setenv("MLXD_PLAN_DEVICE", "gpu")
    with pytest.raises(ValueError, match="MLXD_PLAN_DEVICE"):
        plan_device()


def test_the_kernel_writes_each_inputs_address_then_its_strides_at_its_own_offset():
    src = device_pointers.kernel_source((4, 2))
    assert "out[0] = (uint64_t)(a0);" in src and "out[4] = (uint64_t)(a0_strides[3]);" in src
    assert "out[5] = (uint64_t)(a1);" in src and "out[7] = (uint64_t)(a1_strides[1]);" in src
    assert "out[8]" not in src and src.startswith("if (blockIdx.x != 0 || threadIdx.x != 0) return;")


def test_a_view_at_an_address_is_the_strided_slice_it_describes():
    whole = np.arange(2 * 4 * 32 * 8, dtype=np.uint16).reshape(2, 4, 32, 8)
    part = whole[1, :, 5:21, :]
    v = device_pointers.view_at(part.ctypes.data, part.shape, part.dtype, [s // 2 for s in part.strides])
    assert v.shape == part.shape and v.strides == part.strides and np.array_equal(v, part)
    assert device_pointers.view_at(0, (0, 3), np.dtype(np.uint16), (3, 1)).shape == (0, 3)
    with pytest.raises(ValueError, match="negative"):
        device_pointers.view_at(part.ctypes.data, (2,), np.dtype(np.uint16), (-1,))


def test_off_cuda_no_address_is_read_and_plans_stay_memoryviews():
    assert not device_pointers.available()
    assert device_pointers.addresses([mx.zeros((2, 3))]) is None
    plan = kinds.plan_snapshot([_kv(40)], meta=_meta(40), device=True)
    assert not plan.on_device and plan.keep == ()


def test_a_plan_of_addresses_is_never_written_only_staged_and_then_writes_the_same_file(tmp_path, lib, addresses):
    kv, meta = _kv(300), _meta(300)
    plain = kinds.plan_snapshot([kv], meta=meta)
    plan = kinds.plan_snapshot([kv], meta=meta, device=True)
    assert addresses == [2] and plan.on_device and len(plan.keep) == 2 and plan.nbytes == plain.nbytes
    with pytest.raises(ff.StorageError, match="device memory"):
        ff.write_snapshot(plan, tmp_path / "direct.mlxkv")
    assert list(tmp_path.iterdir()) == []  # not even a tmp file
    staged = host_memory.Staging().stage(plan)
    assert not staged.on_device and staged.keep == ()
    assert sum(c.nbytes for c in lib.calls if c.op == "copy") == plan.nbytes  # every byte copied by address
    ff.write_snapshot(staged, tmp_path / "staged.mlxkv")
    ff.write_snapshot(plain, tmp_path / "plain.mlxkv")
    assert (tmp_path / "staged.mlxkv").read_bytes() == (tmp_path / "plain.mlxkv").read_bytes()


@pytest.mark.parametrize("layout", ["file", "blocks"])
def test_the_writer_stages_a_plan_of_addresses_even_unasked_and_stores_the_same_bytes(tmp_path, lib, addresses,
                                                                                        layout):
    kw = {"layout": "blocks", "block_tokens": 64} if layout == "blocks" else {}
    kv = _kv(300)
    plan = kinds.plan_snapshot([kv], meta=_meta(300), device=True)
    assert plan.on_device
    ref_store = SsdStore(tmp_path / "plain", IDENTITY, **kw)
    expect = ref_store.write(kinds.plan_snapshot([kv], meta=_meta(300)))
    refused = SsdStore(tmp_path / "refused", IDENTITY, **kw)
    failed = refused.write(plan)  # a store write without staging: a failed write (a cache miss), nothing read
    assert isinstance(failed, Failed) and "device memory" in failed.error
    assert refused.scan().records == ()
    store = SsdStore(tmp_path / "staged", IDENTITY, **kw)
    got = ssd_writer._write(store, plan, Pacer(None), None)  # a writer built not to stage: it stages this one
    assert isinstance(got, Stored) and isinstance(expect, Stored)
    loaded, reference = store.load(got.record), ref_store.load(expect.record)
    assert loaded is not None and reference is not None
    assert [bytes(a) for a in loaded.buffers] == [bytes(b) for b in reference.buffers]


async def test_the_ssd_writer_actor_writes_a_plan_of_addresses(tmp_path, lib, addresses):
    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=32)
    plan = kinds.plan_snapshot([_kv(100)], meta=_meta(100), device=True)
    queue = WriteQueue()
    queue.mark("", tuple(plan.meta.tokens), plan=plan, trimmable=True, nbytes=0)
    job = queue.next_job()
    assert job is not None
    write_send, write_inbox = trio.open_memory_channel[WriteSnapshot](1)
    out_send, out = trio.open_memory_channel[DurabilityMessage](math.inf)
    writer = SsdWriterActor(store, inbox=write_inbox, outbox=out_send, staging=True)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            await write_send.send(WriteSnapshot(job))
            written = await out.receive()
            nursery.cancel_scope.cancel()
    assert isinstance(written, SnapshotWritten) and isinstance(written.outcome, Stored)
    assert written.stats.staged_bytes == plan.nbytes
    loaded = store.load(written.outcome.record)
    assert loaded is not None
    plain = kinds.plan_snapshot([_kv(100)], meta=_meta(100))
    assert [bytes(a) for a in loaded.buffers] == [np.asarray(b).tobytes() for b in plain.buffers]


def test_the_generation_checkpointer_stages_a_plan_of_addresses_and_writes_the_same_file(tmp_path, lib, addresses):
    kv, meta = _kv(200), _meta(200)
    plan = kinds.plan_snapshot([kv], meta=meta, device=True)
    assert plan.on_device
    (tmp_path / "g").mkdir()
    written = gen_checkpointer._write_file(plan, tmp_path / "g" / "a.mlxkv", None)
    ff.write_snapshot(kinds.plan_snapshot([kv], meta=meta), tmp_path / "b.mlxkv")
    assert written.nbytes > 0 and sum(c.nbytes for c in lib.calls if c.op == "copy") == plan.nbytes
    assert (tmp_path / "g" / "a.mlxkv").read_bytes() == (tmp_path / "b.mlxkv").read_bytes()


@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_writers_plans_are_made_by_address_only_when_on(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("MLXD_PLAN_DEVICE", setting)
    monkeypatch.delenv("MLXD_FINAL_PLAN", raising=False)
    core, _ = make(**CACHE_ON, snapshot_min_tokens=4, ssd_cache_dir=tmp_path, identity=IDENTITY,
                   generation_checkpoint=2)
    asked: list[bool] = []
    plan_snapshot = kinds.plan_snapshot

    def watched(caches, *, meta, pack_max_bytes=0, device=False):
        asked.append(device)
        return plan_snapshot(caches, meta=meta, pack_max_bytes=pack_max_bytes, device=device)

    monkeypatch.setattr(kinds, "plan_snapshot", watched)
    snapshots: list[bool] = []
    snapshot = core._snapshot

    def counted(*args, **kwargs):
        out = snapshot(*args, **kwargs)
        snapshots.append(out.plan is not None)
        return out

    monkeypatch.setattr(core, "_snapshot", counted)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 30)), max_tokens=5, key="k1"),)))
    assert any(r.finished for r in results)
    assert len(snapshots) >= 2 and all(snapshots)  # the prompt boundary and the final checkpoint, with plans
    assert len(asked) > len(snapshots)  # and the generation checkpoints' (every 2 tokens)
    assert asked == [setting == "1"] * len(asked)  # every one by address (both writers stage them), or none
