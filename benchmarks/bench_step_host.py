# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Decode's host cost per step, in measures that do not follow the host's speed (issue 28).

With the tiny `test` model the forward pass is nearly free, so a step is the host's work, as the
1.7B model's decode step is on an H200. Per row count (1 and 8, EOS banned), interleaved:
  (a) mlx_lm's `BatchGenerator.next()`;
  (b) mlxd's `EngineCore.step()` on the same rows (prompt cache on, as `mlxd serve` runs it).
Per decode step: the calling thread's CPU time (`time.thread_time`) in all and outside the calls
that wait for the device or launch work (mx.eval / async_eval, .item, .tolist, int/float/bool of
an array: "syncs"), how many syncs, and whether the step queued the next step's work
(`async_eval`) before its first sync (pipelining, as mlx_lm's `GenerationBatch._step` does).
Also, traced (exact, the same on any host): the Python calls and bytecodes a step executes on this
thread. Medians + IQR over repeats; the counts are exact, the CPU times are this host's.

    PYTHONPATH=src python benchmarks/bench_step_host.py [--steps 200] [--repeats 8] [--rows 1,8] [--logprobs K]
        [--model DIR]  (on an H200: the 1.7B shape, `wave3.sh stephost`)
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

HERE = Path(__file__).resolve().parent
SYNCS = ("eval", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__")
TRACED = 20  # steps traced for the exact counts (after the timed ones)
BAN = ((0, -100.0), (2, -100.0))  # EOS banned, as the servers' clients ban it


@attrs.define
class Probe:
    """Wraps MLX's waiting calls to count them and time them on this thread while `on`."""

    on: bool = False
    events: list[str] = attrs.Factory(list)
    walls: list[float] = attrs.Factory(list)  # wall seconds inside each event
    inside_cpu: float = 0.0
    _depth: int = 0

    def install(self) -> None:
        for name in ("eval", "async_eval"):
            setattr(mx, name, self._wrap(name, getattr(mx, name)))
        for name in SYNCS[1:]:
            if hasattr(mx.array, name):
                setattr(mx.array, name, self._wrap(name, getattr(mx.array, name)))

    def _wrap(self, name: str, inner: Any) -> Any:
        probe = self

        def call(*args: Any, **kwargs: Any) -> Any:
            if not probe.on or probe._depth:
                return inner(*args, **kwargs)
            probe._depth += 1
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                probe.inside_cpu += time.thread_time() - t0
                probe.walls.append(time.perf_counter() - w0)
                probe.events.append(name)
                probe._depth -= 1

        return call

    def begin(self) -> None:
        self.events, self.walls, self.inside_cpu, self.on = [], [], 0.0, True

    def end(self) -> dict[str, Any]:
        self.on = False
        syncs = [e for e in self.events if e != "async_eval"]
        first_sync = next((i for i, e in enumerate(self.events) if e != "async_eval"), len(self.events))
        # after the step's tokens are read (mlx-lm's tolist): reads of its other outputs (logprobs), whose
        # wait is the next step's forward when they queue behind it on the generation stream
        tokens_read = self.events.index("tolist") + 1 if "tolist" in self.events else len(self.events)
        return {"syncs": len(syncs), "pipelined": "async_eval" in self.events[:first_sync],
                "read_wait": sum(self.walls[tokens_read:]),
                "inside_cpu": self.inside_cpu, "events": " ".join(self.events)}


def measure(step: Any, probe: Probe, steps: int) -> dict[str, Any]:
    """`steps` calls of `step`, each timed on this thread; per-step medians."""
    cpu, outside, syncs, piped, wall, kinds, waits = [], [], [], 0, [], {}, []
    for _ in range(steps):
        probe.begin()
        w0, c0 = time.perf_counter(), time.thread_time()
        step()
        c1, w1 = time.thread_time(), time.perf_counter()
        got = probe.end()
        cpu.append(c1 - c0)
        outside.append(c1 - c0 - got["inside_cpu"])
        wall.append(w1 - w0)
        syncs.append(got["syncs"])
        waits.append(got["read_wait"])
        piped += got["pipelined"]
        kinds[got["events"]] = kinds.get(got["events"], 0) + 1
    return {"cpu_us": 1e6 * statistics.median(cpu), "outside_sync_cpu_us": 1e6 * statistics.median(outside),
            "wall_us": 1e6 * statistics.median(wall), "syncs_per_step": statistics.median(syncs),
            "read_wait_us": 1e6 * statistics.median(waits),
            "pipelined_share": piped / steps, "event_patterns": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:3])}


