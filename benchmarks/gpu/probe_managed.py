"""Does host access to MLX CUDA memory slow a RAM hit, and how should restores land?

    # on the CUDA host (see docs/benchmarks.md for the install), or here on the CPU:
    python3 benchmarks/gpu/probe_managed.py --out $OUT [--small]

MLX's CUDA backend allocates with `cudaMallocManaged`: a host read of an array
(the SSD writer copying a checkpoint to disk) migrates its pages to the host,
and the GPU's next use of them (a RAM hit on the same prefix) faults them back.
This driver measures, on one 16k-token KV cache:

1. a RAM hit alone (lend + first token of a 1-token suffix);
2. the real snapshot writer on that cache, then a hit (sequential);
3. the writer running in a thread while a hit runs (what write-behind does);
4. the same with the writer reading a device-side copy (staging) instead;
5. (CUDA, when libcudart is found) `cudaMemAdviseSetReadMostly` on the cache;
6. restores from the cold file: read_snapshot + adopt vs reading straight into
   MLX-allocated buffers (optionally prefetched to the device), each to first token.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
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
from bench_gpu import (  # noqa: E402
    QWEN3_1_7B,
    build,
    cache_for,
    drop_cache,
    first_token,
    generator,
    load,
    log,
    tokens,
    write_file,
)

import mlxd  # noqa: E402, F401
from mlxd.model import presets  # noqa: E402


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


class Cudart:
    """The few CUDA runtime calls the experiment needs, through ctypes (None when not found)."""

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        v = ctypes.c_int()
        lib.cudaRuntimeGetVersion(ctypes.byref(v))
        self.version = v.value

    @classmethod
    def find(cls) -> Cudart | None:
        pats = [os.path.join(p, "nvidia", "*", "lib", "libcudart.so*") for p in sys.path if p]
        pats += ["/usr/local/cuda/lib64/libcudart.so*"]
        for pat in pats:
            for path in sorted(glob.glob(pat)):
                try:
                    return cls(ctypes.CDLL(path))
                except OSError:
                    continue
        return None

    def advise_read_mostly(self, ptr: int, size: int) -> int:
        if self.version >= 13000:
            return int(self.lib.cudaMemAdvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size), 1, self.Location(1, 0)))
        return int(self.lib.cudaMemAdvise(ctypes.c_void_p(ptr), ctypes.c_size_t(size), 1, 0))

    def prefetch(self, ptr: int, size: int, *, to_host: bool) -> int:
        if self.version >= 13000:
            loc = self.Location(2, 0) if to_host else self.Location(1, 0)
            return int(self.lib.cudaMemPrefetchAsync(ctypes.c_void_p(ptr), ctypes.c_size_t(size), loc, 0, None))
        return int(self.lib.cudaMemPrefetchAsync(ctypes.c_void_p(ptr), ctypes.c_size_t(size), -1 if to_host else 0, None))

    def sync(self) -> int:
        return int(self.lib.cudaDeviceSynchronize())


def pointers(caches: list[Any]) -> list[tuple[int, int]]:
    import numpy as np

    out = []
    for c in caches:
        for a in (c.keys, c.values):
            mv = memoryview(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).cast("B")
            out.append((np.frombuffer(mv, dtype=np.uint8).ctypes.data, mv.nbytes))
    return out


def staged(caches: list[Any]) -> list[Any]:
    """A device-side copy of each cache (the writer reads this; the original stays on the device)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        s = KVCache()
        s.keys, s.values, s.offset = mx.multiply(c.keys, 1), mx.multiply(c.values, 1), c.offset
        out.append(s)
    mx.eval([(s.keys, s.values) for s in out])
    return out


def hit(gen: Any, entry: list[Any], prompt: list[int]) -> float:
    from mlxd.kv import kinds

    n = len(prompt)
    return first_token(gen, prompt[n - 1 :], kinds.lend(entry, n - 1), prompt[: n - 1])


