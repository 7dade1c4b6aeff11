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
  beside  the served small flush: the write begins one block at a time (rows decoding), the flush
          arrives in the middle of its first block (`--flip-at`, a fraction of a block); what it
          does with the block in flight and the rest is the code's (`beside:N`: N block writers)
  ARM/old the same arm with the two changes of 2026-12-04 23:30 off (the blocks not started handed
          to the writers only once the block in flight ends; no block of the tail split between
          threads): `--arms beside/old,beside,new/old,new` measures them side by side

`--shape bench` writes the bench preset's KV (12 layers, 4 KV heads, head dim 64, fp32: 24 KiB a
token; an 8,192-token checkpoint is 201 MB in 32 blocks of 256 tokens, as the 1.7B shape's 0.94 GB
is on the H200) instead of the 1.7B shape's.

Every run is traced (`timeline` per row): each thread's pwrites, write-backs, fsyncs (files and
directories), staging and files (open to rename), the manifest; the summary splits the wall time
into the first byte, the data (seconds with 0, 1, 2, ... block files in flight), the tail after the
last byte handed to the OS (the files' last fsyncs, the blocks directory's fsync, the manifest).

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
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from bench_host_tier_servers import raw_write_s  # noqa: E402
from tests import fake_cuda  # noqa: E402

LAYERS, HEADS, DIM = 28, 8, 128  # the 1.7B shape's KV (bf16)
SHAPES = {"1.7b": (28, 8, 128, "bfloat16"), "bench": (12, 4, 64, "float32")}


class Tracer:
    """Spans (thread, kind, start, end, bytes) of one write, seconds from `t0`; installed by patching the
    module attributes the write path calls (undone by `undo`)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float, int]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def add(self, kind: str, start: float, nbytes: int = 0) -> None:
        self.events.append((threading.current_thread().name, kind, start - self.t0, time.perf_counter() - self.t0,
                            nbytes))

    def patch(self, owner: Any, name: str, make: Any) -> None:
        real = getattr(owner, name)
        self._undo.append((owner, name, real))
        setattr(owner, name, make(real))

    def install(self) -> None:
        import stat

        from mlxd.kv import block_store
        from mlxd.kv import file_format as ff
        from mlxd.kv.file_format import write as ffw

        def pwrite(real: Any) -> Any:
            def f(fd: int, data: Any, offset: int) -> int:
                t = time.perf_counter()
                n = real(fd, data, offset)
                self.add("pwrite", t, n)
                return int(n)
            return f

        def sync_range(real: Any) -> Any:
            def f(fd: int, offset: int, nbytes: int, flags: int) -> bool:
                t = time.perf_counter()
                ok = real(fd, offset, nbytes, flags)
                self.add("wb_start" if flags == ffw._SYNC_RANGE_WRITE else "wb_wait", t, nbytes)
                return bool(ok)
            return f

        def timed(kind: str) -> Any:
            def make(real: Any) -> Any:
                def f(*a: Any, **kw: Any) -> Any:
                    t = time.perf_counter()
                    try:
                        return real(*a, **kw)
                    finally:
                        self.add(kind, t)
                return f
            return make

        def fsync(real: Any) -> Any:
            def f(fd: int) -> None:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                t = time.perf_counter()
                real(fd)
                self.add("fsync_dir" if is_dir else "fsync_file", t)
            return f

        self.patch(os, "pwrite", pwrite)
        self.patch(os, "fsync", fsync)
        self.patch(os, "fdatasync", timed("fdatasync"))
        self.patch(ffw, "_sync_range", sync_range)
        self.patch(ff, "write_snapshot", timed("file"))
        self.patch(block_store, "_write_durably", timed("manifest"))
        self.patch(block_store.BlockStore, "_write_block", timed("block"))  # staging + the file
        if hasattr(block_store.BlockStore, "_write_part"):  # a block split between threads: its parts
            self.patch(block_store.BlockStore, "_write_part", timed("block"))
            self.patch(ffw.SplitWrite, "write_part", timed("file"))

    def undo(self) -> None:
        while self._undo:
            owner, name, real = self._undo.pop()
            setattr(owner, name, real)


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _in_flight(spans: list[tuple[float, float]], lo: float, hi: float) -> dict[int, float]:
    """Seconds of [lo, hi] with k of `spans` open, for each k."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans] + [(lo, 0), (hi, 0)])
    out: dict[int, float] = {}
    k, at = 0, lo
    for t, d in edges:
        t = min(max(t, lo), hi)
        if t > at:
            out[k] = out.get(k, 0.0) + t - at
            at = t
        k += d
    return {n: round(v, 4) for n, v in sorted(out.items())}


