# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Decode's host cost (issue 28): the loops alone, then the servers, side by side in one run.

With the tiny `test` model the forward pass is nearly free, so decode is bound by
the host's Python per step and per token, as the 1.7B model's decode is on an H200.
Per stream count (1 and 8 rows, EOS banned):
  (a) mlx_lm's BatchGenerator stepped alone on this thread;
  (b) mlxd's EngineCore stepping the same rows (engine/drive.py run_rows);
then, through benchmarks/gpu/bench_host_tier_servers.py (`--rounds 0`: decode only),
  (c) mlx_lm.server, (d) `mlxd serve` (RAM only), (e) `mlxd serve --host-cache-gb
  --ssd-cache DIR` with a fresh long prompt's write-behind in flight.
Reported: tok/s of all rows together and host µs per token (1e6 / tok/s).

    PYTHONPATH=src python benchmarks/bench_decode_host.py [--tokens 1000] [--out benchmarks/results]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def loop_alone(model: Any, rows: int, tokens: int) -> float:
    """(a) BatchGenerator.next() until every row has `tokens` tokens; tok/s after each row's first."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    # EOS banned as mlx_lm.server bans it for a request's logit_bias (the servers' clients send one)
    gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], prefill_step_size=512,
                         logits_processors=make_logits_processors(logit_bias={0: -100.0, 2: -100.0}))
    gen.insert([[5 + i, 6, 7, 8] for i in range(rows)], [tokens] * rows)
    seen, t0, done = 0, None, 0
    while done < rows:
        _, responses = gen.next()
        if not responses:
            continue  # prefill
        done += sum(r.finish_reason is not None for r in responses)
        if t0 is None:  # the first tokens: timing starts here
            t0 = time.perf_counter()
            continue
        seen += len(responses)
    dt = time.perf_counter() - t0 if t0 else 0.0
    gen.close() if hasattr(gen, "close") else None
    return seen / dt if dt > 0 else float("nan")


def core_rows(model_dir: Path, rows: int, tokens: int) -> float:
    """(b) EngineCore.step() with the same rows, as the engine actor calls it (no actors, no HTTP)."""
    from mlxd import RuntimeConfig
    from mlxd.engine.core import EngineCore
    from mlxd.engine.drive import run_rows
    from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams

    config = RuntimeConfig(model=str(model_dir), model_name="test", prompt_cache_bytes=0, device_probe="off",
                           max_batch=max(rows, 8), prefill_batch=max(rows, 8), max_context=tokens + 64)
    core = EngineCore(config)
    core.load()
    try:
        requests = [GenerationRequest(request_id=f"r{i}", prompt=(5 + i, 6, 7, 8),
                                      sampling=SamplingParams(max_tokens=tokens, logit_bias=((0, -100.0), (2, -100.0))))
                    for i in range(rows)]
        return run_rows(core, requests).decode_tok_s()
    finally:
        core.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per row / stream")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="in-process loops: the median of this many")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "decode-host-work")
    ap.add_argument("--no-servers", action="store_true")
    args = ap.parse_args()
    streams = [int(x) for x in args.streams.split(",") if x]
    from mlx_lm.utils import load

    from mlxd.model.tiny import build_model

    model_dir = args.work / "model-test"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, "test", seed=0)
    model, _ = load(str(model_dir))
    out: dict[str, Any] = {"tokens": args.tokens, "load_before": os.getloadavg(), "loops": {}}
    for n in streams:
        a = sorted(loop_alone(model, n, args.tokens) for _ in range(args.repeats))[args.repeats // 2]
        b = sorted(core_rows(model_dir, n, args.tokens) for _ in range(args.repeats))[args.repeats // 2]
        out["loops"][str(n)] = {"mlx_lm_loop_tok_s": a, "engine_core_tok_s": b, "core_vs_loop": b / a,
                                "mlx_lm_loop_us_per_token": 1e6 / a, "engine_core_us_per_token": 1e6 / b}
        print(f"{n} rows: (a) BatchGenerator {a:.0f} tok/s ({1e6 / a:.0f} us/token)  (b) EngineCore {b:.0f} tok/s "
              f"({1e6 / b:.0f} us/token)  b/a {b / a:.3f}", flush=True)
    if not args.no_servers:
        srv = args.work / "servers"
        cmd = [sys.executable, str(HERE / "gpu" / "bench_host_tier_servers.py"), "--small", "--preset", "test",
               "--rounds", "0", "--streams", ",".join(str(n) for n in streams for _ in range(2)),  # each twice: warm
               "--decode-tokens", str(args.tokens), "--servers", "mlx_lm,mlxd_ram,mlxd_host_ssd",
               "--out", str(srv), "--work", str(args.work)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        res = json.loads(max(srv.glob("host_servers-*.json"), key=lambda p: p.stat().st_mtime).read_text())
        med = res["summary"]["medians_s"]
        servers = {}
        for name in ("mlx_lm", "mlxd_ram", "mlxd_host_ssd"):
            for n in streams:
                tok_s = (med.get(name) or {}).get(f"decode_{n}_tok_s")
                servers.setdefault(name, {})[str(n)] = {"tok_s": tok_s, "us_per_token": 1e6 / tok_s if tok_s else None}
        out["servers"] = servers
        for n in streams:
            lm = servers["mlx_lm"][str(n)]["tok_s"]
            line = " ".join(f"{k} {v[str(n)]['tok_s']:.0f} ({v[str(n)]['tok_s'] / lm:.3f}x)" for k, v in servers.items()
                            if v[str(n)]["tok_s"] and lm)
            print(f"{n} streams over HTTP: {line}", flush=True)
    out["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-host-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
