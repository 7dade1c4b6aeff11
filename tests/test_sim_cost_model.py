"""The cost model: shapes, restore-or-recompute, JSON round trip."""

import attrs

from mlxd.kv.cost_model import DEFAULT, CostModel


def test_prefill_grows_with_context_and_length():
    assert DEFAULT.prefill_seconds(0, 100) == 0.0
    assert DEFAULT.prefill_seconds(100, 1000) > DEFAULT.prefill_seconds(100, 0)
    assert DEFAULT.prefill_seconds(2000) > 2 * DEFAULT.prefill_seconds(1000)  # attention


def test_should_restore_compares_with_recompute():
    prefix, suffix = 8000, 100
    nbytes = DEFAULT.kv_bytes(prefix)
    assert DEFAULT.should_restore(nbytes, prefix, suffix)
    slow_disk = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3)
    assert not slow_disk.should_restore(nbytes, prefix, suffix)


def test_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    DEFAULT.save(path)
    assert CostModel.load(path) == DEFAULT
