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


def test_the_wrapper_routes_short_chunks_over_long_contexts_and_very_short_ones_over_any(monkeypatch):
    """Up to MAX_QUERY queries over MIN_KEYS keys or more (causal or no mask) go the plain way, and so do
    2..SHORT_QUERY queries over any keys (no per-shape graph at a new key length); under an array mask (the
    whole-buffer views: stable shapes) MLX's kernel keeps them, as it keeps a decode step."""
    calls: list[tuple[int, int, str]] = []
    real = suffix_attention.unfused

    def spy(q, k, v, *, scale, causal, mask=None):
        calls.append((q.shape[2], k.shape[2], "causal" if causal else "array" if mask is not None else "none"))
        return real(q, k, v, scale=scale, causal=causal, mask=mask)

    monkeypatch.setattr(suffix_attention, "unfused", spy)
    short = suffix_attention.SHORT_QUERY
    try:
        assert suffix_attention.install(force=True)
        for n, keys, mask in [(1, 2048, None), (30, 2048, "causal"), (30, 512, "causal"), (300, 2048, "causal"),
                              (30, 2048, mx.ones((30, 2048), dtype=mx.bool_)),
                              (5, 300, "causal"), (5, 512, mx.ones((1, 1, 5, 512), dtype=mx.bool_)),
                              (short, 40, None), (short + 1, 512, mx.ones((short + 1, 512), dtype=mx.bool_)),
                              (8, 4, "causal"), (1, 300, mx.ones((1, 300), dtype=mx.bool_))]:
            q = mx.random.normal((1, 4, n, 64))
            k = v = mx.random.normal((1, 2, keys, 64))
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))
    finally:
        suffix_attention.uninstall()
    # Kept MLX's: a decode step, a 30-query chunk over a short context, a long chunk, array masks (30, 5,
    # SHORT_QUERY + 1 queries), a causal chunk longer than its keys, one query under a mask.
    assert calls == [(30, 2048, "causal"), (5, 300, "causal"), (short, 40, "none")]


