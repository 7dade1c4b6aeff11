# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""The engine thread's Python per decode step in a running runtime, traced (issue 28; exact on any host).

`bench_step_host.py` counts `EngineCore.step` alone; this counts everything the MLX thread runs while rows
decode through the actors (no HTTP): the step loop, the step, the hand-off to the trio thread. One runtime,
the tiny `test` model, `--rows` rows with EOS banned; tracing starts at a row's 100th token and ends at its 400th.

    PYTHONPATH=src python benchmarks/count_engine_thread.py [--rows 1] [--out benchmarks/results]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

HERE = Path(__file__).resolve().parent


async def count(model_dir: Path, rows: int) -> dict[str, Any]:
    from mlxd import RuntimeConfig
    from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams, TokenGenerated
    from mlxd.runtime.supervisor import open_runtime

    calls: collections.Counter[str] = collections.Counter()
    opcodes = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            opcodes[0] += 1
        return local

    def traced(frame: Any, event: str, arg: Any) -> Any:
        c = frame.f_code
        calls[f"{Path(c.co_filename).name}:{c.co_name}"] += 1
        frame.f_trace_opcodes = True
        return local

    config = RuntimeConfig(model=str(model_dir), model_name="test", prompt_cache_bytes=64 << 20, device_probe="off",
                           max_batch=max(8, rows), prefill_batch=max(8, rows), max_context=1024)
    async with open_runtime(config) as rt:
        engine, marks = rt.engine, {}
        ban = ((0, -100.0), (2, -100.0))
        streams = [rt.submit(GenerationRequest(request_id=f"r{i}", prompt=(5 + i, 6, 7, 8),
                                               sampling=SamplingParams(max_tokens=500, logit_bias=ban)))
                   for i in range(rows)]

        async def read(i: int, stream: Any) -> None:
            n = 0
            async for event in stream:
                n += isinstance(event, TokenGenerated)
                if i == 0 and n in (100, 400) and n not in marks:  # on the MLX thread, between two steps
                    on = traced if n == 100 else None
                    marks[n] = await engine._thread.run(lambda on=on: (sys.settrace(on), engine.core.counters.steps)[1])

        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(streams):
                nursery.start_soon(read, i, stream)
    steps = marks[400] - marks[100]
    return {"rows": rows, "steps": steps, "py_calls_per_step": sum(calls.values()) / steps,
            "py_opcodes_per_step": opcodes[0] / steps,
            "calls": {k: round(v / steps, 2) for k, v in calls.most_common(60)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "step-host-work")
    args = ap.parse_args()
    from mlxd.model.tiny import build_model

    model_dir = args.work / "model-test"
    if not (model_dir / "config.json").exists():
        build_model(model_dir, "test", seed=0)
    out = {"label": args.label, "runs": [trio.run(count, model_dir, int(n)) for n in args.rows.split(",") if n]}
    for run in out["runs"]:
        print(f"{run['rows']} rows: the engine thread per decode step {run['py_calls_per_step']:.1f} Python calls, "
              f"{run['py_opcodes_per_step']:.0f} bytecodes ({run['steps']} steps)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engine-thread-{args.label + '-' if args.label else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
