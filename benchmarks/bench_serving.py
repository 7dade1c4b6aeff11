"""Serving benchmark: mlxd vs mlx_lm.server on the same model, in the same run.

    /tmp/venv/bin/python benchmarks/bench_serving.py [--conversations 4] [--turns 5] [--rounds 6]

Both servers run as real subprocesses on loopback ports and serve the same
directory (the built-in "bench" preset: 42M params, fp32, Qwen3-shaped; built
into ~/.cache/mlxd when missing). Requests are interleaved A/B (the order
alternates per request) so machine noise hits both equally; only one request
is in flight at a time in scenario 1, so the idle server is idle (its CPU time
is sampled from /proc and reported). The machine is shared: before each A/B
pair the script waits (up to --quiet-wait s) for other processes to go quiet,
and it reports the cores other processes used during each request
("ext. load"), from /proc/stat minus both servers and this client.

BLAS parity: mlxd preloads OpenBLAS in-process (mlxd._blas); mlx_lm.server is
started with LD_PRELOAD of the same library. Both processes' /proc/PID/maps
are checked for it, and the cold full-prompt prefill times are compared.

Scenario 1 (TTFT): N conversations share a ~6,000-token system prompt; each
has several turns of ~130-token user messages. TTFT = time from sending a
streaming request to the first chunk with non-empty content. Replies are
greedy, `max_tokens` long (EOS ids banned with logit_bias on both servers),
and each server's own reply is fed back as the assistant message.

Scenario 2 (throughput): C concurrent short conversations, `--decode-tokens`
each with EOS banned; aggregate decode tokens/s = completion tokens / wall
time of the batch, plus each request's decode rate after its first token.
mlx_lm.server runs with --decode-concurrency C, mlxd with --max-batch C.
Rounds alternate A/B/B/A.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
EOS_BAN = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|> of the built-in tokenizer
REPO = Path(__file__).resolve().parents[1]

WORDS = """
cache prefix token engine actor batch decode prefill request stream channel thread memory disk
write read flush durable snapshot entry index radix tree policy retention eviction byte budget
latency throughput model layer head vector matrix kernel softmax attention query key value
server client socket route header status reply error retry timeout deadline drain shutdown
signal worker queue slot admission backpressure cancel scheduler owner tier ram ssd file format
header hash fingerprint namespace adapter session checkpoint restore recompute cost measure
the a of to and in on for with from by at as is are was were be been this that these those
it its they them their we our you your he she his her not no yes all any some many few more
most less least first last next previous new old long short large small fast slow early late
river mountain forest ocean island desert valley city village market garden kitchen library
window door table chair lamp book paper pencil letter story poem song music color light shadow
morning evening night summer winter spring autumn weather rain snow wind cloud sun moon star
walk run jump swim climb carry build break open close start stop begin finish learn teach
think know remember forget believe hope wish want need like love hate find lose keep give take
""".split()


# --- deterministic text ----------------------------------------------------------------


class TextMaker:
    """Seeded sentences of common words, sized in tokens of the served tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def make(self, seed: int, tokens: int) -> str:
        rng = random.Random(seed)
        sentences: list[str] = []
        total = 0
        while total < tokens:
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
            sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"])
            sentences.append(sentence)
            total += self.count(" " + sentence)
        return " ".join(sentences)


# --- servers -----------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU-seconds all cores spent busy since boot (everything but idle and iowait), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used during a span by the active server, the idle server, this client, and everyone else."""

    def __init__(self, active: int, idle: int) -> None:
        self.active, self.idle = active, idle

    def __enter__(self) -> CpuMeter:
        self.t0 = time.perf_counter()
        self.start = (
            proc_cpu_seconds(self.active),
            proc_cpu_seconds(self.idle),
            time.process_time(),
            machine_busy_seconds(),
        )
        return self

    def __exit__(self, *exc: object) -> None:
        end = (
            proc_cpu_seconds(self.active),
            proc_cpu_seconds(self.idle),
            time.process_time(),
            machine_busy_seconds(),
        )
        d = [b - a for a, b in zip(self.start, end, strict=True)]
        wall = time.perf_counter() - self.t0
        self.result = {
            "server_cpu_s": d[0],
            "idle_server_cpu_s": d[1],
            "client_cpu_s": d[2],
            # Everyone else on the machine (other engineers' jobs), in cores on average.
            "external_cores": max(0.0, d[3] - d[0] - d[1] - d[2]) / wall if wall > 0 else 0.0,
        }


