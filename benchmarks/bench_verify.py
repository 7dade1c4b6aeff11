"""What verifying every restored byte costs: restores with and without per-tensor CRC-32, side by side.

    python benchmarks/bench_verify.py [--dir DIR] [--tokens 512] [--rounds 5]

One snapshot of a Qwen3-1.7B-like fp32 KV cache (28 layers, 8 KV heads, head
dim 128: 229 KB per token) is stored three ways through `SsdStore` and
restored the way serving restores it (`SsdStore.load` on a reader thread's
behalf, then `kinds.adopt`), with `verify=True` (the default) and
`verify=False` (`--ssd-cache-verify off`):

- `whole_host`: a whole file read into a private host buffer (`--restore-landing host`);
- `whole_mlx`: a whole file read straight into MLX arrays (`kinds.landing`; the CPU default);
- `blocks`: the blocks layout (`--ssd-layout blocks`, 128-token blocks), into a host buffer.

Each arm runs warm (the file's pages in the page cache: a restore soon after
the write, or after the startup's page-cache warming) and cold (its pages
dropped with posix_fadvise(DONTNEED) first, so the bytes come from the disk).
Rounds alternate the order of the arms; medians go to
benchmarks/results/verify-<timestamp>.json with the ratio verified / unverified
per arm, and zlib.crc32's own speed over the same bytes in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ssd_io  # noqa: E402

import mlxd  # noqa: E402, F401  (OpenBLAS preload before mlx)
from mlxd.kv import kinds  # noqa: E402
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity, compute_fingerprint  # noqa: E402
from mlxd.kv.tiers import SsdRecord  # noqa: E402

IDENTITY = StoreIdentity("bench", compute_fingerprint({"bench": "verify"}), "tok")


def files_of(store: SsdStore, record: SsdRecord) -> list[Path]:
    assert record.path is not None
    return [*store.blocks.block_paths(record), record.path] if record.blocks else [record.path]


def restore(store: SsdStore, record: SsdRecord, *, verify: bool, land: bool, cold: bool) -> float:
    """Seconds for one restore: load (read, and with `verify` every CRC-32) + adopt into MLX."""
    if cold:
        for path in files_of(store, record):
            bench_ssd_io.drop_cache(path)
    t0 = time.perf_counter()
    loaded = store.load(record, verify=verify, land=kinds.landing if land else None)
    assert loaded is not None
    caches = kinds.adopt(loaded)
    seconds = time.perf_counter() - t0
    assert caches[0].offset == len(record.tokens)
    del loaded, caches
    gc.collect()
    return seconds


def crc32_gbps(store: SsdStore, record: SsdRecord) -> float:
    assert record.path is not None
    data = memoryview(record.path.read_bytes())
    t0 = time.perf_counter()
    zlib.crc32(data)
    return data.nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-verify-", dir=args.dir))
    try:
        caches = bench_ssd_io.make_caches(args.tokens)
        plan = kinds.plan_snapshot(caches, meta=IDENTITY.meta(list(range(1, args.tokens + 1)), ""))
        whole = SsdStore(work / "whole", IDENTITY)
        blocks = SsdStore(work / "blocks", IDENTITY, layout="blocks", block_tokens=128)
        records = {}
        for name, store in (("whole", whole), ("blocks", blocks)):
            outcome = store.write(plan)
            assert isinstance(outcome, Stored), outcome
            records[name] = outcome.record
        nbytes = plan.nbytes
        del plan, caches
        arms: dict[str, Callable[[bool, bool], float]] = {
            "whole_host": lambda v, c: restore(whole, records["whole"], verify=v, land=False, cold=c),
            "whole_mlx": lambda v, c: restore(whole, records["whole"], verify=v, land=True, cold=c),
            "blocks": lambda v, c: restore(blocks, records["blocks"], verify=v, land=False, cold=c),
        }
        steps = [(arm, mode, verify) for arm in arms for mode in ("warm", "cold") for verify in (True, False)]
        for arm, mode, verify in steps:
            arms[arm](verify, mode == "cold")  # first touch, not measured
        seconds: dict[str, list[float]] = {f"{a}_{m}_{'verified' if v else 'unverified'}": [] for a, m, v in steps}
        crc: list[float] = []
        for r in range(args.rounds):
            order = steps[r % len(steps):] + steps[: r % len(steps)]
            for arm, mode, verify in order:
                key = f"{arm}_{mode}_{'verified' if verify else 'unverified'}"
                seconds[key].append(arms[arm](verify, mode == "cold"))
            crc.append(crc32_gbps(whole, records["whole"]))
        medians = {k: statistics.median(v) for k, v in seconds.items()}
        summary = {}
        print(f"{nbytes / 1e6:.0f} MB of KV, {args.rounds} rounds, medians (restore = load + adopt):")
        print(f"{'arm':22s} {'verified ms':>12s} {'unverified ms':>14s} {'ratio':>6s} {'+ms/GB':>7s}")
        for arm in arms:
            for mode in ("warm", "cold"):
                on, off = medians[f"{arm}_{mode}_verified"], medians[f"{arm}_{mode}_unverified"]
                row = {"verified_ms": on * 1e3, "unverified_ms": off * 1e3, "ratio": on / off,
                       "extra_ms_per_gb": (on - off) * 1e3 / (nbytes / 1e9)}
                summary[f"{arm}_{mode}"] = row
                print(f"{arm + ' ' + mode:22s} {row['verified_ms']:12.1f} {row['unverified_ms']:14.1f} "
                      f"{row['ratio']:6.2f} {row['extra_ms_per_gb']:7.0f}")
        print(f"zlib.crc32 alone: {statistics.median(crc):.2f} GB/s (median)")
        out = HERE / "results" / f"verify-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/bench_verify.py", *sys.argv[1:]]),
            "tokens": args.tokens, "kv_bytes": nbytes, "rounds": args.rounds, "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(), "summary": summary, "crc32_gbps": crc,
            "seconds": seconds,
        }, indent=2) + "\n")
        print(f"wrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