@attrs.define
class Counted:
    """Python calls and bytecodes executed by this thread (exact: the same on any host)."""

    calls: int = 0
    opcodes: int = 0

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.opcodes += 1
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        self.calls += 1
        frame.f_trace_opcodes = True
        return self._local


def count(step: Any, steps: int) -> dict[str, float]:
    """Python function calls and bytecodes per call of `step` (over `steps` calls, traced)."""
    counted = Counted()
    sys.settrace(counted._global)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    return {"py_calls": counted.calls / steps, "py_opcodes": counted.opcodes / steps}


def server_reads(gen: Any, top: int) -> Any:
    """A step as mlx_lm.server takes it with logprobs asked for (`top` >= 0): each token's logprob read, and
    its top `top` (server.py's `_format_top_logprobs`), row by row."""

    def step() -> None:
        for r in gen.next()[1]:
            r.logprobs[r.token].item()
            if top > 0:
                idx = mx.argpartition(-r.logprobs, kth=top - 1)[:top]
                idx.tolist()
                r.logprobs[idx].tolist()

    return step


def arm_mlx_lm(model: Any, probe: Probe, rows: int, warm: int, steps: int, top: int = -1) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    n = warm + steps + TRACED + 4
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=[], prefill_step_size=512,
                         logits_processors=make_logits_processors(logit_bias=dict(BAN)))
    gen.insert([[5 + i, 6, 7, 8] for i in range(rows)], [n] * rows)
    decoded = 0
    while decoded < warm:
        _, responses = gen.next()
        decoded += bool(responses)
    step = gen.next if top < 0 else server_reads(gen, top)
    out = measure(step, probe, steps)
    out.update(count(step, TRACED))
    gen.close()
    return out