def concurrent(gen: Any, entry: list[Any], prompt: list[int], source: list[Any], path: Path, n: int) -> dict[str, float]:
    done: dict[str, float] = {}

    def write() -> None:
        t0 = time.perf_counter()
        nbytes = write_file(source, path, n)
        done["write_s"] = time.perf_counter() - t0
        done["write_GBps"] = nbytes / done["write_s"] / 1e9

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.05)
    done["hit_s"] = hit(gen, entry, prompt)
    t.join()
    path.unlink(missing_ok=True)
    return done


def restore_direct(path: Path, cudart: Cudart | None, prefetch: bool) -> list[Any]:
    """Read the file's tensors straight into MLX-allocated buffers; KVCaches over them."""
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from mlxd.kv import file_format

    header = file_format.read_header(path)
    arrays = []
    with open(path, "rb", buffering=0) as f:
        for _, t in header.tensors():
            a = mx.zeros(tuple(t.shape), dtype=mx.uint16 if t.dtype == "bfloat16" else getattr(mx, t.dtype))
            mx.eval(a)
            view = memoryview(np.array(a, copy=False)).cast("B")
            f.seek(t.offset)
            pos = 0
            while pos < t.nbytes:
                got = f.readinto(view[pos:])
                if not got:
                    raise EOFError(path)
                pos += got
            if prefetch and cudart is not None:
                cudart.prefetch(np.frombuffer(view, dtype=np.uint8).ctypes.data, t.nbytes, to_host=False)
            arrays.append(a.view(mx.bfloat16) if t.dtype == "bfloat16" else a)
    caches = []
    for i in range(0, len(arrays), 2):
        c = KVCache()
        c.keys, c.values = arrays[i], arrays[i + 1]
        c.offset = c.keys.shape[2]
        caches.append(c)
    return caches


