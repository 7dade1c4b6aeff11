# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""What a prompt checkpoint's write plan costs the engine thread, part by part (issue 28).

With the SSD tier, the prompt-boundary checkpoint is taken before the first token, and its write plan
(`kv/kinds.plan_snapshot`) is made there, on the engine thread. On the H200 that checkpoint took 46–152 ms of
a cold turn's TTFT with the SSD tier against 2.5–6 ms without it (`first_token_ms.checkpoint` in every
`host_servers-h200-*` run of 2026-12-04/05). The plan slices each layer's KV to its length (a device copy),
evaluates, then takes a `memoryview` of each array: on MLX's CUDA backend that first host access converts
an array computed on the device to managed memory (an allocation and a synchronous copy, with the GIL held).

Here, on KV caches of the 1.7B shape (28 layers, 8 KV heads, head dim 128, bf16) at each `--tokens`, fresh
caches per round: the whole `plan_snapshot`, then its parts (slice + eval; the memoryviews, first and again),
each with the longest gap of a 1 ms ticker thread (the GIL held that long), and whether the arrays offer
DLPack (a device pointer without the host access, if MLX gives one). No model, no server.

    python3 benchmarks/gpu/time_plan_snapshot.py --tokens 8192 16384 --rounds 3 --json OUT.json
    python3 benchmarks/gpu/time_plan_snapshot.py --tokens 100 --rounds 5 --pack-mb 64   # a final checkpoint, packed too
"""

from __future__ import annotations

import mlxd  # noqa: F401

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

LAYERS, KV_HEADS, HEAD_DIM = 28, 8, 128


class Ticker:
    """A thread that wakes every ms: its longest gap while `measure` runs is how long it could not run."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.stamps.append(time.perf_counter())
            time.sleep(0.001)

    def longest_gap_ms(self, t0: float, t1: float) -> float:
        inside = [t0] + [s for s in list(self.stamps) if t0 <= s <= t1] + [t1]
        return round(max(b - a for a, b in zip(inside, inside[1:], strict=False)) * 1e3, 2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def caches_of(tokens: int, dtype: Any) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(dtype)
        v = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(dtype)
        c.update_and_fetch(k, v)
        # One more token, as a decoded or next-turn row's cache has: the buffer grows a step (256) past its
        # length, so the plan slices it to `offset`, as in serving. That slice is a view (`kinds._token_slice`),
        # so its memoryview converts the whole shared buffer: the live cache's, in serving.
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def timed(ticker: Ticker, fn: Any) -> tuple[Any, float, float]:
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    return out, round((t1 - t0) * 1e3, 2), ticker.longest_gap_ms(t0, t1)


def one_round(tokens: int, ticker: Ticker, pack_mb: float = 0.0) -> dict[str, Any]:
    import mlx.core as mx

    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import StoreIdentity, compute_fingerprint

    meta = StoreIdentity("plan", compute_fingerprint({"plan": 1}), "plan").meta(list(range(tokens)), "")
    row: dict[str, Any] = {"tokens": tokens}
    caches = caches_of(tokens, mx.bfloat16)
    plan, row["plan_snapshot_ms"], row["plan_snapshot_gap_ms"] = timed(
        ticker, lambda: kinds.plan_snapshot(caches, meta=meta))
    row["plan_mb"] = round(sum(b.nbytes for b in plan.buffers) / 1e6, 1)
    del plan
    if pack_mb:  # MLXD_PLAN_PACK_MB's path on fresh caches: one packed copy, one host conversion
        caches = caches_of(tokens, mx.bfloat16)
        plan, row["plan_packed_ms"], row["plan_packed_gap_ms"] = timed(
            ticker, lambda: kinds.plan_snapshot(caches, meta=meta, pack_max_bytes=int(pack_mb * (1 << 20))))
        row["packed"] = plan.packed
        del plan
    caches = caches_of(tokens, mx.bfloat16)  # fresh arrays: the parts, as plan_snapshot does them

    def slices() -> list[Any]:
        arrays: list[Any] = []
        for c in caches:
            kinds.kind_of(c).plan(c, arrays)
        mx.eval(arrays)
        return arrays

    arrays, row["slice_eval_ms"], row["slice_eval_gap_ms"] = timed(ticker, slices)
    views = [a.view(mx.uint16) for a in arrays]
    mx.eval(views)
    _, row["memoryview_first_ms"], row["memoryview_first_gap_ms"] = timed(
        ticker, lambda: [memoryview(v) for v in views])
    _, row["memoryview_again_ms"], row["memoryview_again_gap_ms"] = timed(
        ticker, lambda: [memoryview(v) for v in views])
    fresh = slices()
    row["dlpack"] = hasattr(fresh[0], "__dlpack__")
    if row["dlpack"]:
        try:
            row["dlpack_device"] = str(fresh[0].__dlpack_device__())
            _, row["dlpack_ms"], row["dlpack_gap_ms"] = timed(ticker, lambda: [a.__dlpack__() for a in fresh])
        except Exception as exc:  # (the device's arrays may not export)
            row["dlpack_error"] = f"{type(exc).__name__}: {exc}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pack-mb", type=float, default=0.0,
                    help="also time the plan made from one packed copy (MLXD_PLAN_PACK_MB) up to this size")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    return run_rounds(lambda n, ticker: one_round(n, ticker, args.pack_mb), args.tokens, args.rounds, args.json)


def probe_meta(tokens: int) -> Any:
    """A write plan's metadata for `tokens` tokens (the probes' plans are never restored)."""
    from mlxd.kv.ssd_store import StoreIdentity, compute_fingerprint

    return StoreIdentity("probe", compute_fingerprint({"probe": 1}), "probe").meta(list(range(tokens)), "")


def probe_main(measure: Any, doc: str | None) -> int:
    """A probe's command line (`--tokens`, `--rounds`, `--json`), then `run_rounds(measure, ...)`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    return run_rounds(measure, args.tokens, args.rounds, args.json)


def run_rounds(measure: Any, tokens: list[int], rounds: int, json_path: Path | None) -> int:
    """`measure(tokens, ticker)` once at 256 tokens (warm-up: kernels, allocator), then each round at each size;
    every row printed, and all of them written to `json_path` with the device and MLX version."""
    import mlx.core as mx

    ticker = Ticker()
    rows = []
    try:
        measure(256, ticker)
        for r in range(rounds):
            for n in tokens:
                row = {"round": r, **measure(n, ticker)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        ticker.stop()
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": rows}
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1))
        print("->", json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
