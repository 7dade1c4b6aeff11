"""Does the SSD writer slow a host-bound engine thread's steps through the GIL? (issue 28, decode beside write-behind)

On the H200 the 1.7B model's decode step is host-bound: the engine thread builds
the step's graph in Python (GIL held), then waits for the device (GIL released)
and needs the GIL back the moment the device answers. wbgaps (20:23 UTC) put the
steps 11-21% longer while a checkpoint was written than after it, with the gaps
between steps unchanged. This models that engine thread on the CPU: a loop of
`--build-ms` of pure Python, then `--wait-ms` of sleep (the device), its step
times recorded, beside the real writer path (`SsdStore`, blocks layout, the
writer's `Pacer`) writing a checkpoint of host buffers (as staged on CUDA) over
and over, unpaced (a backlog past its bound: full speed) or paced (24 MB/s, the
default). Arms, interleaved in every round:

- `none`: no writer (the baseline of the round);
- `gil`: the writer copies each slice into its bounce buffer holding the GIL (the CPU's default);
- `nogil`: the same copy with the GIL released (`Pacer.release_gil`, CUDA's default since issue 28).

Printed per arm: median and mean step (ms), the per-round ratio of its mean step to `none`'s, MB written.

    PYTHONPATH=src python benchmarks/bench_writer_gil.py [--rounds 5] [--seconds 3] [--mb 192] [--paced]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from mlxd.kv.file_format import SnapshotPlan
from mlxd.kv.pacing import Pacer, WriteGovernor, WriteInterrupted
from mlxd.kv.ssd_store import SsdStore, Stored, StoreIdentity

IDENTITY = StoreIdentity(model_id="bench", fingerprint="b" * 32, tokenizer_hash="t")
LAYERS, HEADS, DIM = 28, 8, 128  # the 1.7B shape's KV: 114,688 bytes a token in bf16
PACED_RATE = 24 << 20  # the default write-behind rate beside decode (bytes/s)


def schedstat() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one) from the scheduler."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run, wait, _ = f.read().split()
    return int(run) / 1e9, int(wait) / 1e9


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def plan_of(tokens: int, seed: int, arena: np.ndarray) -> SnapshotPlan:
    """A checkpoint of `tokens` tokens of the 1.7B shape, its tensors views of one host arena (as staged)."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlc

    from mlxd.kv import kinds

    caches = []
    for _ in range(LAYERS):
        c = mlc.KVCache()
        k = mx.zeros((1, HEADS, tokens, DIM), dtype=mx.float16)
        c.update_and_fetch(k, k)
        caches.append(c)
    toks = tuple(range(seed * 1_000_000, seed * 1_000_000 + tokens))
    plan = kinds.plan_snapshot(caches, meta=IDENTITY.meta(toks, ""))
    # Point the buffers at host memory of the same shapes (what staging hands the writer on CUDA).
    views, pos = [], 0
    for b in plan.buffers:
        a = np.asarray(b)
        v = arena[pos : pos + a.nbytes].view(a.dtype).reshape(a.shape)
        views.append(memoryview(v))
        pos += a.nbytes
    return SnapshotPlan(meta=plan.meta, caches=plan.caches, buffers=tuple(views))


def writer(arm: str, root: Path, plans: list[SnapshotPlan], governor: WriteGovernor, stop: threading.Event,
           out: dict[str, float]) -> None:
    i = 0
    while not stop.is_set():
        store = SsdStore(root / f"{arm}-{i}", IDENTITY, layout="blocks", block_tokens=256)
        pacer = Pacer(governor, slice_bytes=16 << 20, stop=stop.is_set, release_gil=arm == "nogil")
        try:
            outcome = store.write(plans[i % len(plans)], pacer)
        except WriteInterrupted:
            break
        if isinstance(outcome, Stored):
            out["bytes"] += outcome.written
        shutil.rmtree(root / f"{arm}-{i}", ignore_errors=True)
        i += 1