def analyse(events: list[tuple[str, str, float, float, int]], wall: float, flip: float | None,
            threads: int = 4) -> dict[str, Any]:
    """Where one write's wall seconds went, from its spans."""
    by = lambda kind: [e for e in events if e[1] == kind]  # noqa: E731
    pw = by("pwrite")
    files = [(e[2], e[3]) for e in by("file")]
    blocks = [(e[2], e[3]) for e in by("block")]
    first, last = min(e[2] for e in pw), max(e[3] for e in pw)
    last_file = max(b for _, b in files)
    manifest = by("manifest")
    m0 = min((e[2] for e in manifest), default=wall)
    dirs_before_manifest = [e for e in by("fsync_dir") if e[2] < m0]
    writers: dict[str, dict[str, float]] = {}
    for name, kind, a, b, n in events:
        w = writers.setdefault(name, {"bytes": 0, "pwrite_s": 0.0, "wb_s": 0.0, "fsync_s": 0.0, "files": 0,
                                      "first_s": a, "last_s": b})
        w["first_s"], w["last_s"] = min(w["first_s"], a), max(w["last_s"], b)
        if kind == "pwrite":
            w["bytes"] += n
            w["pwrite_s"] += b - a
        elif kind in ("wb_start", "wb_wait", "fdatasync"):
            w["wb_s"] += b - a
        elif kind == "fsync_file":
            w["fsync_s"] += b - a
        elif kind == "file":
            w["files"] += 1
    # bytes handed to the OS over time, in tenths of the data window
    span = max(last - first, 1e-9)
    deciles = [0] * 10
    for e in pw:
        deciles[min(9, int((e[3] - first) / span * 10))] += e[4]
    out: dict[str, Any] = {
        "wall_s": round(wall, 4),
        "first_byte_s": round(first, 4),  # start to the first pwrite (layout, probes, staging of the first piece)
        "data_s": round(last - first, 4),  # first pwrite to the last one's end
        "tail_s": round(wall - last, 4),  # after the last byte handed to the OS
        "tail": {
            "to_last_file_s": round(last_file - last, 4),  # the last files' final fsyncs (and renames)
            "blocks_dir_fsync_s": round(sum(e[3] - e[2] for e in dirs_before_manifest if e[2] >= last_file - 1e-6), 4),
            "manifest_s": round(sum(e[3] - e[2] for e in manifest), 4),  # write + fsync + rename + dir fsync
            "after_manifest_s": round(wall - max((e[3] for e in manifest), default=wall), 4),
        },
        "files_in_flight_s": _in_flight(files, first, last_file),  # seconds with k block files open
        "blocks_in_flight_s": _in_flight(blocks, 0.0, last_file),  # ... with k blocks staging or writing
        "fsync_file_s": [round(e[3] - e[2], 4) for e in sorted(by("fsync_file"), key=lambda e: e[2])],
        "last_fsyncs_overlap_s": round(_union([(e[2], e[3]) for e in by("fsync_file") if e[3] > last - 1e-6]), 4),
        "bytes_per_tenth_MB": [round(x / 1e6, 1) for x in deciles],
        "writers": {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                    for k, v in sorted(writers.items())},
    }
    # writer-seconds left idle from the flush (the flip, or the start) to the last file's rename: with k < writers
    # blocks (or parts) staging or writing, writers - k threads had nothing to do
    window = _in_flight(blocks, flip if flip is not None else 0.0, last_file)
    out["idle_writer_s"] = round(sum(max(0, threads - k) * t for k, t in window.items()), 4)
    out["flush_window_s"] = round(last_file - (flip if flip is not None else 0.0), 4)
    if flip is not None:
        before = sum(e[4] for e in pw if e[3] <= flip)
        out["flip_s"] = round(flip, 4)
        out["bytes_after_flip"] = sum(e[4] for e in pw) - before
        files_at_flip = [(a, b) for a, b in files if a <= flip < b]
        out["block_in_flight_ends_s"] = round(max((b for _, b in files_at_flip), default=flip), 4)
        # after the flip, until the block in flight ends: how many files were open beside it
        out["after_flip_in_flight_s"] = _in_flight(blocks, flip, out["block_in_flight_ends_s"])
    return out


