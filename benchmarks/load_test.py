"""Load: many concurrent streaming clients against a real `mlxd serve`, then SIGTERM under load.

    python benchmarks/load_test.py --clients 48 --seconds 60 --sigterm

The report goes to benchmarks/results/load-<timestamp>.json (--out DIR).

Every client holds a multi-turn conversation of streaming chat requests over
loopback for a bounded time. Every request must complete ([DONE] after a
finish_reason) or be refused cleanly (503/429 with an OpenAI-style error).
The server's RSS is sampled from /proc and must stay within its baseline plus
the configured RAM cache cap (and a fixed slack for decode buffers).
With --sigterm, the server gets SIGTERM while the clients are still running:
admitted requests must complete or end with a clean error, the shutdown
flush must log durable=true, and after a restart on the same --ssd-cache each
conversation's next turn must be a cache hit.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import ServeProc  # noqa: E402

NO_EOS = {"0": -100, "2": -100}
SLACK_BYTES = 512 << 20  # decode buffers, MLX temporaries, Python objects


@attrs.define
class Outcome:
    kind: str  # ok | refused | shutting_down | unavailable | clean_error | broken
    status: int = 0
    ttft_s: float | None = None
    tokens: int = 0
    cached: int = 0
    detail: str = ""


@attrs.define
class Client:
    number: int
    messages: list[dict[str, str]]
    outcomes: list[Outcome] = attrs.Factory(list)
    last_ok: list[dict[str, str]] | None = None  # the conversation after its last completed turn


def stream_chat(http: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> tuple[Outcome, str]:
    """One streaming request; classify how it ended."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": NO_EOS}
    t0 = time.monotonic()
    text, ttft, finish, usage = [], None, None, None
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return _refusal(r), ""
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome("clean_error", 200, detail=chunk["error"]["message"]), ""
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("role"):
                        continue
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text.append(choice["delta"].get("content", ""))
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
    except httpx.ConnectError as exc:  # the server is gone: nothing was admitted
        return Outcome("unavailable", 0, detail=repr(exc)), ""
    except httpx.HTTPError as exc:
        return Outcome("broken", 0, detail=repr(exc)), ""
    if finish is None or usage is None:
        return Outcome("broken", 200, detail="the stream ended without a finish_reason"), ""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Outcome("ok", 200, ttft, usage["completion_tokens"], cached), "".join(text)


