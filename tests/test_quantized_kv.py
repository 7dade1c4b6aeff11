"""Quantized KV (KV4/KV8): rows batch like rows alone, lent prefixes match cold ones, files round-trip."""

import mlxd  # noqa: F401, I001  # preloads OpenBLAS before mlx

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from models import tiny_qwen3
from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.quantized_batch import BatchQuantizedKVCache, batchable, quantized_like

STEPS = 5


def alone(model, prompt: list[int], bits: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decode of one row with mlx-lm's own QuantizedKVCache, no batching."""
    caches = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    logits = model(mx.array(prompt)[None], cache=caches)[0, -1]
    tokens, logprobs = [], []
    for _ in range(STEPS):
        lp = logits - mx.logsumexp(logits)
        token = int(mx.argmax(lp).item())
        tokens.append(token)
        logprobs.append(np.array(lp))
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
    return tokens, logprobs


def batched(model, rows: list[tuple[list[int], list | None, list[int]]]) -> dict[int, tuple[list[int], list]]:
    """Every row in one BatchGenerator: (prompt suffix, lent caches or None, cached prefix)."""
    gen = BatchGenerator(model, max_tokens=STEPS, completion_batch_size=8, prefill_batch_size=8,
                         prefill_step_size=16)
    uids = gen.insert(
        [suffix for suffix, _, _ in rows],
        caches=[batchable(lent if lent is not None else fresh(model)) for _, lent, _ in rows],
        all_tokens=[prefix for _, _, prefix in rows],
    )
    out: dict[int, tuple[list[int], list]] = {uid: ([], []) for uid in uids}
    while any(len(t) < STEPS for t, _ in out.values()):
        for r in gen.next()[1]:
            out[r.uid][0].append(r.token)
            out[r.uid][1].append(np.array(r.logprobs))
    gen.close()
    return {i: out[uid] for i, uid in enumerate(uids)}


def fresh(model, bits: int = 8) -> list:
    return quantized_like(make_prompt_cache(model), group_size=64, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_rows_batch_like_rows_alone(bits):
    model = tiny_qwen3(head_dim=64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (40, 9, 23)]

    # an entry for prompts[0]: prefill it once, alone, then lend its first 30 tokens
    entry = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    mx.eval(model(mx.array(prompts[0])[None], cache=entry))
    lent = kinds.lend(entry, 30)

    fresh_rows = [(p, [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers], []) for p in prompts]
    got = batched(model, [*fresh_rows, (prompts[0][30:], lent, prompts[0][:30])])
    for i, prompt in enumerate([*prompts, prompts[0]]):
        want_tokens, want_lp = alone(model, prompt, bits)
        tokens, lps = got[i]
        assert tokens == want_tokens, i
        for a, b in zip(lps, want_lp, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-4)


def test_rows_leave_the_batch_as_plain_quantized_caches():
    model = tiny_qwen3(head_dim=64)
    caches = batchable(fresh(model))
    assert all(type(c) is not QuantizedKVCache for c in caches)  # mergeable inside the generator
    gen = BatchGenerator(model, max_tokens=2, prefill_step_size=8)
    (uid,) = gen.insert([list(range(20))], caches=[caches])
    extracted = None
    while extracted is None:
        for r in gen.next()[1]:
            if r.finish_reason is not None:
                extracted, held = r.prompt_cache, r.all_tokens
    gen.close()
    assert [type(c) for c in extracted] == [QuantizedKVCache] * len(model.layers)
    assert kinds.signatures(extracted) == ("quant:8:64",) * len(model.layers)
    assert kinds.num_tokens(extracted, total=len(held)) == len(held) > 20


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_entries_round_trip_ssd_bit_exactly(tmp_path, bits):
    model = tiny_qwen3(head_dim=64)
    entry = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    mx.eval(model(mx.arange(70)[None], cache=entry))
    plan = kinds.plan_snapshot(entry, meta=ff.SnapshotMeta("m", "fp", "", "tok", range(70)))
    written = ff.write_snapshot(plan, tmp_path / "q.mlxkv")
    restored = kinds.adopt(ff.read_snapshot(written.path, verify=True))
    assert kinds.signatures(restored) == kinds.signatures(entry)
    for a, b in zip(entry, restored, strict=True):
        assert b.offset == a.offset == 70
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
            assert x.dtype == y.dtype
            assert mx.array_equal(x[..., :70, :], y).item()
    # the restored entry continues exactly like the original
    suffix = mx.array([[5, 6, 7]])
    want = model(suffix, cache=kinds.lend(entry, 70))
    got = model(suffix, cache=kinds.lend(restored, 70))
    assert mx.array_equal(want, got).item()


def test_quantized_kv_is_smaller_per_token():
    model = tiny_qwen3(head_dim=64)
    sizes = {}
    for name, caches in {"native": [KVCache() for _ in model.layers], "kv8": fresh(model, 8),
                         "kv4": fresh(model, 4)}.items():
        mx.eval(model(mx.arange(64)[None], cache=caches))
        sizes[name] = kinds.nbytes(caches)
    # fp32 head_dim 64: 256 B per head-token; KV8 64 + 8 (scale, bias) B; KV4 32 + 8 B
    assert sizes["kv8"] / sizes["native"] == pytest.approx(72 / 256)
    assert sizes["kv4"] / sizes["native"] == pytest.approx(40 / 256)


def test_batch_cache_refuses_mixed_schemes():
    a, b = QuantizedKVCache(group_size=64, bits=8), QuantizedKVCache(group_size=64, bits=4)
    for c in (a, b):
        c.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    with pytest.raises(ValueError, match="different schemes"):
        BatchQuantizedKVCache.merge([a, b])
