"""Serving's host-tier operations around a returning conversation, traced on the CPU (issue 28).

    PYTHONPATH=src python benchmarks/trace_host_promotion.py [--budget tight|none] [--out DIR]

A live in-process mlxd (the "test" preset) with the host tier forced on and the
CUDA runtime calls of `runtime/host_memory.py` answered by `tests/fake_cuda.py`:
every page migration and copy is recorded (thread, stream, bytes, when issued,
when its stream reached it) and timed as an H200 would (to the host 7.5 GB/s,
synchronous in the calling thread; to the device 40 GB/s, queued on its stream),
with each byte standing for enough bytes that one conversation's KV is the 1.88 GB
of a 16k-token prefix on the 1.7B shape. The turns are the H200 bench's
(`bench_host_tier_servers.py`): A cold, A again, A's next turn, B, C, A returning;
the RAM tier holds about one conversation, and with `--budget tight` the memory
budget is what the server measured plus one conversation (so B and C push A out of
HBM, as `mlxd_host_tight` does).

It counts operations, not speed: per turn, from the request's arrival to its first
token, the migrations to the device and to the host by thread and stream, how long
the lookup held the request (the trio thread), when the promotion's stream reached
its first migration (queued behind what), and when its last one would have landed.
The device side (the forward pass faulting pages) is not simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import fake_cuda  # noqa: E402
from tests.serving import ServerThread, config_for  # noqa: E402

ENTRY_GB = 1.88  # a 16k-token prefix of the 1.7B shape (bf16)


def turn(base: str, text: str, max_tokens: int = 2) -> None:
    import httpx

    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
    httpx.post(base + "/completions", json=body, timeout=120).raise_for_status()


def run(budget: str, work: Path, headroom: float = 3.5) -> dict[str, Any]:
    from mlxd.model.tiny import build_model
    from mlxd.runtime import host_memory

    model = work / "tiny"
    if not (model / "config.json").exists():
        build_model(model, "test", seed=0)
    from transformers import AutoTokenizer

    n = 120  # words per first prompt
    kv_per_token = 2 * 2 * 16 * 2 * 4  # the test preset: layers x kv heads x head dim x (K, V) x fp32
    prompts = [" ".join(f"w{c}x{i}" for i in range(n)) for c in range(3)]
    tokens = len(AutoTokenizer.from_pretrained(str(model))(prompts[0])["input_ids"])
    entry_bytes = tokens * kv_per_token
    lib = fake_cuda.FakeCudaLib(scale=ENTRY_GB * 1e9 / entry_bytes)
    patch = fake_cuda.Patch()
    fake_cuda.install(patch, lib)
    # A demotion's pieces stand for DEMOTE_PIECE bytes of the H200's entry, as every other byte here.
    if hasattr(host_memory, "DEMOTE_PIECE"):  # (the code before 28h moved an entry whole)
        patch.setattr(host_memory, "DEMOTE_PIECE", max(1, int(host_memory.DEMOTE_PIECE / lib.scale)))
    out: dict[str, Any] = {"budget": budget, "scale": lib.scale, "entry_bytes": entry_bytes, "turns": []}
    try:
        ram = int(1.3 * entry_bytes)  # about one conversation, as the H200 bench's 3 GB
        memory_budget = 0
        if budget == "tight":  # what a plain server holds after one conversation, plus one entry of room
            with ServerThread(config_for(model, prompt_cache_bytes=ram, host_cache_bytes=1 << 30,
                                         memory_budget_bytes=1 << 34)) as s:
                turn(s.base_url, prompts[0])
                stats = s.call(s.runtime.stats) if s.runtime is not None else None
                memory = (stats.as_dict() if hasattr(stats, "as_dict") else stats)["cache"]["memory"]
            memory_budget = int(memory["other_bytes"] + ram + headroom * entry_bytes)
            out["budget_bytes"] = memory_budget
        lib.calls.clear()
        with ServerThread(config_for(model, prompt_cache_bytes=ram, host_cache_bytes=1 << 30,
                                     memory_budget_bytes=memory_budget)) as s:
            assert s.runtime is not None
            records: list[Any] = []
            s.runtime.scheduler.observers.append(records.append)
            trio_thread = s._thread.name
            a2 = prompts[0] + " and again"
            a3 = a2 + " and once more"
            order = [("A cold", prompts[0]), ("A hit", prompts[0]), ("A next", a2), ("B", prompts[1]),
                     ("C", prompts[2]), ("A returning", a3)]
            marks = []
            for name, text in order:
                marks.append((name, lib.now()))
                turn(s.base_url, text)
            time.sleep(1.0)  # the last moves finish
            stats = s.call(s.runtime.stats)
        host_stats = (stats.as_dict() if hasattr(stats, "as_dict") else stats)["cache"]["host"]
        out["host_stats"] = host_stats
        mono_to_fake = time.monotonic() - (time.perf_counter() - lib.t0)  # monotonic == perf_counter on Linux
        for (name, _), rec in zip(order, records, strict=True):
            arrive = rec.submitted_at - mono_to_fake
            first = rec.first_token_at - mono_to_fake if rec.first_token_at else arrive
            inside = [c for c in lib.calls if arrive <= c.issued <= first and c.op != "sync"]
            running = [c for c in lib.calls if c.op == "prefetch_host" and c.starts < first and c.ends > arrive]
            promote = [c for c in inside if c.op == "prefetch_device"]
            row = {
                "turn": name, "cached_tokens": rec.cached_tokens, "promoted_bytes": rec.promoted_bytes,
                "lookup_ms": round(rec.lookup_s * 1000, 2), "ttft_ms_cpu": round((first - arrive) * 1000, 1),
                "to_device_calls": len(promote), "to_device_gb": round(sum(c.nbytes for c in promote) / 1e9, 3),
                "to_device_threads": sorted({"trio" if c.thread == trio_thread else c.thread for c in promote}),
                "to_host_calls_before_first_token": len([c for c in inside if c.op == "prefetch_host"]),
                "to_host_gb_running_before_first_token": round(sum(c.nbytes for c in running) / 1e9, 3),
                "to_host_threads": sorted({c.thread for c in running}),
            }
            if promote:
                row["promotion_queued_ms"] = round((promote[0].starts - promote[0].issued) * 1000, 1)
                row["promotion_lands_ms_after_arrival"] = round((promote[-1].ends - arrive) * 1000, 1)
                row["promotion_streams"] = sorted({c.stream for c in promote})
            out["turns"].append(row)
        out["calls"] = {op: len([c for c in lib.calls if c.op == op]) for op in
                        ("prefetch_device", "prefetch_host", "copy", "sync")}
    finally:
        patch.undo()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=("tight", "none"), default="tight")
    ap.add_argument("--headroom", type=float, default=3.5, help="tight: the budget's room over what one conversation left, in entries")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trace-host-"))
    res = run(args.budget, work, args.headroom)
    for row in res["turns"]:
        print(json.dumps(row))
    print("host", json.dumps({k: res["host_stats"].get(k) for k in ("demotions", "moves", "promotions", "reclaims",
                                                                   "copies")}))
    print("calls", json.dumps(res["calls"]), "budget", res.get("budget_bytes"), "entry", res["entry_bytes"])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_host_promotion-{args.budget}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print("->", path)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "main"
    sys.exit(main())
