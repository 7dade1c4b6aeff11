"""Two live mlxd replicas behind the SMG gateway: cache-aware vs round-robin routing.

    python benchmarks/bench_fleet.py --conversations 3 --turns 4

Starts two `mlxd serve` replicas on loopback (RAM tier only) and, for each
policy in turn, an `smg launch --policy POLICY` gateway in front of them. Each
policy gets its own conversations (distinct from the first token, so no policy
reuses another's cache); turns are interleaved across conversations as
concurrent users would send them, one request at a time, streamed. A follow-up
turn's time to first token (measured by the client, through the gateway) is
what routing changes: on the replica holding the conversation only the new
suffix is prefilled. Results go to benchmarks/results/fleet-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import ServeProc  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NO_EOS = {"0": -100, "2": -100}
WORDS = ("cache prefix token replica gateway route tier block page memory disk restore "
         "latency batch decode prefill shard fleet index event").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(policy: str, workers: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    smg = Path(sys.executable).with_name("smg")
    port = free_port()
    args = [str(smg) if smg.exists() else (shutil.which("smg") or "smg"), "launch", "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--worker-urls", *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/readiness", timeout=2)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(workers):
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited {proc.returncode}: see {log_path}")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"smg not ready: see {log_path}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


def system_prompt(tag: str, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(words))
    return f"{tag}: you are a helpful assistant for the {tag} team. {body}"


def stream_turn(http: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        worker = r.headers.get("x-smg-routed-worker-id", "")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft, "worker": worker, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def run_policy(policy: str, workers: list[str], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    proc, url = start_gateway(policy, workers, log_dir / f"smg-{policy}.log")
    turns: list[dict[str, Any]] = []
    try:
        conversations = [
            [{"role": "system", "content": system_prompt(f"{policy}-{c}", args.system_words)},
             {"role": "user", "content": f"Question {c}: how should I size the cache?"}]
            for c in range(args.conversations)
        ]
        with httpx.Client(base_url=url, timeout=600) as http:
            for turn in range(args.turns):
                for c, messages in enumerate(conversations):
                    out = stream_turn(http, messages, args.max_tokens)
                    turns.append({"conversation": c, "turn": turn, **{k: v for k, v in out.items() if k != "text"}})
                    messages += [{"role": "assistant", "content": out["text"]},
                                 {"role": "user", "content": f"Follow-up {turn}: and then?"}]
    finally:
        stop(proc)
    follow = [t for t in turns if t["turn"] > 0]
    per_worker: dict[str, int] = {}
    for t in turns:
        per_worker[t["worker"]] = per_worker.get(t["worker"], 0) + 1
    sticky = sum(len({t["worker"] for t in turns if t["conversation"] == c}) == 1
                 for c in range(args.conversations))
    return {
        "policy": policy,
        "turns": turns,
        "followup_ttft_s_mean": statistics.mean(t["ttft_s"] for t in follow),
        "followup_ttft_s_median": statistics.median(t["ttft_s"] for t in follow),
        "followup_cached_fraction": sum(t["cached_tokens"] for t in follow) / sum(t["prompt_tokens"] for t in follow),
        "first_turn_ttft_s_mean": statistics.mean(t["ttft_s"] for t in turns if t["turn"] == 0),
        "requests_per_worker": per_worker,
        "conversations_on_one_replica": sticky,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default", help="built-in model preset each replica serves")
    # Odd, so round-robin over 2 replicas does not keep conversations in place by accident.
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=400, help="length of each conversation's system prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        log_dir = Path(tmp)
        replicas = [ServeProc(["--preset", args.preset, "--model-name", "default", "--max-batch", "2"],
                              log_dir / f"replica{i}.log") for i in range(2)]
        try:
            for r in replicas:
                r.start(timeout=600)
            workers = [r.url for r in replicas]
            results = [run_policy(policy, workers, args, log_dir) for policy in args.policies]
        finally:
            for r in replicas:
                r.kill()
    by = {r["policy"]: r for r in results}
    summary: dict[str, Any] = {
        "benchmark": "fleet",
        "command": "python " + " ".join(sys.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "replicas": 2,
        "results": results,
    }
    if "round_robin" in by and "cache_aware" in by:
        summary["followup_ttft_ratio_round_robin_over_cache_aware"] = (
            by["round_robin"]["followup_ttft_s_mean"] / by["cache_aware"]["followup_ttft_s_mean"])
    for r in results:
        print(f"{r['policy']:>12}: follow-up TTFT mean {r['followup_ttft_s_mean'] * 1000:8.1f} ms, "
              f"median {r['followup_ttft_s_median'] * 1000:8.1f} ms, cached {r['followup_cached_fraction']:.0%}, "
              f"first turn {r['first_turn_ttft_s_mean'] * 1000:8.1f} ms, per replica {sorted(r['requests_per_worker'].values())}, "
              f"sticky {r['conversations_on_one_replica']}/{args.conversations}")
    if "followup_ttft_ratio_round_robin_over_cache_aware" in summary:
        print(f"follow-up TTFT, round_robin / cache_aware: {summary['followup_ttft_ratio_round_robin_over_cache_aware']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
