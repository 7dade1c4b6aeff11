# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""Eight streams at once on one `mlxd serve`: when each row's first token comes, and where its time went.

The servers bench's 8-stream decode (benchmarks/gpu/bench_host_tier_servers.py `decode`, the same eight short
prompts) against one server on a preset model, `--rounds` times after a warm-up: per round, each stream's first
token after the run's first (ms), each client's time to first token from its request (`ttft_ms`), the run's end
(the last token after the first request, `end_ms`) and, from the server's `request.done` log lines
(`first_token_ms`), the time each request took to reach the engine (`to_engine`) and the steps to its first token.
Shows whether rows that arrive together start together, or one alone and the rest a step or more later.

With `--arms NAME=ENV[,ENV...] ...`, one server per arm (each with those environment variables; the key `ARGS`
is split on spaces into server arguments, `{tmp}` the run's temporary folder: `ssd=ARGS=--ssd-cache {tmp}/ssd`),
all up at once, every round visiting each in turn (the order alternating): per arm the joiners' median TTFT (every
stream but the first's), the last TTFT and the run's end, with each arm's ratio to the first arm per round
(median + IQR). `--fresh-tokens N`: before each run a fresh prompt of N tokens (its own text per run and arm), as
the servers bench's decode does (on an SSD server its checkpoint is written while the streams decode); with
`--streams 1`, one request right after it (a return while the last turn's checkpoint is written).

    PYTHONPATH=src python benchmarks/probe_join_first_tokens.py [--preset bench] [--rounds 12] [--tokens 24]
        [--arms late=MLXD_JOIN_FIRST_EARLY=0 early=MLXD_JOIN_FIRST_EARLY=1] [--fresh-tokens 2048]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "gpu"), str(HERE)]

from bench_gpu import text_of, ttft  # noqa: E402
from bench_host_tier_servers import TEXTS, decode, settle  # noqa: E402
from interleave import spread  # noqa: E402
from serve_proc import ServeProc  # noqa: E402


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """`NAME=KEY=VALUE[,KEY=VALUE...]` (or a bare NAME: no variables) -> (NAME, {KEY: VALUE})."""
    name, _, rest = text.partition("=")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def server_args(env: dict[str, str], tmp: Path) -> list[str]:
    """An arm's own server arguments: its `ARGS` variable split on spaces, `{tmp}` the run's temporary folder."""
    return [a.replace("{tmp}", str(tmp)) for a in env.get("ARGS", "").split()]


def summary(run: dict[str, Any]) -> dict[str, float]:
    """One run's figures (ms): the joiners' median TTFT (every stream but the first's; with one stream its own), the
    last TTFT, the end."""
    ttft = sorted(run["ttft_ms"])
    return {"joiners_ttft_ms": statistics.median(ttft[1:] or ttft), "last_ttft_ms": ttft[-1], "end_ms": run["end_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--cold", action="store_true", help="fresh prompts every round (no RAM hits past the template)")
    ap.add_argument("--arms", nargs="*", default=["default"], help="NAME=KEY=VALUE[,KEY=VALUE...] (a server each)")
    ap.add_argument("--streams", type=int, default=8, help="streams sent together each run (the bench's 8)")
    ap.add_argument("--fresh-tokens", type=int, default=0,
                    help="before each run, a fresh prompt of this many tokens (0: none)")
    ap.add_argument("--settle", action="store_true",
                    help="after the fresh prompt, wait until the server's writes are done (at most 60 s): the decode "
                         "without write-behind beside it")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()

    from mlxd.model import build_model

    arms = [parse_arm(a) for a in args.arms]
    prompts = [f"Story {j}: " + TEXTS["q2"] for j in range(args.streams)]
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in arms}
    done: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = build_model(Path(tmp) / args.preset, args.preset, seed=0)
        servers = {name: stack.enter_context(ServeProc(["--model", str(model), "--prompt-cache-gb", "1",
                                                        "--queue-timeout", "0", *server_args(env, Path(tmp))],
                                                       Path(tmp) / f"serve-{name}.log",
                                                       env={k: v for k, v in env.items() if k != "ARGS"}))
                   for name, env in arms}
        seed = 7000
        for server in servers.values():
            asyncio.run(decode(server.url, args.preset, prompts, 8))  # warm-up: every prompt a RAM hit from here on
        for r in range(args.rounds):
            for name, _ in (arms if r % 2 == 0 else arms[::-1]):
                texts = [f"Story {r}-{j}: " + TEXTS["q2"] for j in range(args.streams)] if args.cold else prompts
                if args.fresh_tokens:
                    asyncio.run(ttft(servers[name].url, args.preset, text_of(model, args.fresh_tokens, seed)))
                    seed += 1
                    if args.settle:
                        settle([servers[name].url], 60)
                got = asyncio.run(decode(servers[name].url, args.preset, texts, args.tokens))
                end = max(t + last - first for t, first, last in zip(got["ttft_ms"], got["first_ms"], got["last_ms"],
                                                                   strict=True))
                rounds[name].append({"first_ms": sorted(got["first_ms"]), "ttft_ms": got["ttft_ms"],
                                     "end_ms": round(end, 1), "per_stream_tok_s": got["per_stream_tok_s"]})
        for name, server in servers.items():
            server.signal()
            server.wait(60)
            done[name] = [q for q in (json.loads(line) for line in server.log().splitlines()
                                      if '"request.done"' in line)
                          if not args.fresh_tokens or q["prompt_tokens"] < args.fresh_tokens // 2]  # the streams
    out: dict[str, Any] = {"argv": sys.argv[1:], "arms": dict(arms), "rounds": rounds}
    for name, _ in arms:
        n = args.streams
        for r, requests in zip(rounds[name], (done[name][n * (i + 1): n * (i + 2)] for i in range(args.rounds)),
                               strict=True):
            r["requests"] = sorted(({"ttft_ms": q["ttft_ms"], "cached_tokens": q["cached_tokens"],
                                     **{k: q["first_token_ms"].get(k) for k in
                                        ("to_engine", "join", "apart", "forward", "steps", "step_ms")}}
                                    for q in requests), key=lambda q: q["ttft_ms"])
            r |= summary(r)
        joins = [r["first_ms"][-1] for r in rounds[name]]
        print(f"{name}: the last first token after the first: median {statistics.median(joins):.1f} ms "
              f"[{min(joins):.1f}–{max(joins):.1f}]; joiners' TTFT median "
              f"{statistics.median(r['joiners_ttft_ms'] for r in rounds[name]):.1f} ms, the run's end "
              f"{statistics.median(r['end_ms'] for r in rounds[name]):.1f} ms over {len(joins)} rounds")
    base = arms[0][0]
    out["ratios"] = {name: {key: spread([a[key] / b[key] for a, b in zip(rounds[name], rounds[base], strict=True)])
                            for key in ("joiners_ttft_ms", "last_ttft_ms", "end_ms")}
                     for name, _ in arms[1:]}
    for name, ratios in out["ratios"].items():
        print(f"{name} ÷ {base} per round: " + "; ".join(f"{k} {v['median']} [{v['iqr'][0]}–{v['iqr'][1]}]"
                                                          for k, v in ratios.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"join_first_tokens-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
