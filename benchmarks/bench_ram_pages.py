"""Paged RAM tier vs contiguous entries (`--ram-pages on|off`, issue 26), side by side in one run.

    python benchmarks/bench_ram_pages.py [--preset default] [--sessions 64] [--shared 5000]

Two in-process runtimes (`open_runtime`, RAM tier only, a cap no run reaches),
one per arm. `--sessions` agent sessions share one `--shared`-token prompt
and each add their own `--suffix` tokens; session 0 prefills the shared
prompt (a miss), every later one is a RAM hit on it. One runtime at a time:
round 1 runs every session on each arm and reports RAM retained (the tier's
bytes, as /stats counts them, and MLX active memory grown over the sessions)
over the deduplicated KV (the union of the entries' tokens x KV bytes per
token); rounds 2.. (`--rounds`, default 2) run the first `--speed-sessions` again,
the arm order alternating. TTFT and decode tok/s: the RAM hits' medians over both rounds,
pages / contiguous (and per round).
Writes benchmarks/results/ram_pages-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARMS = ("contiguous", "pages")


async def _session(rt: Any, prompt: list[int], session: str, max_tokens: int) -> dict[str, Any]:
    from mlxd import SamplingParams
    from mlxd.runtime.kernel.messages import TokenGenerated

    t0 = time.perf_counter()
    times: list[float] = []
    request = rt.request(prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), session=session)
    async with rt.submit(request) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated):
                times.append(time.perf_counter() - t0)
    assert stream.accepted is not None
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"ttft_s": times[0], "decode_tok_s": decode, "tokens": len(times), "cached": stream.accepted.cached_tokens}


def _unique_tokens(entries: list[Any]) -> int:
    """Tokens of the union of the entries' prefixes."""
    keys = sorted(tuple(int(t) for t in e.tokens) for e in entries)
    total = sum(len(k) for k in keys)
    for prev, key in zip(keys, keys[1:], strict=False):
        m = min(len(prev), len(key))
        total -= next((i for i in range(m) if prev[i] != key[i]), m)
    return total


