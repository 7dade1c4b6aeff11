"""Measure a `CostModel` on this machine's real engine (`mlxd simulate --calibrate`).

Times prefill at a few lengths and contexts, decode steps at two contexts, and
a save/load round trip of a KV cache with mlx-lm directly, all on the calling
thread, then fits the cost model's coefficients by least squares.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)
from mlxd.kv.cost_model import CostModel


def kv_bytes_per_token(model_dir: Path) -> int:
    """Bytes of K and V one token occupies across all layers (from config.json)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(cfg.get("torch_dtype"), 4)
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _prefill(model, cache, tokens):
    import mlx.core as mx

    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits, [c.state for c in cache])


def _random_tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(10, vocab - 1, size=n).tolist()


def measure_prefill(model, vocab: int, rng, shapes) -> list[tuple[int, int, float]]:
    """(new tokens, context, seconds) for each (new, context) shape."""
    from mlx_lm.models.cache import make_prompt_cache

    samples = []
    for new, ctx in shapes:
        cache = make_prompt_cache(model)
        if ctx:
            _prefill(model, cache, _random_tokens(rng, ctx, vocab))
        toks = _random_tokens(rng, new, vocab)
        samples.append((new, ctx, _timed(lambda c=cache, t=toks: _prefill(model, c, t))))
    return samples


def measure_decode(model, vocab: int, rng, contexts, steps: int) -> list[tuple[int, float]]:
    """(context, seconds per token) for single-token steps after a prefill of `context`."""
    from mlx_lm.models.cache import make_prompt_cache

    samples = []
    for ctx in contexts:
        cache = make_prompt_cache(model)
        _prefill(model, cache, _random_tokens(rng, ctx, vocab))
        _prefill(model, cache, [11])  # warm up the single-token graph

        def run(c=cache):
            for _ in range(steps):
                _prefill(model, c, [11])

        samples.append((ctx, _timed(run) / steps))
    return samples


def measure_restore(model, vocab: int, rng, tokens: int) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of a save/load round trip of a KV cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    def load_seconds(path: str) -> float:
        def run():
            cache = load_prompt_cache(path)
            mx.eval([c.state for c in cache])

        run()  # warm the page cache: a restore reads a recently written file
        return min(_timed(run) for _ in range(3))

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (16, tokens):
            cache = make_prompt_cache(model)
            _prefill(model, cache, _random_tokens(rng, n, vocab))
            path = str(Path(tmp) / f"c{n}.safetensors")
            save_prompt_cache(path, cache)
            results.append((Path(path).stat().st_size, load_seconds(path)))
    (small_bytes, small_s), (big_bytes, big_s) = results
    bandwidth = (big_bytes - small_bytes) / max(big_s - small_s, 1e-9)
    return max(small_s - small_bytes / bandwidth, 0.0), bandwidth


def fit_prefill(samples) -> tuple[float, float, float]:
    """Least-squares (fixed, per_token, per_pair), clipped at zero."""
    rows = [[1.0, n, n * ctx + n * n / 2] for n, ctx, _ in samples]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array([s for *_, s in samples]), rcond=None)
    fixed, per_token, per_pair = (max(float(c), 0.0) for c in coef)
    return fixed, per_token, per_pair


def fit_decode(samples) -> tuple[float, float]:
    """Least-squares (per_token, per_pair) from (context, seconds per token)."""
    rows = [[1.0, ctx] for ctx, _ in samples]
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array([s for _, s in samples]), rcond=None)
    return max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)


def calibrate(model_dir: Path, *, max_tokens: int = 2048, seed: int = 0, log=print) -> CostModel:
    """Measure prefill, decode and restore on the model in `model_dir`."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model = load(str(model_dir))[0]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    _prefill(model, make_prompt_cache(model), [1, 2])  # warm up
    m = max_tokens
    shapes = [(m // 16, 0), (m // 4, 0), (m // 2, 0), (m, 0), (m // 8, m // 2), (m // 8, m)]
    prefill = measure_prefill(model, vocab, rng, shapes)
    for new, ctx, s in prefill:
        log(f"prefill {new:6d} new on {ctx:6d} cached: {s:8.3f} s")
    decode = measure_decode(model, vocab, rng, [16, m], steps=16)
    for ctx, s in decode:
        log(f"decode at context {ctx:6d}: {s * 1000:8.2f} ms/token")
    restore_fixed, bandwidth = measure_restore(model, vocab, rng, m)
    log(f"restore: fixed {restore_fixed * 1000:.2f} ms, {bandwidth / 1e9:.2f} GB/s")
    fixed, per_token, per_pair = fit_prefill(prefill)
    d_token, d_pair = fit_decode(decode)
    return CostModel(
        model=model_dir.name,
        prefill_fixed=fixed,
        prefill_per_token=per_token,
        prefill_per_pair=per_pair,
        decode_per_token=d_token,
        decode_per_pair=d_pair,
        restore_fixed=restore_fixed,
        restore_bytes_per_s=bandwidth,
        kv_bytes_per_token=kv_bytes_per_token(model_dir),
    )
