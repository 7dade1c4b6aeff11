# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""A write plan's bytes by device address + DMA, never converted to managed memory (issue 28).

On the H100 (2026-12-06 09:02, `dlpack-copy-h100-*.json`) DLPack gave no way around the host read that converts
a fresh array to managed memory: MLX exports the converted host pointer (device type CPU), and its first export
cost what the `memoryview` does (46 ms for an 8k row of the 1.7B shape, the GIL held throughout). Here the
address comes from a custom CUDA kernel instead (`runtime/device_pointers.py`), per round on fresh KV caches of
the 1.7B shape sliced as a plan slices them:

(a) `addresses()`: time and the longest gap of a 1 ms ticker thread (how long the GIL was held);
(b) `host_memory.to_host` from those addresses into one page-locked buffer (the writer's staging): time, gap,
    GB/s, runtime calls;
(c) the same arrays' `memoryview` (the plan's path today: the conversion) and whether (b)'s bytes equal it;
(d) beside a ~100 ms chain of matmuls dispatched on the default stream: (a) + (b) on a side stream on fresh caches,
    then the `memoryview` path on other fresh caches, each with how long it took (a path that waits for the
    device's queue takes as long as the matmuls);
(e) serving's own path end to end on fresh caches: `kinds.plan_snapshot(device=True)` (its time: the engine
    thread's), the SSD writer's `Staging.stage`, the file written, byte for byte the file of a host-view plan
    (`plan_file_equal`).
Off CUDA `addresses()` is None and the script says so. No model, no server.

    python3 benchmarks/gpu/probe_device_pointer.py --tokens 8192 --rounds 3 --json OUT.json
    wave3.sh devptr
"""

from __future__ import annotations

import mlxd  # noqa: F401

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_plan_snapshot import Ticker, caches_of, probe_main, probe_meta, timed  # noqa: E402


def plan_arrays(tokens: int) -> list[Any]:
    """Fresh caches' arrays as a plan hands them to the writer: sliced to the length, bf16 viewed as uint16."""
    import mlx.core as mx

    from mlxd.kv import kinds

    arrays: list[Any] = []
    for c in caches_of(tokens, mx.bfloat16):
        kinds.kind_of(c).plan(c, arrays)
    arrays = [a.view(mx.uint16) for a in arrays]
    mx.eval(arrays)
    return arrays


def busy_device() -> Any:
    """A chain of matmuls (~100 ms on an H100) dispatched on the default stream, not waited for."""
    import mlx.core as mx

    x = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(x)
    y = x
    for _ in range(60):
        y = (y @ x) * 1e-4
    mx.async_eval(y)
    return y


def one_round(tokens: int, ticker: Ticker) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    from mlxd.runtime import device_pointers, host_memory

    row: dict[str, Any] = {"tokens": tokens}
    print(f"(a) {tokens}", file=sys.stderr, flush=True)
    side = mx.new_stream(mx.default_device())
    arrays = plan_arrays(tokens)
    views, row["addresses_ms"], row["addresses_gap_ms"] = timed(
        ticker, lambda: device_pointers.device_views(arrays, stream=side))
    if views is None:
        row["unavailable"] = device_pointers._broken[:1] or ["not CUDA"]
        return row
    nbytes = sum(v.nbytes for v in views)
    buf = host_memory.alloc(nbytes)
    counts = host_memory.Copied()
    (_, copied), row["copy_ms"], row["copy_gap_ms"] = timed(
        ticker, lambda: host_memory.to_host(views, buf, counts=counts))
    row["copy_mb"], row["copy_calls"], row["pinned"] = round(nbytes / 1e6, 1), counts.calls, buf.pinned
    row["copy_gb_s"] = round(nbytes / 1e6 / max(row["copy_ms"], 1e-3), 2)
    mvs, row["memoryview_ms"], row["memoryview_gap_ms"] = timed(ticker, lambda: [memoryview(a) for a in arrays])
    plain = np.concatenate([np.asarray(m).reshape(-1).view(np.uint8) for m in mvs])
    row["equal"] = bool(np.array_equal(plain, buf.array[: plain.nbytes]))
    del mvs, copied

    # (d) beside a queue of matmuls
    print(f"(d) {tokens}", file=sys.stderr, flush=True)
    fresh = plan_arrays(tokens)
    busy = busy_device()
    t0 = time.perf_counter()
    (views2, _), row["beside_addresses_copy_ms"], row["beside_addresses_copy_gap_ms"] = timed(
        ticker, lambda: (v := device_pointers.device_views(fresh, stream=side),
                         host_memory.to_host(v, buf) if v is not None else None))
    row["beside_addresses_busy_done"] = bool(busy.is_available()) if hasattr(busy, "is_available") else None
    mx.eval(busy)
    row["beside_busy_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    fresh2 = plan_arrays(tokens)
    busy = busy_device()
    t0 = time.perf_counter()
    _, row["beside_memoryview_ms"], row["beside_memoryview_gap_ms"] = timed(
        ticker, lambda: [memoryview(a) for a in fresh2])
    mx.eval(busy)
    row["beside_busy_memoryview_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    del views2

    # (e) the plan, staged and written, against the plan of host views
    import tempfile

    from mlxd.kv import file_format as ff
    from mlxd.kv import kinds

    caches, meta = caches_of(tokens, mx.bfloat16), probe_meta(tokens)
    print(f"(e) {tokens}: plan", file=sys.stderr, flush=True)  # (where a crash came: the log's last line)
    plan, row["plan_device_ms"], row["plan_device_gap_ms"] = timed(
        ticker, lambda: kinds.plan_snapshot(caches, meta=meta, device=True))
    row["plan_on_device"] = plan.on_device
    print(f"(e) {tokens}: stage", file=sys.stderr, flush=True)
    staging = host_memory.Staging()  # (its buffer holds the staged bytes: kept while they are written)
    (staged, row["stage_ms"], row["stage_gap_ms"]) = timed(ticker, lambda: staging.stage(plan))
    print(f"(e) {tokens}: write", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as d:
        ff.write_snapshot(staged, Path(d) / "device.mlxkv")
        ff.write_snapshot(kinds.plan_snapshot(caches, meta=meta), Path(d) / "host.mlxkv")
        row["plan_file_equal"] = (Path(d) / "device.mlxkv").read_bytes() == (Path(d) / "host.mlxkv").read_bytes()
    return row


def main() -> int:
    return probe_main(one_round, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
