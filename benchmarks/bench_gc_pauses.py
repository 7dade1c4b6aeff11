"""Garbage-collection pauses with the serving heap frozen after start-up, and without (runtime/gc_pauses.py).

Two real `mlxd serve` processes of one model are up at once, `frozen` (the default) and `thawed`
(`MLXD_GC_FREEZE=0`), each with its own SSD tier. The same multi-turn conversations (`--conversations`
taken in turn, each starting over after `--turns`) go to both, one request at a time, alternating
which server goes first (ABBA), streamed, so the client's time to the first token is measured. A full
collection comes once enough objects outlived the younger generations (about a quarter of what the
last full one kept: hundreds of requests), so the run must be long. Afterwards each server's
`/stats` `gc` (collections by generation, their total and longest pause, the long ones with the
thread they stopped) and `event_loop` (the stall watch, on at `--stall-ms`: stalls of the event
loop and how many of their ms were collections).
Ratios are frozen ÷ thawed, measured side by side in one run.

    PYTHONPATH=src python benchmarks/bench_gc_pauses.py --requests 1200 \\
        --json benchmarks/results/gc-pauses-cpu-$(date +%Y%m%d-%H%M%S).json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_flush import build_model  # noqa: E402
from bench_serving import TextMaker  # noqa: E402
from serve_proc import ServeProc  # noqa: E402

ARMS = {"frozen": {}, "thawed": {"MLXD_GC_FREEZE": "0"}}


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def first_token_s(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """The client's time to the first streamed content, and the reply's text."""
    t0 = time.perf_counter()
    first, text = None, []
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.perf_counter() - t0
                text.append(delta)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test", help="model preset (test: the tiny model, fast requests)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gc-pauses-work")
    ap.add_argument("--requests", type=int, default=600, help="requests to each server")
    ap.add_argument("--conversations", type=int, default=16, help="conversations at once, taken in turn")
    ap.add_argument("--turns", type=int, default=12, help="turns before a conversation starts over")
    ap.add_argument("--first-tokens", type=int, default=300, help="a conversation's first message, in tokens")
    ap.add_argument("--next-tokens", type=int, default=40, help="each later user message, in tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stall-ms", type=float, default=20.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.preset, args.work / f"model-{args.preset}")
    text = TextMaker(model)
    procs: dict[str, ServeProc] = {}
    out: dict[str, Any] = {"argv": sys.argv[1:], "preset": args.preset, "arms": {}}
    try:
        for arm, env in ARMS.items():
            ssd = args.work / f"ssd-{arm}"
            shutil.rmtree(ssd, ignore_errors=True)
            procs[arm] = ServeProc(["--model", str(model), "--ssd-cache", str(ssd)], args.work / f"{arm}.log",
                                   env={**env, "MLXD_STALL_WATCH_MS": str(args.stall_ms)}).start()
        first = {c: 0 for c in range(args.conversations)}  # each conversation's first request (a new one after --turns)
        convs = {arm: [[] for _ in range(args.conversations)] for arm in ARMS}
        ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
        pairs: list[float] = []
        for i in range(args.requests):
            c = i % args.conversations
            if i // args.conversations - first[c] >= args.turns or not convs["frozen"][c]:
                first[c] = i // args.conversations
                opening = text.make(100 + i, args.first_tokens)
                for arm in ARMS:
                    convs[arm][c] = [{"role": "user", "content": opening}]
            got = {}
            for arm in (list(ARMS) if i % 4 in (0, 3) else list(reversed(ARMS))):
                msgs = convs[arm][c]
                got[arm], reply = first_token_s(procs[arm].url, msgs, args.max_tokens)
                msgs += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": text.make(10_000 + i, args.next_tokens)}]
                ttft[arm].append(got[arm])
            pairs.append(got["frozen"] / got["thawed"])
            if (i + 1) % 100 == 0:
                log(f"{i + 1} requests each: frozen p50 {quantile(ttft['frozen'], 0.5) * 1e3:.1f} ms, "
                    f"thawed p50 {quantile(ttft['thawed'], 0.5) * 1e3:.1f} ms")
        for arm, p in procs.items():
            stats = httpx.get(p.url + "/stats", timeout=30).json()
            loop = stats.get("event_loop") or {}
            out["arms"][arm] = {
                "ttft_ms": {"p50": round(quantile(ttft[arm], 0.5) * 1e3, 2),
                            "p95": round(quantile(ttft[arm], 0.95) * 1e3, 2), "max": round(max(ttft[arm]) * 1e3, 2)},
                "gc": stats.get("gc"),
                "event_loop": {**{k: v for k, v in loop.items() if k != "recent"},
                               "gc_ms_in_stalls": round(sum(s.get("gc_ms") or 0 for s in loop.get("recent", [])), 1),
                               "recent": [{k: v for k, v in s.items() if k != "frames"} for s in loop.get("recent", [])]},
                "ttft_s": [round(x, 5) for x in ttft[arm]],
            }
    finally:
        for p in procs.values():
            p.signal()  # SIGTERM: each flushes its SSD tier and exits
        for p in procs.values():
            try:
                p.wait(60)
            except Exception:
                p.kill()
    f, t = out["arms"]["frozen"], out["arms"]["thawed"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    out["summary"] = {
        "requests_per_arm": len(ttft["frozen"]),
        "gc_recent": {"frozen": f["gc"]["recent"], "thawed": t["gc"]["recent"]},
        "gen2_collections": {"frozen": f["gc"]["collections"][2], "thawed": t["gc"]["collections"][2]},
        "gen2_max_ms": {"frozen": f["gc"]["max_ms"][2], "thawed": t["gc"]["max_ms"][2]},
        "pause_s_all_generations": {"frozen": round(sum(f["gc"]["paused_s"]), 4),
                                    "thawed": round(sum(t["gc"]["paused_s"]), 4)},
        "frozen_objects": f["gc"]["frozen_objects"],
        "long_collections (>= 20 ms)": {"frozen": f["gc"]["long"], "thawed": t["gc"]["long"]},
        "stalls": {"frozen": f["event_loop"].get("stalls"), "thawed": t["event_loop"].get("stalls")},
        "ttft_frozen_over_thawed": {k: ratio(f["ttft_ms"][k], t["ttft_ms"][k]) for k in ("p50", "p95", "max")},
        "ttft_pairs_median": round(quantile(pairs, 0.5), 3),
    }
    print(json.dumps(out["summary"], indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        log(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
