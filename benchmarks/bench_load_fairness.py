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
error); a request with no byte for --hang-s, or still open --hang-s after the
load stops, counts as hung. p50/p99 TTFT of the answered ones (short questions
and documents apart), the 503s by reason, and the load average around each run.
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

import attrs
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import ServeProc  # noqa: E402

NO_EOS = {"0": -100, "2": -100}


def serve(args: argparse.Namespace, log: Path, extra: list[str]) -> ServeProc:
    flags = ["--preset", args.preset, "--model-name", "tiny"]
    if args.max_batch is not None:
        flags += ["--max-batch", str(args.max_batch)]
    if args.max_queue is not None:
        flags += ["--max-queue", str(args.max_queue)]
    flags += extra
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


@attrs.define
class Request:
    """One streaming request of the load run, timed from the client's side."""

    client: int
    document: bool
    start: float
    end: float = 0.0
    kind: str = ""  # ok | refused | broken (read timeout = hung) | open (never ended: hung)
    status: int = 0
    headers_s: float | None = None  # the response started (a stream's first chunk comes with it)
    ttft_s: float | None = None  # the first generated token
    detail: str = ""


def stream_once(http: httpx.Client, r: Request, content: str, max_tokens: int) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "logit_bias": NO_EOS,
    }
    finish = None
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            r.status, r.headers_s = resp.status_code, time.monotonic() - r.start
            if resp.status_code != 200:
                resp.read()
                error = (
                    resp.json().get("error", {})
                    if resp.headers.get("content-type", "").startswith("application/json")
                    else {}
                )
                clean = resp.status_code == 503 and bool(error.get("message"))
                r.kind, r.detail = (
                    ("refused" if clean else "broken"),
                    error.get("message", resp.text[:200]),
                )
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.kind, r.detail = "broken", chunk["error"]["message"]
                    return
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content") and r.ttft_s is None:
                        r.ttft_s = time.monotonic() - r.start
                    finish = choice.get("finish_reason") or finish
        r.kind = "ok" if finish is not None else "broken"
        r.detail = "" if finish is not None else "the stream ended without a finish_reason"
    except httpx.HTTPError as exc:
        r.kind, r.detail = "broken", repr(exc)
    finally:
        r.end = time.monotonic()


def load_client(
    i: int, url: str, until: float, hang_s: float, max_tokens: int, requests: list[Request]
) -> None:
    rng = random.Random(i)
    long_client = i % 4 == 0
    with httpx.Client(base_url=url, timeout=httpx.Timeout(hang_s, connect=hang_s)) as http:
        while time.monotonic() < until:
            if long_client:
                content = f"Summarize this document ({rng.random():.6f}):\n{document(rng)}"
            else:
                content = f"Question {rng.randint(0, 10**6)} from client {i}: what comes next?"
            r = Request(i, long_client, time.monotonic())
            requests.append(r)  # list.append is atomic: the main thread sees it while it runs
            stream_once(http, r, content, max_tokens)
            if r.kind == "refused":
                time.sleep(rng.uniform(0.5, 1.5))  # Retry-After: 1
            elif r.kind != "ok":
                time.sleep(0.5)


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))]


def _reason(detail: str) -> str:
    keys = (
        "prompts ahead",
        "prompt tokens are ahead",
        "--ttft-timeout",
        "--queue-timeout",
        "queue is full",
    )
    for key in keys:
        if key in detail:
            return {"prompts ahead": "backlog", "prompt tokens are ahead": "backlog (cold)"}.get(
                key, key
            )
    return detail[:60]


def summarize_run(n: int, requests: list[Request], until: float, hang_s: float) -> dict[str, Any]:
    """Counts, TTFT percentiles (all answered, short, documents) and when the last request ended."""
    for r in requests:
        if not r.kind:
            r.kind = "open"
    hung = [
        r for r in requests if r.kind == "open" or (r.kind == "broken" and "Timeout" in r.detail)
    ]
    ok = [r for r in requests if r.kind == "ok"]

    def ttfts(rs: list[Request]) -> dict[str, Any]:
        t = [r.ttft_s for r in rs if r.ttft_s is not None]
        return {
            "n": len(t),
            "p50_s": _round(_pct(t, 50)),
            "p99_s": _round(_pct(t, 99)),
            "max_s": _round(max(t, default=None)),
        }

    refusals: dict[str, int] = {}
    for r in requests:
        if r.kind == "refused":
            refusals[_reason(r.detail)] = refusals.get(_reason(r.detail), 0) + 1
    ended = [r.end for r in requests if r.end]
    return {
        "clients": n,
        "requests": len(requests),
        "ok": len(ok),
        "ok_documents": sum(r.document for r in ok),
        "refused": sum(r.kind == "refused" for r in requests),
        "refusals": refusals,
        "broken": sum(r.kind == "broken" for r in requests) - sum(r.kind == "broken" for r in hung),
        "hung": len(hung),
        "ttft": ttfts(ok),
        "ttft_short": ttfts([r for r in ok if not r.document]),
        "ttft_documents": ttfts([r for r in ok if r.document]),
        "longest_request_s": _round(
            max((r.end - r.start for r in requests if r.end), default=None)
        ),
        "last_end_after_load_s": _round(max(ended, default=until) - until),
        "broken_details": [r.detail for r in requests if r.kind == "broken"][:5],
        "refused_statuses": sorted({r.status for r in requests if r.kind == "refused"}),
        "hang_bound_s": hang_s,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


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
        serve(args, args.log or Path(tmp) / "serve.log", args.flags) as proc,
    ):
        ttft(proc.url, [20, 21, 22, 23], 2)  # warm-up
        for n in args.clients:
            requests: list[Request] = []
            load_before = _loadavg()
            until = time.monotonic() + args.seconds
            threads = [
                threading.Thread(
                    target=load_client,
                    daemon=True,
                    args=(i, proc.url, until, args.hang_s, args.max_tokens, requests),
                )
                for i in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:  # a request still open hang_s after the load stopped is hung
                t.join(timeout=max(0.0, until + args.hang_s - time.monotonic()))
            run = {
                **summarize_run(n, list(requests), until, args.hang_s),
                "loadavg_before": load_before,
                "loadavg_after": _loadavg(),
            }
            stats = httpx.get(proc.url + "/stats", timeout=60).json()
            run["server_scheduler"] = stats.get("scheduler")
            report["runs"].append(run)
            t, ts, td = run["ttft"], run["ttft_short"], run["ttft_documents"]
            print(
                f"{n} clients, {args.seconds:.0f} s: {run['requests']} requests, ok {run['ok']} "
                f"({run['ok_documents']} documents), 503 {run['refused']} {run['refusals']}, "
                f"broken {run['broken']}, hung {run['hung']}; TTFT p50/p99/max {t['p50_s']}/{t['p99_s']}/"
                f"{t['max_s']} s (short {ts['p50_s']}/{ts['p99_s']}, documents {td['p50_s']}/{td['p99_s']}); "
                f"last request ended {run['last_end_after_load_s']} s after the load; "
                f"load average {load_before} -> {run['loadavg_after']}",
                flush=True,
            )
            if any(t.is_alive() for t in threads):  # wait them out: the next run must start clean
                for t in threads:
                    t.join()
            time.sleep(2)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("interleave", "load"))
    p.add_argument("--preset", default="default")
    p.add_argument("--max-batch", type=int, default=None, help="default: the server's")
    p.add_argument("--max-queue", type=int, default=None, help="default: the server's")
    p.add_argument(
        "--flags", nargs=argparse.REMAINDER, default=[], help="more `mlxd serve` flags (last)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=None, help="keep the server's log here")
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
