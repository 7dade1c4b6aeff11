"""Why the startup probe's restore reads slower than serving's (issue 28): one process, side by side.

    # on the CUDA host, after the host_ssd phase built the model (or it builds one, ~30 s):
    python3 benchmarks/gpu/probe_restore_paths.py --out $OUT
    # here, on the CPU, with the small `bench` model:
    python benchmarks/gpu/probe_restore_paths.py --small --out /tmp/restore-paths

The H200's probe read a 470 MB block record at 0.88-0.91 GB/s (and from the page cache at ~1.0),
while served restores of 1.89 GB records read 2.33-2.53 GB/s — in servers started with
`--device-probe off`. This driver times, in ONE process, cold (DONTNEED) restores of records of the
1.7B shape written through serving's store (blocks layout, serving's span, 8 readers), at a probe's
size (4,096 tokens) and a served record's (16,384), by each of:

- `probe`: the probe's own `_restore_once` (the read on a worker thread with the landing handed to
  this thread, as the prefetcher does; then the engine's adoption);
- `inline`: the read issued from this thread (the probe's path before this change);
- `host`: read into a host buffer (`--restore-landing host`) and adopted by a copy;
- `noverify`: `probe` without the CRC-32 checks;
- `touched`: `probe` into landing memory first written by the CPU (on CUDA: pages already on the host,
  so the read does not fault them over from the device; the touch's own seconds are reported apart);
- `hosted`: `probe` into landing memory moved to the host in bulk first (`cudaMemPrefetchAsync`, as the
  host tier demotes; waited, its seconds apart): a fix for serving if `touched` is the fast one;
- `raw`: the record's block files read whole by 8 threads into fresh host memory (the disk alone);

three times: in a fresh process (no forward pass yet), after two prefills of the longest size (their
freed buffers in MLX's cache, as in a server that has served), and after the engine's own startup
probe (`probe_device`, as `mlxd serve` runs it, whose numbers are reported too; it ends with MLX's
cache cleared). Each row has GB/s and the landing / read / adopt split. What to look at: the
`probe` and `inline` rows against `raw` at 16,384 tokens (is the landed read the disk's speed?),
4,096 against 16,384 (a per-byte cost that depends on the size?), fresh against after the probe
and after_prefill (do the prefills' cached buffers slow a landing?), `touched` against `probe` (faults).

`--warm` asks the other question, where `mlxd simulate`'s SSD p95 on the GPU hosts comes from: reads of
records the page cache holds whole (`mincore` said so at every slow read of the recordings) that took
2.5-5.5x their run's median at random. Each round reads the record once per variant with the files kept
in the page cache, after `--churn` tokens of prefill (a miss between two SSD hits, as the recorded runs
serve them; MLX's cache not cleared, so a landing may be carved from the prefill's freed buffers), and
records MLX's cache memory before and after the landing (`reused_bytes`: what the landing took from MLX's
cache of freed buffers) and the seconds: the summary counts the reads above 2x their variant's median,
with and without reused buffers:

    python3 benchmarks/gpu/probe_restore_paths.py --warm --tokens 1156 --rounds 40 --churn 1024 \
        --variants probe,touched,hosted,host --no-probe --out $OUT

`--busy N` keeps the GPU busy during every read: this thread runs N-token forward passes over and over
while the reader fills the landing (in the recorded runs the engine prefilled other requests beside the
prefetcher's reads); a landing whose pages fault over from the device may wait on those kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import first_token, generator, load, log, probe_model, probe_options, tokens  # noqa: E402

import mlxd  # noqa: E402, F401

VARIANTS = ("probe", "inline", "host", "noverify", "touched", "hosted", "raw")


def synthetic_caches(model: Any, n: int, seed: int) -> list[Any]:
    """The model's own cache objects holding `n` tokens of random KV (no forward pass)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    key = mx.random.key(seed)
    for c in caches:
        heads, dim = model.args.num_key_value_heads, model.args.head_dim
        dtype = mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, heads, n, dim), key=k1).astype(dtype)
        v = mx.random.normal((1, heads, n, dim), key=k2).astype(dtype)
        c.update_and_fetch(k, v)
    mx.eval([c.state for c in caches])
    return caches