def arm_core(core: Any, probe: Probe, rows: int, warm: int, steps: int, tag: int, top: int = -1) -> dict[str, Any]:
    from mlxd.engine.ops import RowStart, StepOps
    from mlxd.runtime.kernel.messages import GenerationRequest, SamplingParams

    n = warm + steps + TRACED + 4
    starts = tuple(
        RowStart(request=GenerationRequest(request_id=f"r{tag}-{i}", prompt=(5 + i, 6, 7, 8),
                                      sampling=SamplingParams(max_tokens=n, logit_bias=BAN, logprobs=top >= 0,
                                                              top_logprobs=max(top, 0))))
        for i in range(rows))
    core.step(StepOps(starts=starts))
    decoded = 0
    while decoded < warm:
        result = core.step(StepOps())
        decoded += bool(result.emits)
    empty = StepOps()
    out = measure(lambda: core.step(empty), probe, steps)
    out.update(count(lambda: core.step(empty), TRACED))
    core.step(StepOps(cancels=tuple(s.request.request_id for s in starts)))
    return out


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="decode steps measured per arm and repeat")
    ap.add_argument("--warm", type=int, default=20, help="decode steps before measuring")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--logprobs", type=int, default=-1,
                    help="rows ask for logprobs with this many top logprobs (-1: none; mlx_lm's arm reads them as "
                         "mlx_lm.server does)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (default: the tiny `test` preset, built under --work)")
    ap.add_argument("--label", default="", help="a name for this tree (kept in the JSON)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "step-host-work")
    args = ap.parse_args()
    from mlx_lm.utils import load

    from mlxd import RuntimeConfig
    from mlxd.engine.core import EngineCore
    from mlxd.model.tiny import build_model

    model_dir = args.model or args.work / "model-test"
    if args.model is None and not (model_dir / "config.json").exists():
        build_model(model_dir, "test", seed=0)
    model, _ = load(str(model_dir))
    if mx.default_device() == mx.cpu:
        from mlxd.engine.loading import cast_float_weights

        cast_float_weights(model, mx.float32)  # as the engine does on the CPU
    rows = [int(x) for x in args.rows.split(",") if x]
    config = RuntimeConfig(model=str(model_dir), model_name="test", prompt_cache_bytes=64 << 20, device_probe="off",
                           max_batch=max(8, *rows), prefill_batch=max(8, *rows),
                           max_context=args.warm + args.steps + 64)
    core = EngineCore(config)
    core.load()
    probe = Probe()
    probe.install()
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {"mlx_lm": [], "core": []} for n in rows}
    load_before = os.getloadavg()
    tag = 0
    for r in range(args.repeats):
        for n in rows:
            order = ("mlx_lm", "core") if r % 2 == 0 else ("core", "mlx_lm")
            for arm in order:
                tag += 1
                got = (arm_mlx_lm(model, probe, n, args.warm, args.steps, args.logprobs) if arm == "mlx_lm"
                       else arm_core(core, probe, n, args.warm, args.steps, tag, args.logprobs))
                raw[str(n)][arm].append(got)
        print(f"repeat {r + 1}/{args.repeats} load {os.getloadavg()[0]:.2f}", flush=True)
    core.close()
    out: dict[str, Any] = {"label": args.label, "model": str(model_dir), "device": str(mx.default_device()),
                           "steps": args.steps, "logprobs": args.logprobs, "repeats": args.repeats,
                           "load_before": load_before, "load_after": os.getloadavg(), "rows": {}}
    for n in rows:
        per: dict[str, Any] = {}
        for arm in ("mlx_lm", "core"):
            runs = raw[str(n)][arm]
            per[arm] = {k: summary([x[k] for x in runs]) for k in
                        ("cpu_us", "outside_sync_cpu_us", "wall_us", "syncs_per_step", "read_wait_us", "pipelined_share",
                         "py_calls", "py_opcodes")}
            per[arm]["event_patterns"] = runs[-1]["event_patterns"]
            per[arm]["runs"] = [{k: v for k, v in x.items() if k != "event_patterns"} for x in runs]
        ratios = [c["outside_sync_cpu_us"] / m["outside_sync_cpu_us"]
                  for c, m in zip(raw[str(n)]["core"], raw[str(n)]["mlx_lm"], strict=True)]
        extra = [c["outside_sync_cpu_us"] - m["outside_sync_cpu_us"]
                 for c, m in zip(raw[str(n)]["core"], raw[str(n)]["mlx_lm"], strict=True)]
        per["core_vs_mlx_lm_outside_sync_cpu"] = summary(ratios)
        per["core_minus_mlx_lm_outside_sync_cpu_us"] = summary(extra)
        out["rows"][str(n)] = per
        m, c = per["mlx_lm"], per["core"]
        print(f"{n} rows: CPU/step outside syncs mlx_lm {m['outside_sync_cpu_us']['median']:.0f} us, core "
              f"{c['outside_sync_cpu_us']['median']:.0f} us (+{per['core_minus_mlx_lm_outside_sync_cpu_us']['median']:.0f}"
              f" us [{per['core_minus_mlx_lm_outside_sync_cpu_us']['q1']:.0f}-"
              f"{per['core_minus_mlx_lm_outside_sync_cpu_us']['q3']:.0f}], x{per['core_vs_mlx_lm_outside_sync_cpu']['median']:.3f}); "
              f"all CPU {m['cpu_us']['median']:.0f} / {c['cpu_us']['median']:.0f} us; syncs "
              f"{m['syncs_per_step']['median']:g} / {c['syncs_per_step']['median']:g}; pipelined "
              f"{m['pipelined_share']['median']:.2f} / {c['pipelined_share']['median']:.2f}; wall in reads after the "
              f"tokens' {m['read_wait_us']['median']:.0f} / {c['read_wait_us']['median']:.0f} us; Python calls "
              f"{m['py_calls']['median']:.0f} / {c['py_calls']['median']:.0f}, bytecodes "
              f"{m['py_opcodes']['median']:.0f} / {c['py_opcodes']['median']:.0f}; "
              f"events {next(iter(m['event_patterns']))!r} / {next(iter(c['event_patterns']))!r}", flush=True)
    print(f"load {out['load_before'][0]:.2f} -> {out['load_after'][0]:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step-host-{args.label + '-' if args.label else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
