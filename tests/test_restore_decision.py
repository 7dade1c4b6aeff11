"""Restore or recompute, calibrated from the engine's own timings."""

from __future__ import annotations

import attrs

from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.restore_decision import RestoreAdvisor

KV_PER_TOKEN = 114_688  # a 1.7B-class model's fp16 KV per token, roughly


def test_slow_prefill_cpu_restores():
    advisor = RestoreAdvisor()
    # 16k tokens took minutes of prefill here; a 1.9 GB read takes ~1 s.
    advisor.observe_prefill(new_tokens=2048, context=4096, seconds=20.0)
    advisor.observe_restore(nbytes=1_900_000_000, seconds=1.2)
    assert advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.restores_chosen == 1


def test_fast_accelerator_recomputes():
    advisor = RestoreAdvisor()
    # An H200-like engine: 16k tokens of prefill in ~0.2 s, KV to host and back at ~0.7 GB/s.
    seconds = 0.2 * DEFAULT.prefill_seconds(2048, 4096) / DEFAULT.prefill_seconds(16_000, 0)
    advisor.observe_prefill(new_tokens=2048, context=4096, seconds=seconds)
    advisor.observe_restore(nbytes=1_900_000_000, seconds=2.7)
    assert not advisor.should_restore(
        restore_bytes=16_000 * KV_PER_TOKEN, cold_tokens=16_000, warm_tokens=0, prompt_tokens=16_140
    )
    assert advisor.recomputes_chosen == 1


def test_a_long_warm_prefix_makes_a_slightly_longer_cold_one_not_worth_it():
    advisor = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e8))
    assert not advisor.should_restore(
        restore_bytes=8_000 * KV_PER_TOKEN, cold_tokens=8_010, warm_tokens=8_000, prompt_tokens=8_100
    )


def test_observations_move_the_estimates_smoothly():
    advisor = RestoreAdvisor()
    advisor.observe_restore(nbytes=10**9, seconds=1.0)
    assert advisor.restore_bytes_per_s == 1e9
    advisor.observe_restore(nbytes=10**9, seconds=0.5)
    assert 1e9 < advisor.restore_bytes_per_s < 2e9
    advisor.observe_prefill(new_tokens=4, context=0, seconds=10.0)  # too small to count
    assert advisor.prefill_samples == 0
