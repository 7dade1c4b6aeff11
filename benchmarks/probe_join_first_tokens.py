# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Eight streams at once on one `mlxd serve`: when each row's first token comes, and where its time went.

The servers bench's 8-stream decode (benchmarks/gpu/bench_host_tier_servers.py `decode`, the same eight short
prompts) against one server on a preset model, `--rounds` times after a warm-up: per round, each stream's first
token after the run's first (ms) and, from the server's `request.done` log lines (`first_token_ms`), the time each
request took to reach the engine (`to_engine`) and the steps to its first token. Shows whether rows that arrive
together start together, or one alone and the rest a step or more later.

    PYTHONPATH=src python benchmarks/probe_join_first_tokens.py [--preset bench] [--rounds 12] [--tokens 24]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu"), str(HERE)]

from bench_host_tier_servers import TEXTS, decode  # noqa: E402
from serve_proc import ServeProc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()

    from mlxd.model import build_model

    prompts = [f"Story {j}: " + TEXTS["q2"] for j in range(8)]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / args.preset, args.preset, seed=0)
        with ServeProc(["--model", str(model), "--prompt-cache-gb", "1", "--queue-timeout", "0"],
                       Path(tmp) / "serve.log") as server:
            asyncio.run(decode(server.url, args.preset, prompts, 8))  # warm-up: every prompt a RAM hit from here on
            for _ in range(args.rounds):
                got = asyncio.run(decode(server.url, args.preset, prompts, args.tokens))
                rounds.append({"first_ms": sorted(got["first_ms"]), "per_stream_tok_s": got["per_stream_tok_s"]})
            server.signal()
            server.wait(60)
            done = [json.loads(line) for line in server.log().splitlines() if '"request.done"' in line]
    for r, requests in zip(rounds, (done[8 * (i + 1): 8 * (i + 2)] for i in range(len(rounds))), strict=True):
        r["requests"] = sorted(({"ttft_ms": q["ttft_ms"], **{k: q["first_token_ms"].get(k) for k in
                                                            ("to_engine", "forward", "steps", "step_ms")}}
                                for q in requests), key=lambda q: q["ttft_ms"])
        first, rest = r["requests"][0], r["requests"][1:]
        print(f"last first token {r['first_ms'][-1]:7.1f} ms; first request to_engine {first['to_engine']} ms, "
              f"{first['steps']} step(s); the others to_engine {min(q['to_engine'] for q in rest)}–"
              f"{max(q['to_engine'] for q in rest)} ms, steps {sorted({q['steps'] for q in rest})}", flush=True)
    joins = [r["first_ms"][-1] for r in rounds]
    print(f"the last first token after the first: median {statistics.median(joins):.1f} ms "
          f"[{min(joins):.1f}–{max(joins):.1f}] over {len(joins)} rounds")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"join_first_tokens-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps({"argv": sys.argv[1:], "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
