"""The cost model: shapes, restore-or-recompute, JSON round trip."""

import attrs

from mlxd.kv.cost_model import DEFAULT, CostModel
from mlxd.kv.restore_decision import RestoreAdvisor


def test_prefill_grows_with_context_and_length():
    assert DEFAULT.prefill_seconds(0, 100) == 0.0
    assert DEFAULT.prefill_seconds(100, 1000) > DEFAULT.prefill_seconds(100, 0)
    assert DEFAULT.prefill_seconds(2000) > 2 * DEFAULT.prefill_seconds(1000)  # attention


def test_the_one_restore_rule_starts_from_the_cost_model():
    # Serving and simulation both decide with RestoreAdvisor (no second rule here).
    prefix, suffix = 8000, 100
    nbytes = DEFAULT.kv_bytes(prefix)
    ask = dict(restore_bytes=nbytes, cold_tokens=prefix, warm_tokens=0, prompt_tokens=prefix + suffix)
    assert RestoreAdvisor(base=DEFAULT).should_restore(**ask)
    slow_disk = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3)
    assert not RestoreAdvisor(base=slow_disk).should_restore(**ask)
    assert not hasattr(CostModel, "should_restore")


def test_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    DEFAULT.save(path)
    assert CostModel.load(path) == DEFAULT


def test_restore_choice_always_restores_what_the_costs_would_recompute():
    ask = {"restore_bytes": 10**12, "cold_tokens": 10, "warm_tokens": 0, "prompt_tokens": 12}
    assert not RestoreAdvisor(base=DEFAULT).should_restore(**ask)  # a terabyte for 10 tokens
    always = RestoreAdvisor(base=DEFAULT, always=True)
    assert always.should_restore(**ask) and always.stats()["restores_chosen"] == 1
