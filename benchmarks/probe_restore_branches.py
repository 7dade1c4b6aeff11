"""What a restored turn hands the engine, the advisor's restore against a forced one (issue 28).

On the CPU the advisor's restored turns ran slower than `--restore-choice always`'s in 6 of 7 runs, in the
one-token forward after the restore (docs/benchmarks.md, "After a restart on the CPU, end to end"). This
checks, without timing, whether the two plans' branches hand the engine different states: one server writes
a conversation's checkpoints to its SSD tier; two copies of that directory are served by a restarted server
each, `measured` (the advisor, calibrated to choose the restore) and `always`; both are sent the same
returning prompt. For each, at `EngineCore._admit`: every cache layer's class, offset, arrays' dtype, shape,
strides and contiguity, the MLX graph still pending behind them (primitives: 0 = evaluated), their bytes'
digest; then the first `generator.next()` after it: Python calls traced (by function), MLX peak memory over
the active memory before it (a copy inside the forward would show), the token; and the same prompt sent again
to that server (a RAM hit's first forward, for comparison). `--timed N`: N more restarts
of each, alternated, each's first forward timed (medians; `uptime`).

    PYTHONPATH=src python benchmarks/probe_restore_branches.py [--preset bench --prompt-tokens 512] [--timed 6]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
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

import attrs
import httpx
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mlxd.engine.core import EngineCore  # noqa: E402
from mlxd.kv.advisor_file import FILE_NAME, VERSION  # noqa: E402
from mlxd.model import build_model  # noqa: E402

from serving import ServerThread, config_for  # noqa: E402

CAPTURE: dict[str, Any] = {}
_ARMED = threading.Event()


def pending_ops(arrays: list[mx.array]) -> int:
    """Primitives still to run behind `arrays` (0: all evaluated)."""
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    return f.getvalue().count("shape=rectangle")


def describe(caches: list[Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for c in caches or []:
        row: dict[str, Any] = {"class": type(c).__name__, "offset": getattr(c, "offset", None)}
        arrays = [(k, v) for k, v in vars(c).items() if isinstance(v, mx.array)]
        row["pending_ops"] = pending_ops([a for _, a in arrays]) if arrays else 0  # before anything evaluates them
        for name, a in arrays:
            mv = memoryview(a)  # evaluates: after the graph was counted
            row[name] = {"dtype": str(a.dtype), "shape": list(a.shape), "strides": list(mv.strides),
                         "c_contiguous": mv.c_contiguous,
                         "sha1": hashlib.sha1(np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
                                              .tobytes()).hexdigest()[:12]}
        out.append(row)
    return out


def patch() -> None:
    admit, step = EngineCore._admit, EngineCore._next

    def _admit(self, row, prompt, max_tokens, caches, history, cuts=()):  # type: ignore[no-untyped-def]
        if _ARMED.is_set():
            CAPTURE["admit"] = {"prompt_tokens": len(prompt), "history_tokens": len(history), "cuts": list(cuts),
                                "caches": describe(caches)}
        admit(self, row, prompt, max_tokens, caches, history, cuts)

    def _next(self, out):  # type: ignore[no-untyped-def]
        if not (_ARMED.is_set() and "admit" in CAPTURE and "first_next" not in CAPTURE):
            return step(self, out)
        calls: collections.Counter[str] = collections.Counter()

        def prof(frame, event, arg):  # type: ignore[no-untyped-def]
            if event in ("call", "c_call"):
                name = (f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_code.co_name}" if event == "call"
                        else f"C:{getattr(arg, '__qualname__', repr(arg))}")
                calls[name] += 1

        active = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        profiled = not CAPTURE.get("untraced")
        if profiled:
            sys.setprofile(prof)
        try:
            step(self, out)
        finally:
            sys.setprofile(None)
        seconds = time.perf_counter() - t0
        CAPTURE["first_next"] = {"python_calls": sum(calls.values()), "by_function": dict(sorted(calls.items())),
                                 "peak_over_active_bytes": mx.get_peak_memory() - active, "traced_s": seconds}

    EngineCore._admit, EngineCore._next = _admit, _next


def complete(server: ServerThread, ids: list[int], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/completions", timeout=600, json={
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "logprobs": 0, "temperature": 0})
    r.raise_for_status()
    return r.json()


def get(server: ServerThread, path: str) -> dict[str, Any]:
    return httpx.get(server.base_url.removesuffix("/v1") + path, timeout=120).json()


def calibrate(ssd: Path) -> None:
    """The advisor's file as a restarted server reads it: restores measured fast (it chooses them)."""
    cal = {"prefill_scale": 1.0, "whole_prefill_samples": 1, "restore_bytes_per_s": 1e12, "restore_samples": 5,
           "page_cache_bytes_per_s": 1e12, "page_cache_samples": 5, "forgone_s": 0.0, "restore_retries": 0}
    for f in list(ssd.rglob(FILE_NAME)) or [next(p for p in ssd.rglob("*") if p.is_dir() and any(p.iterdir()))
                                            / FILE_NAME]:
        f.write_text(json.dumps({"version": VERSION, "device": "", "calibration": cal}))


