"""Short prefill chunks over a long cached context attended without cuDNN, longer ones with contiguous keys
(CUDA; `MLXD_SUFFIX_ATTENTION`).

On CUDA, MLX runs a multi-token attention through a cuDNN graph built and cached per exact
query/key shape (mlx/backend/cuda/scaled_dot_product_attention.cpp, `sdpa_cache`): a next turn
(a ~30-token suffix over a 16k-token prefix) has a key length no earlier step had, so it builds a
graph, and its forward costs far more than a hit's (H200: 144-165 ms against 50-61 ms, both in
mlx-lm's steps). The same attention as plain operations (what MLX itself runs on the CPU: scores,
causal mask, precise softmax, values) has no per-shape build, and for a few dozen queries its
scores are small. On a GPU, chunks of 2..MAX_QUERY queries over at least MIN_KEYS keys (no sinks, a causal or no
mask) go that way; anything else keeps MLX's kernel. The H200 (18:48, `mlxd_ram_unfused` against
`mlxd_ram`, 3 rounds): the next turn's forward 133 -> 94 ms, its client time 0.729x. On by default on
a GPU (the CPU has no cuDNN: nothing to install); `MLXD_SUFFIX_ATTENTION=off` keeps MLX's everywhere.

Chunks of 2..SHORT_QUERY queries (no mask or a causal one) go the plain way over any number of keys: a
chunk that short over the exact keys has a new shape at nearly every key length (issue 23: a speculative
draft's catch-ups; a short suffix over a short context), and the H200 (21:09, benchmarks/gpu/verify_shapes.py,
Qwen3-1.7B shape) builds a plan for each new one in +58-67 ms against a 10-12 ms forward. Under an array mask
they keep MLX's kernel: the speculative forwards that have one attend over the whole KV buffer
(spec_batch.WholeBuffer, draft._LayerView), one shape per 256 positions, no build after the first (+0.05 ms),
and there the fused kernel is the cheaper (a 5-query verify 12.2 ms, plain operations 13.4 ms). `unfused`
takes an array mask too (MLXD_SHORT_QUERY does not route one; kept for measuring).

Every other chunk of more than one query reaches MLX's kernel with its keys and values made contiguous
(`mx.contiguous`: a copy when they are a slice of a larger cache buffer, nothing when they are not). The
graph's cache key holds the keys' strides as well as their shape, and a KV cache's keys are a slice
`[..., :offset, :]` of a buffer grown 256 positions at a time: its strides carry the buffer's size, which
depends on every chunk the cache took before (a 3-token cached prefix first: 256, 2,304, 4,352...), so a
prompt that started from a cached prefix, a restored one or a lent page built a graph for every chunk even
where the key lengths repeated. On the H100 (2026-12-05 18:36, benchmarks/gpu/probe_contiguous_kv.py, a 16k
prompt in 2,048-token chunks after a 3-token prefix, the chunks aligned to multiples of 2,048 as the engine
cuts them, engine/prefill_slices.aligned): 793 ms with the slices as they are (every chunk ~85 ms, each a new
graph), 481 ms contiguous the first time (two new shapes), 217 ms the next, against 193 ms for a warm prompt
from 0; the copy costs ~1 ms a chunk. A decode step (one query) keeps its slice: MLX's decode kernel reads the
buffer past the slice on purpose (`use_cudnn_for_decoding`).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "MLXD_SUFFIX_ATTENTION"
MAX_QUERY = 128  # a chunk this short is a suffix: its scores are queries x keys per head
MIN_KEYS = 1024  # over a context this long: a short context's graph build is rare and cheap to redo
# Chunks this short (no mask or a causal one) go the plain way over any number of keys: over the exact keys
# they see a new key length at nearly every step. MLXD_SHORT_QUERY sets it when the routing is installed
# (1: none, only the long-context rule above).
SHORT_QUERY = 16
SHORT_ENV = "MLXD_SHORT_QUERY"
# Chunks of 2+ queries whose queries x keys is at most this (no mask or a causal one) go the plain way too: a
# short prompt's or a mid-size suffix's chunk ends where its prompt does, a key length of its own, so each builds
# a graph (~80-200 ms on the H100 against a few ms of attention). MLXD_UNFUSED_AREA sets it when the routing is
# installed; 0, the default, is off until a GPU run measures it (benchmarks/gpu/probe_unfused_area.py).
AREA = 0
AREA_ENV = "MLXD_UNFUSED_AREA"
# The area rule rents before it buys: a chunk shape (queries, keys, heads, mask kind, dtype) it routes goes the
# plain way on the first FUSE_AFTER - 1 forwards it comes up in and through MLX's kernel from the FUSE_AFTER-th on
# (which builds its graph once; later ones find it cached). A server sees some shapes again and again (a trace's
# fixed lengths: H100 23:12/23:20, misses of 1,024 tokens at an engine median of 35.2 ms through the cached graph
# against 48.5 ms plain, `sim_ttft-h100-*-20261205-23*.json`) and most only once (a prompt's last chunk ends
# where its prompt does): a new shape through the kernel took 54-64 ms for 301-2,041 tokens against 11-42 ms
# plain (`unfused-area-h100-20261205-230209.json`). The build costs about three plain uses (~40 ms against
# ~13 ms a use), so the third sighting buys it (ski rental). Forwards are counted by `next_forward` (the
# engine calls it before each step); without it every sighting is the first.
FUSE_AFTER = 3
SEEN_MAX = 4096  # shapes remembered (least recently seen forgotten first)
_seen: dict[tuple[Any, ...], tuple[int, int]] = {}  # shape -> (forwards it came up in, the last one)
_forward = 0

_ORIGINAL: Any = None


def wanted() -> bool:
    """Whether it is on: unset, "" or "unfused" (the default); "0", "off" or "fused" turn it off. Another
    value is a ValueError (read once, when the engine loads: a typo must not measure one path as the other)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "0", "off", "fused", "unfused"):
        raise ValueError(f"{ENV} must be 'unfused' (the default) or 'fused'/'off'/'0', not {value!r}")
    return value in ("", "unfused")


