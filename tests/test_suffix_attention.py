"""MLXD_SUFFIX_ATTENTION=unfused (model/suffix_attention.py): short chunks over a long context attended
as plain operations give MLX's attention, and a served conversation the same tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.model import suffix_attention


@pytest.mark.parametrize(("heads", "kv_heads", "n", "keys"), [(4, 2, 5, 1100), (8, 8, 30, 1030), (16, 8, 128, 2048)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_unfused_matches_mlx_attention(heads, kv_heads, n, keys, mask):
    mx.random.seed(n)
    q = mx.random.normal((1, heads, n, 64))
    k, v = mx.random.normal((1, kv_heads, keys, 64)), mx.random.normal((1, kv_heads, keys, 64))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = suffix_attention.unfused(q, k, v, scale=0.125, causal=mask == "causal")
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-4).item()


def test_it_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(suffix_attention.ENV, raising=False)
    assert suffix_attention.wanted()
    monkeypatch.setenv(suffix_attention.ENV, "off")
    assert not suffix_attention.wanted()
    monkeypatch.delenv(suffix_attention.ENV)
    if mx.default_device() == mx.cpu:  # nothing to route around on the CPU: MLX's own attention is plain ops
        assert not suffix_attention.install() and suffix_attention._ORIGINAL is None


def test_the_wrapper_routes_only_short_chunks_over_long_contexts(monkeypatch):
    calls: list[tuple[int, int]] = []
    real = suffix_attention.unfused

    def spy(q, k, v, *, scale, causal):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, scale=scale, causal=causal)

    monkeypatch.setattr(suffix_attention, "unfused", spy)
    try:
        assert suffix_attention.install(force=True)
        for n, keys, mask in [(1, 2048, None), (30, 2048, "causal"), (30, 512, "causal"), (300, 2048, "causal"),
                              (30, 2048, mx.ones((30, 2048), dtype=mx.bool_))]:
            q = mx.random.normal((1, 4, n, 64))
            k = v = mx.random.normal((1, 2, keys, 64))
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
    finally:
        suffix_attention.uninstall()
    assert calls == [(30, 2048)]  # a decode step, a short context, a long chunk and an array mask keep MLX's


def test_a_conversation_served_with_it_gives_the_same_tokens(tiny_model_dir, monkeypatch):
    """Greedy turns of a long conversation (the cached prefix past MIN_KEYS, ~20-token suffixes) with the
    unfused path forced on this CPU decode what MLX's attention decodes."""
    import trio
    from tests.serving import config_for, greedy_turns

    from mlxd.runtime.supervisor import open_runtime

    async def conversation() -> list[list[int]]:
        async with open_runtime(config_for(tiny_model_dir, snapshot_min_tokens=16)) as rt:
            return await greedy_turns(rt, " ".join(f"w{i % 97}x{i}" for i in range(500)),
                                      [f"go on {turn}" for turn in range(2)], max_tokens=6)

    plain = trio.run(conversation)
    calls: list[int] = []
    real = suffix_attention.unfused

    def spy(q, k, v, *, scale, causal):
        calls.append(q.shape[2])
        return real(q, k, v, scale=scale, causal=causal)

    monkeypatch.setattr(suffix_attention, "unfused", spy)
    try:
        suffix_attention.install(force=True)
        routed = trio.run(conversation)
    finally:
        suffix_attention.uninstall()
    assert calls  # the next turns' suffixes went the unfused way
    assert routed == plain


def test_a_short_suffix_prefilled_apart_on_an_idle_engine_decodes_the_same(tiny_model_dir, monkeypatch):
    """MLXD_SUFFIX_APART (engine/core.py): a next turn's suffix joining an empty batch is prefilled on its
    lent caches before it joins; the turns decode the same greedy tokens as through mlx-lm's prompt phase."""
    import trio
    from tests.serving import config_for, greedy_turns

    from mlxd.engine import core
    from mlxd.runtime.supervisor import open_runtime

    async def conversation() -> tuple[list[list[int]], list[bool]]:
        async with open_runtime(config_for(tiny_model_dir, snapshot_min_tokens=16)) as rt:
            records: list = []
            rt.scheduler.observers.append(records.append)
            out = await greedy_turns(rt, " ".join(f"w{i % 31}y{i}" for i in range(200)),
                                     [f"and {turn}?" for turn in range(2)], max_tokens=5)
            await rt.scheduler.wait_idle()
            apart = [any(name == "prefilled_apart" for name, _ in r.engine_stages) for r in records]
        return out, apart

    monkeypatch.setattr(core, "SUFFIX_APART", 0)
    plain, plain_apart = trio.run(conversation)
    monkeypatch.setattr(core, "SUFFIX_APART", 256)
    routed, routed_apart = trio.run(conversation)
    assert routed == plain
    assert plain_apart == [False, False, False]
    assert routed_apart == [False, True, True]  # the first turn has no cached prefix
