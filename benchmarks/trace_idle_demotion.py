"""Host-tier demotions beside decode, traced on the CPU (issue 28: decode with the host + SSD tiers).

    PYTHONPATH=src python benchmarks/trace_idle_demotion.py [--rounds 4] [--tokens 64] [--streams 1,8]

`decodeil` on the H200 sends each server a fresh 8k-token prompt, then the decode streams at once. On a
server with the host tier, the fresh prompt's checkpoint pushes an older one out of the RAM tier (3 GB:
about three of them) into the host tier, and the engine going idle after the prompt issues its move to
host memory (0.94 GB at the H200's 7.5 GB/s: 125 ms). The decode's requests come milliseconds later.

A live in-process mlxd (the `test` preset, host tier on, no memory budget, RAM tier `--ram-prompts`
fresh prompts) whose CUDA runtime is `tests/fake_cuda.py`: each fake byte stands for `scale` real ones,
so a move takes as long as on the H200 (the fake sleeps for it, in the demoting thread), and the demote
pieces are scaled alike. Each round, per arm (interleaved): a fresh prompt, then N streams of T tokens
over HTTP; recorded: every host-bound piece (start, end) against the engine's busy spans (rows in the
batch: `EngineBusy` as the cache owner takes it) that began in the decode's window. Arms:

  hold    as it is: a move issued while idle holds still once rows decode (cache_owner._idle_demotion_holds)
  before  as before 2026-12-05 08:00: it held only while a request waited for its first token

On this CPU the moves cost decode nothing (the fake only sleeps), so the trace is the overlap: pieces and
ms of migration while the decode's rows were in the batch. Without an SSD tier there is no write governor,
so nothing holds a move while a request waits for its first token: the pieces before the rows join run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
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

PROMPT_GB = 0.94  # 8,192 tokens of the 1.7B shape, bf16
TO_HOST_BPS = 7.5e9  # the H200's managed-memory migration to the host (docs/benchmarks.md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per decode stream")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--fresh-tokens", type=int, default=1024)
    ap.add_argument("--ram-prompts", type=float, default=3.2, help="the RAM tier in fresh prompts (H200: 3 GB)")
    ap.add_argument("--arms", default="hold,before")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from mlxd.actors.cache_owner import CacheOwnerActor
    from mlxd.model.tiny import build_model
    from mlxd.runtime import host_memory
    from mlxd.runtime.kernel.messages import EngineBusy

    work = Path(time.strftime("/tmp/trace-idle-demotion-%H%M%S"))
    model = work / "tiny"
    build_model(model, "test", seed=0)
    kv_per_token = 2 * 2 * 16 * 2 * 4  # the test preset: layers x KV heads x head dim x (K, V) x fp32
    scale = PROMPT_GB * 1e9 / (args.fresh_tokens * kv_per_token)
    lib = fake_cuda.FakeCudaLib(scale=scale, to_host_Bps=TO_HOST_BPS)
    patch = fake_cuda.Patch()
    fake_cuda.install(patch, lib)
    patch.setattr(host_memory, "DEMOTE_PIECE", max(1, int(host_memory.DEMOTE_PIECE / scale)))
    as_is = CacheOwnerActor._idle_demotion_holds
    handle = CacheOwnerActor._handle_safely
    busy: list[tuple[bool, float]] = []  # the engine's EngineBusy messages as the cache owner took them (fake clock)

    def traced(self: Any, msg: Any) -> Any:
        if isinstance(msg, EngineBusy):
            busy.append((msg.busy, time.perf_counter() - lib.t0))
        return handle(self, msg)

    patch.setattr(CacheOwnerActor, "_handle_safely", traced)
    arms = [a for a in args.arms.split(",") if a]
    levels = [int(x) for x in args.streams.split(",") if x]
    ram = int(args.ram_prompts * args.fresh_tokens * kv_per_token)
    config = config_for(model, prompt_cache_bytes=ram, host_cache_bytes=1 << 34, memory_budget_bytes=0,
                        max_context=args.fresh_tokens + 512)
    out: dict[str, Any] = {"argv": sys.argv[1:], "scale": scale, "fresh_tokens": args.fresh_tokens, "rows": []}
    seed = 0
    try:
        with ServerThread(config) as s:
            base = s.base_url.removesuffix("/v1")
            asyncio.run(ttft(base, "tiny", "warm up " * 20))
            for r in range(args.rounds):
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    CacheOwnerActor._idle_demotion_holds = (  # type: ignore[method-assign]
                        as_is if arm == "hold" else CacheOwnerActor._demotion_holds)
                    for n in levels:
                        seed += 1
                        asyncio.run(ttft(base, "tiny", text_of(model, args.fresh_tokens, 700 + seed)))
                        t0 = time.perf_counter() - lib.t0
                        d = asyncio.run(decode(base, "tiny", [f"Story {j}: " + TEXTS["q2"] for j in range(n)],
                                               args.tokens))
                        t1 = time.perf_counter() - lib.t0
                        time.sleep(1.0)  # idle: what was held goes now
                        moved = [c for c in lib.calls if c.op == "prefetch_host" and c.ends > t0 - 0.5]
                        rows = _windows(busy, t0, t1)  # the engine's busy spans of this decode (server clock)
                        beside = [(c, w) for c in moved for w in rows if c.starts < w[1] and c.ends > w[0]]
                        row = {"round": r, "arm": arm, "streams": n, "tok_s": d["tok_s"],
                               "decode_s": round(t1 - t0, 3),
                               "rows_busy_s": round(sum(b - a for a, b in rows), 3),
                               "pieces_beside_rows": len({id(c) for c, _ in beside}),
                               "ms_beside_rows": round(sum(min(c.ends, w[1]) - max(c.starts, w[0])
                                                           for c, w in beside) * 1e3, 1),
                               "pieces_near": len(moved), "mb_moved_near": round(sum(c.nbytes for c in moved) / 1e6, 1)}
                        out["rows"].append(row)
                        print(json.dumps(row), flush=True)
            host = s.call(s.runtime.stats)
            stats = host.as_dict() if hasattr(host, "as_dict") else host
            out["host_copies"] = ((stats.get("cache") or {}).get("host") or {}).get("copies")
    finally:
        CacheOwnerActor._idle_demotion_holds = as_is  # type: ignore[method-assign]
        patch.undo()
    out["summary"] = {
        f"{arm} {n}": {
            "pieces_beside_rows": [x["pieces_beside_rows"] for x in rows],
            "ms_beside_rows": [x["ms_beside_rows"] for x in rows], "pieces_near": [x["pieces_near"] for x in rows],
            "decode_s": statistics.median(x["decode_s"] for x in rows), "runs": len(rows)}
        for arm in arms for n in levels
        if (rows := [x for x in out["rows"] if x["arm"] == arm and x["streams"] == n])}
    print(json.dumps(out["summary"], indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_idle_demotion-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print("->", path)
    return 0


def _windows(busy: list[tuple[bool, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The engine's busy spans (EngineBusy True to False) that began between t0 and t1."""
    out, began = [], None
    for on, t in busy:
        if on and began is None:
            began = t
        elif not on and began is not None:
            if t0 <= began <= t1:
                out.append((began, t))
            began = None
    if began is not None and t0 <= began <= t1:
        out.append((began, t1))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
