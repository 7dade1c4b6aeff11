"""MLXD_BATCH_HANDOVER (model/batch_handover.py): a lone row merged and moved to generation without copies
decodes what mlx-lm's copying path decodes, alone and beside other rows, and never writes the cache entry."""

from __future__ import annotations

import mlx.core as mx
import trio
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache
from tests.serving import config_for, greedy_turns, served_with_patch

from mlxd.model import batch_handover
from mlxd.runtime.kernel.messages import SamplingParams
from mlxd.runtime.supervisor import open_runtime


def test_a_lone_merge_is_a_view_and_its_growth_leaves_the_source_alone():
    src = KVCache()
    k, v = mx.random.normal((1, 2, 300, 16)), mx.random.normal((1, 2, 300, 16))
    src.update_and_fetch(k, v)
    before = mx.array(src.keys)
    try:
        assert batch_handover.install(force=True)
        merged = BatchKVCache.merge([src])
        assert merged.keys.shape == (1, 2, 300, 16) and merged.size() == 300 and int(merged.offset[0]) == 300
        keys, _ = merged.update_and_fetch(mx.ones((1, 2, 1, 16)), mx.ones((1, 2, 1, 16)))
        mx.eval(keys)
        assert keys.shape[2] == 301 and mx.array_equal(keys[..., :300, :], k).item()
        assert mx.array_equal(src.keys, before).item()  # the lent entry is untouched
        two = BatchKVCache.merge([src, src])  # several rows: mlx-lm's own merge
        assert two.keys.shape[0] == 2
    finally:
        batch_handover.uninstall()
    assert BatchKVCache.merge.__func__ is not None and PromptProcessingBatch.split is not None


def test_served_turns_decode_the_same_with_the_handover(tiny_model_dir, monkeypatch):
    async def turns() -> list[list[int]]:
        async with open_runtime(config_for(tiny_model_dir, snapshot_min_tokens=16, max_batch=4)) as rt:
            out = await greedy_turns(rt, " ".join(f"v{i % 23}z{i}" for i in range(150)),
                                     [f"then {turn}" for turn in range(2)], max_tokens=6)
            # several rows at once: joins that split part of a prompt batch take mlx-lm's path
            results: list[list[int]] = [[] for _ in range(3)]

            async def one(i: int) -> None:
                prompt = rt.encode(f"row {i} " + "words and more words " * (10 + 5 * i))
                async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=5, temperature=0.0))) as s:
                    results[i] = list(await s.tokens())

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            out.extend(results)
        return out

    plain = served_with_patch(batch_handover, monkeypatch, turns, False)
    handed = served_with_patch(batch_handover, monkeypatch, turns, True)
    assert handed == plain