def served(config: Any, prompt: list[int], *, trace: bool, max_tokens: int = 1, profile: bool = True) -> dict[str, Any]:
    CAPTURE.clear()
    CAPTURE["untraced"] = not profile
    with ServerThread(config) as s:
        if trace:
            _ARMED.set()
        try:
            reply = complete(s, prompt, max_tokens)
        finally:
            _ARMED.clear()
        st = get(s, "/stats").get("ssd_cache") or {}
        restored = dict(CAPTURE)
        if trace and profile:  # the same prompt again: a RAM hit's first forward, for comparison
            CAPTURE.clear()
            _ARMED.set()
            try:
                complete(s, prompt, max_tokens)
            finally:
                _ARMED.clear()
            restored["ram_hit"] = {k: v for k, v in CAPTURE.get("first_next", {}).items() if k != "by_function"}
        CAPTURE.clear()
        CAPTURE.update(restored)
    d = st.get("restore_decisions") or {}
    return {"capture": dict(CAPTURE), "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
            "tokens": reply["choices"][0]["logprobs"]["tokens"], "logprobs": reply["choices"][0]["logprobs"]["token_logprobs"],
            "restores": st.get("restores"), "restore_ms": st.get("restore_ms_last"),
            "decisions": {k: d.get(k) for k in ("restores_chosen", "recomputes_chosen", "splits_chosen", "explorations")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--prompt-tokens", type=int, default=240)
    ap.add_argument("--suffix", type=int, default=0, help="new tokens after the checkpointed prompt (0: sent again)")
    ap.add_argument("--layout", default="blocks", choices=("blocks", "whole"))
    ap.add_argument("--host-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--timed", type=int, default=0, help="more restarts of each arm, alternated, first forward timed")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    patch()
    work = Path(tempfile.mkdtemp(prefix="restore-branches-"))
    try:
        model = build_model(work / "model", args.preset, seed=0)
        rng = np.random.default_rng(28)
        first = [int(x) for x in rng.integers(1, 1000, args.prompt_tokens)]
        returning = first + [int(x) for x in rng.integers(1, 1000, args.suffix)]
        base = config_for(model, host_cache_bytes=args.host_cache_bytes, ssd_layout=args.layout,
                          ssd_block_tokens=64)
        with ServerThread(attrs.evolve(base, ssd_cache_dir=work / "ssd0", restore_choice="always")) as s:
            complete(s, first, 4)
            assert httpx.post(s.base_url.removesuffix("/v1") + "/admin/cache/flush", timeout=120).status_code == 200
        calibrate(work / "ssd0")
        report: dict[str, Any] = {"argv": sys.argv, "uptime": os.getloadavg(), "arms": {}}
        for choice in ("measured", "always"):
            d = work / f"ssd-{choice}"
            shutil.copytree(work / "ssd0", d)
            report["arms"][choice] = served(attrs.evolve(base, ssd_cache_dir=d, restore_choice=choice), returning,
                                            trace=True)
        a, b = report["arms"]["measured"], report["arms"]["always"]
        same_admit = a["capture"].get("admit") == b["capture"].get("admit")
        fa, fb = a["capture"].get("first_next", {}), b["capture"].get("first_next", {})
        report["same"] = {
            "admit": same_admit, "tokens": a["tokens"] == b["tokens"], "logprobs": a["logprobs"] == b["logprobs"],
            "python_calls": (fa.get("python_calls"), fb.get("python_calls")),
            "calls_by_function_equal": fa.get("by_function") == fb.get("by_function"),
            "peak_over_active_bytes": (fa.get("peak_over_active_bytes"), fb.get("peak_over_active_bytes")),
            "ram_hit_python_calls": a["capture"].get("ram_hit", {}).get("python_calls"),
            "ram_hit_peak_over_active_bytes": a["capture"].get("ram_hit", {}).get("peak_over_active_bytes"),
        }
        if fa.get("by_function") != fb.get("by_function"):
            ka, kb = fa.get("by_function", {}), fb.get("by_function", {})
            report["same"]["call_diff"] = {k: (ka.get(k, 0), kb.get(k, 0)) for k in sorted(set(ka) | set(kb))
                                           if ka.get(k, 0) != kb.get(k, 0)}
        print(json.dumps({k: report["arms"][k]["decisions"] | {"cached": report["arms"][k]["cached_tokens"],
                                                               "restores": report["arms"][k]["restores"]}
                          for k in report["arms"]}), flush=True)
        print(json.dumps(report["same"]), flush=True)
        if not same_admit:
            print(json.dumps({"measured": a["capture"].get("admit"), "always": b["capture"].get("admit")})[:4000])
        if args.timed:
            times: dict[str, list[float]] = {"measured": [], "always": []}
            for i in range(args.timed):
                for choice in (("measured", "always") if i % 2 == 0 else ("always", "measured")):
                    d = work / f"ssd-{choice}-{i}"
                    shutil.copytree(work / "ssd0", d)
                    r = served(attrs.evolve(base, ssd_cache_dir=d, restore_choice=choice), returning, trace=True, profile=False)
                    times[choice].append(r["capture"]["first_next"]["traced_s"])
            report["timed"] = {k: {"first_next_s": v, "median_s": statistics.median(v)} for k, v in times.items()}
            report["timed"]["measured_over_always"] = (report["timed"]["measured"]["median_s"]
                                                       / report["timed"]["always"]["median_s"])
            report["uptime_after"] = os.getloadavg()
            print(json.dumps(report["timed"]), "load", report["uptime"], "->", report["uptime_after"], flush=True)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
