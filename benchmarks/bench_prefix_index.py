"""Prefix index lookups and inserts at serving scale.

10,000 resident entries of 8,192-token prompts: 100 system prompts (2,048
tokens each) x 100 conversations (6,144 tokens each) under each. Requests
mix what a chat server sees: 80% continue a cached conversation (its tokens
plus a 256-token new turn: an exact-prefix hit of 8,192), 15% open a new
conversation on a known system prompt (a trimmed hit of 2,048), 5% are cold.

    python benchmarks/bench_prefix_index.py [--entries 10000] [--requests 5000]

The timings go to benchmarks/results/prefix_index-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from mlxd.kv.prefix_index import PrefixIndex

VOCAB = 150_000
SYSTEM_TOKENS = 2_048
CONVERSATION_TOKENS = 6_144
TURN_TOKENS = 256


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n, dtype=np.int32)


def system_prompt(s: int) -> np.ndarray:
    return tokens(1_000_000 + s, SYSTEM_TOKENS)


def conversation(s: int, c: int) -> np.ndarray:
    return np.concatenate([system_prompt(s), tokens(s * 100_000 + c, CONVERSATION_TOKENS)])


def make_request(rng: np.random.Generator, systems: int, convs: int) -> tuple[np.ndarray, int]:
    """A prompt and the usable length the index must report."""
    s, c, roll = rng.integers(systems), rng.integers(convs), rng.random()
    if roll < 0.80:
        prompt = np.concatenate([conversation(s, c), tokens(int(rng.integers(2**31)), TURN_TOKENS)])
        return prompt, SYSTEM_TOKENS + CONVERSATION_TOKENS
    if roll < 0.95:
        prompt = np.concatenate([system_prompt(s), tokens(int(rng.integers(2**31)), 6_400)])
        return prompt, SYSTEM_TOKENS
    return tokens(int(rng.integers(2**31)), 8_448), 0


def percentiles(samples_ns: list[int]) -> tuple[float, float, float]:
    us = np.array(samples_ns) / 1e3
    return float(us.mean()), float(np.percentile(us, 50)), float(np.percentile(us, 99))


def build(systems: int, convs: int) -> tuple[PrefixIndex, list[int]]:
    index, insert_ns = PrefixIndex(), []
    for s in range(systems):
        for c in range(convs):
            entry = conversation(s, c)
            start = time.perf_counter_ns()
            index.insert(entry, (s, c), trimmable=True)
            insert_ns.append(time.perf_counter_ns() - start)
    return index, insert_ns


def lookups(index: PrefixIndex, requests, as_list: bool) -> list[int]:
    samples = []
    for prompt, want in requests:
        query = prompt.tolist() if as_list else prompt
        start = time.perf_counter_ns()
        match = index.longest_usable(query, limit=len(prompt) - 1)
        samples.append(time.perf_counter_ns() - start)
        assert (match.usable if match else 0) == want
    return samples


def index_bytes(systems: int, convs: int) -> int:
    """Python heap held by a freshly built index (tracemalloc; slows building, so measured apart)."""
    tracemalloc.start()
    index, _ = build(systems, convs)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del index
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=5_000)
    args = parser.parse_args()
    systems = 100
    convs = args.entries // systems

    index, insert_ns = build(systems, convs)
    rng = np.random.default_rng(7)
    requests = [make_request(rng, systems, convs) for _ in range(args.requests)]
    array_ns = lookups(index, requests, as_list=False)
    list_ns = lookups(index, requests[: args.requests // 5], as_list=True)
    remove_ns = []
    for s, c in zip(rng.integers(systems, size=500), rng.integers(convs, size=500), strict=True):
        entry = conversation(int(s), int(c))
        start = time.perf_counter_ns()
        index.remove(entry)
        remove_ns.append(time.perf_counter_ns() - start)
    unique_tokens = systems * SYSTEM_TOKENS + systems * convs * CONVERSATION_TOKENS
    held = index_bytes(systems, convs)

    print(
        f"entries={systems * convs} x {SYSTEM_TOKENS + CONVERSATION_TOKENS} tokens, "
        f"{systems} system prompts, requests={args.requests}"
    )
    print(f"{'operation':<44}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}")
    rows = [
        ("lookup, numpy int32 prompt (8.2-8.4k tokens)", array_ns),
        ("lookup, Python list prompt (incl. packing)", list_ns),
        ("insert 8,192-token entry (numpy)", insert_ns),
        ("remove entry", remove_ns),
    ]
    table = {}
    for name, samples in rows:
        mean, p50, p99 = percentiles(samples)
        table[name] = {"mean_us": mean, "p50_us": p50, "p99_us": p99, "n": len(samples)}
        print(f"{name:<44}{mean:>10.1f}{p50:>10.1f}{p99:>10.1f}")
    out = Path(__file__).resolve().parent / "results" / f"prefix_index-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/bench_prefix_index.py", *sys.argv[1:]]),
        "entries": systems * convs, "requests": args.requests, "timings": table,
        "index_bytes": held, "distinct_tokens": unique_tokens,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    print(
        f"index memory: {held / 2**20:.0f} MiB for {unique_tokens / 1e6:.1f}M distinct tokens "
        f"({held / unique_tokens:.2f} bytes/token)"
    )


if __name__ == "__main__":
    main()