def _refusal(r: httpx.Response) -> Outcome:
    """A clean refusal is a 503/429 with an OpenAI-style error; anything else is broken."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return Outcome("broken", r.status_code, detail=r.text[:200])
    if r.status_code not in (429, 503):
        return Outcome("broken", r.status_code, detail=r.text[:200])
    kind = "shutting_down" if error.get("type") == "server_shutting_down" else "refused"
    return Outcome(kind, r.status_code, detail=error.get("message", ""))


def drive(client: Client, url: str, until: threading.Event, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as http:
        while not until.is_set():
            question = f"Question {rng.randint(0, 999)}: and then?"
            messages = [*client.messages, {"role": "user", "content": question}]
            outcome, reply = stream_chat(http, messages, max_tokens)
            client.outcomes.append(outcome)
            if outcome.kind == "ok":
                client.messages = [*messages, {"role": "assistant", "content": reply}]
                client.last_ok = client.messages
            elif outcome.kind == "refused":
                time.sleep(rng.uniform(0.05, 0.2))  # Retry-After, shortened
            else:
                return  # shutting down, gone or broken: this client is done


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def sample_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        try:
            out.append(rss_bytes(pid))
        except (OSError, AttributeError):
            return
        time.sleep(0.1)


def new_clients(n: int) -> list[Client]:
    return [Client(i, [{"role": "system", "content": f"You are assistant number {i}. Be brief and kind. " * 8}])
            for i in range(n)]


def run_load(proc: ServeProc, clients: list[Client], seconds: float, *, max_tokens: int,
             sigterm_after: float | None = None) -> dict[str, Any]:
    """Drive `clients` for `seconds` (or SIGTERM the server after `sigterm_after`); summarize."""
    stop, rss_stop, rss = threading.Event(), threading.Event(), []
    seen = {c.number: len(c.outcomes) for c in clients}  # count only this run's outcomes
    baseline = rss_bytes(proc.pid)
    sampler = threading.Thread(target=sample_rss, args=(proc.pid, rss_stop, rss), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=drive, args=(c, proc.url, stop, max_tokens, c.number), daemon=True)
               for c in clients]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    if sigterm_after is not None:
        time.sleep(sigterm_after)
        proc.signal(signal.SIGTERM)
    time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    stop.set()
    for t in threads:
        t.join(timeout=300)
    elapsed = time.monotonic() - t0
    rss_stop.set()
    sampler.join(timeout=5)
    return summarize([o for c in clients for o in c.outcomes[seen[c.number]:]], elapsed, baseline, rss)


def summarize(outcomes: list[Outcome], elapsed: float, baseline: int, rss: list[int]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.kind == "ok"]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    kinds = ("ok", "refused", "shutting_down", "unavailable", "clean_error", "broken")
    counts = {k: sum(o.kind == k for o in outcomes) for k in kinds}
    return {
        **counts,
        "requests": len(outcomes),
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "tokens_per_s": round(sum(o.tokens for o in ok) / elapsed, 1),
        "ttft_p50_ms": round(1000 * _pct(ttfts, 50), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * _pct(ttfts, 99), 1) if ttfts else None,
        "rss_baseline_mb": round(baseline / 2**20, 1),
        "rss_peak_mb": round(max(rss, default=baseline) / 2**20, 1),
        "broken_details": [o.detail for o in outcomes if o.kind == "broken"][:5],
        "refused_statuses": sorted({o.status for o in outcomes if o.kind == "refused"}),
    }


def _pct(sorted_values: list[float], p: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[min(98, max(0, int(p) - 1))]


def flushed_durable(log: str) -> bool:
    """Did the shutdown flush log durable=true (JSON log lines)?"""
    for line in log.splitlines():
        if '"serve.flushed"' in line:
            return json.loads(line).get("durable") is True
    return False


def next_turns(url: str, clients: list[Client], max_tokens: int) -> list[dict[str, int]]:
    """After a restart: each conversation's next turn; its prompt and cached tokens."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for c in clients:
            if c.last_ok is None:
                continue
            outcome, _ = stream_chat(http, [*c.last_ok, {"role": "user", "content": "One more thing."}], max_tokens)
            out.append({"client": c.number, "kind": outcome.kind, "cached": outcome.cached})
    return out


def serve_args(model: Path, cache: Path, *, max_batch: int, max_queue: int, cache_gb: float) -> list[str]:
    return ["--model", str(model), "--model-name", "tiny", "--ssd-cache", str(cache), "--max-batch", str(max_batch),
            "--max-queue", str(max_queue), "--prompt-cache-gb", str(cache_gb), "--shutdown-timeout", "120"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--prompt-cache-gb", type=float, default=0.5)
    p.add_argument("--sigterm", action="store_true", help="then SIGTERM under load, restart, next turns")
    p.add_argument("--model", type=Path, help="model dir (default: build the 'test' preset)")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for the result JSON")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mlxd-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from mlxd.model.tiny import build_model

        model = build_model(workdir / "model", "test", seed=0)
    sargs = serve_args(model, workdir / "ssd", max_batch=args.max_batch, max_queue=args.max_queue,
                       cache_gb=args.prompt_cache_gb)
    clients = new_clients(args.clients)
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/load_test.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(args) | {"model": str(model), "workdir": str(workdir), "out": str(args.out)},
    }
    with ServeProc(sargs, workdir / "serve.log") as proc:
        report["load"] = run_load(proc, clients, args.seconds, max_tokens=args.max_tokens)
        cap_mb = args.prompt_cache_gb * 1024 + SLACK_BYTES / 2**20
        report["load"]["rss_bound_ok"] = report["load"]["rss_peak_mb"] <= report["load"]["rss_baseline_mb"] + cap_mb
        if args.sigterm:
            report["sigterm"] = run_load(proc, clients, args.seconds / 2, max_tokens=args.max_tokens,
                                         sigterm_after=args.seconds / 4)
            report["sigterm"]["exit_code"] = proc.wait(150)
            report["sigterm"]["flush_durable"] = flushed_durable(proc.log())
    if args.sigterm:
        with ServeProc(sargs, workdir / "serve.log") as proc:
            turns = next_turns(proc.url, clients, args.max_tokens)
        report["after_restart"] = {
            "conversations": len(turns),
            "hits": sum(t["kind"] == "ok" and t["cached"] > 0 for t in turns),
            "cached_tokens_min": min((t["cached"] for t in turns), default=0),
        }
    print(json.dumps(report, indent=2, default=str))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"load-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
