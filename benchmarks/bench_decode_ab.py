"""Decode over HTTP, mlx_lm.server against `mlxd serve` from one or more source trees, rounds interleaved.

Every server starts at once (idle ones cost nothing); each round decodes 1 then 8
streams on each server in turn, so a loaded host's drift lands on every arm alike;
reported: per arm and level the median tok/s and its ratio to mlx_lm's median,
and each round's ratio to the mlx_lm decode just before it (issue 28: the engine
thread stepping on by itself vs one trio round trip per step). An arm is
`NAME=SRC` (a `src` directory put first on PYTHONPATH); `--ssd` adds `NAME+ssd`
(`--host-cache-gb 1 --ssd-cache DIR`) with a fresh prompt before each decode, so its
write-behind runs while it decodes.

    python benchmarks/bench_decode_ab.py --model DIR --arm new=src --arm base=/tmp/base/src --rounds 5 --ssd
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))

from bench_gpu import Proc, log, text_of, ttft  # noqa: E402
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
    ap.add_argument("--port", type=int, default=18390)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "decode-ab-work")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.streams.split(",") if x]
    port = args.port
    servers: dict[str, tuple[Proc, str]] = {}

    def add(name: str, cmd: list[str], ready: str, src: str | None) -> None:
        nonlocal port
        proc = Proc(name, [*cmd, "--port", str(port)], port, ready, args.work / f"{name}.log")
        servers[name] = (proc, src or "")
        port += 1

    add("mlx_lm", [sys.executable, "-m", "mlx_lm", "server", "--model", str(args.model), "--log-level", "WARNING"],
        "/v1/models", None)
    for arm in args.arm:
        name, src = arm.split("=", 1)
        serve = [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(args.model), "--log-format", "json",
                 "--queue-timeout", "0", "--device-probe", "off"]
        add(name, serve, "/health", src)
        if args.ssd:
            ssd = args.work / f"ssd-{name}"
            shutil.rmtree(ssd, ignore_errors=True)
            add(f"{name}+ssd", [*serve, "--host-cache-gb", "1", "--ssd-cache", str(ssd), *args.ssd_args.split()],
                "/health", src)
    base_path = os.environ.get("PYTHONPATH", "")
    out: dict[str, Any] = {"argv": sys.argv, "load_before": os.getloadavg(), "rounds": []}
    try:
        for proc, src in servers.values():
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (src, base_path) if p)
            proc.start()
        os.environ["PYTHONPATH"] = base_path
        fresh = 0
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for n in levels:
                for name, (proc, _) in servers.items():
                    model = "default_model" if name == "mlx_lm" else args.model.name
                    if name.endswith("+ssd"):
                        fresh += 1
                        asyncio.run(ttft(proc.base, model, text_of(args.model, args.fresh_tokens, 900 + fresh)))
                    prompts = [f"Story {j}: " + TEXTS["q2"] for j in range(n)]
                    row.setdefault(name, {})[str(n)] = asyncio.run(decode(proc.base, model, prompts, args.tokens))["tok_s"]
            out["rounds"].append(row)
            log(f"round {r}", json.dumps({k: {n: round(v or 0) for n, v in x.items()} for k, x in row.items()}))
    finally:
        for proc, _ in servers.values():
            proc.stop()
    out["load_after"] = os.getloadavg()
    summary: dict[str, Any] = {}
    for name in servers:
        for n in map(str, levels):
            got = [row[name][n] for row in out["rounds"] if row[name][n]]
            paired = [row[name][n] / row["mlx_lm"][n] for row in out["rounds"] if row[name][n] and row["mlx_lm"][n]]
            summary.setdefault(name, {})[n] = {"median_tok_s": statistics.median(got) if got else None,
                                               "paired_vs_mlx_lm": paired,
                                               "median_paired_vs_mlx_lm": statistics.median(paired) if paired else None}
    out["summary"] = summary
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-ab-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    for name, levels_ in summary.items():
        print(name, " ".join(f"{n}: {v['median_tok_s'] or 0:.0f} tok/s ({v['median_paired_vs_mlx_lm'] or 0:.2f}x)"
                             for n, v in levels_.items()), flush=True)
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
