"""KV schemes side by side: native precision vs affine KV8 vs KV4 (`--kv-bits`).

    python benchmarks/bench_kv_schemes.py [--preset default] [--context 2048] [--conversations 3]
                                          [--followups 3] [--rounds 2]

Each scheme runs in its own fresh process (so resident memory is its own),
through the in-process runtime API (`open_runtime`) with the RAM and SSD
tiers on. Per scheme and round:

1. `--conversations` prompts of `--context` random token ids, each prefilled
   cold (max_tokens 1): the RAM tier then holds one checkpoint per
   conversation, all of equal context;
2. resident memory is read there: MLX active memory (weights + checkpoints +
   buffers) and the process RSS, and the same less the values right after
   the model loaded (what the checkpoints and batch buffers cost);
3. `--followups` follow-ups per conversation (the prompt + 32 new tokens):
   TTFT of a RAM hit, from submit to the first token event;
4. bytes per token: the RAM entries' logical bytes over their tokens, the
   engine's measured `kv_bytes_per_token`, and the SSD files' bytes over
   their tokens after a flush.

Schemes alternate order across rounds (native, kv8, kv4, then reversed), and
the report gives each scheme's median beside the native one's, as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMES = {"native": None, "kv8": 8, "kv4": 4}
SUFFIX = 32


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _ssd_bytes_per_token(ssd: Path) -> float:
    """The SSD files' bytes over the tokens they hold; removes the files."""
    from mlxd.kv import file_format

    files = list(ssd.rglob("*.mlxkv"))
    tokens = sum(len(file_format.read_header(f).tokens) for f in files)
    size = sum(f.stat().st_size for f in files)
    for f in files:
        f.unlink()
    return size / max(1, tokens)


async def _ttft(rt: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first generated token, and the cached tokens it reused."""
    from mlxd import SamplingParams
    from mlxd.runtime.kernel.messages import TokenGenerated

    t0 = time.perf_counter()
    first = None
    async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=1))) as stream:
        async for event in stream:
            if first is None and isinstance(event, TokenGenerated):
                first = time.perf_counter() - t0
    assert first is not None and stream.accepted is not None
    return first, stream.accepted.cached_tokens


async def _one(args: argparse.Namespace, scheme: str) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from mlxd import RuntimeConfig, open_runtime

    ssd = Path(tempfile.mkdtemp(prefix="bench-kv-"))
    config = RuntimeConfig(
        model_preset=args.preset, kv_bits=SCHEMES[scheme], ssd_cache_dir=ssd, prompt_cache_bytes=16 << 30,
        max_context=args.context + SUFFIX + 8, ssd_demote_idle_s=0, ssd_write_rate_bytes=0,
        ssd_layout="whole",  # SSD bytes per token: one file per checkpoint, as measured before blocks
    )
    rng = np.random.default_rng(7)
    async with open_runtime(config) as rt:
        loaded_active, loaded_rss = mx.get_active_memory(), _rss_bytes()
        vocab = rt.info.vocab_size
        prompts = [rng.integers(16, vocab, size=args.context).tolist() for _ in range(args.conversations)]
        cold = [(await _ttft(rt, p))[0] for p in prompts]
        active, rss = mx.get_active_memory(), _rss_bytes()
        ram = list(rt.cache_owner.cache.entries())
        follow, reused = [], []
        for _ in range(args.followups):
            for p in prompts:
                seconds, hit = await _ttft(rt, p + rng.integers(16, vocab, size=SUFFIX).tolist())
                follow.append(seconds)
                reused.append(hit)
        report = await rt.flush()
        assert report["durable"], report
    return {
        "scheme": scheme,
        "kv_bits": SCHEMES[scheme],
        "kv_bytes_per_token": rt.info.kv_bytes_per_token,
        "ram_bytes_per_token": sum(e.nbytes for e in ram) / sum(len(e.tokens) for e in ram),
        "ssd_bytes_per_token": _ssd_bytes_per_token(ssd),
        "ram_entries_at_equal_context": len(ram),
        "mlx_active_bytes": active,
        "mlx_active_over_loaded_bytes": active - loaded_active,
        "rss_bytes": rss,
        "rss_over_loaded_bytes": rss - loaded_rss,
        "cold_ttft_s": cold,
        "followup_ttft_s": follow,
        "followup_cached_tokens": reused,
    }


def _child(args: argparse.Namespace, scheme: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", scheme, "--preset", args.preset, "--context", str(args.context),
           "--conversations", str(args.conversations), "--followups", str(args.followups)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "MLXD_LOG_LEVEL": "warning"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--followups", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", choices=tuple(SCHEMES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        import trio

        sys.path.insert(0, str(REPO / "src"))
        print(json.dumps(trio.run(_one, args, args.one)))
        return

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEMES}
    for r in range(args.rounds):
        order = list(SCHEMES) if r % 2 == 0 else list(reversed(SCHEMES))
        for scheme in order:
            row = _child(args, scheme)
            runs[scheme].append(row)
            print(f"round {r} {scheme:6s}: follow-up TTFT {statistics.median(row['followup_ttft_s']) * 1e3:7.1f} ms, "
                  f"cold {statistics.median(row['cold_ttft_s']):6.2f} s, RAM {row['ram_bytes_per_token']:7.0f} B/token, "
                  f"MLX active +{row['mlx_active_over_loaded_bytes'] / 2**20:6.1f} MiB", flush=True)

    def med(scheme: str, key: str) -> float:
        values = [v for row in runs[scheme] for v in (row[key] if isinstance(row[key], list) else [row[key]])]
        return statistics.median(values)

    summary = {}
    for scheme in SCHEMES:
        summary[scheme] = {
            "ram_bytes_per_token": med(scheme, "ram_bytes_per_token"),
            "ssd_bytes_per_token": med(scheme, "ssd_bytes_per_token"),
            "kv_bytes_per_token": med(scheme, "kv_bytes_per_token"),
            "followup_ttft_ms": med(scheme, "followup_ttft_s") * 1e3,
            "cold_ttft_s": med(scheme, "cold_ttft_s"),
            "mlx_active_over_loaded_MiB": med(scheme, "mlx_active_over_loaded_bytes") / 2**20,
            "rss_over_loaded_MiB": med(scheme, "rss_over_loaded_bytes") / 2**20,
        }
    base = summary["native"]
    print(f"\n{args.conversations} conversations x {args.context} tokens, preset {args.preset}; medians; "
          "ratio = scheme / native")
    print("scheme  RAM B/tok  SSD B/tok  follow-up TTFT ms  cold TTFT s  MLX active +MiB  RSS +MiB")
    for scheme, s in summary.items():
        print(f"{scheme:6s} {s['ram_bytes_per_token']:10.0f} {s['ssd_bytes_per_token']:10.0f} "
              f"{s['followup_ttft_ms']:13.1f} ({s['followup_ttft_ms'] / base['followup_ttft_ms']:.2f}x) "
              f"{s['cold_ttft_s']:8.2f} ({s['cold_ttft_s'] / base['cold_ttft_s']:.2f}x) "
              f"{s['mlx_active_over_loaded_MiB']:9.1f} ({s['mlx_active_over_loaded_MiB'] / base['mlx_active_over_loaded_MiB']:.2f}x) "
              f"{s['rss_over_loaded_MiB']:7.1f}")
    out = REPO / "benchmarks" / "results" / f"kv_schemes-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "args": {k: v for k, v in vars(args).items() if k != "one"},
        "summary": summary,
        "runs": runs,
    }, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
