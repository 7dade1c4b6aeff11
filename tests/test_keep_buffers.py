"""MLXD_KEEP_BUFFERS (model/keep_buffers.py): mlx-lm's prompt phase leaves a chunk's freed buffers in MLX's cache
for the next chunk instead of clearing it, decodes the same, and touches no other clear."""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from tests.serving import config_for, greedy_turns, served_with_patch

from mlxd.model import keep_buffers
from mlxd.runtime.supervisor import open_runtime

generate = importlib.import_module("mlx_lm.generate")  # the module (the package exports a function by its name)


def _cache_after_a_prompt_chunk(model) -> int:
    """MLX's cache memory after one generator step that prefilled a 48-token chunk (of a longer prompt)."""
    gen = BatchGenerator(model, max_tokens=2, prefill_step_size=48)
    gen.insert([[(i * 29) % 800 + 5 for i in range(200)]])
    mx.clear_cache()
    prompts, _ = gen.next()
    assert prompts and not prompts[0].end_of_prompt  # the step ran a chunk, not the whole prompt
    return int(mx.get_cache_memory())


def test_a_prompt_chunk_keeps_its_buffers_only_while_installed(tiny_model):
    model, _ = tiny_model
    keep_buffers.uninstall()
    try:
        cleared = _cache_after_a_prompt_chunk(model)  # mlx-lm's own clear after the chunk (the step's last
        # small arrays, freed after it, are all the cache holds)
        assert keep_buffers.install(force=True)
        kept = _cache_after_a_prompt_chunk(model)  # the chunk's intermediates stay for the next one
        assert cleared < 4096 and kept > 50 * max(cleared, 1024), (cleared, kept)
        assert generate.mx is mx  # mlx-lm's module sees mlx.core again after the call
        mx.eval(mx.ones((256, 256)) @ mx.ones((256, 256)))
        mx.clear_cache()  # everyone else's clear still clears
        assert mx.get_cache_memory() == 0
    finally:
        keep_buffers.uninstall()
        keep_buffers.install()  # as the engine's load leaves it (on unless MLXD_KEEP_BUFFERS=0)


def test_a_failing_chunk_gives_mlx_lm_its_module_back(tiny_model, monkeypatch):
    keep_buffers.uninstall()
    try:
        keep_buffers.install(force=True)
        batch = generate.PromptProcessingBatch.empty(tiny_model[0], fallback_sampler=lambda x: x)
        try:
            batch.prompt([[1, 2, 3]])  # no row for these tokens: mlx-lm refuses
        except ValueError:
            pass
        else:
            raise AssertionError("mlx-lm took tokens for a row it does not have")
        assert generate.mx is mx
    finally:
        keep_buffers.uninstall()
        keep_buffers.install()  # as the engine's load leaves it


def test_served_turns_decode_the_same_with_buffers_kept(tiny_model_dir, monkeypatch):
    async def turns() -> list[list[int]]:
        async with open_runtime(config_for(tiny_model_dir, snapshot_min_tokens=16, prefill_step_size=64)) as rt:
            return await greedy_turns(rt, " ".join(f"q{i % 19}w{i}" for i in range(160)),
                                      [f"and then {turn}" for turn in range(2)], max_tokens=6)

    cleared = served_with_patch(keep_buffers, monkeypatch, turns, False)
    kept = served_with_patch(keep_buffers, monkeypatch, turns, True)
    assert kept == cleared
