"""Where decode's host time goes in `mlxd serve` (issue 28): the engine thread's steps and the gaps between them.

Serves a model built by bench_host_tier_servers.py (its `--work`) under
benchmarks/prof_serve_threads.py (every thread sampled, the engine thread's jobs
timed), decodes 1 then 8 streams over HTTP (its `decode`), stops the server and
writes the profile JSON (median step and the gap between steps per batch size, the
engine thread's jobs, and per thread the functions on the stack) to `--out`.

    python3 benchmarks/gpu/profile_decode_gaps.py --model /tmp/host-servers-work/model-qwen3-1.7b --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gpu import Proc, log, text_of, ttft  # noqa: E402
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
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prof = args.out / "decode-gaps-profile.json"
    cmd = [sys.executable, str(HERE.parent / "prof_serve_threads.py"), "serve", "--model", str(args.model),
           "--port", str(args.port), "--log-format", "json", "--queue-timeout", "0", "--device-probe", "off",
           *args.serve_args.split()]
    os.environ.update(MLXD_SAMPLE_OUT=str(prof), MLXD_SAMPLE_MS=str(args.sample_ms))
    server = Proc("mlxd_prof", cmd, args.port, "/health", args.out / "decode-gaps-serve.log")
    server.start()
    results = {}
    try:
        for i, n in enumerate(int(x) for x in args.streams.split(",") if x):
            if args.fresh_tokens:
                asyncio.run(ttft(server.base, args.model.name, text_of(args.model, args.fresh_tokens, 900 + i)))
            d = asyncio.run(decode(server.base, args.model.name, [f"Story {j}: " + TEXTS["q2"] for j in range(n)],
                                   args.tokens))
            results[str(n)] = d["tok_s"]
            log("decode", n, "streams", d["tok_s"])
    finally:
        server.stop()
    report = json.loads(prof.read_text()) if prof.exists() else {}
    summary = {"tok_s": results, "engine_jobs": report.get("engine_jobs"), "engine_steps": report.get("engine_steps")}
    (args.out / "decode-gaps.json").write_text(json.dumps(summary, indent=1))
    log("summary", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