def install(*, force: bool = False) -> bool:
    """Wrap `mx.fast.scaled_dot_product_attention` once per process on a GPU unless turned off (`force`:
    on any device, for tests); returns whether it is installed."""
    global _ORIGINAL, SHORT_QUERY, AREA
    import mlx.core as mx

    if _ORIGINAL is not None:
        return True
    if not force and (not wanted() or mx.default_device() == mx.cpu):
        return False
    SHORT_QUERY = _whole(SHORT_ENV, SHORT_QUERY, least=1, what="queries, 1 or more")
    AREA = _whole(AREA_ENV, AREA, least=0, what="query x key pairs (0: off)")
    original = mx.fast.scaled_dot_product_attention

    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None,
                                     sinks: Any = None, **kwargs: Any) -> Any:
        if sinks is None and not kwargs and routed(q.shape[2], k.shape[2], mask) and not _bought(q, k, mask):
            if isinstance(mask, str):
                return unfused(q, k, v, scale=scale, causal=True)
            return unfused(q, k, v, scale=scale, causal=False, mask=mask)
        if q.shape[2] > 1:  # a chunk: its graph keyed by the keys' shape alone, not their buffer's size
            k, v = mx.contiguous(k), mx.contiguous(v)
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)

    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
    _ORIGINAL = original
    return True


def _whole(name: str, default: int, *, least: int, what: str) -> int:
    """Environment variable `name` as a whole number of at least `least` (unset or "": `default`); else a
    ValueError naming it."""
    given = os.environ.get(name, "").strip()
    if not given:
        return default
    if not given.isdigit() or int(given) < least:
        raise ValueError(f"{name} must be a whole number of {what}, not {given!r}")
    return int(given)


def routed(queries: int, keys: int, mask: Any) -> bool:
    """Whether a chunk of `queries` over `keys` under `mask` (None, "causal" or an array) goes the plain way:
    2..SHORT_QUERY queries over any keys, up to MAX_QUERY over MIN_KEYS or more, or (MLXD_UNFUSED_AREA) 2+
    whose queries x keys is at most AREA, with no mask or a causal one. An array mask keeps MLX's (the
    whole-buffer views: stable shapes, the fused kernel the cheaper); so does a causal chunk longer than its
    keys (MLX aligns it to the end)."""
    if mask is not None and not isinstance(mask, str) or queries > keys:
        return False
    if isinstance(mask, str) and mask != "causal":
        return False
    return 1 < queries and (queries <= SHORT_QUERY or (queries <= MAX_QUERY and keys >= MIN_KEYS)
                            or queries * keys <= AREA)


def next_forward() -> None:
    """A new forward pass begins (the engine, before each step): a shape's sightings count once per forward,
    not once per layer."""
    global _forward
    _forward += 1


def _bought(q: Any, k: Any, mask: Any) -> bool:
    """Whether a chunk the rules route goes through MLX's kernel after all: routed by the area rule alone (the
    suffix and short-chunk rules always go the plain way) and its shape has come up in FUSE_AFTER forwards."""
    queries, keys = q.shape[2], k.shape[2]
    if AREA <= 0 or queries <= SHORT_QUERY or (queries <= MAX_QUERY and keys >= MIN_KEYS):
        return False
    shape = (tuple(q.shape), tuple(k.shape), mask if isinstance(mask, str) else "none", q.dtype)
    count, last = _seen.pop(shape, (0, -1))
    if last != _forward:
        count += 1
    _seen[shape] = (count, _forward)  # (re)inserted last: the dict's order is the sightings' order
    if len(_seen) > SEEN_MAX:
        del _seen[next(iter(_seen))]
    return count >= FUSE_AFTER


def uninstall() -> None:
    global _ORIGINAL
    import mlx.core as mx

    if _ORIGINAL is not None:
        mx.fast.scaled_dot_product_attention = _ORIGINAL
        _ORIGINAL = None
    _seen.clear()


def unfused(q: Any, k: Any, v: Any, *, scale: float, causal: bool, mask: Any = None) -> Any:
    """Attention as MLX's own fallback computes it (B, heads, L, D queries; grouped KV heads; a causal
    mask aligned to the end of the keys, or an array `mask`: boolean, True where a query may attend,
    or added to the scores, broadcast to (B, heads, L, keys) as MLX's kernel broadcasts it)."""
    import mlx.core as mx

    b, heads, n, d = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    q = q * mx.array(scale, dtype=q.dtype)
    repeats = heads // kv_heads
    if repeats > 1:
        q = q.reshape(b, kv_heads, repeats, n, d)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ mx.swapaxes(k, -1, -2)
    if causal:
        allowed = (mx.arange(n)[:, None] + (keys - n)) >= mx.arange(keys)[None]
        scores = mx.where(allowed, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    elif mask is not None:
        if repeats > 1:  # (.., heads, L, keys) -> (.., kv heads, repeats, L, keys), as the scores are
            if mask.ndim == 4 and mask.shape[1] == heads:
                mask = mask.reshape(mask.shape[0], kv_heads, repeats, *mask.shape[2:])
            else:
                mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(b, heads, n, v.shape[-1]) if repeats > 1 else out
