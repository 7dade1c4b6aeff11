"""A flush's seconds, traced on the CPU with real files (issue 28).

    PYTHONPATH=src python benchmarks/trace_flush.py [--tokens 4096] [--block-tokens 256] [--rounds 3] [--dir DIR]

One checkpoint of the 1.7B shape (28 layers, 8 KV heads, head dim 128, bf16: 112 KiB a token) as
the RAM tier holds it, written to a block store as the SSD writer writes it during a flush: each
block staged to host memory first through `tests/fake_cuda.py` (real copies, timed at the H200's
50 GB/s; `--cuda real` on a CUDA host: the real runtime and page-locked buffers), then packed,
checksummed and written in 16 MiB slices. Arms, alternating per round, on
the same plan, each into a fresh directory on the same disk:

  serial  the flush path before issue 28's change, for a write begun beside decode: its blocks
          one at a time to the last, each buffered 16 MiB slice fdatasynced before the next
  new     the blocks handed to the four block writers once the flush waits; each slice's
          write-back started at once, only the slice before it waited for (sync_file_range)
  new:N   the same with N block writers (`--arms serial,new,new:8`: would more files in flight help?)
  fdsync  four blocks at a time, each slice fdatasynced (the old path of a flush begun with the
          engine idle: `new` less the write-back change alone)

Per arm: wall seconds, MB/s and ÷ a plain file of the same size (8 MiB writes + fsync, same
directory, same round), and where the seconds went (`WriteTimes`, thread-seconds summed over
the writing threads): staging, pwrite, sync (write-backs, fsyncs), files (open to rename; the
CRC and the copy into the write buffer are files less pwrite and sync).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from bench_host_tier_servers import raw_write_s  # noqa: E402
from tests import fake_cuda  # noqa: E402

LAYERS, HEADS, DIM = 28, 8, 128  # the 1.7B shape's KV (bf16)


def plan_of(tokens: int) -> Any:
    import mlx.core as mx
    from mlx_lm.models import cache as mlc

    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import StoreIdentity

    caches = []
    for layer in range(LAYERS):
        c = mlc.KVCache()
        k = mx.random.normal((1, HEADS, tokens, DIM), key=mx.random.key(layer)).astype(mx.bfloat16)
        c.update_and_fetch(k, -k)
        caches.append(c)
    mx.eval([c.state for c in caches])
    identity = StoreIdentity(model_id="trace", fingerprint="f" * 32, tokenizer_hash="t")
    return kinds.plan_snapshot(caches, meta=identity.meta(tuple(range(tokens)), "")), identity


def write_once(arm: str, plan: Any, identity: Any, directory: Path, block_tokens: int) -> dict[str, Any]:
    from mlxd.actors import ssd_writer
    from mlxd.kv.file_format import write as ffw
    from mlxd.kv.pacing import PACE_SLICE, Pacer, WriteGovernor
    from mlxd.kv.ssd_store import SsdStore, Stored
    from mlxd.runtime import host_memory

    g = WriteGovernor(busy_rate_bytes_per_s=None)
    if arm == "serial":  # one block at a time at full speed (a backlog beside decode: the old flush's in-flight write)
        g.set_busy(True)
        g.set_urgent("backlog", True)
    else:
        g.set_urgent("flush", True)
    # as the SSD writer's: the copy into the write buffer without the GIL where it stages (CUDA)
    pacer = Pacer(g, slice_bytes=PACE_SLICE, release_gil=host_memory.separate_host_memory())
    assert pacer.serial() == (arm == "serial")
    saved = ffw._sync_file_range
    if arm in ("serial", "fdsync"):
        ffw._sync_file_range = None  # an fdatasync per slice
    staging = host_memory.Staging()
    store = SsdStore(directory, identity, layout="blocks", block_tokens=block_tokens)
    if ":" in arm:  # new:N: N block writers instead of block_store.WRITERS
        store.blocks.writers = int(arm.split(":")[1])
    try:
        t0 = time.perf_counter()
        stored = store.write(plan, pacer, prepare=partial(ssd_writer._stage, staging, pacer))
        wall = time.perf_counter() - t0
    finally:
        ffw._sync_file_range = saved
    assert isinstance(stored, Stored), stored
    t = pacer.times
    return {"arm": arm, "wall_s": round(wall, 4), "bytes": stored.written, "MB_s": stored.written / wall / 1e6,
            "stage_s": round(t.stage_s, 4), "pwrite_s": round(t.pwrite_s, 4), "sync_s": round(t.sync_s, 4),
            "files_s": round(t.files_s, 4), "staged_bytes": staging.staged_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="serial,new")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--cuda", choices=("fake", "real"), default="fake",
                    help="stage through tests/fake_cuda.py (CPU) or the real runtime (on a CUDA host: real D2H copies "
                         "into page-locked buffers; elsewhere numpy copies)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    patch = fake_cuda.Patch()
    if args.cuda == "fake":
        fake_cuda.install(patch, fake_cuda.FakeCudaLib())
    work = Path(tempfile.mkdtemp(prefix="trace-flush-", dir=args.dir))
    plan, identity = plan_of(args.tokens)
    arms = args.arms.split(",")
    from mlxd.runtime import host_memory

    out: dict[str, Any] = {"argv": sys.argv, "tokens": args.tokens, "block_tokens": args.block_tokens,
                           "cuda": args.cuda, "separate_host_memory": host_memory.separate_host_memory(),
                           "plan_bytes": plan.nbytes, "load": os.getloadavg(), "rows": []}
    try:
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                d = work / f"{arm}-{r}"
                row = write_once(arm, plan, identity, d, args.block_tokens)
                row["raw_MB_s"] = row["bytes"] / raw_write_s(work, row["bytes"]) / 1e6
                row["over_raw"] = row["MB_s"] / row["raw_MB_s"]
                row["round"] = r
                out["rows"].append(row)
                shutil.rmtree(d, ignore_errors=True)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        patch.undo()
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {}
    for arm in arms:
        rows = [x for x in out["rows"] if x["arm"] == arm]
        summary[arm] = {k: statistics.median(x[k] for x in rows)
                        for k in ("wall_s", "MB_s", "raw_MB_s", "over_raw", "stage_s", "pwrite_s", "sync_s", "files_s")}
    for arm in (a for a in arms if a != "serial" and "serial" in arms):  # per round, paired with the old path
        per = [n["MB_s"] / s["MB_s"] for n in out["rows"] for s in out["rows"]
               if n["arm"] == arm and s["arm"] == "serial" and n["round"] == s["round"]]
        summary[f"{arm}_over_serial_MB_s"] = {"median": statistics.median(per), "rounds": [round(x, 3) for x in per]}
    out["summary"] = summary
    out["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    res = args.out / f"trace-flush-{time.strftime('%Y%m%d-%H%M%S')}.json"
    res.write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    print("->", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
