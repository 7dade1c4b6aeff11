"""Write-behind beside decode, traced on the CPU (issue 28).

    PYTHONPATH=src python benchmarks/trace_writebehind_decode.py [--rounds 3] [--tokens 200] [--streams 1,8]

A live in-process mlxd (the `test` preset, `--ssd-cache`, blocks of 256 tokens) whose CUDA
runtime is `tests/fake_cuda.py`, so the SSD writer stages every block it writes to host
memory as it does on CUDA (real copies, recorded, timed at the H200's 50 GB/s). Each byte
stands for `scale` bytes: a fresh prompt of `--fresh-tokens` tokens is the 0.94 GB of an
8,192-token prompt of the 1.7B shape (bf16), and the pacing's rate and slices, the staged
pieces and the SSD block size are scaled alike, so a write takes as long beside decode as
it would there. Before each decode level, either a fresh prompt (its checkpoint is written
behind while the streams decode) or the last one again (a RAM hit: nothing to write); then
N streams of T tokens over HTTP. The RAM tier holds `--ram-prompts` fresh prompts, as the H200
bench's 3 GB (the backlog bound, half of it, is then passed as there). Arms, interleaved within each round:

  new    the staging as it is: one 2D copy per tensor, 8 MiB pieces while rows decode, one per step
  rows   the staging before: one runtime call per row (head), 64 MiB pieces, no step pacing
  hold   new, with write-behind held still while rows decode (`--ssd-write-hold-decode`)
  none   no write beside the decode (the prompt repeated)

Reported per arm and level: decode tok/s (client), and from the writer's threads during the
decode: staged pieces, runtime calls (on CUDA each is a ctypes call: the GIL released inside,
taken back after), bytes per piece, and per piece the writer thread's CPU ms (an upper bound
on the GIL it held) and wall ms; the engine's step and gap medians. On this shared 2-core VM
the tok/s are noise-bound; the counts are the trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from bench_gpu import text_of, ttft  # noqa: E402
from bench_host_tier_servers import TEXTS, decode  # noqa: E402
from tests import fake_cuda  # noqa: E402
from tests.serving import ServerThread, config_for  # noqa: E402

PROMPT_GB = 0.94  # 8,192 tokens of the 1.7B shape, bf16 (28 layers x 8 KV heads x 128 x K, V x 2 bytes)
H200_BLOCK_TOKENS = 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per decode stream")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--fresh-tokens", type=int, default=2048)
    ap.add_argument("--arms", default="new,rows,hold,none")
    ap.add_argument("--ram-prompts", type=float, default=3.2,
                    help="the RAM tier in fresh prompts (the H200 bench: 3 GB = 3.2 prompts of 0.94 GB; the write "
                         "backlog's bound is half of it)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from mlxd.actors import ssd_writer
    from mlxd.engine.core import EngineCore
    from mlxd.kv import pacing
    from mlxd.model.tiny import build_model
    from mlxd.runtime import host_memory

    work = Path(tempfile.mkdtemp(prefix="trace-wb-decode-"))
    model = work / "tiny"
    build_model(model, "test", seed=0)
    kv_per_token = 2 * 2 * 16 * 2 * 4  # the test preset: layers x KV heads x head dim x (K, V) x fp32
    scale = PROMPT_GB * 1e9 / (args.fresh_tokens * kv_per_token)
    lib = fake_cuda.FakeCudaLib(scale=scale)
    patch = fake_cuda.Patch()
    cuda = fake_cuda.install(patch, lib)
    # Sizes in the fake's bytes: each stands for `scale` real ones.
    sizes = {"STAGE_PIECE": host_memory.STAGE_PIECE, "STAGE_PIECE_DECODING": host_memory.STAGE_PIECE_DECODING}
    for name, value in sizes.items():
        patch.setattr(host_memory, name, max(1, int(value / scale)))
    patch.setattr(ssd_writer, "PACE_SLICE", max(4096, int(pacing.PACE_SLICE / scale)))
    block_tokens = max(16, int(H200_BLOCK_TOKENS * args.fresh_tokens / 8192))

    # The engine's steps (MLX thread), the writer's staged pieces and step waits (writer threads).
    steps: list[tuple[float, float, int]] = []
    pieces: list[dict[str, Any]] = []
    real_step, real_copy = EngineCore.step, cuda.copy

    def step(self: Any, ops: Any) -> Any:
        t0 = time.perf_counter()
        out = real_step(self, ops)
        steps.append((t0, time.perf_counter(), len(getattr(self, "_rows", ()) or ())))
        return out

    def copy(copies: Any) -> int:
        t0, c0 = time.perf_counter(), time.thread_time()
        calls = real_copy(copies)
        pieces.append({"thread": threading.current_thread().name, "at": t0, "calls": calls,
                       "rows": sum(c.height for c in copies), "bytes": int(sum(c.nbytes for c in copies) * scale),
                       "cpu_ms": (time.thread_time() - c0) * 1000, "wall_ms": (time.perf_counter() - t0) * 1000})
        return calls

    patch.setattr(EngineCore, "step", step)
    patch.setattr(cuda, "copy", copy)
    arms = [a for a in args.arms.split(",") if a]
    levels = [int(x) for x in args.streams.split(",") if x]
    out: dict[str, Any] = {"scale": scale, "fresh_tokens": args.fresh_tokens, "block_tokens": block_tokens,
                           "tokens": args.tokens, "argv": sys.argv, "rows": []}
    rate = max(1, int(24 * 2**20 / scale))  # the default --ssd-write-rate, scaled
    ram = int(args.ram_prompts * args.fresh_tokens * kv_per_token)
    config = config_for(model, prompt_cache_bytes=ram, ssd_cache_dir=str(work / "ssd"),
                        ssd_write_rate_bytes=rate, ssd_layout="blocks", ssd_block_tokens=block_tokens,
                        max_context=args.fresh_tokens + 512)
    seed = 0
    try:
        with ServerThread(config) as s:
            assert s.runtime is not None
            base = s.base_url.removesuffix("/v1")
            assert s.runtime.cold is not None
            governor = s.runtime.cold.governor
            asyncio.run(ttft(base, "tiny", "warm up " * 20))
            last = text_of(model, args.fresh_tokens, 900)
            asyncio.run(ttft(base, "tiny", last))
            for r in range(args.rounds):
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    for n in levels:
                        _set_arm(patch, arm, cuda, governor, host_memory, pacing, sizes, scale)
                        if arm != "none":
                            seed += 1
                            last = text_of(model, args.fresh_tokens, 900 + seed)
                        asyncio.run(ttft(base, "tiny", last))
                        steps.clear()
                        pieces.clear()
                        cpu0 = _thread_cpu()
                        states: list[str] = []
                        watching = threading.Event()
                        watcher = threading.Thread(target=_watch, args=(governor, states, watching), daemon=True)
                        watcher.start()
                        t0 = time.perf_counter()
                        d = asyncio.run(decode(base, "tiny", [f"Story {j}: " + TEXTS["q2"] for j in range(n)],
                                               args.tokens))
                        t1 = time.perf_counter()
                        watching.set()
                        watcher.join()
                        cpu = {k: round((v - cpu0.get(k, 0.0)) * 1000, 1) for k, v in _thread_cpu().items()}
                        row = {"round": r, "arm": arm, "streams": n, "tok_s": d["tok_s"],
                               **_summary(steps, pieces, t0, t1),
                               "thread_cpu_ms": {k: v for k, v in sorted(cpu.items()) if v >= 1.0},
                               "writer_state": {k: round(states.count(k) / max(1, len(states)), 3)
                                                for k in sorted(set(states))}}
                        out["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        _set_arm(patch, "new", cuda, governor, host_memory, pacing, sizes, scale)
                        time.sleep(0.5)  # the rest of the write goes while idle (full speed)
            stats = s.call(s.runtime.stats)
            out["ssd_writer"] = (stats.as_dict() if hasattr(stats, "as_dict") else stats).get("ssd_cache", {}).get(
                "writer")
    finally:
        patch.undo()
    table: dict[str, dict[str, Any]] = {}
    for row in out["rows"]:
        table.setdefault(f"{row['arm']} {row['streams']}", []).append(row)  # type: ignore[arg-type]
    out["medians"] = {k: {"tok_s": _median([r["tok_s"] for r in v]),
                          "pieces": _median([r["pieces"] for r in v]), "calls": _median([r["calls"] for r in v]),
                          "gap_us": _median([r["gap_us_median"] for r in v])} for k, v in table.items()}
    for k, v in out["medians"].items():
        print(k, json.dumps(v))
    for arm in arms:
        if arm == "none":
            continue
        for n in levels:  # paired by round: this arm's decode / the no-write decode of the same round
            pairs = [a["tok_s"] / b["tok_s"] for a in out["rows"] for b in out["rows"]
                     if a["arm"] == arm and b["arm"] == "none" and a["streams"] == b["streams"] == n
                     and a["round"] == b["round"] and a["tok_s"] and b["tok_s"]]
            out.setdefault("vs_none", {})[f"{arm} {n}"] = [round(p, 3) for p in pairs]
            print(f"{arm} {n} streams / none, per round:", [round(p, 3) for p in pairs])
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_writebehind_decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print("->", path)
    return 0


def _watch(governor: Any, states: list[str], done: threading.Event) -> None:
    """Every 5 ms, what the governor tells write-behind: held, paced, urgent (which), or free (idle engine)."""
    while not done.wait(0.005):
        urgent = governor.urgent
        states.append("urgent:" + "+".join(sorted(urgent)) if urgent else "held" if governor.held()
                      else "paced" if governor.rate() is not None else "free")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of every live thread, by name (writer threads, the engine's, trio's)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            out[t.name] = out.get(t.name, 0.0) + time.clock_gettime(time.pthread_getcpuclockid(t.ident or 0))
        except (OSError, ProcessLookupError):
            continue
    return out


def _set_arm(patch: Any, arm: str, cuda: Any, governor: Any, host_memory: Any, pacing: Any, sizes: dict[str, int],
             scale: float) -> None:
    rows = arm == "rows"
    cuda._copy_2d = None if rows else cuda._lib.cudaMemcpy2DAsync
    host_memory.STAGE_PIECE_DECODING = max(1, int(sizes["STAGE_PIECE" if rows else "STAGE_PIECE_DECODING"] / scale))
    pacing.STEP_WAIT_S = 0.0 if rows else 0.1
    if governor is not None:
        governor.hold_while_decoding = arm == "hold"


def _summary(steps: list[tuple[float, float, int]], pieces: list[dict[str, Any]], t0: float, t1: float
             ) -> dict[str, Any]:
    inside = [p for p in pieces if t0 <= p["at"] <= t1]
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:], strict=False)]
    return {
        "pieces": len(inside), "calls": sum(p["calls"] for p in inside), "rows_copied": sum(p["rows"] for p in inside),
        "staged_gb": round(sum(p["bytes"] for p in inside) / 1e9, 3),
        "piece_mb_max": round(max((p["bytes"] for p in inside), default=0) / 2**20, 1),
        "piece_cpu_ms_median": _median([p["cpu_ms"] for p in inside]),
        "piece_cpu_ms_max": round(max((p["cpu_ms"] for p in inside), default=0.0), 3),
        "piece_wall_ms_median": _median([p["wall_ms"] for p in inside]),
        "threads": sorted({p["thread"] for p in inside}),
        "steps": len(steps), "step_us_median": _median([(b - a) * 1e6 for a, b, _ in steps]),
        "gap_us_median": _median([g * 1e6 for g in gaps]),
    }


def _median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


if __name__ == "__main__":
    threading.current_thread().name = "main"
    sys.exit(main())