def drop(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path], readers: int = 8) -> float:
    """Every file read whole into fresh host memory, `readers` files at a time: seconds."""
    import numpy as np

    todo = list(paths)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            size = p.stat().st_size
            buf = np.empty(size, dtype=np.uint8)
            with open(p, "rb", buffering=0) as f:
                f.readinto(memoryview(buf))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def timed(variant: str, store: Any, record: Any, land: Any) -> dict[str, Any]:
    """One cold restore of `record` by `variant`; seconds and their split."""
    import numpy as np

    from mlxd.actors import device_probe as dp
    from mlxd.kv import kinds
    from mlxd.runtime import device_memory

    files = [record.path, *store.blocks.block_paths(record)]
    if not WARM:
        drop(files)
    row: dict[str, Any] = {"variant": variant}
    plain_land = land

    def land(header: Any) -> Any:  # noqa: F811  what the landing took from MLX's cache of freed buffers
        before = mx.get_cache_memory()
        got = plain_land(header)
        row["reused_bytes"] = max(0, before - mx.get_cache_memory())
        return got

    if variant == "raw":
        s = raw_read(store.blocks.block_paths(record))
        row.update(seconds=s, nbytes=sum(p.stat().st_size for p in files))
        return row
    if variant in ("probe", "noverify", "touched", "hosted"):
        from mlxd.runtime import host_memory

        touch_s = 0.0

        def touched_land(header: Any) -> Any:
            nonlocal touch_s
            got = land(header)
            t0 = time.perf_counter()
            if variant == "touched":
                for v in got.views:
                    np.frombuffer(v, dtype=np.uint8)[:] = 0  # the CPU writes every page first
            else:  # the pages moved to the host in bulk (a no-op on unified memory)
                host_memory.move_pages(list(got.owner), to_host=True)
                host_memory.wait_moves()
            touch_s += time.perf_counter() - t0
            return got

        path = dp.RestorePath(directory=Path("."), land=touched_land if variant in ("touched", "hosted") else land,
                              verify=variant != "noverify", layout="blocks")
        loaded, adopted, seconds, (landing_s, read_s, adopt_s) = dp._restore_once(store, record, path, meanwhile=BUSY)
        if variant in ("touched", "hosted"):  # the touch / move is not the read's: report it apart
            row["touch_s"] = touch_s
            seconds -= touch_s
            landing_s -= touch_s
        row.update(seconds=seconds, nbytes=loaded.nbytes, landing_s=landing_s, read_s=read_s, adopt_s=adopt_s)
        del adopted, loaded
        return row
    t0 = time.perf_counter()
    if variant == "inline":  # the read issued from this thread (the landing allocated inline)
        loaded = store.load(record, verify=True, land=land)
    else:  # host
        loaded = store.load(record, verify=True, land=None)
    assert loaded is not None
    t1 = time.perf_counter()
    adopted = kinds.adopt(loaded, landed=device_memory.to_device)
    t2 = time.perf_counter()
    row.update(seconds=loaded.seconds + (t2 - t1), nbytes=loaded.nbytes, read_s=t1 - t0, adopt_s=t2 - t1)
    del adopted, loaded
    return row


WARM = False  # --warm: the files stay in the page cache (no DONTNEED before a read)
BUSY: Any = None  # --busy: a forward pass run over and over on this thread while the reader reads


def round_of(label: str, store: Any, records: dict[int, Any], land: Any, rounds: int, out: list[dict[str, Any]],
             *, clear: bool = True, variants: tuple[str, ...] = VARIANTS, churn: Any = None) -> None:
    """Each variant on each record; `clear`: MLX's cache emptied after each (each landing in fresh memory),
    else the next landing may reuse the last one's buffers (moved to the device by its adoption); `churn`:
    called before each read (a prefill between two restores)."""
    for r in range(rounds):
        order = variants if r % 2 == 0 else tuple(reversed(variants))
        for n, record in records.items():
            for v in order:
                if churn is not None:
                    churn(r)
                row = timed(v, store, record, land)
                row.update(phase=label, tokens=n, round=r, gb_s=row["nbytes"] / row["seconds"] / 1e9)
                out.append(row)
                log(label, n, v, f"{row['gb_s']:.2f} GB/s", json.dumps({k: round(x, 4) for k, x in row.items()
                                                                       if isinstance(x, float)}))
                if clear:
                    mx.clear_cache()