def plan_of(tokens: int, shape: str = "1.7b") -> Any:
    import mlx.core as mx
    from mlx_lm.models import cache as mlc

    from mlxd.kv import kinds
    from mlxd.kv.ssd_store import StoreIdentity

    layers, heads, dim, dtype = SHAPES[shape]
    caches = []
    for layer in range(layers):
        c = mlc.KVCache()
        k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(layer)).astype(getattr(mx, dtype))
        c.update_and_fetch(k, -k)
        caches.append(c)
    mx.eval([c.state for c in caches])
    identity = StoreIdentity(model_id="trace", fingerprint="f" * 32, tokenizer_hash="t")
    return kinds.plan_snapshot(caches, meta=identity.meta(tuple(range(tokens)), "")), identity


def write_once(arm: str, plan: Any, identity: Any, directory: Path, block_tokens: int,
               flip_at: float = 0.5) -> dict[str, Any]:
    from mlxd.actors import ssd_writer
    from mlxd.kv.file_format import write as ffw
    from mlxd.kv.pacing import PACE_SLICE, Pacer, WriteGovernor
    from mlxd.kv.ssd_store import SsdStore, Stored
    from mlxd.runtime import host_memory

    base = arm.split("/")[0].split(":")[0]
    g = WriteGovernor(busy_rate_bytes_per_s=None)
    flip: list[float] = []
    if base in ("serial", "beside"):  # one block at a time at full speed (a backlog beside decode)
        g.set_busy(True)
        g.set_urgent("backlog", True)
    else:
        g.set_urgent("flush", True)
    tracer = Tracer()
    if base == "beside":  # the flush arrives after flip_at of the first block's bytes were handed to the OS
        at = flip_at * plan.nbytes * block_tokens / max(1, len(plan.meta.tokens))
        real_count = g.count

        def count(**kw: Any) -> None:
            real_count(**kw)
            if not flip and g.bytes_out >= at:
                flip.append(time.perf_counter() - tracer.t0)
                g.set_urgent("flush", True)

        g.count = count  # type: ignore[method-assign]
    # as the SSD writer's: the copy into the write buffer without the GIL where it stages (CUDA)
    pacer = Pacer(g, slice_bytes=PACE_SLICE, release_gil=host_memory.separate_host_memory())
    assert pacer.serial() == (base in ("serial", "beside"))
    saved = ffw._sync_file_range
    if base in ("serial", "fdsync"):
        ffw._sync_file_range = None  # an fdatasync per slice
    staging = host_memory.Staging()
    store = SsdStore(directory, identity, layout="blocks", block_tokens=block_tokens)
    if ":" in arm:  # new:N: N block writers instead of block_store.WRITERS
        store.blocks.writers = int(arm.split("/")[0].split(":")[1])
    old = arm.endswith("/old") and hasattr(pacer, "watching")
    if old:  # the code before the mid-block hand-off and the split tail (both off: its behaviour)
        from contextlib import nullcontext

        from mlxd.kv import block_store
        saved_split = block_store.SPLIT_MIN_PART
        block_store.SPLIT_MIN_PART = 1 << 62
        pacer.watching = lambda fn: nullcontext()  # type: ignore[method-assign]

    def prepare(piece: Any) -> Any:
        t = time.perf_counter()
        try:
            return ssd_writer._stage(staging, pacer, piece)
        finally:
            tracer.add("stage", t)

    tracer.install()
    try:
        tracer.t0 = t0 = time.perf_counter()
        stored = store.write(plan, pacer, prepare=prepare)
        wall = time.perf_counter() - t0
    finally:
        tracer.undo()
        ffw._sync_file_range = saved
        if old:
            block_store.SPLIT_MIN_PART = saved_split
    assert isinstance(stored, Stored), stored
    t = pacer.times
    row = {"arm": arm, "wall_s": round(wall, 4), "bytes": stored.written, "MB_s": stored.written / wall / 1e6,
           "stage_s": round(t.stage_s, 4), "pwrite_s": round(t.pwrite_s, 4), "sync_s": round(t.sync_s, 4),
           "files_s": round(t.files_s, 4), "staged_bytes": staging.staged_bytes}
    row["timeline"] = analyse(tracer.events, wall, flip[0] if flip else None, store.blocks.writers)
    if flip:  # the flush's own rate: the bytes after it came, over the seconds after it came
        row["flush_MB_s"] = row["timeline"]["bytes_after_flip"] / (wall - flip[0]) / 1e6
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="serial,new")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b", help="the KV's shape (bench: the CPU preset)")
    ap.add_argument("--flip-at", type=float, default=0.5,
                    help="beside: the flush arrives after this fraction of a block's bytes")
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
    plan, identity = plan_of(args.tokens, args.shape)
    arms = args.arms.split(",")
    from mlxd.runtime import host_memory

    out: dict[str, Any] = {"argv": sys.argv, "tokens": args.tokens, "block_tokens": args.block_tokens,
                           "cuda": args.cuda, "shape": args.shape, "flip_at": args.flip_at,
                           "separate_host_memory": host_memory.separate_host_memory(),
                           "plan_bytes": plan.nbytes, "load": os.getloadavg(), "rows": []}
    try:
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                d = work / f"{arm.replace('/', '-')}-{r}"
                row = write_once(arm, plan, identity, d, args.block_tokens, args.flip_at)
                row["raw_MB_s"] = row["bytes"] / raw_write_s(work, row["bytes"]) / 1e6
                row["over_raw"] = row["MB_s"] / row["raw_MB_s"]
                if "flush_MB_s" in row:
                    row["flush_over_raw"] = row["flush_MB_s"] / row["raw_MB_s"]
                row["round"] = r
                out["rows"].append(row)
                shutil.rmtree(d, ignore_errors=True)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                  if k != "timeline"}), flush=True)
                tl = row["timeline"]
                print("   ", json.dumps({k: tl[k] for k in ("first_byte_s", "data_s", "tail_s", "idle_writer_s", "tail",
                                                            "blocks_in_flight_s")}), flush=True)
    finally:
        patch.undo()
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {}
    for arm in arms:
        rows = [x for x in out["rows"] if x["arm"] == arm]
        summary[arm] = {k: statistics.median(x[k] for x in rows)
                        for k in ("wall_s", "MB_s", "raw_MB_s", "over_raw", "stage_s", "pwrite_s", "sync_s", "files_s",
                                  "flush_MB_s", "flush_over_raw") if all(k in x for x in rows)}
        tls = [x["timeline"] for x in rows]  # the wall time's split, medians
        summary[arm]["split"] = {
            **{k: statistics.median(t[k] for t in tls) for k in ("first_byte_s", "data_s", "tail_s", "idle_writer_s",
                                                                 "flush_window_s")},
            **{k: statistics.median(t["tail"][k] for t in tls) for k in tls[0]["tail"]},
            **{key: {n: statistics.median(t[key].get(n, 0.0) for t in tls) for n in sorted({n for t in tls for n in t[key]})}
               for key in ("files_in_flight_s", "blocks_in_flight_s")},
        }
    for arm in (a for a in arms if a != "serial" and "serial" in arms):  # per round, paired with the old path
        per = [n["MB_s"] / s["MB_s"] for n in out["rows"] for s in out["rows"]
               if n["arm"] == arm and s["arm"] == "serial" and n["round"] == s["round"]]
        summary[f"{arm}_over_serial_MB_s"] = {"median": statistics.median(per), "rounds": [round(x, 3) for x in per]}
    for arm in (a for a in arms if f"{a}/old" in arms):  # per round, the change alone: new ÷ old code, same arm
        idle = [(n["timeline"]["idle_writer_s"], o["timeline"]["idle_writer_s"]) for n in out["rows"] for o in out["rows"]
                if n["arm"] == arm and o["arm"] == f"{arm}/old" and n["round"] == o["round"]]
        summary[f"{arm}_idle_writer_s_new_old"] = {"median": [statistics.median(x for x, _ in idle),
                                                              statistics.median(y for _, y in idle)],
                                                   "rounds": [[round(x, 4), round(y, 4)] for x, y in idle]}
        key = "flush_MB_s" if arm.startswith("beside") else "MB_s"
        per = [n[key] / o[key] for n in out["rows"] for o in out["rows"]
               if n["arm"] == arm and o["arm"] == f"{arm}/old" and n["round"] == o["round"]]
        summary[f"{arm}_over_old_{key}"] = {"median": statistics.median(per), "rounds": [round(x, 3) for x in per]}
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