def run_arm(arm: str, args: argparse.Namespace, root: Path, plans: list[SnapshotPlan]) -> dict[str, float]:
    governor = WriteGovernor(busy_rate_bytes_per_s=PACED_RATE)
    governor.set_busy(True)  # rows decode
    governor.set_urgent("backlog", not args.paced)  # a backlog past its bound: full speed beside decode
    stop = threading.Event()
    written = {"bytes": 0.0}
    t = None
    if arm != "none":
        t = threading.Thread(target=writer, args=(arm, root, plans, governor, stop, written), daemon=True)
        t.start()
        time.sleep(0.2)  # the writer under way
    steps, late, gil = [], [], []
    end = time.perf_counter() + args.seconds
    _, queued0 = schedstat()
    build, wait = args.build_ms / 1e3 / args.pieces, args.wait_ms / 1e3 / args.pieces
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(args.pieces):  # the step as `pieces` stretches of Python, each then a wait for the device
            spin(build)  # the step's graph: Python, GIL held
            _, q1 = schedstat()
            t1 = time.perf_counter()
            time.sleep(wait)  # the device: GIL released
            t2 = time.perf_counter()
            _, q2 = schedstat()
            # Late back after the device answered: waiting for a CPU (the scheduler's runnable time) or the GIL.
            late.append(t2 - t1 - wait)
            gil.append(max(0.0, t2 - t1 - wait - (q2 - q1)))
        steps.append(time.perf_counter() - t0)
    _, queued1 = schedstat()
    stop.set()
    if t is not None:
        t.join()
    return {"steps": len(steps), "wake_late_ms_median": statistics.median(late) * 1e3,
            "wake_late_ms_mean": statistics.fmean(late) * 1e3,
            # the lateness less the scheduler's runnable time in it: blocked on the GIL (the load shows up as
            # runnable time instead, so this part is robust to it)
            "gil_wait_ms_per_step": statistics.fmean(gil) * 1e3 * args.pieces, "gil_wait_ms_p90": statistics.quantiles(gil, n=10)[8] * 1e3,
            "cpu_queue_ms_per_step": (queued1 - queued0) / len(steps) * 1e3, "step_median_ms": statistics.median(steps) * 1e3,
            "step_mean_ms": statistics.fmean(steps) * 1e3, "step_p90_ms": statistics.quantiles(steps, n=10)[8] * 1e3,
            "mb_written": written["bytes"] / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0, help="per arm per round")
    ap.add_argument("--mb", type=int, default=192, help="checkpoint size (MB of host buffers)")
    ap.add_argument("--build-ms", type=float, default=8.0, help="the engine step's Python (GIL held)")
    ap.add_argument("--wait-ms", type=float, default=5.0, help="the engine step's device wait (GIL released)")
    ap.add_argument("--pieces", type=int, default=1,
                    help="the step's Python and device wait in this many alternating stretches (the H200's step "
                         "waits for the device many times: mx.eval, .item(), .tolist())")
    ap.add_argument("--paced", action="store_true", help="paced at 24 MB/s (default: full speed, as urgent)")
    ap.add_argument("--arms", default="none,gil,nogil")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    tokens = max(256, args.mb * 1_000_000 // (LAYERS * 2 * HEADS * DIM * 2))
    arena = np.random.default_rng(0).integers(0, 255, size=tokens * LAYERS * 2 * HEADS * DIM * 2, dtype=np.uint8)
    plans = [plan_of(tokens, s, arena) for s in range(2)]
    root = Path(tempfile.mkdtemp(prefix="writer-gil-", dir=args.dir))
    rows: list[dict[str, object]] = []
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    try:
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]  # rotate: no arm always first
            for arm in order:
                row = {"round": r, "arm": arm, **run_arm(arm, args, root, plans)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    summary: dict[str, object] = {}
    for arm in arms:
        mine = [x for x in rows if x["arm"] == arm]
        ratios = []
        for x in mine:
            base = next((b for b in rows if b["arm"] == "none" and b["round"] == x["round"]), None)
            if base is not None:
                ratios.append(x["step_mean_ms"] / base["step_mean_ms"])  # type: ignore[operator]
        summary[arm] = {"gil_wait_ms_p90": statistics.median(x["gil_wait_ms_p90"] for x in mine),  # type: ignore[misc]
                        "wake_late_ms_median": statistics.median(x["wake_late_ms_median"] for x in mine),  # type: ignore[misc]
                        "wake_late_ms_mean": statistics.median(x["wake_late_ms_mean"] for x in mine),  # type: ignore[misc]
                        "gil_wait_ms_per_step": statistics.median(x["gil_wait_ms_per_step"] for x in mine),  # type: ignore[misc]
                        "cpu_queue_ms_per_step": statistics.median(x["cpu_queue_ms_per_step"] for x in mine),  # type: ignore[misc]
                        "step_median_ms": statistics.median(x["step_median_ms"] for x in mine),  # type: ignore[misc]
                        "step_mean_ms": statistics.median(x["step_mean_ms"] for x in mine),  # type: ignore[misc]
                        "mean_step_vs_none": [round(v, 3) for v in ratios],
                        "mean_step_vs_none_median": round(statistics.median(ratios), 3) if ratios else None,
                        "mb_written_per_s": round(statistics.median(x["mb_written"] for x in mine) / args.seconds, 1)}  # type: ignore[misc]
    result = {"argv": vars(args) | {"out": str(args.out), "dir": str(args.dir)}, "tokens": tokens,
              "load": {"before": load_before, "after": load_after}, "rows": rows, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"writer_gil-{'paced' if args.paced else 'urgent'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    print("->", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