def test_a_chunk_reaches_mlx_attention_with_contiguous_keys_and_a_decode_step_with_its_slice(monkeypatch):
    """cuDNN's graph is cached by the keys' strides too: a cache's keys are a slice of a buffer whose size
    depends on the chunks before, so a chunk's keys and values go as a contiguous copy (same values); a decode
    step's stay the slice (MLX's decode kernel reads the buffer behind it)."""
    seen: list[tuple[int, bool, bool]] = []
    real = mx.fast.scaled_dot_product_attention

    def kernel(q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        seen.append((q.shape[2], k is given[0], v is given[1]))
        return real(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", kernel)
    buffer = mx.random.normal((1, 2, 512, 64))
    try:
        assert suffix_attention.install(force=True)
        for n, mask in [(1, None), (300, "causal"), (40, mx.ones((40, 300), dtype=mx.bool_))]:
            given = (buffer[..., :300, :], buffer[..., 1:301, :])  # slices, as a KV cache hands them out
            q = mx.random.normal((1, 4, n, 64))
            got = mx.fast.scaled_dot_product_attention(q, *given, scale=0.125, mask=mask)
            want = real(q, *given, scale=0.125, mask=mask)
            assert mx.allclose(got, want).item()
    finally:
        suffix_attention.uninstall()
    assert seen == [(1, True, True), (300, False, False), (40, False, False)]


@pytest.mark.parametrize("mask_shape", [(1, 1, 5, 300), (2, 1, 5, 300), (5, 300), (2, 8, 5, 300)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_unfused_under_an_array_mask_matches_mlx_attention(mask_shape, kind):
    """A verify's whole-buffer mask (rows, 1, queries, buffer), a per-head one and a 2-d one, boolean or
    additive, attended the plain way as MLX's kernel attends them (grouped KV heads: 8 over 2)."""
    mx.random.seed(len(mask_shape))
    q = mx.random.normal((2, 8, 5, 64))
    k, v = mx.random.normal((2, 2, 300, 64)), mx.random.normal((2, 2, 300, 64))
    allowed = mx.random.uniform(shape=mask_shape) > 0.3
    allowed = allowed | (mx.arange(300) == 0)  # every query sees one key at least
    mask = allowed if kind == "bool" else mx.where(allowed, 0.0, -1e9).astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = suffix_attention.unfused(q, k, v, scale=0.125, causal=False, mask=mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-4).item()


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

    def spy(q, k, v, *, scale, causal, mask=None):
        calls.append(q.shape[2])
        return real(q, k, v, scale=scale, causal=causal, mask=mask)

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


def test_the_area_routing_is_off_by_default_and_set_by_its_variable(monkeypatch):
    """MLXD_UNFUSED_AREA: chunks of 2+ queries whose queries x keys is at most it (causal or no mask) go the
    plain way whatever their length (a short prompt's whole prefill, a mid-size suffix); not a decode step or
    an array mask; unset, nothing changes; a bad value is refused when the routing is installed."""
    monkeypatch.setattr(suffix_attention, "AREA", suffix_attention.AREA)
    monkeypatch.delenv(suffix_attention.AREA_ENV, raising=False)
    try:
        assert suffix_attention.install(force=True)
        assert not suffix_attention.routed(1000, 1000, "causal")  # off by default
    finally:
        suffix_attention.uninstall()
    monkeypatch.setenv(suffix_attention.AREA_ENV, str(1 << 20))
    try:
        assert suffix_attention.install(force=True)
        assert suffix_attention.routed(1000, 1000, "causal") and suffix_attention.routed(512, 2048, None)
        assert not suffix_attention.routed(1024, 1025, "causal")  # over the area
        assert not suffix_attention.routed(1, 4096, None)  # a decode step keeps MLX's decode kernel
        assert not suffix_attention.routed(300, 600, mx.ones((300, 600), dtype=mx.bool_))
        q, k, v = (mx.random.normal((1, 4, 300, 64)), mx.random.normal((1, 2, 300, 64)),
                   mx.random.normal((1, 2, 300, 64)))
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        assert mx.allclose(got, suffix_attention._ORIGINAL(q, k, v, scale=0.125, mask="causal"),
                           atol=1e-5, rtol=1e-4).item()
    finally:
        suffix_attention.uninstall()
    monkeypatch.setenv(suffix_attention.AREA_ENV, "4M")
    with pytest.raises(ValueError, match=suffix_attention.AREA_ENV):
        suffix_attention.install(force=True)


def test_the_area_routing_rents_a_shape_twice_then_builds_its_graph(monkeypatch):
    """Under MLXD_UNFUSED_AREA a chunk shape goes the plain way in the first FUSE_AFTER - 1 forwards it comes
    up in (a new shape's graph build costs about three plain uses) and through MLX's kernel from the FUSE_AFTER-th
    on; its layers count once per forward (`next_forward`); the suffix rule's chunks always go the plain way;
    the table of shapes is bounded."""
    calls: list[tuple[int, int]] = []
    real = suffix_attention.unfused

    def spy(q, k, v, *, scale, causal, mask=None):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, scale=scale, causal=causal, mask=mask)

    monkeypatch.setattr(suffix_attention, "unfused", spy)
    monkeypatch.setattr(suffix_attention, "AREA", suffix_attention.AREA)
    monkeypatch.setattr(suffix_attention, "SEEN_MAX", 4)
    monkeypatch.setenv(suffix_attention.AREA_ENV, str(1 << 20))

    def forward(n: int, keys: int, layers: int = 3) -> int:
        """One forward of `layers` attentions of n queries over `keys`; how many went the plain way."""
        suffix_attention.next_forward()
        before = len(calls)
        q = mx.random.normal((1, 4, n, 64))
        k = v = mx.random.normal((1, 2, keys, 64))
        for _ in range(layers):
            got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
            want = suffix_attention._ORIGINAL(q, k, v, scale=0.125, mask="causal")
            assert mx.allclose(got, want, atol=1e-5, rtol=1e-4).item()
        return len(calls) - before

    try:
        assert suffix_attention.install(force=True)
        fuse = suffix_attention.FUSE_AFTER
        assert [forward(300, 300) for _ in range(fuse + 1)] == [3] * (fuse - 1) + [0, 0]
        assert forward(301, 301) == 3  # another length: a new shape, rented again
        assert [forward(64, 2048) for _ in range(fuse + 1)] == [3] * (fuse + 1)  # the suffix rule never buys
        for n in range(310, 316):  # more shapes than the table holds: the least recently seen is forgotten
            forward(n, n)
        assert len(suffix_attention._seen) == 4 and forward(300, 300) == 3
    finally:
        suffix_attention.uninstall()
    assert not suffix_attention._seen


def test_the_short_routing_is_set_by_its_variable(monkeypatch):
    """MLXD_SHORT_QUERY=1: only the long-context rule (a 5-query verify over 512 keys keeps MLX's); a
    bad value is refused when the routing is installed."""
    monkeypatch.setattr(suffix_attention, "SHORT_QUERY", suffix_attention.SHORT_QUERY)
    monkeypatch.setenv(suffix_attention.SHORT_ENV, "1")
    try:
        assert suffix_attention.install(force=True)
        assert not suffix_attention.routed(5, 512, "causal") and suffix_attention.routed(5, 2048, "causal")
    finally:
        suffix_attention.uninstall()
    monkeypatch.setenv(suffix_attention.SHORT_ENV, "many")
    with pytest.raises(ValueError, match="MLXD_SHORT_QUERY"):
        suffix_attention.install(force=True)
    assert suffix_attention._ORIGINAL is None
