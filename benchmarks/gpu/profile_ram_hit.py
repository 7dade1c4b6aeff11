"""Where a served RAM hit spends its time: client TTFT split at the server's own marks.

    # on the CUDA host (see docs/benchmarks.md for the install), or here on the CPU:
    python3 benchmarks/gpu/profile_ram_hit.py --out $OUT [--small]

One in-process server (the real app under hypercorn on loopback, `tests/serving.py`),
a long chat prompt sent cold once and then as RAM hits. For each hit: client send ->
handler rendering the chat template -> `Runtime.submit` -> the engine's PromptAccepted
and first token (server side) -> the first content chunk at the client.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

import httpx  # noqa: E402

import mlxd  # noqa: E402, F401
from mlxd.model import presets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/ramhit")))
    ap.add_argument("--hits", type=int, default=8)
    ap.add_argument("--words", type=int, default=0, help="prompt words (default: ~16k tokens, 2.5k on --small)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from bench_gpu import QWEN3_1_7B, build

    from serving import ServerThread, config_for

    work = Path(tempfile.mkdtemp(prefix="ramhit-"))
    model = build(presets.PRESETS["default"] if args.small else QWEN3_1_7B, work / "model")
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "theta", "kappa"]
    n_words = args.words or (2500 if args.small else 3400)
    prompt = " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(n_words))
    cfg = config_for(model, model_name="m", max_context=65536, prompt_cache_bytes=40 << 30)
    rows: list[dict[str, Any]] = []
    with ServerThread(cfg) as server:
        rt = server.runtime
        marks: dict[str, float] = {}
        submit, render = rt.submit, rt.render_chat

        def timed_submit(req: Any) -> Any:
            marks["submit"] = time.perf_counter()
            return submit(req)

        async def timed_render(*a: Any, **k: Any) -> Any:
            marks["render0"] = time.perf_counter()
            out = await render(*a, **k)
            marks["render1"] = time.perf_counter()
            return out

        rt.submit, rt.render_chat = timed_submit, timed_render  # type: ignore[method-assign]
        records: list[Any] = []
        rt.scheduler.observers.append(records.append)
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=None) as client:
            for i in range(args.hits + 1):
                t0 = time.perf_counter()
                first_chunk = first = None
                usage: dict[str, Any] = {}
                with client.stream("POST", server.base_url + "/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        obj = json.loads(line[6:])
                        usage = obj.get("usage") or usage
                        if first_chunk is None:
                            first_chunk = time.perf_counter()
                        if first is None and obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                            first = time.perf_counter()
                end = first or time.perf_counter()
                rec = records[-1]
                row = {
                    "kind": "cold" if i == 0 else "hit",
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "client_ttft_s": end - t0,
                    "send_to_render_s": marks["render0"] - t0,
                    "render_s": marks["render1"] - marks["render0"],
                    "render_to_submit_s": marks["submit"] - marks["render1"],
                    "submit_to_first_content_s": end - marks["submit"],
                    "server_ttft_s": rec.ttft_s,
                    "server_queued_s": rec.queued_s,
                    "first_chunk_s": (first_chunk or end) - t0,
                }
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    hits = sorted(rows[1:], key=lambda r: r["client_ttft_s"])
    med = hits[len(hits) // 2]
    out = {"device": str(__import__("mlx.core").core.default_device()), "rows": rows, "median_hit": med}
    path = args.out / f"ramhit-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("median hit", json.dumps(med), "\nwrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
