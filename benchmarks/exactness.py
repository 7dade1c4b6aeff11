# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""The exactness contract: does any cache path change an answer? (issue 27)

Replays random greedy and seeded requests (plain turns, tool turns, n = 2,
stop strings) over every cache path (cold, RAM hit, SSD restore, resumed
generation checkpoint, restart, a replica sharing the SSD directory) for
every cache family the presets build (KVCache, QuantizedKVCache KV8 / KV4,
RotatingKVCache, hybrid and pure ArraysCache), and compares tokens and
logprobs with a cold recompute under the same KV scheme (tests/exactness.py
says how). Chunks of one cell and one seed run until `--replays` are done;
the JSON result is rewritten after every chunk, so an interrupted run keeps
what it did.

    python benchmarks/exactness.py --replays 10000 --seed 1

Results go to benchmarks/results/exactness-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import exactness as ex  # noqa: E402
from mlxd.model import ensure_model  # noqa: E402
from mlxd.model.presets import PRESETS  # noqa: E402

DISTRIBUTED_SKIPPED = (
    "--distributed needs a world of MLX ranks that mlx.launch starts as separate processes (the ring "
    "backend); there is no in-process group, and --distributed refuses the SSD tier. "
    "tests/test_distributed.py compares a two-rank server with one process (tokens equal, logprobs within 1e-3)."
)


async def run(args: argparse.Namespace, out: Path) -> dict:
    cells = [c for c in ex.CELLS if not args.cells or f"{c[0]}/{c[1] or 'native'}" in args.cells
             or c[0] in args.cells]
    models = {preset: ensure_model(preset) for preset, _ in cells if preset in PRESETS}
    if any(preset == "falcon_h1" for preset, _ in cells):
        models["falcon_h1"] = ex.falcon_h1_dir(ensure_model("test"), Path(tempfile.mkdtemp(dir=args.dir)) / "falcon")
    replays: list[ex.Replay] = []
    chunks = []
    t0 = time.perf_counter()
    i = 0
    while len(replays) < args.replays:
        preset, bits = cells[i % len(cells)]
        seed = args.seed * 100_003 + i
        # Each round over the cells takes the next SSD layout and restore landing (the first runtime's).
        layout = ("whole", "blocks")[(i // len(cells)) % 2]
        landing = ("mlx", "host")[(i // (2 * len(cells))) % 2]
        work = Path(tempfile.mkdtemp(prefix="mlxd-exactness-", dir=args.dir))
        started = time.perf_counter()
        try:
            got = await ex.run_cell(models[preset], preset, bits, work, conversations=args.conversations, seed=seed,
                                    scenarios=args.scenarios, concurrency=args.concurrency,
                                    max_tokens=tuple(args.max_tokens), checkpoint_every=args.checkpoint_every,
                                    demote_idle_s=args.demote_idle, ssd_layout=layout, restore_landing=landing)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        replays += got
        chunks.append({"cell": f"{preset}/{bits or 'native'}", "seed": seed, "layout": layout, "landing": landing,
                       "replays": len(got),
                       "mismatches": sum(r.verdict == "mismatch" for r in got), "seconds": time.perf_counter() - started})
        summary = ex.summarize(replays)
        print(f"chunk {i}: {chunks[-1]['cell']:<21} {layout:<6} {landing:<4} seed {seed}: {len(got)} replays, {chunks[-1]['mismatches']} "
              f"mismatches ({chunks[-1]['seconds']:.0f} s); total {len(replays)}, {summary['mismatches']} mismatches, "
              f"{summary['ties']} ties, {summary['kv_noise']} kv-noise", flush=True)
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "seconds": time.perf_counter() - t0,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "tolerances": {f"{p}/{b or 'native'}": ex.tolerance(p, b) for p, b in cells},
            "distributed": {"skipped": DISTRIBUTED_SKIPPED},
            "summary": summary,
            "not_ok": [attrs.asdict(r) for r in replays if r.verdict != "ok"],
            "chunks": chunks,
        }
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
        i += 1
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replays", type=int, default=1000, help="stop after the chunk that reaches this many")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--conversations", type=int, default=6, help="conversations per chunk (half as many held out)")
    p.add_argument("--concurrency", type=int, default=4, help="requests sent at once in each pass")
    p.add_argument("--max-tokens", type=int, nargs=2, default=[10, 16], metavar=("LO", "HI"))
    p.add_argument("--checkpoint-every", type=int, default=4, help="generation checkpoint interval (tokens)")
    p.add_argument("--demote-idle", type=float, default=1.5, help="ssd_demote_idle_s of the first runtime")
    p.add_argument("--cells", nargs="*", default=[], help="e.g. test-wide/8 or test-mamba2 (default: all)")
    p.add_argument("--scenarios", nargs="*", default=list(ex.SCENARIOS), choices=ex.SCENARIOS)
    p.add_argument("--dir", help="where the SSD dirs go (default: the system temp dir)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"exactness-{ex.now()}.json"
    result = trio.run(run, args, out)
    s = result["summary"]
    for key in ("by_scenario", "by_cell", "by_feature", "by_sampling", "by_tier"):
        print(ex.table(s, key), end="\n\n")
    print(f"{s['replays']} replays, {s['mismatches']} mismatches, {s['ties']} near-ties, {s['kv_noise']} kv-noise; "
          f"distributed: skipped ({DISTRIBUTED_SKIPPED.split(';')[0]})")
    print(f"wrote {out}")
    return 1 if s["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
