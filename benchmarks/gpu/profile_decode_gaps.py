"""Where decode's host time goes in `mlxd serve` (issue 28): the engine thread's steps and the gaps between them.

Serves a model built by bench_host_tier_servers.py (its `--work`) under
benchmarks/prof_serve_threads.py (every thread sampled, the engine thread's jobs
timed), decodes 1 then 8 streams over HTTP (its `decode`), stops the server and
writes the profile JSON (median step and the gap between steps per batch size, the
engine thread's jobs, and per thread the functions on the stack) to `--out`.

    python3 benchmarks/gpu/profile_decode_gaps.py --model /tmp/host-servers-work/model-qwen3-1.7b --out $OUT

Write-behind beside decode (issue 28): `--fresh-tokens N --fresh-pattern 1,w,0` with
`--serve-args "--ssd-cache DIR"` puts a fresh N-token prompt before the levels marked 1 (its
checkpoint is staged and written while they decode), a fresh one before those marked w and
then waits until everything is written (nothing written during the decode), and the previous
prompt again before those marked 0 (a RAM hit; an earlier write may still run), and reports per level the steps and gaps
inside its decode window and what the SSD writer did meanwhile (`/stats` before and after:
staged pieces, runtime calls, step waits, bytes written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import QWEN3_1_7B, Proc, built, log, text_of, ttft  # noqa: E402
from bench_host_tier_servers import TEXTS, decode  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/decode-gaps")))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--port", type=int, default=18194)
    ap.add_argument("--serve-args", default="", help="more `mlxd serve` flags, e.g. '--ssd-cache /tmp/x'")
    ap.add_argument("--sample-ms", type=float, default=5.0,
                    help="the thread sampler's period (large, e.g. 1000: steps timed, almost no sampling)")
    ap.add_argument("--fresh-tokens", type=int, default=0,
                    help="a fresh prompt this long before each level (with --ssd-cache its write-behind runs "
                         "during the decode)")
    ap.add_argument("--fresh-pattern", default="",
                    help="per level, 1: a fresh prompt before it, 0: the previous prompt again (nothing new to "
                         "write), w: a fresh prompt, then wait until write-behind has written everything (the "
                         "idle engine writes at full speed) before the decode; default: fresh before every level")
    ap.add_argument("--wait-s", type=float, default=30.0, help="w: the longest wait for write-behind")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.model / "config.json").exists() and args.model.name == f"model-{QWEN3_1_7B.name}":
        built(QWEN3_1_7B, args.model.parent)  # a fresh machine: the servers bench's model, built as it builds it
    prof = args.out / "decode-gaps-profile.json"
    cmd = [sys.executable, str(HERE.parent / "prof_serve_threads.py"), "serve", "--model", str(args.model),
           "--port", str(args.port), "--log-format", "json", "--queue-timeout", "0", "--device-probe", "off",
           *args.serve_args.split()]
    os.environ.update(MLXD_SAMPLE_OUT=str(prof), MLXD_SAMPLE_MS=str(args.sample_ms))
    server = Proc("mlxd_prof", cmd, args.port, "/health", args.out / "decode-gaps-serve.log")
    server.start()
    results = {}
    levels: list[dict[str, object]] = []
    pattern = [x.strip() for x in args.fresh_pattern.split(",") if x.strip()]
    prompt = ""
    try:
        for i, n in enumerate(int(x) for x in args.streams.split(",") if x):
            mark = pattern[i] if i < len(pattern) else "1"
            fresh = mark in ("1", "w")
            if args.fresh_tokens:
                if fresh or not prompt:
                    prompt = text_of(args.model, args.fresh_tokens, 900 + i)
                asyncio.run(ttft(server.base, args.model.name, prompt))
            waited = _written(server.base, args.wait_s) if mark == "w" else None
            before = _writer(server.base)
            t0 = time.perf_counter()
            d = asyncio.run(decode(server.base, args.model.name, [f"Story {j}: " + TEXTS["q2"] for j in range(n)],
                                   args.tokens))
            t1 = time.perf_counter()
            after = _writer(server.base)
            results.setdefault(str(n), []).append(d["tok_s"])
            levels.append({"streams": n, "fresh": bool(args.fresh_tokens) and fresh, "waited_for_writes_s": waited,
                           "tok_s": d["tok_s"],
                           "window": (t0, t1), "writer": {k: round(after[k] - before[k], 3) for k in after
                                                           if isinstance(after[k], int | float) and k in before},
                           # write-behind's state as the decode began and ended: urgent (a backlog past its
                           # bound writes at full speed), held, paced
                           "pacing": [{k: (p or {}).get(k) for k in ("urgent", "held_now", "pacing_now")}
                                      for p in (before.get("pacing"), after.get("pacing"))]})
            log("decode", n, "streams", d["tok_s"], "fresh" if fresh else "repeat", json.dumps(levels[-1]["writer"]))
    finally:
        server.stop()
    report = json.loads(prof.read_text()) if prof.exists() else {}
    steps = report.get("steps_raw") or []
    for level in levels:
        t0, t1 = level.pop("window")  # type: ignore[misc]
        level.update(_window(steps, t0, t1))
        log("level", json.dumps(level))
    summary = {"tok_s": results, "levels": levels, "engine_jobs": report.get("engine_jobs"),
               "engine_steps": report.get("engine_steps")}
    (args.out / "decode-gaps.json").write_text(json.dumps(summary, indent=1))
    log("summary", json.dumps(summary))
    return 0


def _writer(base: str) -> dict[str, object]:
    """The SSD writer's counters now (`/stats` ssd_cache.writer; empty without an SSD tier)."""
    import httpx

    try:
        stats = httpx.get(base + "/stats", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return dict((stats.get("ssd_cache") or {}).get("writer") or {})


def _written(base: str, limit_s: float) -> float | None:
    """Wait until `/stats` shows no write pending (at most `limit_s`); the seconds waited, None if it never did."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            ssd = httpx.get(base + "/stats", timeout=30).json().get("ssd_cache") or {}
        except (httpx.HTTPError, ValueError):
            return None
        if not ssd.get("pending_spills"):
            return round(time.perf_counter() - t0, 2)
        time.sleep(0.1)
    return None


def _window(steps: list[list[float]], t0: float, t1: float) -> dict[str, object]:
    """The decode steps inside [t0, t1] (all rows decoding or not) and the gaps between them."""
    import statistics

    inside = [s for s in steps if t0 <= s[0] and s[1] <= t1]
    gaps = [b[0] - a[1] for a, b in zip(inside, inside[1:], strict=False)]
    if len(inside) < 2:
        return {"steps": len(inside)}
    q = statistics.quantiles(gaps, n=100) if len(gaps) >= 2 else [gaps[0]] * 99
    return {"steps": len(inside), "step_median_us": round(statistics.median(b - a for a, b, _ in inside) * 1e6, 1),
            "gap_median_us": round(statistics.median(gaps) * 1e6, 1), "gap_p90_us": round(q[89] * 1e6, 1),
            "gap_p99_us": round(q[98] * 1e6, 1), "gap_max_ms": round(max(gaps) * 1e3, 2),
            "gaps_over_1ms": sum(g > 1e-3 for g in gaps), "gap_total_ms": round(sum(gaps) * 1e3, 1),
            "span_ms": round((inside[-1][1] - inside[0][0]) * 1e3, 1)}


if __name__ == "__main__":
    sys.exit(main())