async def wait_quiet(args: argparse.Namespace, pids: list[int]) -> float:
    """Wait (at most --quiet-wait s) until other processes use under --quiet-cores; return the wait."""
    t0 = time.perf_counter()
    while True:
        busy0, own0 = (
            machine_busy_seconds(),
            sum(proc_cpu_seconds(p) for p in pids) + time.process_time(),
        )
        await asyncio.sleep(0.5)
        busy1, own1 = (
            machine_busy_seconds(),
            sum(proc_cpu_seconds(p) for p in pids) + time.process_time(),
        )
        external = max(0.0, (busy1 - busy0) - (own1 - own0)) / 0.5
        waited = time.perf_counter() - t0
        if external < args.quiet_cores or waited >= args.quiet_wait:
            return waited


def blas_libs(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return sorted(
        {line.split()[-1] for line in maps.splitlines() if "blas" in line.split()[-1].lower()}
    )


class Server:
    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        ready_path: str,
        model: str,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.cmd, self.port, self.ready_path, self.model = (
            name,
            cmd,
            port,
            ready_path,
            model,
        )
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {}))
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                self.cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log}"
                )
            try:
                if httpx.get(self.base + self.ready_path, timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- one streaming request -----------------------------------------------------------------


async def stream_chat(
    client: httpx.AsyncClient, server: Server, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": EOS_BAN,
    }
    text: list[str] = []
    usage: dict[str, Any] | None = None
    first = last = None
    chunks = 0
    t0 = time.perf_counter()
    async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"{server.name}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            )
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"{server.name}: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    last = now
                    chunks += 1
                    text.append(content)
    end = time.perf_counter()
    usage = usage or {}
    completion = int(usage.get("completion_tokens") or chunks)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": (first - t0) if first is not None else None,
        "total_s": end - t0,
        "decode_s": (last - first) if first is not None and last is not None else None,
        "completion_tokens": completion,
        "content_chunks": chunks,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "text": "".join(text),
    }


# --- scenario 1: multi-turn TTFT ------------------------------------------------------------


async def scenario_ttft(
    servers: list[Server], maker: TextMaker, args: argparse.Namespace
) -> list[dict[str, Any]]:
    system = maker.make(1, args.system_tokens)
    users = [
        [maker.make(1000 + 100 * c + t, args.user_tokens) for t in range(args.turns)]
        for c in range(args.conversations)
    ]
    history = {
        s.name: [[{"role": "system", "content": system}] for _ in range(args.conversations)]
        for s in servers
    }
    rows: list[dict[str, Any]] = []
    n = 0
    async with httpx.AsyncClient(timeout=None) as client:
        for t in range(args.turns):
            for c in range(args.conversations):
                kind = "cold" if (t == 0 and c == 0) else ("first" if t == 0 else "follow")
                order = servers if n % 2 == 0 else servers[::-1]
                n += 1
                await wait_quiet(args, [x.pid for x in servers])
                for s in order:
                    other = next(o for o in servers if o is not s)
                    msgs = history[s.name][c] + [{"role": "user", "content": users[c][t]}]
                    with CpuMeter(s.pid, other.pid) as meter:
                        r = await stream_chat(client, s, msgs, args.reply_tokens)
                    r.update(server=s.name, conversation=c, turn=t, kind=kind, **meter.result)
                    history[s.name][c] = msgs + [{"role": "assistant", "content": r["text"]}]
                    rows.append(r)
                    print(
                        f"  conv {c} turn {t} {kind:6s} {s.name:6s} ttft {r['ttft_s']:7.3f}s "
                        f"prompt {r['prompt_tokens']} cached {r['cached_tokens']} "
                        f"tokens {r['completion_tokens']} cpu {r['server_cpu_s']:.2f}s "
                        f"idle-cpu {r['idle_server_cpu_s']:.2f}s ext-load {r['external_cores']:.2f}",
                        flush=True,
                    )
                    await asyncio.sleep(args.gap)
    return rows


# --- scenario 2: concurrent decode throughput ---------------------------------------------


