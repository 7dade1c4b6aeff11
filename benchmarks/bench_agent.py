"""Agent-session benchmark: per-step TTFT of mlxd vs mlx_lm.server, side by side in one run.

    python benchmarks/bench_agent.py [--preset default] [--steps 12] [--system-tokens 4200]

A recorded agent session is replayed against both servers: a long system
prompt (~--system-tokens of instructions) with tool definitions, a user task,
then --steps tool turns. Every request sends the whole conversation so far with
`tools`; the assistant turns are the session's recorded tool calls (the same
for both servers, since a random-weight model does not call tools) and the
tool results are ~--result-tokens of text. The last request asks for the
answer. TTFT = time from sending a streaming request to the first chunk that
carries content, reasoning or a tool call; replies are greedy, --reply-tokens
long with EOS banned.

Both servers are real subprocesses on loopback serving the same model
directory (built-in preset), with OpenBLAS in both (as in bench_serving.py).
Steps alternate which server goes first; per-step ratios mlxd/mlx_lm are
reported with each server's prompt and cached token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import OPENBLAS, WORDS, Server, TextMaker, _commit, blas_libs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EOS_BAN = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|> of the built-in tokenizer

TOOL_NAMES = ["read_file", "search_code", "run_tests", "list_directory", "edit_file", "git_diff"]


def tools(maker: TextMaker, seed: int) -> list[dict[str, Any]]:
    """Six function tools with paragraph-long descriptions, like a coding agent's."""
    out = []
    for i, name in enumerate(TOOL_NAMES):
        out.append({
            "type": "function",
            "function": {
                "name": name,
                "description": maker.make(seed + i, 60),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": maker.make(seed + 100 + i, 15)},
                        "query": {"type": "string", "description": maker.make(seed + 200 + i, 15)},
                    },
                    "required": ["path"],
                },
            },
        })
    return out


def session(maker: TextMaker, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[tuple[dict, dict]]]:
    """The opening messages and the recorded (tool call, tool result) turns."""
    opening = [
        {"role": "system", "content": maker.make(args.seed, args.system_tokens)},
        {"role": "user", "content": maker.make(args.seed + 1, 80)},
    ]
    rng = random.Random(args.seed)
    turns = []
    for step in range(args.steps):
        name = TOOL_NAMES[step % len(TOOL_NAMES)]
        arguments = {"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py", "query": rng.choice(WORDS)}
        call = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{step}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }]}
        result = {"role": "tool", "tool_call_id": f"call_{step}",
                  "content": maker.make(args.seed + 1000 + step, args.result_tokens)}
        turns.append((call, result))
    return opening, turns


async def stream_step(
    client: httpx.AsyncClient, server: Server, messages: list[dict[str, Any]], tool_specs: list[dict[str, Any]],
    max_tokens: int,
) -> dict[str, Any]:
    body = {
        "model": server.model, "messages": messages, "tools": tool_specs, "max_tokens": max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": EOS_BAN,
    }
    usage: dict[str, Any] = {}
    first = None
    t0 = time.perf_counter()
    async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line[6:] == "[DONE]":
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"{server.name}: {obj['error']}")
            usage = obj.get("usage") or usage
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                if first is None and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning",
                                                                   "tool_calls")):
                    first = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": None if first is None else first - t0,
        "total_s": time.perf_counter() - t0,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }


async def replay(servers: list[Server], maker: TextMaker, args: argparse.Namespace) -> list[dict[str, Any]]:
    opening, turns = session(maker, args)
    tool_specs = tools(maker, args.seed + 500)
    rows = []
    messages = list(opening)
    async with httpx.AsyncClient(timeout=None) as client:
        for step in range(args.steps + 1):
            order = servers if step % 2 == 0 else servers[::-1]
            row: dict[str, Any] = {"step": step, "kind": "answer" if step == args.steps else "tool turn",
                                   "messages": len(messages), "first": order[0].name}
            for s in order:
                await asyncio.sleep(args.gap)
                row[s.name] = await stream_step(client, s, messages, tool_specs, args.reply_tokens)
            a, b = (row[s.name]["ttft_s"] for s in servers)
            row["ratio"] = a / b if a and b else None
            rows.append(row)
            print(
                f"step {step:2d} ({row['kind']}, {len(messages)} msgs): "
                + "  ".join(f"{s.name} ttft {row[s.name]['ttft_s']:.3f}s prompt {row[s.name]['prompt_tokens']} "
                            f"cached {row[s.name]['cached_tokens']}" for s in servers)
                + f"  ratio {row['ratio']:.3f}", flush=True)
            if step < args.steps:
                messages += list(turns[step])
    return rows


