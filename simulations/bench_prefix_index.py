"""Benchmark: prefix lookups with 10,000 resident 8k-token entries.

    /tmp/venv/bin/python simulations/bench_prefix_index.py [--entries 10000] [--tokens 8192]

Builds a `PromptCache` (the serving RAM tier) holding `entries` conversations
of `tokens` tokens each, sharing one of 10 system prompts of 1,024 tokens, then
times `take()` for follow-up turns (prompt = a resident entry + 200 new tokens:
the hit is the whole entry) and for new conversations (system prompt + new
text: the hit is the system prompt, trimmed out of a resident entry). Prompts
are passed as int32 numpy arrays and as Python lists (the list case includes
packing the prompt).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import mlxd  # noqa: F401
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.retention import make_policy

SYSTEM = 1024


def build(entries: int, tokens: int, rng) -> tuple[PromptCache, list[np.ndarray]]:
    systems = [rng.integers(0, 150_000, SYSTEM, dtype=np.int32) for _ in range(10)]
    cache = PromptCache(max_bytes=2**62, policy=make_policy("lru"))
    convs = []
    for i in range(entries):
        body = rng.integers(0, 150_000, tokens - SYSTEM, dtype=np.int32)
        conv = np.concatenate([systems[i % 10], body])
        cache.put(conv, "", payload=None, nbytes=tokens, trimmable=True)
        convs.append(conv)
    return cache, convs


def time_lookups(cache, prompts) -> tuple[float, int]:
    start = time.perf_counter()
    hit = 0
    for p in prompts:
        h = cache.take(p, "")
        hit += h.usable if h else 0
    return (time.perf_counter() - start) / len(prompts), hit // len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    cache, convs = build(args.entries, args.tokens, rng)
    build_s = time.perf_counter() - t0
    pick = rng.integers(0, len(convs), args.lookups)
    follow = [
        np.concatenate([convs[i], rng.integers(0, 150_000, 200, dtype=np.int32)]) for i in pick
    ]
    fresh = [
        np.concatenate(
            [convs[i][:SYSTEM], rng.integers(0, 150_000, args.tokens - SYSTEM, dtype=np.int32)]
        )
        for i in pick
    ]
    results = {"entries": len(cache), "tokens_per_entry": args.tokens, "build_s": round(build_s, 2)}
    for name, prompts in (("follow_up", follow), ("new_conversation", fresh)):
        per, hit = time_lookups(cache, prompts)
        results[f"{name}_array_us"] = round(per * 1e6, 1)
        per, _ = time_lookups(cache, [p.tolist() for p in prompts])
        results[f"{name}_list_us"] = round(per * 1e6, 1)
        results[f"{name}_hit_tokens"] = hit
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
