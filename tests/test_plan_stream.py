"""MLXD_PLAN_STREAM (EngineCore.plan, issue 28): with the SSD tier, a checkpoint's write plan evaluates its token
slices on the engine's side stream by default, not behind the forward the step dispatched on the generation stream;
`main` keeps the old stream; the plans write the same files either way."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlc
from tests.test_engine_core import CACHE_ON, make, run, start

from mlxd.engine.features import plan_stream
from mlxd.engine.ops import StepOps
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.ssd_store import StoreIdentity

IDENTITY = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")


def test_the_setting_is_side_unless_main_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("MLXD_PLAN_STREAM", raising=False)
    assert plan_stream() == "side"
    monkeypatch.setenv("MLXD_PLAN_STREAM", "main")
    assert plan_stream() == "main"
    monkeypatch.setenv("MLXD_PLAN_STREAM", "gpu")
    with pytest.raises(ValueError, match="MLXD_PLAN_STREAM"):
        plan_stream()


@pytest.mark.parametrize("setting", ["side", "main"])
def test_every_checkpoint_plan_of_a_served_row_is_made_on_the_stream_set(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("MLXD_PLAN_STREAM", setting)
    monkeypatch.delenv("MLXD_FINAL_PLAN", raising=False)
    core, _ = make(**CACHE_ON, snapshot_min_tokens=4, ssd_cache_dir=tmp_path, identity=IDENTITY,
                   generation_checkpoint=2)
    core._reads = mx.new_stream(mx.default_device())  # as load() makes it
    seen: list[object] = []
    plan_snapshot = kinds.plan_snapshot

    def watched(*args, **kwargs):
        seen.append(mx.default_stream(mx.default_device()))
        return plan_snapshot(*args, **kwargs)

    monkeypatch.setattr(kinds, "plan_snapshot", watched)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 30)), max_tokens=5, key="k1"),)))
    assert any(r.finished for r in results)
    assert len(seen) >= 4  # the prompt boundary, the generation checkpoints (every 2 tokens), the final one
    want = core._reads if setting == "side" else core._stream
    assert all(s == want for s in seen) and core._reads != core._stream


def test_a_plan_on_the_side_stream_writes_the_same_file(tmp_path, monkeypatch):
    kv = mlc.KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, 300, 8)).astype(mx.bfloat16),
                        mx.random.normal((1, 2, 300, 8)).astype(mx.bfloat16))
    mx.eval(kv.keys, kv.values)
    meta = ff.SnapshotMeta(model_id="tiny", config_fingerprint="fp", namespace="", tokenizer_hash="tok",
                           tokens=tuple(range(300)))
    files = []
    for setting in ("main", "side"):
        monkeypatch.setenv("MLXD_PLAN_STREAM", setting)
        core, _ = make(**CACHE_ON, ssd_cache_dir=tmp_path, identity=IDENTITY)
        core._reads = mx.new_stream(mx.default_device())
        ff.write_snapshot(core.plan([kv], meta), tmp_path / f"{setting}.mlxkv")
        files.append((tmp_path / f"{setting}.mlxkv").read_bytes())
    assert files[0] == files[1] and len(files[0]) > 300 * 2 * 8 * 2 * 2