def summarize(rows: list[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    warm = [r for r in rows if r["step"] > 0 and r["ratio"]]
    ratios = [r["ratio"] for r in warm]
    return {
        "first_step_ratio": rows[0]["ratio"],
        "first_step_ttft_s": {a: rows[0][a]["ttft_s"], b: rows[0][b]["ttft_s"]},
        "later_steps": len(warm),
        "later_median_ratio": statistics.median(ratios),
        "later_geomean_ratio": statistics.geometric_mean(ratios),
        "later_max_ratio": max(ratios),
        f"later_median_ttft_s_{a}": statistics.median(r[a]["ttft_s"] for r in warm),
        f"later_median_ttft_s_{b}": statistics.median(r[b]["ttft_s"] for r in warm),
        "last_prompt_tokens": rows[-1][a]["prompt_tokens"],
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--steps", type=int, default=12, help="tool turns before the answer")
    p.add_argument("--system-tokens", type=int, default=4200)
    p.add_argument("--result-tokens", type=int, default=150)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap", type=float, default=0.3, help="seconds of quiet before each request")
    p.add_argument("--cache-gb", type=float, default=2.0, help="prompt-cache byte cap for both servers")
    p.add_argument("--mlxd-port", type=int, default=18441)
    p.add_argument("--mlx-lm-port", type=int, default=18442)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import mlxd as mlxd_pkg
    from mlxd.model import ensure_model

    model_dir = Path(ensure_model(args.preset))
    maker = TextMaker(model_dir)
    logdir = Path(tempfile.mkdtemp(prefix="bench_agent-"))
    mlxd = Server(
        "mlxd",
        [sys.executable, "-m", "mlxd.cli", "serve", "--model", str(model_dir), "--port", str(args.mlxd_port),
         "--log-format", "json", "--prompt-cache-gb", str(args.cache_gb)],
        args.mlxd_port, "/health", "default", logdir / "mlxd.log",
    )
    mlx_lm = Server(
        "mlx_lm",
        [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(args.mlx_lm_port),
         "--prompt-cache-bytes", str(int(args.cache_gb * 1024**3)), "--log-level", "WARNING"],
        args.mlx_lm_port, "/v1/models", "default_model", logdir / "mlx_lm.log", env={"LD_PRELOAD": OPENBLAS},
    )
    servers = [mlxd, mlx_lm]
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model_dir": str(model_dir),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "commands": {s.name: " ".join(s.cmd) for s in servers},
        "mlx_lm_env": {"LD_PRELOAD": OPENBLAS},
        "mlxd_commit": _commit(Path(mlxd_pkg.__file__).parent),
    }
    try:
        from importlib.metadata import version

        result["versions"] = {p: version(p) for p in ("mlx", "mlx-lm")}
    except Exception:
        pass
    t_start = time.perf_counter()
    try:
        for s in servers:
            s.start()
        for s in servers:
            print(f"{s.name}: ready in {s.wait_ready():.1f}s (pid {s.pid}, log {s.log})", flush=True)
        result["blas"] = {s.name: blas_libs(s.pid) for s in servers}
        rows = asyncio.run(replay(servers, maker, args))
        result["rows"] = rows
        result["summary"] = summary = summarize(rows, mlxd.name, mlx_lm.name)
        print(json.dumps(summary, indent=1))
        result["mlxd_stats"] = httpx.get(mlxd.base + "/stats", timeout=5).json()
    finally:
        for s in servers:
            s.stop()
    result["runtime_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"agent-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out} (total {result['runtime_s']:.0f}s; server logs in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
