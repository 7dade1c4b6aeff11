"""A session's KV moved to a fresh server as a file, against prefilling it there (issue 25).

    python benchmarks/bench_session_import.py [--preset default] [--context 2048] [--rounds 3]

Through the in-process runtime API (`open_runtime`), RAM tier only. Server A
runs a `--context`-token prompt in session "s" and exports the session
(`Runtime.export_session`, what `GET /admin/sessions/{id}/export` calls).
Then, in fresh servers of the same model, the session's next turn (the
prompt plus 64 new tokens) runs cold, and again after importing the file
(`Runtime.import_session`, what `POST /admin/sessions/{id}/import` calls:
every CRC checked, one forward token on a copy). Prints the file's size, the
export and import times, and the next turn's TTFT side by side (medians).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
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
    assert stream.accepted is not None and first is not None
    return {"ttft_s": first, "cached": stream.accepted.cached_tokens}


def _config(args: argparse.Namespace) -> Any:
    from mlxd import RuntimeConfig

    return RuntimeConfig(model_preset=args.preset, max_context=args.context + SUFFIX + 8, device_probe="off")


async def _export(args: argparse.Namespace, prompt: list[int], dest: Path) -> dict[str, Any]:
    from mlxd import open_runtime

    async with open_runtime(_config(args)) as rt:
        await _turn(rt, prompt, "s")
        t0 = time.perf_counter()
        path = await rt.export_session("s")
        seconds = time.perf_counter() - t0
        assert path is not None
        shutil.move(path, dest)
    return {"export_s": seconds}


async def _next_turn(args: argparse.Namespace, prompt: list[int], file: Path | None) -> dict[str, Any]:
    from mlxd import open_runtime

    async with open_runtime(_config(args)) as rt:
        import_s = 0.0
        if file is not None:
            upload = rt.transfer_dir / f"bench-{time.monotonic_ns()}.upload"
            shutil.copy(file, upload)
            t0 = time.perf_counter()
            done = await rt.import_session("s", upload)
            import_s = time.perf_counter() - t0
            upload.unlink(missing_ok=True)
            assert done.ram
        turn = await _turn(rt, prompt, "s")
    return {**turn, "import_s": import_s}


def main() -> None:
    import numpy as np
    import trio

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="default")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(7)
    prompt = rng.integers(10, 200, args.context).tolist()
    follow = [*prompt, *rng.integers(10, 200, SUFFIX).tolist()]
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "s.mlxkv"
        exported = {**trio.run(_export, args, prompt, file), "bytes": file.stat().st_size}
        rows: dict[str, list[dict[str, Any]]] = {"cold": [], "imported": []}
        for _ in range(args.rounds):
            rows["cold"].append(trio.run(_next_turn, args, follow, None))
            rows["imported"].append(trio.run(_next_turn, args, follow, file))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    print(f"preset {args.preset}, {args.context}-token session, next turn +{SUFFIX} tokens, {args.rounds} rounds "
          f"(medians); file {exported['bytes'] / 2**20:.1f} MiB, export {exported['export_s'] * 1000:.0f} ms")
    print("next turn on a fresh server   cached tokens   import ms   TTFT ms   import + TTFT ms")
    for name in rows:
        cached = rows[name][0]["cached"]
        imp, ttft = med(name, "import_s") * 1000, med(name, "ttft_s") * 1000
        print(f"{name:28s}  {cached:13d}   {imp:9.1f}   {ttft:7.1f}   {imp + ttft:16.1f}")
    cold = med("cold", "ttft_s")
    warm = med("imported", "import_s") + med("imported", "ttft_s")
    print(f"cold TTFT / (import + TTFT): {cold / warm:.2f}x")


if __name__ == "__main__":
    main()
