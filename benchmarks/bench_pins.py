"""A pinned conversation under RAM pressure (`prompt_cache_retention: "24h"`, `cache_control`).

    python benchmarks/bench_pins.py [--preset default] [--context 1024] [--others 4]

Through the in-process runtime API (`open_runtime`), RAM tier only, its byte
cap sized to about 2.5 conversations of `--context` tokens. Conversation A
runs first, then `--others` unrelated conversations push it out of RAM, then
A's next turn (its prompt plus 64 new tokens) runs. Twice: A unpinned, then A
pinned for 24 h (`Runtime.pin_session`, what the HTTP routes call). Prints
A's follow-up side by side: tokens read from cache and TTFT.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

SUFFIX = 64


async def _turn(rt: Any, prompt: list[int], session: str) -> dict[str, Any]:
    from mlxd import SamplingParams
    from mlxd.runtime.kernel.messages import TokenGenerated

    t0 = time.perf_counter()
    first = None
    async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=1), session=session)) as stream:
        async for event in stream:
            if isinstance(event, TokenGenerated) and first is None:
                first = time.perf_counter() - t0
    assert stream.accepted is not None
    return {"ttft_s": first, "cached": stream.accepted.cached_tokens}


async def _run(args: argparse.Namespace, cache_bytes: int, pin: bool) -> dict[str, Any]:
    import numpy as np

    from mlxd import RuntimeConfig, open_runtime

    config = RuntimeConfig(model_preset=args.preset, prompt_cache_bytes=cache_bytes, snapshot_min_tokens=256,
                           max_context=args.context + SUFFIX + 8, device_probe="off")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 200, args.context).tolist() for _ in range(args.others + 1)]
    async with open_runtime(config) as rt:
        if pin:
            await rt.pin_session("a", 24 * 3600.0)
        await _turn(rt, prompts[0], "a")
        for i, prompt in enumerate(prompts[1:]):
            await _turn(rt, prompt, f"other-{i}")
        follow = await _turn(rt, [*prompts[0], *rng.integers(10, 200, SUFFIX).tolist()], "a")
        stats = await rt.cache_stats()
    return {**follow, "ram": stats["ram"], "pins": stats["pins"]}


async def _entry_bytes(args: argparse.Namespace) -> int:
    """The RAM bytes of one conversation's checkpoint."""
    from mlxd import RuntimeConfig, open_runtime

    config = RuntimeConfig(model_preset=args.preset, snapshot_min_tokens=256, max_context=args.context + SUFFIX + 8,
                           device_probe="off")
    async with open_runtime(config) as rt:
        await _turn(rt, list(range(10, 10 + args.context)), "probe")
        return int((await rt.cache_stats())["ram"]["bytes"])


def main() -> None:
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--others", type=int, default=4)
    args = p.parse_args()
    cache_bytes = int(2.5 * trio.run(_entry_bytes, args))
    rows = {name: trio.run(_run, args, cache_bytes, name == "pinned") for name in ("unpinned", "pinned")}
    print(f"preset {args.preset}, {args.context}-token conversations, {args.others} others after A, "
          f"RAM tier {cache_bytes / 2**20:.1f} MiB (pins may hold half)")
    print("A's follow-up   cached tokens   TTFT ms   RAM evictions   pinned bytes   refused")
    for name, row in rows.items():
        print(f"{name:14s}  {row['cached']:13d}   {row['ttft_s'] * 1000:7.1f}   {row['ram']['evictions']:13d}   "
              f"{row['pins']['bytes']:12d}   {row['pins']['refused']:7d}")
    un, pin = rows["unpinned"], rows["pinned"]
    print(f"TTFT unpinned / pinned: {un['ttft_s'] / pin['ttft_s']:.2f}x")


if __name__ == "__main__":
    main()
