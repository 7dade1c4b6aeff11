"""Returning conversations with the host tier: mlxd (host tier / RAM only / host + SSD) vs mlx_lm.server.

    # on the CUDA host (../shared/GPU.md), or here on the CPU with --small:
    python3 benchmarks/gpu/bench_host_tier_servers.py --out $OUT [--small]

Each server gets the same conversations (16k-token first prompts on the
1.7B shape): A cold, A again (RAM hit), A's next turn (prefix hit + ~30 new
tokens), then B and C cold, which push A out of a RAM tier sized for about
one conversation (`--prompt-cache-gb 3`), then A's third turn (the returning
conversation: a host-tier promotion, a recompute without one). mlx_lm.server
keeps every prompt in device memory. The host + SSD server is then
restarted on its SSD tier and A's third turn sent again (restore or
recompute, as its advisor chooses). Client TTFT, streamed, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, Proc, build, done_lines, log, text_of, ttft  # noqa: E402

import mlxd  # noqa: E402, F401
from mlxd.model import presets  # noqa: E402


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def conversation(base: str, model: str, first: str, texts: dict[str, str]) -> dict[str, Any]:
    """Turns of one conversation; returns the history so far and each turn's TTFT."""
    hist = [{"role": "user", "content": first}]
    cold = asyncio.run(ttft(base, model, hist))
    hit = asyncio.run(ttft(base, model, hist))
    hist += [{"role": "assistant", "content": hit["text"]}, {"role": "user", "content": texts["q2"]}]
    nxt = asyncio.run(ttft(base, model, hist))
    hist += [{"role": "assistant", "content": nxt["text"]}, {"role": "user", "content": texts["q3"]}]
    return {"history": hist, "cold": cold, "hit": hit, "next": nxt}


def run_server(s: Proc, model: str, prompts: list[list[str]], texts: dict[str, str], out: dict[str, Any],
               save_progress: Any) -> dict[str, Any]:
    import httpx

    rows: list[dict[str, Any]] = []
    out["start_s"] = s.start()
    save_progress()
    asyncio.run(ttft(s.base, model, "warm up " * 20))
    for a, b, c in prompts:
        conv = conversation(s.base, model, a, texts)
        others = [asyncio.run(ttft(s.base, model, p)) for p in (b, c)]
        back = asyncio.run(ttft(s.base, model, conv["history"]))  # A returns after B and C
        row = {k: conv[k] for k in ("cold", "hit", "next")} | {"others": others, "returning": back,
                                                                 "history": conv["history"]}
        rows.append(row)
        out["rows"] = rows
        save_progress()
        log(s.name, " ".join(f"{k} {row[k]['ttft_s']:.3f}s/{row[k]['cached_tokens']}" for k in
                             ("cold", "hit", "next", "returning")))
    out["rows"] = rows
    if s.name.startswith("mlxd"):
        out["stats"] = httpx.get(s.base + "/stats", timeout=30).json().get("cache")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/host-servers")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="mlxd_host,mlxd_ram,mlxd_host_ssd,mlx_lm")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="host-servers-"))
    preset = presets.PRESETS["bench"] if args.small else QWEN3_1_7B
    model_dir = build(preset, work / "model")
    n = 512 if args.small else 16384
    ram_gb = "0.05" if args.small else "3"
    host_gb = "1" if args.small else "24"
    texts = {"q2": "Say more about the last part, briefly.", "q3": "And how does that compare with the start?"}
    prompts = [[text_of(model_dir, n, 700 + 3 * r + i) for i in range(3)] for r in range(args.rounds)]
    base = [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--log-format", "json",
            "--prompt-cache-gb", ram_gb]
    ssd = ["--ssd-cache", str(work / "ssd")]
    cmds = {
        "mlxd_host": (base + ["--port", "18190", "--host-cache-gb", host_gb, "--device-probe", "off"], 18190),
        "mlxd_ram": (base + ["--port", "18191", "--device-probe", "off"], 18191),
        "mlxd_host_ssd": (base + ["--port", "18192", "--host-cache-gb", host_gb, *ssd], 18192),
        "mlx_lm": ([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", "18193",
                    "--log-level", "WARNING"], 18193),
    }
    wanted = args.servers.split(",")
    out: dict[str, Any] = {"device": str(mx.default_device()), "tokens": n, "rounds": args.rounds,
                           "commands": {k: " ".join(v[0]) for k, v in cmds.items() if k in wanted}}
    res = args.out / f"host_servers-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:
        res.write_text(json.dumps(out, indent=1, default=str))

    def stop(*_: Any) -> None:  # `timeout` sends SIGTERM: keep what was measured, with the server logs' tails
        for name in wanted:
            path = work / f"{name}.log"
            if path.exists():
                out.setdefault("log_tails", {})[name] = path.read_text(errors="replace")[-4000:]
        save()
        raise SystemExit(124)

    import signal

    signal.signal(signal.SIGTERM, stop)

    for name in wanted:
        cmd, port = cmds[name]
        s = Proc(name, cmd, port, "/v1/models" if name == "mlx_lm" else "/health", work / f"{name}.log")
        model = "default_model" if name == "mlx_lm" else model_dir.name
        try:
            run_server(s, model, prompts, texts, out.setdefault(name, {}), save)
        except Exception as exc:  # keep what was measured
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            log(name, "failed", exc)
        finally:
            out.setdefault(name, {})["exit_code"] = s.stop()
            if name.startswith("mlxd"):
                out[name]["log"] = done_lines(work / f"{name}.log")
            save()
    if "mlxd_host_ssd" in wanted and out.get("mlxd_host_ssd", {}).get("rows"):
        cmd, port = cmds["mlxd_host_ssd"]
        again = Proc("restart", cmd, port, "/health", work / "restart.log")
        try:
            out["restart"] = {"start_s": again.start()}
            rows = [asyncio.run(ttft(again.base, model_dir.name, r["history"])) for r in out["mlxd_host_ssd"]["rows"]]
            out["restart"]["returning"] = rows
            import httpx

            out["restart"]["stats"] = httpx.get(again.base + "/stats", timeout=30).json().get("cache")
            log("restart", [round(r["ttft_s"], 3) for r in rows])
        except Exception as exc:
            out["restart_error"] = f"{type(exc).__name__}: {exc}"
        finally:
            out.setdefault("restart", {})["exit_code"] = again.stop()
            out["restart"]["log"] = done_lines(work / "restart.log")
    summary: dict[str, Any] = {}
    for name in wanted:
        rows = out.get(name, {}).get("rows") or []
        summary[name] = {k: median([r[k]["ttft_s"] for r in rows]) for k in ("cold", "hit", "next", "returning")}
    if out.get("restart", {}).get("returning"):
        summary["restart_returning"] = median([r["ttft_s"] for r in out["restart"]["returning"]])
    lm = summary.get("mlx_lm", {})
    for name in wanted:
        if name != "mlx_lm" and lm:
            summary[name]["vs_mlx_lm"] = {k: summary[name][k] / lm[k] for k in lm if lm[k] == lm[k] and lm[k] > 0}
        if name.startswith("mlxd") and summary[name].get("hit"):
            summary[name]["returning_vs_own_hit"] = summary[name]["returning"] / summary[name]["hit"]
    out["summary"] = summary
    for r in (out.get(k, {}) for k in wanted):
        for row in r.get("rows", []):
            row.pop("history", None)
    save()
    log("summary", json.dumps(summary))
    shutil.rmtree(work, ignore_errors=True)
    log("->", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
