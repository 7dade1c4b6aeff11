"""Recompute the head of a cold prefix while its tail is read from disk (issue 28): a split whose halves overlap.

    # on the CUDA host (../shared/GPU.md), the 1.7B shape (built once, ~30 s):
    python3 benchmarks/gpu/probe_reverse_split.py --out $OUT
    # here, on the CPU, with the small `bench` model:
    python benchmarks/gpu/probe_reverse_split.py --small --out /tmp/reverse-split

The restore advisor's split (kv/restore_decision.py) restores the first k tokens and prefills the rest on top of
them: the prefill needs the restored KV, so the two run one after the other, and with a restore cost proportional
to the bytes the best cut is always an arm. The other way round they need not wait for each other: the KV of
tokens j..n is on disk, computed long ago with the same prefix, so it can be read while the engine recomputes
tokens 0..j, and the row starts from both. On a GPU, where recomputing 16k tokens of the 1.7B shape beats reading
their 1.9 GB (H100 2026-12-06 10:36: recompute 0.43 s, restore 1.02 s), reading the tail beside the head's
prefill would take max(prefill(j), read(n - j)) instead of min(prefill(n), read(n)) — about 0.30 s there if the
two do not slow each other.

This measures whether they do, in one process, per prefix size and head fraction, the page cache dropped before
every read: `recompute` (the whole prefix and the suffix prefilled), `restore` (the whole prefix's file read,
adopted, the suffix prefilled: serving's SSD hit), `head` (the head prefilled alone), `read` (the tail's file
read and adopted alone), and `split` (the tail's file read into host memory on a thread while this thread
prefills the head, then adopted, the two joined into one cache and the suffix prefilled; every MLX call on this
thread, as serving's one MLX thread). Each split also checks its answer: the next-token logits after the
suffix on the split cache against the recompute's (max |difference|, and whether the argmax agrees).
What to look at: `split_s` against min(`recompute_s`, `restore_s`), and against max(`head_s`, `read_s`) (the
overlap's own cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlxd  # noqa: F401  (BLAS preload decision before mlx: on the CPU, 15x slower prefills without it)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
from bench_gpu import drop_cache, load, log, probe_model, probe_options, tokens, write_file  # noqa: E402


def kv(c: Any) -> tuple[mx.array, mx.array]:
    """A plain KV cache's keys and values up to its offset (its buffers carry spare capacity)."""
    return c.keys[..., : c.offset, :], c.values[..., : c.offset, :]


def evaluated(caches: list[Any]) -> list[Any]:
    mx.eval([x for c in caches for x in kv(c)])
    return caches


def prefill(model: Any, prompt: list[int], step: int, caches: list[Any] | None = None) -> list[Any]:
    """`prompt`'s KV in fresh caches (or appended to `caches`), in chunks of `step`, evaluated."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = caches if caches is not None else make_prompt_cache(model)
    for at in range(0, len(prompt), step):
        model(mx.array(prompt[at : at + step])[None], cache=caches)
        evaluated(caches)
    return caches


def sliced(caches: list[Any], start: int, end: int) -> list[Any]:
    """New plain KV caches holding tokens start..end of `caches`."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        k, v = kv(c)
        piece = KVCache()
        piece.update_and_fetch(mx.array(k[..., start:end, :]), mx.array(v[..., start:end, :]))
        out.append(piece)
    return evaluated(out)


def joined(head: list[Any], tail: list[Any]) -> list[Any]:
    """One cache per layer: the head's tokens, then the tail's."""
    from mlx_lm.models.cache import KVCache

    out = []
    for h, t in zip(head, tail, strict=True):
        (hk, hv), (tk, tv) = kv(h), kv(t)
        c = KVCache()
        c.update_and_fetch(mx.concatenate([hk, tk], axis=2), mx.concatenate([hv, tv], axis=2))
        out.append(c)
    return out


def read_tail(path: Path) -> Any:
    """The tail's file read into host memory (no MLX call: this runs beside the engine's thread, as serving's
    prefetcher does; `kinds.adopt` on the MLX thread makes its caches)."""
    from mlxd.kv import file_format

    return file_format.read_snapshot(path, verify=False)


def last_logits(model: Any, caches: list[Any], suffix: list[int], step: int) -> mx.array:
    """The suffix prefilled on `caches` (changed in place): the next-token logits, evaluated."""
    for at in range(0, len(suffix) - 1, step):
        model(mx.array(suffix[at : min(at + step, len(suffix) - 1)])[None], cache=caches)
    logits = model(mx.array(suffix[-1:])[None], cache=caches)[0, -1].astype(mx.float32)
    mx.eval(logits)
    return logits