SLOW = 2.0  # a read this many times its variant's median is slow (as bench_sim_ttft.py's slow_reads)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase / size / variant: GB/s of each read, their median; the reads' seconds, median and max,
    and how many took over SLOW x the median, apart for landings that reused MLX's cached buffers."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(f"{row['phase']}/{row['tokens']}/{row['variant']}", []).append(row)
    out: dict[str, Any] = {}
    for k, group in by.items():
        gb = [round(r["gb_s"], 3) for r in group]
        secs = sorted(r["seconds"] for r in group)
        median = secs[len(secs) // 2]
        slow = [r for r in group if r["seconds"] > SLOW * median]
        reused = [r for r in group if r.get("reused_bytes", 0) > 0]
        out[k] = {"gb_s": gb, "median": sorted(gb)[len(gb) // 2], "median_s": round(median, 4),
                  "max_s": round(secs[-1], 4), "slow": len(slow), "reads": len(group),
                  "reused": len(reused), "slow_reused": sum(1 for r in slow if r.get("reused_bytes", 0) > 0)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    probe_options(ap, Path(os.environ.get("OUT", "/tmp/restore-paths")),
                  work_help="where the model is (bench_host_tier_servers.py builds it there) and the SSD files go")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="record sizes (default 4096 16384; --small 512 2048)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-probe", action="store_true", help="skip the engine's startup probe between the phases")
    ap.add_argument("--warm", action="store_true", help="reads from the page cache (see above)")
    ap.add_argument("--churn", type=int, default=0, help="with --warm: tokens of prefill before each read")
    ap.add_argument("--busy", type=int, default=0, help="tokens of each forward pass run during every read (above)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    args = ap.parse_args()
    global WARM, BUSY
    WARM = args.warm
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    preset, model_dir = probe_model(args)
    sizes = args.tokens or ([512, 2048] if args.small else [4096, 16384])
    from mlxd.actors import device_probe as dp
    from mlxd.kv import kinds
    from mlxd.kv.blocks import span_for
    from mlxd.kv.ssd_store import SsdStore, StoreIdentity, compute_fingerprint

    t_begin = time.perf_counter()
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, _ = load(model_dir)
    kv = preset.num_hidden_layers * preset.num_key_value_heads * preset.head_dim * 2 * (
        4 if mx.default_device() == mx.cpu else 2)

    def land(header: Any) -> Any:  # EngineCore.landing
        with mx.stream(stream):
            return kinds.landing(header)

    ssd = args.work / "restore-paths"
    shutil.rmtree(ssd, ignore_errors=True)
    identity = StoreIdentity("paths", compute_fingerprint({"paths": "restore"}), "paths")
    store = SsdStore(ssd, identity, layout="blocks", block_tokens=span_for(kv))
    kind = ("small-" if args.small else "") + ("warm-" if args.warm else "") + ("busy-" if args.busy else "")
    res = args.out / f"restore_paths-{kind}{time.strftime('%Y%m%d-%H%M%S')}.json"
    out: dict[str, Any] = {"device": str(mx.default_device()), "kv_bytes_per_token": kv, "sizes": sizes,
                           "block_tokens": span_for(kv), "readers": store.blocks.readers, "argv": sys.argv, "rows": []}

    def save() -> None:
        out["elapsed_s"] = round(time.perf_counter() - t_begin, 1)
        out["summary"] = summarize(out["rows"])
        res.write_text(json.dumps(out, indent=1, default=str))

    if args.busy:
        from mlx_lm.models.cache import make_prompt_cache

        ids = mx.array([tokens(args.busy, 777, preset.vocab_size)])

        def busy() -> None:
            with mx.stream(stream):
                mx.eval(model(ids, cache=make_prompt_cache(model)))

        BUSY = busy
        out["busy_tokens"] = args.busy
    records: dict[int, Any] = {}
    with mx.stream(stream):
        for i, n in enumerate(sizes):
            caches = synthetic_caches(model, n, i)
            stored = store.write(kinds.plan_snapshot(caches, meta=identity.meta(range(n), "")))
            records[n] = stored.record
            del caches
        mx.clear_cache()
        # a throwaway restore: one-time costs (allocator, kernels) are not the first row's
        dp._restore_once(store, records[sizes[0]], dp.RestorePath(directory=ssd, land=land, layout="blocks"))
        if args.warm:
            gen = generator(model, 2048)
            if args.churn:
                first_token(gen, tokens(args.churn, 499, preset.vocab_size))  # its shapes compiled

            def churn(r: int) -> None:
                if args.churn:
                    first_token(gen, tokens(args.churn, 600 + r, preset.vocab_size))

            for record in records.values():  # into the page cache: read whole once
                raw_read([record.path, *store.blocks.block_paths(record)])
            round_of("warm", store, records, land, args.rounds, out["rows"], clear=False, variants=variants,
                     churn=churn)
        else:
            round_of("fresh", store, records, land, args.rounds, out["rows"], variants=variants)
            save()
            # A served restore after prefills: their freed buffers cached (MLX reuses them by size).
            gen = generator(model, 2048)
            for seed in range(2):
                first_token(gen, tokens(256 if args.small else max(sizes), 500 + seed, preset.vocab_size))
            out["cache_after_prefill_gb"] = round(mx.get_cache_memory() / 1e9, 3)
            round_of("after_prefill", store, records, land, args.rounds, out["rows"], clear=False, variants=variants)
            save()
            if not args.no_probe:
                t0 = time.perf_counter()
                probe = dp.probe_device(
                    gen, vocab_size=preset.vocab_size, max_context=2048 if args.small else 40960, kv_bytes_per_token=kv,
                    budget_s=1.0 if args.small else 3.0,
                    restore=dp.RestorePath(directory=ssd / "probe", land=land, layout="blocks", block_tokens=span_for(kv)),
                    tune_step=mx.default_device() != mx.cpu,
                )
                out["probe"] = probe.as_dict()
                out["probe_s"] = round(time.perf_counter() - t0, 2)
                log("probe", json.dumps({k: out["probe"][k] for k in ("seconds", "restore", "restore_warm",
                                                                       "restore_parts", "restore_bytes_per_s")}))
                # the probe ends with MLX's cache cleared, as serving then starts
                round_of("after_probe", store, records, land, args.rounds, out["rows"], variants=variants)
                save()
    save()
    store.close()
    shutil.rmtree(ssd, ignore_errors=True)
    log("summary", json.dumps(out["summary"], indent=1))
    log("->", res, f"({out['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
