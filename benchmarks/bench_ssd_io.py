"""SSD tier I/O: write, read + adopt of one ~200 MB snapshot vs the disk's raw read speed.

    /tmp/venv/bin/python benchmarks/bench_ssd_io.py [--dir DIR] [--tokens 900] [--reps 3]

Shape: a Qwen3-1.7B-like fp32 KV cache (28 layers, 8 KV heads, head dim 128),
`--tokens` tokens each (900 -> ~206 MB; capacity 1024, so the writer packs
strided slices). Cold reads: every file's clean pages are dropped with
posix_fadvise(DONTNEED) after its fsync (the writer and reader do this
themselves), so reads come from the disk, not the page cache. The raw
baseline reads a plain copy of the same bytes, dropped the same way, with
16 MiB readinto calls into one preallocated buffer, once just before and once
after the snapshot reads of the same round (mean of the two).
The rounds go to benchmarks/results/ssd_io-<timestamp>.json.
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
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlc

import mlxd  # noqa: F401  (OpenBLAS preload before mlx)
from mlxd.kv import file_format as ff  # noqa: E402
from mlxd.kv import kinds  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128
MB = 1e6


def make_caches(tokens: int) -> list[mlc.KVCache]:
    caches = []
    for _ in range(LAYERS):
        c = mlc.KVCache()
        shape = (1, KV_HEADS, tokens, HEAD_DIM)
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read(path: Path) -> float:
    """Seconds to read a file sequentially, cold."""
    drop_cache(path)
    buf = memoryview(bytearray(16 << 20))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def one_round(caches, tokens: int, d: Path, rep: int) -> dict[str, float]:
    meta = ff.SnapshotMeta("bench", "fp", "", "tok", range(tokens))
    t0 = time.perf_counter()
    plan = kinds.plan_snapshot(caches, meta=meta)
    t_plan = time.perf_counter() - t0
    written = ff.write_snapshot(plan, d / f"snap{rep}.mlxkv")
    del plan
    plain = d / f"plain{rep}.bin"
    shutil.copyfile(written.path, plain)
    raw_before = raw_read(plain)  # the disk is shared and noisy: bracket the snapshot read
    drop_cache(written.path)
    t0 = time.perf_counter()
    loaded = ff.read_snapshot(written.path, verify=False)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    restored = kinds.adopt(loaded)
    t_adopt = time.perf_counter() - t0
    assert restored[0].offset == tokens
    del loaded, restored
    drop_cache(written.path)
    t0 = time.perf_counter()
    ff.read_snapshot(written.path, verify=True)
    t_verify = time.perf_counter() - t0
    t_raw = (raw_before + raw_read(plain)) / 2
    size = written.nbytes
    for p in (written.path, plain):
        p.unlink()
    return {
        "bytes": size,
        "plan_s": t_plan,
        "write_s": written.seconds,
        "read_s": t_read,
        "adopt_s": t_adopt,
        "verify_read_s": t_verify,
        "raw_read_s": t_raw,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    caches = make_caches(args.tokens)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rounds = [one_round(caches, args.tokens, Path(tmp), r) for r in range(args.reps)]
    size = rounds[0]["bytes"] / MB
    print(f"snapshot {size:.1f} MB, {args.tokens} tokens x {LAYERS} layers")
    print("round  write  read  read+adopt  read(verify)  raw-read   MB/s;  plan ms  adopt ms")
    for i, r in enumerate(rounds):
        print(
            f"{i:5d} {size / r['write_s']:6.0f} {size / r['read_s']:5.0f}"
            f" {size / (r['read_s'] + r['adopt_s']):11.0f} {size / r['verify_read_s']:13.0f}"
            f" {size / r['raw_read_s']:9.0f}        {r['plan_s'] * 1e3:8.1f} {r['adopt_s'] * 1e3:9.1f}"
        )
    # round 0 pays the process's first page faults on fresh host memory
    steady = rounds[1:] or rounds
    med = {k: statistics.median(r[k] for r in steady) for k in steady[0]}
    both = size / (med["read_s"] + med["adopt_s"])
    raw = size / med["raw_read_s"]
    print(f"median of rounds 1..{len(rounds) - 1}: read+adopt {both:.0f} MB/s,", end=" ")
    print(f"raw read {raw:.0f} MB/s, ratio {both / raw:.2f}")
    out = Path(__file__).resolve().parent / "results" / f"ssd_io-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/bench_ssd_io.py", *sys.argv[1:]]),
        "file_format_version": ff.FORMAT_VERSION,
        "snapshot_mb": size,
        "rounds": rounds,
        "median_rounds_1_on": {"read_adopt_mb_s": both, "raw_read_mb_s": raw, "ratio": both / raw,
                               "write_mb_s": size / med["write_s"], "verify_read_mb_s": size / med["verify_read_s"]},
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