def one_round(model: Any, prefix: list[int], suffix: list[int], heads: list[int], files: dict[int, Path],
              full: Path, step: int) -> dict[str, Any]:
    from mlxd.kv import file_format, kinds

    n = len(prefix)
    row: dict[str, Any] = {"tokens": n, "suffix": len(suffix)}
    mx.clear_cache()
    t0 = time.perf_counter()
    reference = last_logits(model, prefill(model, prefix, step), suffix, step)
    row["recompute_s"] = time.perf_counter() - t0
    mx.clear_cache()
    drop_cache(full)
    t0 = time.perf_counter()
    restored = kinds.adopt(file_format.read_snapshot(full, verify=False))
    last_logits(model, restored, suffix, step)
    row["restore_s"] = time.perf_counter() - t0
    del restored
    row["splits"] = []
    for j in heads:
        mx.clear_cache()
        t0 = time.perf_counter()
        prefill(model, prefix[:j], step)
        head_s = time.perf_counter() - t0
        drop_cache(files[j])
        t0 = time.perf_counter()
        evaluated(kinds.adopt(read_tail(files[j])))
        read_s = time.perf_counter() - t0
        mx.clear_cache()
        drop_cache(files[j])
        got: dict[str, Any] = {}
        t0 = time.perf_counter()
        reader = threading.Thread(target=lambda got=got, path=files[j]: got.update(tail=read_tail(path)))
        reader.start()
        head = prefill(model, prefix[:j], step)
        head_done = time.perf_counter() - t0
        reader.join()
        joined_at = time.perf_counter() - t0
        logits = last_logits(model, joined(head, kinds.adopt(got["tail"])), suffix, step)
        split_s = time.perf_counter() - t0
        diff = float(mx.max(mx.abs(logits - reference)).item())
        same = bool(mx.argmax(logits).item() == mx.argmax(reference).item())
        row["splits"].append({"head": j, "head_fraction": round(j / n, 3), "head_s": head_s, "read_s": read_s,
                              "split_s": split_s, "split_head_done_s": head_done, "split_joined_s": joined_at,
                              "max_abs_logit_diff": diff, "argmax_same": same})
    return row


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    probe_options(ap, Path("/tmp/reverse-split"))
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="prefix sizes (default 16384; --small 512)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.7, 0.8, 0.9],
                    help="head fractions to recompute (the rest is read)")
    ap.add_argument("--suffix", type=int, default=32, help="new tokens after the prefix")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step", type=int, default=2048, help="prefill chunk (the server's prefill step)")
    args = ap.parse_args(argv)
    if not all(0 < f < 1 for f in args.fractions):
        ap.error("--fractions must be between 0 and 1")
    preset, model_dir = probe_model(args)
    sizes = args.tokens or ([512] if args.small else [16384])
    model, _ = load(model_dir)
    files_dir = args.out / "files"
    files_dir.mkdir(exist_ok=True)
    result: dict[str, Any] = {"device": str(mx.default_device()), "argv": sys.argv, "sizes": {}}
    dest = args.out / f"reverse_split-{'small-' if args.small else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    prefill(model, tokens(min(sizes), 1, preset.vocab_size), args.step)  # warm-up: compiles, allocator
    for n in sizes:
        prefix, suffix = tokens(n, 100 + n, preset.vocab_size), tokens(args.suffix, 200 + n, preset.vocab_size)
        reference = prefill(model, prefix, args.step)
        full = files_dir / f"full-{n}.mlxkv"
        write_file(reference, full, n)
        heads = sorted({max(1, min(n - 1, int(n * f))) for f in args.fractions})
        files = {}
        for j in heads:
            files[j] = files_dir / f"tail-{n}-{j}.mlxkv"
            write_file(sliced(reference, j, n), files[j], n - j)
        del reference
        rounds = [one_round(model, prefix, suffix, heads, files, full, args.step) for _ in range(args.rounds)]
        summary = {"recompute_s": statistics.median(r["recompute_s"] for r in rounds),
                   "restore_s": statistics.median(r["restore_s"] for r in rounds), "splits": []}
        best = min(summary["recompute_s"], summary["restore_s"])
        for i, j in enumerate(heads):
            per = [r["splits"][i] for r in rounds]
            s = {k: statistics.median(x[k] for x in per) for k in ("head_s", "read_s", "split_s")}
            s.update(head=j, head_fraction=round(j / n, 3), split_vs_best_arm=s["split_s"] / best,
                     split_vs_max_parts=s["split_s"] / max(s["head_s"], s["read_s"]),
                     max_abs_logit_diff=max(x["max_abs_logit_diff"] for x in per),
                     argmax_same=all(x["argmax_same"] for x in per))
            summary["splits"].append(s)
            log(f"n={n} head {j} ({j / n:.2f}): split {s['split_s']:.3f}s = {s['split_vs_best_arm']:.3f} of the best "
                f"arm, {s['split_vs_max_parts']:.3f} of max(head {s['head_s']:.3f}, read {s['read_s']:.3f}); "
                f"logits max |diff| {s['max_abs_logit_diff']:.3g}, argmax same {s['argmax_same']}")
        log(f"n={n}: recompute {summary['recompute_s']:.3f}s, restore {summary['restore_s']:.3f}s")
        result["sizes"][str(n)] = {"rounds": rounds, "summary": summary}
        dest.write_text(json.dumps(result, indent=1))
        for p in [full, *files.values()]:
            p.unlink(missing_ok=True)
    log(f"-> {dest}")
    return dest


if __name__ == "__main__":
    main()