async def _arm(config: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One arm alone: every session's timings, then what its RAM tier holds (by /stats and MLX active memory)."""
    import gc

    import mlx.core as mx

    from mlxd import open_runtime

    async with open_runtime(config) as rt:
        gc.collect()
        before = mx.get_active_memory()
        rows = [await _session(rt, prompt, f"s{i}", max_tokens) for i, prompt in enumerate(prompts)]
        ram = (await rt.cache_stats())["ram"]
        gc.collect()
        held = int(mx.get_active_memory() - before)
        entries = list(rt.cache_owner.tiers.ram.entries())
        dedup = _unique_tokens(entries) * rt.info.kv_bytes_per_token
        return rows, {
            "ram_bytes": ram["bytes"], "checkpoint_bytes": ram["checkpoint_bytes"], "pages": ram["pages"],
            "entries": ram["entries"], "held_bytes": held, "dedup_kv_bytes": dedup,
            "retained_over_dedup": ram["bytes"] / dedup, "held_over_dedup": held / dedup,
            "kv_bytes_per_token": rt.info.kv_bytes_per_token,
        }


def _lend_cost(preset: str, tokens: int, page_tokens: int, rounds: int) -> dict[str, Any]:
    """A RAM hit's lend + join, alone, timed back to back (ms): a contiguous entry's slices vs pages concatenated,
    each then merged into a batch cache as the generator does. The merge of a slice shares its buffer (the copy
    comes at the row's first forward step, in both arms), so the difference is what pages add to a RAM hit."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlxd.kv import kinds
    from mlxd.kv.blocks import span_for
    from mlxd.kv.page_pool import PagePool
    from mlxd.model.presets import get_preset

    shape = get_preset(preset)  # fp32 KV of its layers, as the CPU serves it
    heads, dim = shape.num_key_value_heads, shape.head_dim
    page_tokens = page_tokens or span_for(shape.num_hidden_layers * 2 * heads * dim * 4)
    caches = []
    for _ in range(shape.num_hidden_layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, tokens, dim)), mx.random.normal((1, heads, tokens, dim)))
        caches.append(c)
    mx.eval([c.state for c in caches])
    paged = PagePool(fingerprint="bench", page_tokens=page_tokens).page(caches, list(range(tokens)), "")
    assert paged is not None
    usable = tokens - 64
    times: dict[str, list[float]] = {"contiguous": [], "pages": []}

    def join(lent: list[Any]) -> None:
        mx.eval([BatchKVCache.merge([x]).keys for x in lent])

    for i in range(rounds):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            t0 = time.perf_counter()
            join(kinds.lend(caches, usable, total=tokens) if arm == "contiguous" else paged.lend(usable))
            times[arm].append(1000 * (time.perf_counter() - t0))
    out: dict[str, Any] = {arm: statistics.median(v) for arm, v in times.items()}
    out["pages_minus_contiguous_ms"] = statistics.median(p - c for p, c in zip(times["pages"], times["contiguous"],
                                                                              strict=True))
    out["page_count"] = len(paged.pages)
    out["page_tokens"] = page_tokens
    return out


def _speed(rows: list[dict[str, Any]]) -> dict[str, Any]:
    hits = [r for r in rows if r["cached"] > 0]
    return {
        "ram_hits": len(hits), "cached_tokens_median": statistics.median(r["cached"] for r in hits),
        "ttft_ms_median": 1000 * statistics.median(r["ttft_s"] for r in hits),
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in hits if r["decode_tok_s"]),
    }


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from mlxd import RuntimeConfig

    rng = np.random.default_rng(7)
    shared = rng.integers(10, 1000, args.shared).tolist()
    prompts = [shared + rng.integers(10, 1000, args.suffix).tolist() for _ in range(args.sessions)]
    configs = {
        arm: RuntimeConfig(model_preset=args.preset, prompt_cache_bytes=64 << 30, memory_budget_bytes=0,
                           max_context=args.shared + args.suffix + args.max_tokens + 8, device_probe="off",
                           ram_pages="on" if arm == "pages" else "off", ram_page_tokens=args.page_tokens)
        for arm in ARMS
    }
    # One runtime at a time (two in one process ran at different speeds). Round 1: every session on each
    # arm (retention, timings); rounds 2.., the order alternating: the first --speed-sessions again (timings).
    out: dict[str, Any] = {}
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    rounds: list[dict[str, Any]] = []
    for n in range(args.rounds):
        order = ARMS if n % 2 == 0 else ARMS[::-1]
        count = len(prompts) if n == 0 else args.speed_sessions
        speeds = {}
        for arm in order:
            timed, held = await _arm(configs[arm], prompts[:count], args.max_tokens)
            rows[arm] += timed
            speeds[arm] = _speed(timed)
            if n == 0:
                out[arm] = held
            print(f"  round {n + 1}: {arm} done", flush=True)
        rounds.append({"order": list(order), "sessions": count, **speeds, "loadavg": os.getloadavg(),
                       "ttft_pages_over_contiguous": speeds["pages"]["ttft_ms_median"]
                       / speeds["contiguous"]["ttft_ms_median"],
                       "decode_pages_over_contiguous": speeds["pages"]["decode_tok_s_median"]
                       / speeds["contiguous"]["decode_tok_s_median"]})
    for arm in ARMS:
        out[arm].update(_speed(rows[arm]))
    out["ratios"] = {
        "ttft_pages_over_contiguous": out["pages"]["ttft_ms_median"] / out["contiguous"]["ttft_ms_median"],
        "decode_pages_over_contiguous": out["pages"]["decode_tok_s_median"] / out["contiguous"]["decode_tok_s_median"],
        # each round's ratio pairs the arms run back to back: their median is robust to load drifting between rounds
        "median_round_ttft_pages_over_contiguous": statistics.median(r["ttft_pages_over_contiguous"] for r in rounds),
        "median_round_decode_pages_over_contiguous": statistics.median(r["decode_pages_over_contiguous"]
                                                                       for r in rounds),
        "rounds": [{k: r[k] for k in ("order", "ttft_pages_over_contiguous", "decode_pages_over_contiguous")}
                   for r in rounds],
    }
    out["rounds"] = rounds
    out["lend_ms"] = _lend_cost(args.preset, args.shared + args.suffix, args.page_tokens, args.lend_rounds)
    out["rows"] = rows
    return out


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--shared", type=int, default=5000, help="tokens of the shared prompt")
    p.add_argument("--suffix", type=int, default=64, help="each session's own prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--speed-sessions", type=int, default=32, help="sessions of rounds 2.. (timings only)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, arm order alternating (round 1: every session)")
    p.add_argument("--page-tokens", type=int, default=0, help="RAM page size (0: the server's default)")
    p.add_argument("--lend-rounds", type=int, default=40, help="lend + join timings per arm")
    p.add_argument("--lend-only", action="store_true", help="only time a RAM hit's lend + join, both arms")
    p.add_argument("--device", choices=("default", "cpu"), default="default", help="cpu: MLX's CPU even with a GPU")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    if args.device == "cpu":
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    if args.lend_only:
        lend = _lend_cost(args.preset, args.shared + args.suffix, args.page_tokens, args.lend_rounds)
        print(f"preset {args.preset}, {args.shared + args.suffix} tokens, {args.shared} lent: RAM hit's lend + join "
              f"alone ({lend['page_count']} pages of {lend['page_tokens']}): contiguous {lend['contiguous']:.1f} ms, "
              f"pages {lend['pages']:.1f} ms, paired difference {lend['pages_minus_contiguous_ms']:+.1f} ms")
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"ram_pages-lend-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "lend_ms": lend}, indent=1))
        print(f"wrote {path}")
        return
    t0 = time.perf_counter()
    result = trio.run(_bench, args)
    import mlx.core as mx

    print(f"{mx.default_device()}, preset {args.preset}: {args.sessions} sessions over one {args.shared}-token prompt (+{args.suffix} "
          f"own tokens, {args.max_tokens} generated each); {time.perf_counter() - t0:.0f} s")
    print("arm          RAM MiB  held MiB  dedup MiB  retained/dedup  held/dedup  pages  hits  TTFT ms  decode tok/s")
    for arm in ARMS:
        r = result[arm]
        print(f"{arm:<11} {r['ram_bytes'] / 2**20:8.1f} {r['held_bytes'] / 2**20:9.1f} {r['dedup_kv_bytes'] / 2**20:10.1f} "
              f"{r['retained_over_dedup']:14.2f}x {r['held_over_dedup']:10.2f}x {r['pages']:6d} {r['ram_hits']:5d} "
              f"{r['ttft_ms_median']:8.1f} {r['decode_tok_s_median']:13.1f}")
    lend = result["lend_ms"]
    print(f"RAM hit's lend + join alone ({lend['page_count']} pages): contiguous {lend['contiguous']:.1f} ms, pages "
          f"{lend['pages']:.1f} ms, paired difference {lend['pages_minus_contiguous_ms']:+.1f} ms")
    ratios = result["ratios"]
    per_round = ", ".join(f"{'/'.join(r['order'])}: {r['ttft_pages_over_contiguous']:.3f}x, "
                          f"{r['decode_pages_over_contiguous']:.3f}x" for r in ratios["rounds"])
    print(f"pages / contiguous: TTFT {ratios['ttft_pages_over_contiguous']:.3f}x, decode tok/s "
          f"{ratios['decode_pages_over_contiguous']:.3f}x (per round, TTFT and decode: {per_round}; median of the "
          f"rounds' ratios {ratios['median_round_ttft_pages_over_contiguous']:.3f}x, "
          f"{ratios['median_round_decode_pages_over_contiguous']:.3f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ram_pages-{args.preset}-{args.device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
