"""The host-memory tier's copies, and what write-behind costs decode, on one device (issue 28).

    # on the CUDA host (../shared/GPU.md for the install), or here on the CPU:
    python3 benchmarks/gpu/probe_host_tier.py --out $OUT [--small]

1. host tier: one 16k-token KV cache (1.88 GB on the 1.7B shape) copied to host
   memory and back, each way timed, then the first token of a 1-token suffix on
   the promoted copy; against a RAM hit and a full recompute in the same run.
   Paths: page-locked buffer + `cudaMemcpyAsync` on a side stream into landed
   MLX arrays (`runtime/host_memory.py`, what serving uses); the same into a
   pageable buffer; managed-memory migration (`cudaMemPrefetchAsync` to the host
   and back); `mx.array` from the host buffer (adopt's copy) + prefetch; and serving's own
   functions (`host_memory.demote` / `promote`, as the cache owner calls them): the promotion waited
   (promote_s, GB/s against the pinned copy's), issued then the first token, and both beside another
   entry's demotion (serving's, held while the promotion lands, against the old shared stream).
2. decode beside write-behind: B streams decode while a writer thread writes a
   16k checkpoint, in windows alternated with windows alone; writer variants:
   serving's paced write with the read-mostly advice, full speed with the advice,
   full speed without it, full speed from a host copy staged by one bulk DMA, and
   decode alone after an advised buffer was freed (does the advice stay on reused memory?).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import QWEN3_1_7B, build, cache_for, first_token, generator, load, log, tokens  # noqa: E402

import mlxd  # noqa: E402, F401
from mlxd.model import presets  # noqa: E402


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def plan_of(caches: list[Any], n: int) -> Any:
    from mlxd.kv import file_format, kinds

    meta = file_format.SnapshotMeta(model_id="bench", config_fingerprint="bench", namespace="",
                                    tokenizer_hash="bench", tokens=range(n))
    return kinds.plan_snapshot(caches, meta=meta)


def header_of(plan: Any) -> Any:
    from mlxd.kv.file_format import PAGE, FileHeader

    return FileHeader(meta=plan.meta, caches=plan.caches, data_offset=PAGE, file_size=plan.nbytes)


def hit_on(gen: Any, caches: list[Any], prompt: list[int]) -> float:
    from mlxd.kv import kinds

    n = len(prompt)
    return first_token(gen, prompt[n - 1 :], kinds.lend(caches, n - 1), prompt[: n - 1])


# --- 1. the host tier ----------------------------------------------------------------------------


def host_tier(gen: Any, entry: list[Any], prompt: list[int], rounds: int, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    from mlxd.kv import kinds
    from mlxd.kv.file_format import LoadedSnapshot
    from mlxd.runtime import device_memory, host_memory

    n = len(prompt)
    plan = plan_of(entry, n)
    header = header_of(plan)
    nbytes = plan.nbytes
    m = device_memory.managed()
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in (
        "ram_hit", "recompute", "pinned", "pageable", "adopt_copy", "migrate")}
    for _ in range(rounds):
        rows["ram_hit"].append({"first_token_s": hit_on(gen, entry, prompt)})
        mx.clear_cache()
        if "recompute" not in skip:
            rows["recompute"].append({"first_token_s": first_token(gen, prompt)})
        for name in [x for x in ("pinned", "pageable") if x not in skip]:
            t0 = time.perf_counter()
            buf = host_memory.alloc(nbytes) if name == "pinned" else host_memory.HostBuffer(nbytes, cuda=None)
            t1 = time.perf_counter()
            host, views = host_memory.to_host(plan.buffers, buf)
            t2 = time.perf_counter()
            landing = kinds.landing(header)
            t3 = time.perf_counter()
            host_memory.from_host(landing.views, views)
            caches = kinds.adopt(LoadedSnapshot(header, tuple(views), 0.0, landed=landing.owner))
            t4 = time.perf_counter()
            ft = hit_on(gen, caches, prompt)
            rows[name].append({
                "alloc_s": t1 - t0, "to_host_s": t2 - t1, "to_host_GBps": nbytes / (t2 - t1) / 1e9,
                "landing_s": t3 - t2, "to_device_s": t4 - t3, "to_device_GBps": nbytes / (t4 - t3) / 1e9,
                "promote_s": t4 - t2, "promote_GBps": nbytes / (t4 - t2) / 1e9, "first_token_s": ft,
                "promote_to_token_s": t4 - t2 + ft, "pinned": float(host.pinned),
            })
            if name == "pinned" and "adopt_copy" not in skip:  # adopt's copy from the same host buffer, then a bulk migration
                t0 = time.perf_counter()
                caches = kinds.adopt(LoadedSnapshot(header, tuple(views), 0.0), landed=device_memory.to_device)
                t1 = time.perf_counter()
                rows["adopt_copy"].append({"promote_s": t1 - t0, "promote_GBps": nbytes / (t1 - t0) / 1e9,
                                           "first_token_s": hit_on(gen, caches, prompt)})
            del caches, landing, host, views, buf
            mx.clear_cache()
        if m is not None:  # keep the arrays, move their pages (serving's host tier: host_memory.move_pages)
            for name in [x for x in ("migrate", "migrate_async", "migrate_fault") if x not in skip]:
                copy = [type(c)() for c in entry]
                for c, s in zip(copy, entry, strict=True):
                    c.keys, c.values, c.offset = mx.multiply(s.keys, 1), mx.multiply(s.values, 1), s.offset
                mx.eval([(c.keys, c.values) for c in copy])
                t0 = time.perf_counter()
                moved = host_memory.move_pages(copy, to_host=True)
                host_memory.wait_moves()
                t1 = time.perf_counter()
                if name != "migrate_fault":  # (fault: the first forward pass pulls each page back)
                    host_memory.move_pages(copy, to_host=False)
                if name == "migrate":  # the bulk copy alone, then the first token
                    host_memory.wait_moves()
                t2 = time.perf_counter()
                ft = hit_on(gen, copy, prompt)
                rows.setdefault(name, []).append({
                    "moved_bytes": moved, "to_host_s": t1 - t0, "to_host_GBps": moved / (t1 - t0) / 1e9,
                    "promote_s": t2 - t1, "first_token_s": ft, "promote_to_token_s": t2 - t1 + ft,
                    "promote_GBps": moved / max(t2 - t1, 1e-9) / 1e9})
                del copy
                mx.clear_cache()
        if host_memory.separate_host_memory():  # serving's own functions (actors/cache_owner.py): demote / promote
            pinned = rows["pinned"][-1]["to_device_GBps"] if rows.get("pinned") else None
            for name in [x for x in SERVING_ROWS if x not in skip]:
                rows.setdefault(name, []).append(serving_promotion(gen, entry, prompt, name, pinned))
                mx.clear_cache()
    medians = {k: {f: median([r[f] for r in v]) for f in v[0]} for k, v in rows.items() if v}
    return {"nbytes": nbytes, "tokens": n, "rows": rows, "medians": medians}


SERVING_ROWS = ("serving", "serving_async", "serving_beside_demotion", "serving_beside_demotion_held",
                "shared_stream_beside_demotion")


def _copy_of(entry: list[Any]) -> list[Any]:
    copy = [type(c)() for c in entry]
    for c, s in zip(copy, entry, strict=True):
        c.keys, c.values, c.offset = mx.multiply(s.keys, 1), mx.multiply(s.values, 1), s.offset
    mx.eval([(c.keys, c.values) for c in copy])
    return copy


def serving_promotion(gen: Any, entry: list[Any], prompt: list[int], name: str, pinned_GBps: float | None) -> dict[str, float]:
    """One promotion as serving issues it (`host_memory.promote`, what the cache owner calls in the lookup),
    of an entry that serving's demotion (`host_memory.demote`) moved to the host first:

    - serving: the promotion waited (`Promotion.wait`): promote_s and its GB/s against the pinned copy's;
    - serving_async: issued, then the first token at once (what a returning conversation waits for);
    - serving_beside_demotion: the same while another entry's demotion runs on a thread (serving's: it stops
      between pieces while the promotion lands), as when the budget makes room;
    - serving_beside_demotion_held: the same, the demotion also holding still until the first token (serving's
      hold while a request waits for its first token: what a returning turn under a tight budget sees);
    - shared_stream_beside_demotion: the old path, for comparison: the other entry's demotion issued whole
      on one stream, and the promotion on that same stream and lock (what serving did before 28h)."""
    import threading

    from mlxd.runtime import host_memory

    copy = _copy_of(entry)
    other = _copy_of(entry) if "beside" in name else None
    t0 = time.perf_counter()
    demoted = host_memory.demote(copy)
    t1 = time.perf_counter()
    row: dict[str, float] = {"moved_bytes": demoted.nbytes, "to_host_s": t1 - t0, "demote_pieces": demoted.pieces,
                             "to_host_GBps": demoted.nbytes / max(t1 - t0, 1e-9) / 1e9}
    side: dict[str, Any] = {}
    thread = None
    waiting = threading.Event()  # a request waits for its first token (the scheduler's `prefilling`)
    if other is not None:
        cuda = host_memory._runtime()
        assert cuda is not None
        def shared(o: list[Any]) -> None:  # the whole entry in one locked call on the shared stream
            side["bytes"] = cuda.prefetch(host_memory._ranges(o), to_host=True, lane=cuda.demotions)

        def serving(o: list[Any]) -> None:
            d = host_memory.demote(o, hold=waiting.is_set if name.endswith("_held") else (lambda: False))
            side.update(bytes=d.nbytes, holds=d.holds, held_s=d.held_s)

        thread = threading.Thread(target=shared if name == "shared_stream_beside_demotion" else serving,
                                  args=(other,))
        thread.start()
        time.sleep(0.02)  # the other entry's migration is under way
    waiting.set()  # the returning request arrives
    t2 = time.perf_counter()
    if name == "shared_stream_beside_demotion":
        cuda = host_memory._runtime()
        assert cuda is not None
        ranges = host_memory._ranges(copy)
        nbytes = cuda.prefetch(ranges, to_host=False, lane=cuda.demotions)
        promotion = host_memory.Promotion(nbytes=nbytes, calls=len(ranges), issue_s=time.perf_counter() - t2,
                                          issued_at=t2)
    else:
        promotion = host_memory.promote(copy)
    if name == "serving":
        promotion.wait()
        row.update(promote_s=promotion.landed_s or 0.0, promote_GBps=(promotion.bytes_per_s or 0.0) / 1e9)
        if pinned_GBps:
            row["promote_vs_pinned"] = row["promote_GBps"] / pinned_GBps
    t3 = time.perf_counter()
    ft = hit_on(gen, copy, prompt)
    waiting.clear()
    row.update(issue_s=promotion.issue_s, calls=promotion.calls, first_token_s=ft,
               promote_to_token_s=(t3 - t2) + ft if name != "serving" else (promotion.landed_s or 0.0) + ft)
    if thread is not None:
        thread.join()
        host_memory.wait_moves()
        row.update({f"other_{k}": float(v) for k, v in side.items()})
    del copy, other
    return row


# --- 2. decode beside write-behind -----------------------------------------------------------------


class Decoder:
    """B rows decoding for a long time; `window(k)` times k steps (tokens per second over all rows)."""

    def __init__(self, gen: Any, streams: int, context: int) -> None:
        self.gen = gen
        self.uids = gen.insert([tokens(context, 500 + i) for i in range(streams)], max_tokens=[10**6] * streams)
        self.streams = streams
        for _ in range(8):
            gen.next()

    def window(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.gen.next()
        return steps * self.streams / (time.perf_counter() - t0)

    def close(self) -> None:
        self.gen.remove(self.uids)


def _writer(kind: str, plan: Any, path: Path, stop: threading.Event, done: dict[str, Any], payload: Any = None, staging: Any = None) -> None:
    from mlxd.kv import file_format
    from mlxd.kv.pacing import PACE_SLICE, Pacer, WriteGovernor
    from mlxd.runtime import device_memory, host_memory

    writes, stage_s, nbytes, t0 = 0, 0.0, 0, time.perf_counter()
    while kind == "host_moves" and not stop.is_set():  # the host tier's traffic: demote, promote, again
        for to_host in (True, False):
            nbytes += host_memory.move_pages(payload, to_host=to_host)
            host_memory.wait_moves()
        writes += 1
    while kind != "host_moves" and not stop.is_set():
        pacer = None
        p = plan
        if kind == "paced_advised":
            gov = WriteGovernor(busy_rate_bytes_per_s=24 * 1024 * 1024)
            gov.set_busy(True)
            pacer = Pacer(gov, slice_bytes=PACE_SLICE, stop=stop.is_set)
        if kind in ("paced_advised", "full_advised"):
            device_memory.read_mostly(plan.buffers)
        if kind == "full_staged":  # what the serving writer does on CUDA (one reused host buffer)
            s0 = time.perf_counter()
            p = staging.stage(plan)
            stage_s += time.perf_counter() - s0
        try:
            nbytes += file_format.write_snapshot(p, path, pacer=pacer).nbytes
            writes += 1
        except Exception as exc:  # an interrupted paced write
            done["last_error"] = repr(exc)
            break
        finally:
            path.unlink(missing_ok=True)
    done.update(writes=writes, stage_s=stage_s, write_GBps=nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9)


def decode_beside_writes(model: Any, entry: list[Any], n: int, work: Path, streams: list[int], rounds: int,
                         steps: int, context: int) -> dict[str, Any]:
    from mlxd.runtime import device_memory, host_memory

    plan = plan_of(entry, n)
    staging = host_memory.Staging()
    staging.stage(plan)  # allocated once, before any window (as the writer keeps it)
    out: dict[str, Any] = {}
    kinds_ = ["paced_advised", "full_advised", "full_plain", "full_staged"]
    if device_memory.managed() is not None:
        kinds_.append("host_moves")
    for b in streams:
        gen = generator(model, 4096)
        dec = Decoder(gen, b, context)
        res: dict[str, Any] = {k: {"ratios": [], "alone": [], "with": [], "writer": []} for k in kinds_}
        for r in range(rounds):
            for kind in kinds_:
                order = ("alone", "with") if r % 2 == 0 else ("with", "alone")
                for what in order:
                    if what == "alone":
                        res[kind]["alone"].append(dec.window(steps))
                        continue
                    stop, done = threading.Event(), {}
                    t = threading.Thread(target=_writer, args=(kind, plan, work / f"w-{kind}.mlxkv", stop, done, entry, staging))
                    t.start()
                    time.sleep(0.1 if kind != "full_staged" else 0.02)
                    res[kind]["with"].append(dec.window(steps))
                    stop.set()
                    t.join()
                    res[kind]["writer"].append(done)
                res[kind]["ratios"].append(res[kind]["with"][-1] / res[kind]["alone"][-1])
            log(f"{b} streams round {r}", {k: round(v["ratios"][-1], 3) for k, v in res.items()})
        # The advice left on memory MLX reuses: advise a buffer, free it, decode alone.
        m = device_memory.managed()
        if m is not None:
            before = [dec.window(steps) for _ in range(rounds)]
            junk = mx.multiply(entry[0].keys, 1)
            for c in entry[1:]:
                junk = mx.concatenate([junk, c.keys], axis=2)
            junk = junk.view(mx.uint16)  # the buffer protocol's formats have no bfloat16
            mx.eval(junk)
            device_memory.read_mostly([memoryview(junk)])
            del junk  # back to MLX's buffer cache, advice and all
            after = [dec.window(steps) for _ in range(rounds)]
            res["advice_residue"] = {"before": before, "after": after, "ratio": median(after) / median(before)}
        res["summary"] = {k: median(v["ratios"]) for k, v in res.items() if isinstance(v, dict) and "ratios" in v}
        out[f"streams_{b}"] = res
        dec.close()
        gen.close()
        mx.clear_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/host-tier")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phases", default="host,decode")
    ap.add_argument("--skip", default="", help="host rows to leave out, e.g. pageable,adopt_copy,migrate_fault,recompute "
                    "(rows: ram_hit recompute pinned pageable adopt_copy migrate migrate_async migrate_fault "
                    + " ".join(SERVING_ROWS) + ")")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory already built for this shape (skips the ~30-45 s build)")
    ap.add_argument("--fake-cuda", action="store_true",
                    help="CPU check only: the CUDA calls answered by tests/fake_cuda.py (timings mean nothing)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fake_cuda:
        sys.path.insert(0, str(HERE.parent.parent))
        from tests import fake_cuda

        fake_cuda.install(fake_cuda.Patch(), fake_cuda.FakeCudaLib(scale=1.0))
    work = Path(tempfile.mkdtemp(prefix="host-tier-"))
    if args.model is not None and (args.model / "config.json").exists():
        model_dir = args.model  # e.g. the servers driver's /tmp/host-servers-work/model-qwen3-1.7b-shape
    else:
        model_dir = build(presets.PRESETS["bench"] if args.small else QWEN3_1_7B, work / "model")
    model, _ = load(model_dir)
    from mlxd.model import fast_mask

    fast_mask.install()
    from mlxd.runtime import host_memory

    n = 256 if args.small else 16384
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "tokens": n,
                           "separate_host_memory": host_memory.separate_host_memory()}
    res = args.out / f"host_tier-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:
        res.write_text(json.dumps(out, indent=1, default=str))

    gen = generator(model, 8192)
    first_token(gen, tokens(256, 1))
    prompt = tokens(n, 11)
    entry = cache_for(gen, prompt)
    phases = set(args.phases.split(","))
    try:
        if "host" in phases:
            out["host_tier"] = host_tier(gen, entry, prompt, args.rounds,
                                         frozenset(x for x in args.skip.split(",") if x))
            log("host tier", json.dumps(out["host_tier"]["medians"]))
            save()
        gen.close()
        if "decode" in phases:
            out["decode"] = decode_beside_writes(
                model, entry, n, work, [1, 8], args.rounds, 4 if args.small else 48, 32 if args.small else 1024
            )
            log("decode", json.dumps({k: v["summary"] for k, v in out["decode"].items()}))
    except Exception:
        import traceback

        out["traceback"] = traceback.format_exc()
        log(out["traceback"])
    finally:
        save()
    log("->", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
