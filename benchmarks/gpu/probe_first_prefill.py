# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Why a restarted server's first recomputes are slow (issue 28): prefill chunk by chunk in a fresh process.

After a restart on the H100 (`host_servers-h100-restart-20261205-151041.json`, `restart_never`), the first
returning turn's 16k-token recompute spent 1.19-1.52 s in its forward passes, the second 0.90-1.06 s, the third
0.35-0.96 s, at ~100, ~80 and ~34 ms per 2,048-token chunk: every chunk slow, not just the first (a kernel built
on first use would slow one). The suspect is fresh device memory: the first turns' KV and activations are new
allocations, the third's reuse buffers an evicted entry freed. Here, with no server, four 16k prefills in one
fresh process, in chunks as the engine's (mlx_lm's KV cache, `--chunk` tokens, each chunk evaluated and
synchronized), each timed chunk by chunk, MLX's active / cache memory after each:
  p1: fresh process; p2: p1's cache kept (fresh memory again); p3: after p1's cache is dropped (its buffers in
  MLX's cache); p4: after p2 and p3 are dropped; p5: chunks of 3/4 the size (new shapes in a warm process: if
  slow as p1's later chunks, the first use of a shape is the cost); p6-p9: after a 3- and a 5-token prefix,
  chunks counted from the prefix (new key lengths) against chunks aligned to multiples of the chunk size.
(H100 15:39: p1's first chunk 7,858 ms on a fresh machine, its other seven 63-119 ms; p2-p4 17-31 ms a chunk.
H100 17:43: p5 85-176 ms a chunk after any warm-up; `--warm whole` made p1 203 ms.)
`--warm MODE` first runs a warm-up and drops it: `chunk` (one chunk's prefill), `whole` (a whole 16k prefill,
what a startup warm-up to the longest prompt would be). Each mode in its own process (`--modes`).

    python3 benchmarks/gpu/probe_first_prefill.py --modes none chunk whole --json OUT.json
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, built, load  # noqa: E402


def prefill(model: Any, tokens: list[int], chunk: int, *, prefix: int = 0, align: bool = False
            ) -> tuple[Any, list[float]]:
    """Chunks of `chunk` tokens, each timed; `prefix` tokens first as a step of their own (a cached prefix:
    the chunks start after it), `align`: the chunks end on multiples of `chunk` (mlxd's prefill_slices.aligned)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engine.prefill_slices import aligned

    cache = make_prompt_cache(model)
    steps, at = [], 0
    while at < len(tokens):
        n = prefix if at == 0 and prefix else aligned(chunk, at, len(tokens) - at) if align else chunk
        t0 = time.perf_counter()
        out = model(mx.array([tokens[at:at + n]]), cache=cache)
        mx.eval(out, [c.state for c in cache])
        mx.synchronize()
        steps.append(round((time.perf_counter() - t0) * 1000, 2))
        at += n
    return cache, steps


def one_process(model_dir: Path, warm: str, tokens: int, chunk: int, seed: int) -> dict[str, Any]:
    import random

    model, _ = load(model_dir)
    rng = random.Random(seed)
    prompt = lambda: [rng.randrange(3, 8000) for _ in range(tokens)]  # noqa: E731
    out: dict[str, Any] = {"warm": warm, "tokens": tokens, "chunk": chunk, "prefills": []}
    t0 = time.perf_counter()
    if warm == "chunk":
        c, _ = prefill(model, prompt()[:chunk], chunk)
        del c
    elif warm == "whole":
        c, _ = prefill(model, prompt(), chunk)
        del c
    out["warm_s"] = round(time.perf_counter() - t0, 3)

    def record(name: str, steps: list[float]) -> None:
        out["prefills"].append({"name": name, "total_ms": round(sum(steps), 1), "steps_ms": steps,
                                "active_gb": round(mx.get_active_memory() / 1e9, 3),
                                "cache_gb": round(mx.get_cache_memory() / 1e9, 3)})
        print(f"  warm={warm} {name}: {sum(steps):.1f} ms  {steps}", flush=True)

    c1, s = prefill(model, prompt(), chunk)
    record("p1 fresh", s)
    c2, s = prefill(model, prompt(), chunk)
    record("p2 p1 kept", s)
    del c1
    c3, s = prefill(model, prompt(), chunk)
    record("p3 p1 dropped", s)
    del c2, c3
    c4, s = prefill(model, prompt(), chunk)
    record("p4 p2 p3 dropped", s)
    del c4
    c5, s = prefill(model, prompt(), chunk * 3 // 4)
    record("p5 new chunk shapes", s)
    del c5
    # A prompt after a 3-token cached prefix (a chat header), as the server chunked it before 2026-12-05 18:30
    # (from the prefix: every key length new) and as it does now (aligned: the shapes p1-p4 built); then a
    # 5-token prefix unaligned (new shapes again) and aligned (none).
    for name, pre, align in (("p6 prefix 3 unaligned", 3, False), ("p7 prefix 3 aligned", 3, True),
                             ("p8 prefix 5 unaligned", 5, False), ("p9 prefix 5 aligned", 5, True)):
        c, s = prefill(model, prompt(), chunk, prefix=pre, align=align)
        record(name, s)
        del c
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["none", "chunk", "whole"], choices=["none", "chunk", "whole"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path("/tmp/host-servers-work"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = built(QWEN3_1_7B, args.work)
    if args.child is not None:
        print(json.dumps(one_process(model_dir, args.child, args.tokens, args.chunk, seed=7)))
        return 0
    results = {"device": str(mx.default_device()), "argv": sys.argv[1:], "processes": []}
    for mode in args.modes:  # each in a fresh process
        run = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens),
                              "--chunk", str(args.chunk), "--work", str(args.work)],
                             capture_output=True, text=True, timeout=300)
        lines = run.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), run.stderr[-2000:] if run.returncode else "", flush=True)
        results["processes"].append(json.loads(lines[-1]) if run.returncode == 0 and lines else
                                    {"warm": mode, "error": run.stderr[-2000:]})
        if args.json is not None:  # after each mode: a phase cut short keeps what ran
            args.json.write_text(json.dumps(results, indent=1))
            print("->", args.json, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