async def one_batch(
    server: Server, idle_pid: int, prompts: list[str], max_tokens: int
) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=len(prompts) + 2, max_keepalive_connections=len(prompts) + 2
    )
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        with CpuMeter(server.pid, idle_pid) as meter:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *[
                    stream_chat(client, server, [{"role": "user", "content": p}], max_tokens)
                    for p in prompts
                ]
            )
            wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    per_req = [(r["completion_tokens"] - 1) / r["decode_s"] for r in results if r["decode_s"]]
    return {
        "server": server.name,
        "requests": len(prompts),
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tok_s": tokens / wall,
        "per_request_decode_tok_s_median": statistics.median(per_req) if per_req else None,
        "ttft_s_median": statistics.median(r["ttft_s"] for r in results),
        "ttft_s_max": max(r["ttft_s"] for r in results),
        **meter.result,
        "all_full_length": all(r["completion_tokens"] == max_tokens for r in results),
    }


async def scenario_throughput(
    servers: list[Server], maker: TextMaker, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    for rnd in range(args.rounds):
        prompts = [
            maker.make(50_000 + 100 * rnd + i, args.batch_prompt_tokens)
            for i in range(args.concurrency)
        ]
        order = servers if rnd % 2 == 0 else servers[::-1]
        for s in order:
            other = next(o for o in servers if o is not s)
            await wait_quiet(args, [x.pid for x in servers])
            r = await one_batch(s, other.pid, prompts, args.decode_tokens)
            r["round"] = rnd
            rows.append(r)
            print(
                f"  round {rnd} {s.name:6s} {r['completion_tokens']} tokens in {r['wall_s']:.2f}s = "
                f"{r['aggregate_tok_s']:.1f} tok/s aggregate, per-request "
                f"{r['per_request_decode_tok_s_median']:.1f} tok/s, ttft median {r['ttft_s_median']:.2f}s "
                f"full-length {r['all_full_length']} ext-load {r['external_cores']:.2f}",
                flush=True,
            )
            await asyncio.sleep(args.gap)
    return rows


# --- reporting --------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _iqr(vals: list[float]) -> list[float] | None:
    """25th and 75th percentiles (None for fewer than 2 values)."""
    if len(vals) < 2:
        return None
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return [q[0], q[2]]


def _fmt_iqr(iqr: list[float] | None) -> str:
    return "-" if iqr is None else f"{iqr[0]:.3f}-{iqr[1]:.3f}"


def ttft_table(rows: list[dict[str, Any]], a: str, b: str) -> tuple[str, dict[str, Any]]:
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["turn"], r["conversation"]), {})[r["server"]] = r
    lines = [
        f"| conv | turn | kind | prompt tok | {a} cached | {b} cached | {a} TTFT s | {b} TTFT s | ratio {a}/{b} | same reply | ext. load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list[float]] = {"cold": [], "first": [], "follow": []}
    ttfts: dict[str, dict[str, list[float]]] = {k: {a: [], b: []} for k in ratios}
    for (t, c), pair in sorted(by_key.items()):
        ra, rb = pair[a], pair[b]
        ratio = ra["ttft_s"] / rb["ttft_s"]
        ratios[ra["kind"]].append(ratio)
        ttfts[ra["kind"]][a].append(ra["ttft_s"])
        ttfts[ra["kind"]][b].append(rb["ttft_s"])
        lines.append(
            f"| {c} | {t} | {ra['kind']} | {ra['prompt_tokens']} | {ra['cached_tokens']} | {rb['cached_tokens']} | "
            f"{ra['ttft_s']:.3f} | {rb['ttft_s']:.3f} | {ratio:.3f} | {'yes' if ra['text'] == rb['text'] else 'no'} | "
            f"{ra['external_cores']:.2f} / {rb['external_cores']:.2f} |"
        )
    summary = {}
    for kind, vals in ratios.items():
        if vals:
            summary[kind] = {
                "n": len(vals),
                "median_ratio": statistics.median(vals),
                "geomean_ratio": statistics.geometric_mean(vals),
                "iqr_ratio": _iqr(vals),
                "max_ratio": max(vals),
                f"median_ttft_{a}": statistics.median(ttfts[kind][a]),
                f"median_ttft_{b}": statistics.median(ttfts[kind][b]),
            }
            quiet = [
                pair[a]["ttft_s"] / pair[b]["ttft_s"]
                for pair in by_key.values()
                if pair[a]["kind"] == kind
                and max(pair[a]["external_cores"], pair[b]["external_cores"]) < 0.5
            ]
            if quiet:
                summary[kind]["quiet_pairs"] = len(quiet)
                summary[kind]["quiet_median_ratio"] = statistics.median(quiet)
    return "\n".join(lines), summary


def throughput_table(rows: list[dict[str, Any]], a: str, b: str) -> tuple[str, dict[str, Any]]:
    lines = [
        "| round | server | completion tok | wall s | aggregate tok/s | per-request decode tok/s (median) | TTFT median s | server CPU s | ext. load (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['round']} | {r['server']} | {r['completion_tokens']} | {r['wall_s']:.2f} | "
            f"{r['aggregate_tok_s']:.1f} | {_fmt(r['per_request_decode_tok_s_median'], '.1f')} | "
            f"{r['ttft_s_median']:.2f} | {r['server_cpu_s']:.1f} | {r['external_cores']:.2f} |"
        )
    ratios = []
    per_req = []
    for rnd in sorted({r["round"] for r in rows}):
        ra = next(r for r in rows if r["round"] == rnd and r["server"] == a)
        rb = next(r for r in rows if r["round"] == rnd and r["server"] == b)
        ratios.append(ra["aggregate_tok_s"] / rb["aggregate_tok_s"])
        per_req.append(
            ra["per_request_decode_tok_s_median"] / rb["per_request_decode_tok_s_median"]
        )
    summary = {
        "aggregate_ratio_per_round": ratios,
        "aggregate_ratio_median": statistics.median(ratios),
        "aggregate_ratio_geomean": statistics.geometric_mean(ratios),
        "aggregate_ratio_iqr": _iqr(ratios),
        "per_request_ratio_per_round": per_req,
        f"aggregate_tok_s_median_{a}": statistics.median(
            r["aggregate_tok_s"] for r in rows if r["server"] == a
        ),
        f"aggregate_tok_s_median_{b}": statistics.median(
            r["aggregate_tok_s"] for r in rows if r["server"] == b
        ),
        f"server_cpu_s_per_1k_tokens_median_{a}": statistics.median(
            1000 * r["server_cpu_s"] / r["completion_tokens"] for r in rows if r["server"] == a
        ),
        f"server_cpu_s_per_1k_tokens_median_{b}": statistics.median(
            1000 * r["server_cpu_s"] / r["completion_tokens"] for r in rows if r["server"] == b
        ),
    }
    return "\n".join(lines), summary


# --- main ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="bench")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=6000)
    p.add_argument("--user-tokens", type=int, default=130)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch-prompt-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=6, help="A/B throughput rounds (order alternates)")
    p.add_argument("--gap", type=float, default=0.3, help="seconds of quiet between requests")
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="before each A/B pair, wait until other processes use fewer cores than this ...",
    )
    p.add_argument("--quiet-wait", type=float, default=5.0, help="... or at most this many seconds")
    p.add_argument("--mlxd-port", type=int, default=18431)
    p.add_argument("--mlx-lm-port", type=int, default=18432)
    p.add_argument(
        "--cache-gb", type=float, default=2.0, help="prompt-cache byte cap for both servers"
    )
    p.add_argument("--skip", choices=("ttft", "throughput"), action="append", default=[])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def _commit(src: Path) -> str | None:
    """The commit of the mlxd source in use (a COMMIT file next to an exported tree, or git)."""
    for parent in src.parents:
        if (parent / "COMMIT").exists():
            return (parent / "COMMIT").read_text().strip() + " (exported tree)"
    try:
        out = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    args = parse_args()
    import mlxd as mlxd_pkg
    from mlxd.model import ensure_model

    model_dir = Path(ensure_model(args.preset))
    maker = TextMaker(model_dir)
    logdir = Path(tempfile.mkdtemp(prefix="bench_serving-"))
    cache_bytes = int(args.cache_gb * 1024**3)
    mlxd = Server(
        "mlxd",
        [
            sys.executable,
            "-m",
            "mlxd.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(args.mlxd_port),
            "--log-format",
            "json",
            "--max-batch",
            str(args.concurrency),
            "--prompt-cache-gb",
            str(args.cache_gb),
        ],
        args.mlxd_port,
        "/health",
        "default",
        logdir / "mlxd.log",
    )
    mlx_lm = Server(
        "mlx_lm",
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(model_dir),
            "--port",
            str(args.mlx_lm_port),
            "--decode-concurrency",
            str(args.concurrency),
            "--prompt-cache-bytes",
            str(cache_bytes),
            "--log-level",
            "WARNING",
        ],
        args.mlx_lm_port,
        "/v1/models",
        "default_model",
        logdir / "mlx_lm.log",
        env={"LD_PRELOAD": OPENBLAS},
    )
    servers = [mlxd, mlx_lm]
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "model_dir": str(model_dir),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "commands": {s.name: " ".join(s.cmd) for s in servers},
        "mlx_lm_env": {"LD_PRELOAD": OPENBLAS},
        "logs": str(logdir),
        "mlxd_source": str(Path(mlxd_pkg.__file__).parent),
        "mlxd_commit": _commit(Path(mlxd_pkg.__file__).parent),
    }
    try:
        from importlib.metadata import version

        result["versions"] = {p: version(p) for p in ("mlx", "mlx-lm", "mlxd")}
    except Exception:
        pass
    t_start = time.perf_counter()
    try:
        for s in servers:
            s.start()
        for s in servers:
            print(
                f"{s.name}: ready in {s.wait_ready():.1f}s (pid {s.pid}, log {s.log})", flush=True
            )
        result["blas"] = {s.name: blas_libs(s.pid) for s in servers}
        print(f"BLAS mapped: {result['blas']}", flush=True)
        if not all(any("openblas" in lib for lib in libs) for libs in result["blas"].values()):
            print("WARNING: a server does not map OpenBLAS; the comparison is not fair", flush=True)

        async def warm() -> None:
            async with httpx.AsyncClient(timeout=None) as client:
                for s in servers:
                    await stream_chat(client, s, [{"role": "user", "content": "warm up " * 20}], 8)

        asyncio.run(warm())
        a, b = mlxd.name, mlx_lm.name
        if "ttft" not in args.skip:
            print(
                f"\nScenario 1: {args.conversations} conversations x {args.turns} turns, shared system prompt "
                f"of ~{args.system_tokens} tokens, ~{args.user_tokens}-token user turns, "
                f"{args.reply_tokens}-token replies",
                flush=True,
            )
            rows = asyncio.run(scenario_ttft(servers, maker, args))
            table, summary = ttft_table(rows, a, b)
            result["ttft"] = {"rows": rows, "summary": summary, "table": table}
            print("\n" + table)
            for kind, s in summary.items():
                print(
                    f"{kind:7s}: n={s['n']} median TTFT {a} {s[f'median_ttft_{a}']:.3f}s {b} "
                    f"{s[f'median_ttft_{b}']:.3f}s; ratio median {s['median_ratio']:.3f} geomean "
                    f"{s['geomean_ratio']:.3f} IQR {_fmt_iqr(s['iqr_ratio'])} max {s['max_ratio']:.3f}"
                    + (
                        f"; pairs with ext. load < 0.5 cores: n={s['quiet_pairs']} median ratio {s['quiet_median_ratio']:.3f}"
                        if "quiet_pairs" in s
                        else ""
                    )
                )
        if "throughput" not in args.skip:
            print(
                f"\nScenario 2: {args.concurrency} concurrent requests x {args.decode_tokens} tokens, "
                f"{args.rounds} rounds",
                flush=True,
            )
            rows2 = asyncio.run(scenario_throughput(servers, maker, args))
            table2, summary2 = throughput_table(rows2, a, b)
            result["throughput"] = {"rows": rows2, "summary": summary2, "table": table2}
            print("\n" + table2)
            print(
                f"aggregate ratio {a}/{b} per round: "
                + ", ".join(f"{x:.3f}" for x in summary2["aggregate_ratio_per_round"])
                + f"; median {summary2['aggregate_ratio_median']:.3f} geomean "
                + f"{summary2['aggregate_ratio_geomean']:.3f} IQR {_fmt_iqr(summary2['aggregate_ratio_iqr'])}; median per-request decode ratio "
                + f"{statistics.median(summary2['per_request_ratio_per_round']):.3f}; server CPU s per 1k tokens: "
                + f"{a} {summary2[f'server_cpu_s_per_1k_tokens_median_{a}']:.1f}, "
                + f"{b} {summary2[f'server_cpu_s_per_1k_tokens_median_{b}']:.1f}"
            )
        try:
            result["mlxd_stats"] = httpx.get(mlxd.base + "/stats", timeout=5).json()
        except Exception as exc:
            result["mlxd_stats"] = repr(exc)
    finally:
        for s in servers:
            s.stop()
    result["runtime_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwrote {out} (total {result['runtime_s']:.0f}s; server logs in {logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