def followup(gen: Any, entry: list[Any], prompt: list[int], rounds: int) -> dict[str, Any]:
    """7. A RAM hit on the same prompt vs a follow-up (the same prefix + 24 new tokens), in-process.

    Also each after `mx.clear_cache()` (no freed buffers to reuse: every allocation is fresh
    managed memory), to see what the new rows' buffers cost.
    """
    from mlxd.kv import kinds

    n = len(prompt)
    extra = tokens(24, 99)
    rows: dict[str, list[float]] = {"hit": [], "followup": [], "hit_fresh_alloc": [], "followup_fresh_alloc": []}
    for _ in range(rounds):
        for name in rows:
            if name.endswith("fresh_alloc"):
                mx.clear_cache()
            if name.startswith("hit"):
                rows[name].append(hit(gen, entry, prompt))
            else:
                rows[name].append(first_token(gen, extra, kinds.lend(entry, n), prompt))
    return {"rows": rows, "medians": {k: median(v) for k, v in rows.items()},
            "active_GB": mx.get_active_memory() / 1e9, "cache_GB": mx.get_cache_memory() / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/managed")))
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only-followup", action="store_true", help="just the hit vs follow-up comparison (7.)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="managed-"))
    model_dir = build(presets.PRESETS["bench"] if args.small else QWEN3_1_7B, work / "model")
    model, _ = load(model_dir)
    n = args.tokens or (2048 if args.small else 16384)
    cudart = Cudart.find() if mx.default_device() != mx.cpu else None
    out: dict[str, Any] = {"device": str(mx.default_device()), "tokens": n, "mlx": mx.__version__,
                           "cudart_version": cudart.version if cudart else None}
    res = args.out / f"managed-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:
        res.write_text(json.dumps(out, indent=1))

    gen = generator(model, 4096)
    first_token(gen, tokens(256, 1))
    prompt = tokens(n, 11)
    entry = cache_for(gen, prompt)
    path = work / "ckpt.mlxkv"
    if args.only_followup:
        out["followup"] = followup(gen, entry, prompt, args.rounds)
        log("followup", json.dumps(out["followup"]))
        save()
        gen.close()
        return 0
    try:
        out["hit_alone_s"] = [hit(gen, entry, prompt) for _ in range(args.rounds + 1)][1:]
        log("hit alone", out["hit_alone_s"])
        seq = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            nbytes = write_file(entry, path, n)
            w = time.perf_counter() - t0
            seq.append({"write_GBps": nbytes / w / 1e9, "hit_after_s": hit(gen, entry, prompt),
                        "hit_again_s": hit(gen, entry, prompt)})
            path.unlink()
        out["write_then_hit"] = seq
        log("write then hit", seq)
        save()
        out["write_during_hit"] = [concurrent(gen, entry, prompt, entry, path, n) for _ in range(args.rounds)]
        log("write during hit", out["write_during_hit"])
        save()
        rows = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            copy = staged(entry)
            stage_s = time.perf_counter() - t0
            r = concurrent(gen, entry, prompt, copy, path, n)
            r["stage_s"] = stage_s
            rows.append(r)
            del copy
        out["staged_write_during_hit"] = rows
        log("staged write during hit", rows)
        save()
        if cudart is not None:
            codes = [cudart.advise_read_mostly(p, s) for p, s in pointers(entry)]
            out["read_mostly_codes"] = sorted(set(codes))
            out["read_mostly_write_during_hit"] = [
                concurrent(gen, entry, prompt, entry, path, n) for _ in range(args.rounds)
            ]
            out["read_mostly_hit_alone_s"] = [hit(gen, entry, prompt) for _ in range(args.rounds)]
            log("read-mostly", out["read_mostly_write_during_hit"], out["read_mostly_hit_alone_s"])
            rows = []
            for _ in range(args.rounds):
                copy = staged(entry)
                t0 = time.perf_counter()
                for p, s in pointers(copy):
                    cudart.prefetch(p, s, to_host=True)
                cudart.sync()
                pf = time.perf_counter() - t0
                t0 = time.perf_counter()
                nbytes = write_file(copy, path, n)
                rows.append({"prefetch_to_host_s": pf, "write_GBps": nbytes / (time.perf_counter() - t0) / 1e9,
                             "prefetch_GBps": nbytes / pf / 1e9})
                path.unlink()
                del copy
            out["staged_prefetched_write"] = rows
            log("staged+prefetch write", rows)
            save()
        # Restores from the cold file, each to its first token.
        from mlxd.kv import file_format, kinds

        fresh = cache_for(gen, tokens(n, 12))
        nbytes = write_file(fresh, path, n)
        del fresh
        variants: dict[str, list[dict[str, float]]] = {"read_snapshot_adopt": [], "direct": [], "direct_prefetch": []}
        restore_prompt = tokens(n, 12)
        for _ in range(args.rounds):
            for name in variants:
                if name == "direct_prefetch" and cudart is None:
                    continue
                drop_cache(path)
                t0 = time.perf_counter()
                if name == "read_snapshot_adopt":
                    caches = kinds.adopt(file_format.read_snapshot(path, verify=False))
                else:
                    caches = restore_direct(path, cudart, prefetch=name == "direct_prefetch")
                t1 = time.perf_counter()
                ttft = first_token(gen, restore_prompt[n - 1 :], kinds.lend(caches, n - 1), restore_prompt[: n - 1])
                variants[name].append({"load_s": t1 - t0, "first_token_s": ttft, "total_s": time.perf_counter() - t0,
                                       "GBps_to_token": nbytes / (time.perf_counter() - t0) / 1e9})
                del caches
        out["restores"] = variants
        out["file_bytes"] = nbytes
        log("restores", json.dumps(variants))
    except Exception as exc:  # keep what was measured
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        log(out["traceback"])
    finally:
        save()
        gen.close()
    summary = {
        "hit_alone": median(out.get("hit_alone_s", [])),
        "write_during_hit": median([r["hit_s"] for r in out.get("write_during_hit", [])]),
        "staged_write_during_hit": median([r["hit_s"] for r in out.get("staged_write_during_hit", [])]),
        "read_mostly_write_during_hit": median([r["hit_s"] for r in out.get("read_mostly_write_during_hit", [])]),
    }
    out["summary_median_hit_s"] = summary
    save()
    log("summary", json.dumps(summary), "->", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
