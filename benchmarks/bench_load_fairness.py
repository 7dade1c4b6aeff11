"""Fair under load: a short prompt's TTFT alone vs behind a long prefill, and many mixed streaming clients.

    python benchmarks/bench_load_fairness.py interleave --preset default --long 6000
    python benchmarks/bench_load_fairness.py load --preset default --clients 64 256 --seconds 60

The report goes to benchmarks/results/fairness-<phase>-<timestamp>.json (--out DIR).

interleave: a short prompt (32 random token ids, unique each time: no cache hit)
is timed alone, then --rounds times one after another while one long prompt
(unique random ids) is being prefilled, spread over its alone TTFT; the ratio behind / alone is what chunked, interleaved prefill keeps
near 1 (issue 27's goal: at most 2). The long prompt's own TTFT, alone and with
the short one beside it, shows what the interleaving costs it.

load: N streaming chat clients for S seconds, one in four sending a document
of 1,500-3,000 words, the rest short questions. Every request must end with
[DONE] after a finish_reason or be refused cleanly (503 with an OpenAI-style
error); a request with no answer after --hang-s counts as hung. p50/p99 TTFT
of the answered ones.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import Outcome, stream_chat, summarize  # noqa: E402
from serve_proc import ServeProc  # noqa: E402

NO_EOS = {"0": -100, "2": -100}


def serve(args: argparse.Namespace, log: Path, extra: list[str]) -> ServeProc:
    flags = [
        "--preset",
        args.preset,
        "--model-name",
        "tiny",
        "--max-batch",
        str(args.max_batch),
        "--max-queue",
        str(args.max_queue),
        *extra,
    ]
    return ServeProc(flags, log)


# --- interleave ------------------------------------------------------------------------------


def ttft(url: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds to the first generated token of a streaming completion of token ids."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "logit_bias": NO_EOS,
    }
    t0 = time.perf_counter()
    with (
        httpx.Client(timeout=3600) as http,
        http.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - t0
                for _ in lines:
                    pass
                return first
    raise RuntimeError("the stream ended without a token")


def interleave(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = args.vocab

    def ids(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    report: dict[str, Any] = {
        "phase": "interleave",
        "preset": args.preset,
        "long_tokens": args.long,
        "short_tokens": args.short,
        "rounds": args.rounds,
        "extra_flags": args.flags,
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(args, Path(tmp) / "serve.log", args.flags) as proc,
    ):
        ttft(proc.url, ids(args.short), 2)  # warm-up: compile, first allocations
        ttft(proc.url, ids(args.long), 1)
        alone = [ttft(proc.url, ids(args.short), 2) for _ in range(args.rounds)]
        long_alone = [ttft(proc.url, ids(args.long), 1) for _ in range(max(1, args.rounds // 2))]
        behind, long_behind = [], []
        fractions = [(k + 1) / (args.rounds + 1) for k in range(args.rounds)]
        result: dict[str, float] = {}
        long_prompt = ids(args.long)
        t = threading.Thread(target=lambda: result.update(long=ttft(proc.url, long_prompt, 1)))
        t0 = time.perf_counter()
        t.start()
        for f in fractions:  # shorts one after another while the long prompt is prefilled
            time.sleep(max(0.0, f * statistics.median(long_alone) - (time.perf_counter() - t0)))
            if not t.is_alive():
                break
            behind.append(ttft(proc.url, ids(args.short), 2))
        t.join()
        long_behind.append(result["long"])
    a, b = statistics.median(alone), statistics.median(behind)
    report.update(
        {
            "short_alone_ms": [round(1000 * x, 1) for x in alone],
            "short_behind_ms": [round(1000 * x, 1) for x in behind],
            "long_alone_ms": [round(1000 * x, 1) for x in long_alone],
            "long_beside_short_ms": [round(1000 * x, 1) for x in long_behind],
            "sent_at_fractions_of_long_alone": fractions[: len(behind)],
            "ratio_behind_over_alone": round(b / a, 2),
            "long_slowdown": round(
                statistics.median(long_behind) / statistics.median(long_alone), 2
            ),
        }
    )
    print(
        f"short prompt TTFT: alone {1000 * a:.0f} ms | behind a {args.long}-token prefill {1000 * b:.0f} ms"
        f" | ratio {b / a:.2f}x (goal <= 2x)"
    )
    print(
        f"long prompt TTFT: alone {1000 * statistics.median(long_alone):.0f} ms | with the short one beside it "
        f"{1000 * statistics.median(long_behind):.0f} ms | {report['long_slowdown']:.2f}x"
    )
    return report


# --- load --------------------------------------------------------------------------------------

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain light music garden window story letter "
    "question answer paper table market system program city moment family water money night"
).split()


def document(rng: random.Random) -> str:
    n = rng.randint(1500, 3000)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def load_client(
    i: int,
    url: str,
    until: float,
    hang_s: float,
    max_tokens: int,
    outcomes: list[Outcome],
    lock: threading.Lock,
) -> None:
    rng = random.Random(i)
    long_client = i % 4 == 0
    with httpx.Client(base_url=url, timeout=httpx.Timeout(hang_s, connect=hang_s)) as http:
        while time.monotonic() < until:
            if long_client:
                content = f"Summarize this document ({rng.random():.6f}):\n{document(rng)}"
            else:
                content = f"Question {rng.randint(0, 10**6)} from client {i}: what comes next?"
            outcome, _ = stream_chat(http, [{"role": "user", "content": content}], max_tokens)
            with lock:
                outcomes.append(outcome)
            if outcome.kind == "refused":
                time.sleep(rng.uniform(0.5, 1.5))  # Retry-After: 1
            elif outcome.kind != "ok":
                time.sleep(0.5)


def load(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {
        "phase": "load",
        "preset": args.preset,
        "seconds": args.seconds,
        "runs": [],
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "extra_flags": args.flags,
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(args, Path(tmp) / "serve.log", args.flags) as proc,
    ):
        ttft(proc.url, [20, 21, 22, 23], 2)  # warm-up
        for n in args.clients:
            outcomes: list[Outcome] = []
            lock = threading.Lock()
            until = time.monotonic() + args.seconds
            threads = [
                threading.Thread(
                    target=load_client,
                    daemon=True,
                    args=(i, proc.url, until, args.hang_s, args.max_tokens, outcomes, lock),
                )
                for i in range(n)
            ]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=max(1.0, until + args.hang_s + 30 - time.monotonic()))
            hung_threads = sum(t.is_alive() for t in threads)
            elapsed = time.monotonic() - t0
            summary = summarize(outcomes, elapsed, 0, [])
            timeouts = sum(o.kind == "broken" and "Timeout" in o.detail for o in outcomes)
            run = {
                "clients": n,
                **{k: v for k, v in summary.items() if not k.startswith("rss")},
                "hung": hung_threads + timeouts,
            }
            report["runs"].append(run)
            print(
                f"{n} clients, {args.seconds:.0f} s: {run['requests']} requests, ok {run['ok']}, "
                f"503 {run['refused']}, broken {run['broken']}, hung {run['hung']}; "
                f"TTFT p50 {run['ttft_p50_ms']} ms, p99 {run['ttft_p99_ms']} ms"
            )
            time.sleep(2)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("interleave", "load"))
    p.add_argument("--preset", default="default")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=32)
    p.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=[], help="more `mlxd serve` flags (last)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--seed", type=int, default=0)
    # interleave
    p.add_argument("--long", type=int, default=6000, help="tokens of the long prompt")
    p.add_argument("--short", type=int, default=32, help="tokens of the short prompt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vocab", type=int, default=1024, help="token ids are drawn below this")
    # load
    p.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--hang-s", type=float, default=120.0, help="no answer after this many seconds = hung"
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = interleave(args, args.out) if args.phase == "interleave" else load(args, args.out)
    path = args.out / f"fairness-{args.phase}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
