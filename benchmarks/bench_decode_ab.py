"""Decode over HTTP, mlx_lm.server against `mlxd serve` from one or more source trees, rounds interleaved.

Every server starts at once (idle ones cost nothing); each round decodes 1 then 8
streams on each server in turn, so a loaded host's drift lands on every arm alike;
reported: per arm and level the median tok/s and its ratio to mlx_lm's median,
and each round's ratio to the mlx_lm decode just before it (issue 28: the engine
thread stepping on by itself vs one trio round trip per step). An arm is
`NAME=SRC` (a `src` directory put first on PYTHONPATH); `--ssd` adds `NAME+ssd`
(`--host-cache-gb 1 --ssd-cache DIR`) with a fresh prompt before each decode, so its
write-behind runs while it decodes.

For a noisy host (the H200's runs, issue 28): `--fresh-all` sends the fresh prompt before
every server's decode (the goal's workload: bench_host_tier_servers.py), `--control` adds a
second mlx_lm.server (`mlx_lm2`: its ratio to mlx_lm is the noise floor), the order of the
servers rotates every round, `--budget S` starts no round that would end past S seconds,
and the summary gives per arm and level the per-round ratios to mlx_lm with their median,
quartiles and minimum. A `--model` named `model-qwen3-1.7b-shape` that does not exist is
built (as the servers bench builds it).

    python benchmarks/bench_decode_ab.py --model DIR --arm new=src --arm base=/tmp/base/src --rounds 5 --ssd
    python benchmarks/bench_decode_ab.py --model /tmp/host-servers-work/model-qwen3-1.7b-shape --arm mlxd=src \
        --ssd --fresh-all --control --tokens 256 --fresh-tokens 8192 --serve-args "--prompt-cache-gb 3" \
        --ssd-args "--host-cache-gb 24" --rounds 20 --budget 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))

from bench_gpu import QWEN3_1_7B, Proc, built, log, text_of, ttft  # noqa: E402
from bench_host_tier_servers import TEXTS, decode  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--arm", action="append", required=True, help="NAME=SRC (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--ssd", action="store_true", help="also each arm with --host-cache-gb 1 --ssd-cache")
    ap.add_argument("--fresh-tokens", type=int, default=1024, help="the fresh prompt before an SSD arm's decode")
    ap.add_argument("--ssd-args", default="", help="more `mlxd serve` flags for the SSD arms, e.g. a RAM tier and "
                    "write rate scaled so the write backlog passes its bound as on the H200")
    ap.add_argument("--serve-args", default="", help="more `mlxd serve` flags for every mlxd arm")
    ap.add_argument("--fresh-all", action="store_true", help="the fresh prompt before every server's decode")
    ap.add_argument("--control", action="store_true", help="a second mlx_lm.server (mlx_lm2): the noise floor")
    ap.add_argument("--budget", type=float, default=0, help="seconds: no round starts that would end past it")
    ap.add_argument("--copy-logs", action="store_true", help="copy each server's log to --out at the end")
    ap.add_argument("--port", type=int, default=18390)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "decode-ab-work")
    args = ap.parse_args()
    t_begin = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.model / "config.json").exists() and args.model.name == f"model-{QWEN3_1_7B.name}":
        built(QWEN3_1_7B, args.model.parent)
    levels = [int(x) for x in args.streams.split(",") if x]
    port = args.port
    servers: dict[str, tuple[Proc, str]] = {}

    base_path = os.environ.get("PYTHONPATH", "")

    def add(name: str, cmd: list[str], ready: str, src: str | None) -> None:
        nonlocal port
        path = os.pathsep.join(p for p in (src, base_path) if p)
        proc = Proc(name, ["env", f"PYTHONPATH={path}", *cmd, "--port", str(port)], port, ready,
                    args.work / f"{name}.log")
        servers[name] = (proc, src or "")
        port += 1

    mlx_lm = [sys.executable, "-m", "mlx_lm", "server", "--model", str(args.model), "--log-level", "WARNING"]
    add("mlx_lm", mlx_lm, "/v1/models", None)
    if args.control:
        add("mlx_lm2", mlx_lm, "/v1/models", None)
    for arm in args.arm:
        name, src = arm.split("=", 1)
        serve = [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(args.model), "--log-format", "json",
                 "--queue-timeout", "0", "--device-probe", "off", *args.serve_args.split()]
        add(name, serve, "/health", src)
        if args.ssd:
            ssd = args.work / f"ssd-{name}"
            shutil.rmtree(ssd, ignore_errors=True)
            add(f"{name}+ssd", [*serve, "--host-cache-gb", "1", "--ssd-cache", str(ssd), *args.ssd_args.split()],
                "/health", src)
    import mlx.core as mx

    out: dict[str, Any] = {"device": str(mx.default_device()), "argv": sys.argv, "load_before": os.getloadavg(),
                           "rounds": [], "orders": []}
    names = list(servers)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        with ThreadPoolExecutor(len(servers)) as pool:  # every server starts at once
            out["start_s"] = dict(zip(names, pool.map(lambda n: round(servers[n][0].start(), 1), names), strict=True))
        log("started", json.dumps(out["start_s"]))
        fresh = 0
        round_s = 0.0
        for r in range(args.rounds):
            if args.budget and time.perf_counter() - t_begin + round_s > args.budget:
                log(f"budget: {len(out['rounds'])} rounds")
                break
            t_round = time.perf_counter()
            order = names[r % len(names):] + names[:r % len(names)]  # rotated: no server always first
            out["orders"].append(order)
            row: dict[str, Any] = {}
            for n in levels:
                for name in order:
                    proc = servers[name][0]
                    model = "default_model" if name.startswith("mlx_lm") else args.model.name
                    if name.endswith("+ssd") or args.fresh_all:
                        fresh += 1
                        asyncio.run(ttft(proc.base, model, text_of(args.model, args.fresh_tokens, 900 + fresh)))
                    prompts = [f"Story {j}: " + TEXTS["q2"] for j in range(n)]
                    before = _writer(proc.base) if name.endswith("+ssd") else None
                    row.setdefault(name, {})[str(n)] = asyncio.run(decode(proc.base, model, prompts, args.tokens))["tok_s"]
                    if before is not None:  # what write-behind did beside this decode
                        after = _writer(proc.base)
                        row.setdefault("writes", {})[f"{name} {n}"] = {
                            "gb_written": round((after.get("bytes_written", 0) - before.get("bytes_written", 0)) / 1e9, 3),
                            "urgent_at_start": (before.get("pacing") or {}).get("urgent")}
            out["rounds"].append(row)
            round_s = max(round_s, time.perf_counter() - t_round)
            log(f"round {r}", json.dumps({k: {n: round(v or 0) for n, v in x.items()} for k, x in row.items()
                                          if k != "writes"}), json.dumps(row.get("writes")))
            out["summary"] = summarize(out["rounds"], names, levels)
            path.write_text(json.dumps(out, indent=1))  # each round: a run cut short still reports
    finally:
        for proc, _ in servers.values():
            proc.stop()
            if args.copy_logs and proc.logpath.exists():  # beside the results (the work dir holds the SSD tier)
                shutil.copyfile(proc.logpath, args.out / f"decode-ab-{proc.name}.log")
    out["load_after"] = os.getloadavg()
    out["summary"] = summary = summarize(out["rounds"], names, levels)
    path.write_text(json.dumps(out, indent=1))
    for name, levels_ in summary.items():
        def f(x: float | None, spec: str = ".3f") -> str:
            return "-" if x is None else format(x, spec)

        print(name, " ".join(f"{n}: {f(v['median_tok_s'], '.0f')} tok/s ({f(v['median_paired_vs_mlx_lm'])}x "
                             f"[{f(v['q1'])}-{f(v['q3'])}], min {f(v['min'])}, "
                             f"{v['rounds_at_or_above_1']}/{len(v['paired_vs_mlx_lm'])} >= 1)"
                             for n, v in levels_.items()), flush=True)
    print("->", path)
    return 0


def _writer(base: str) -> dict[str, Any]:
    """The SSD writer's counters (`/stats` ssd_cache.writer; empty if unavailable)."""
    import httpx

    try:
        return dict((httpx.get(base + "/stats", timeout=30).json().get("ssd_cache") or {}).get("writer") or {})
    except (httpx.HTTPError, ValueError):
        return {}


def summarize(rounds: list[dict[str, Any]], names: list[str], levels: list[int]) -> dict[str, Any]:
    """Per server and level: median tok/s, and each round's ratio to mlx_lm's decode of the same round and level
    (median, quartiles, minimum, how many rounds at or above 1)."""
    summary: dict[str, Any] = {}
    for name in names:
        for n in map(str, levels):
            got = [row[name][n] for row in rounds if row[name][n]]
            paired = [row[name][n] / row["mlx_lm"][n] for row in rounds if row[name][n] and row["mlx_lm"][n]]
            q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [None, None, None]
            summary.setdefault(name, {})[n] = {"median_tok_s": statistics.median(got) if got else None,
                                               "paired_vs_mlx_lm": [round(x, 3) for x in paired],
                                               "median_paired_vs_mlx_lm": statistics.median(paired) if paired else None,
                                               "q1": q[0], "q3": q[2], "min": min(paired) if paired else None,
                                               "rounds_at_or_above_1": sum(x >= 1.0 for x in paired)}
    return summary


if __name__ == "__main__":
    sys.exit(main())
