# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""What a restarted server pays before and at its first returning turn (issue 28), side by side in one run.

    PYTHONPATH=src python benchmarks/bench_restart_costs.py [--preset bench] [--work /tmp/restart-costs]

1. `probe`: MLX memory a server holds in its buffer cache once it listens, with the startup probe off,
   on (measured afresh) and reused (the last server's, kv/probe_file.py), plus its start seconds and
   the probe's threads and files left. The probe's KV caches were still referenced at its final
   `mx.clear_cache()`, so they stayed cached, where serving's first landings could be carved from them.
2. `residency`: one page-cache residency check (mincore) of a 16k-token record of the 1.7B shape in the
   blocks layout (64 block files of 29.5 MB, sparse: no disk space), as the cache owner runs it for a
   returning prompt's hint and lookup, by the Python loop it used and by the C count it uses now.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import ctypes
import json
import os
import threading
import time
from pathlib import Path

import mlx.core as mx
import trio

from mlxd.kv import ssd_store
from mlxd.model import build_model
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.supervisor import open_runtime


async def _started(model: Path, ssd: Path, probe: str) -> dict[str, object]:
    before = {t.name for t in threading.enumerate()}
    t0 = time.perf_counter()
    config = RuntimeConfig(model=str(model), ssd_cache_dir=ssd, device_probe=probe, device_probe_budget_s=1.0)
    async with open_runtime(config) as rt:
        p = rt.info.probe
        return {"probe": probe, "start_s": round(time.perf_counter() - t0, 2),
                "cache_mb": round(mx.get_cache_memory() / 1e6, 2), "active_mb": round(mx.get_active_memory() / 1e6, 2),
                "probe_reused": None if p is None else getattr(p, "reused", None),
                "threads_left": sorted(t.name for t in threading.enumerate() if t.name not in before
                                       and t.name.startswith("mlxd-probe")),
                "probe_dirs_left": await trio.to_thread.run_sync(lambda: [str(x) for x in ssd.rglob(".device-probe-*")])}


def _python_loop_count(path: Path) -> int:
    """The count as it was: mmap + mincore, then a Python loop over the vector."""
    size = os.path.getsize(path)
    libc = ssd_store._libc()  # (the prototypes as the check sets them)
    pages = (size + 4095) // 4096
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)
        try:
            vec = (ctypes.c_ubyte * pages)()
            libc.mincore(addr, size, vec)
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def residency(work: Path, rounds: int) -> dict[str, object]:
    d = work / "blocks"
    d.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(64):
        p = d / f"b{i}.mlxblk"
        if not p.exists():
            with open(p, "wb") as f:
                f.truncate(29_491_200)  # 256 tokens x 28 layers x 2 x 8 heads x 128 x bf16 = 29.4 MB
        files.append(p)
    out: dict[str, list[float]] = {"python_loop_ms": [], "c_count_ms": []}
    for _ in range(rounds):  # alternating, so load changes hit both alike
        t0 = time.perf_counter()
        for p in files:
            _python_loop_count(p)
        out["python_loop_ms"].append(round(1e3 * (time.perf_counter() - t0), 1))
        t0 = time.perf_counter()
        for p in files:
            ssd_store.resident_pages(p)
        out["c_count_ms"].append(round(1e3 * (time.perf_counter() - t0), 1))
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), **out,
            "ratio_median": sorted(a / b for a, b in zip(out["python_loop_ms"], out["c_count_ms"], strict=True))[rounds // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--work", type=Path, default=Path("/tmp/restart-costs"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["probe", "residency"])
    ap.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"load": os.getloadavg()}
    if "residency" in args.parts:
        result["residency"] = residency(args.work, args.rounds)
        print(json.dumps(result["residency"]), flush=True)
    if "probe" in args.parts:
        model = build_model(args.work / f"model-{args.preset}", args.preset, seed=0)
        ssd = args.work / "ssd"
        rows = []
        for probe in ("off", "on", "auto"):  # auto after on: the saved probe is reused
            if probe == "off":
                import shutil

                shutil.rmtree(ssd, ignore_errors=True)
            rows.append(trio.run(_started, model, ssd, probe))
            print(json.dumps(rows[-1]), flush=True)
        result["probe"] = rows
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
