# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""`mlxd serve` with a sampling profiler over every thread (issue 28: decode's host time).

py-spy is not installed here, and cProfile sees one thread: this samples
`sys._current_frames()` every `MLXD_SAMPLE_MS` (default 1) ms and, when the
server stops (SIGTERM / SIGINT), writes per thread the functions that were on the
stack (inclusive) and on top (self), as shares of that thread's samples, to
`MLXD_SAMPLE_OUT` (JSON). With `MLXD_CPROFILE=PATH` the main thread (trio: the actors'
shells and the HTTP side) also runs under cProfile, dumped to PATH (pstats). Always reported (in
the JSON's "engine_jobs" and on stderr): the engine thread's jobs (`MlxThread.run`): the median job,
the median gap from one job's end to the next one's start, and from a job's hand-off to its start
(the thread's wake-up); and in "engine_steps" the engine's steps themselves (`EngineCore.step`,
one job each before the engine thread stepped on by itself, many per job since) and the gap
between them (under 20 ms: a decode's). The sampler itself holds the GIL for a few µs per
sample: compare runs under it with each other, not with an unsampled server.

Variants for a sweep: MLXD_STEPS_AHEAD=N (the engine thread's run-ahead, actors/engine.py) and
MLXD_SWITCH_MS=X (the GIL's switch interval, 5 ms by default).

    MLXD_SAMPLE_OUT=/tmp/prof.json python benchmarks/prof_serve_threads.py serve --model DIR ...
"""

from __future__ import annotations

import mlxd  # noqa: F401

import collections
import json
import os
import sys
import threading
import time
from typing import Any

from mlxd import cli
from mlxd.runtime.kernel import mlx_thread

JOBS: list[tuple[float, float, float]] = []  # (handed over, started, ended), perf_counter
STEPS: list[tuple[float, float, int]] = []  # EngineCore.step (started, ended, rows after it)


def _time_jobs() -> None:
    run = mlx_thread.MlxThread.run

    async def timed_run(self: Any, fn: Any, *args: Any, on_cancel: Any = None) -> Any:
        handed = time.perf_counter()

        def job(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                JOBS.append((handed, start, time.perf_counter()))

        return await run(self, job, *args, on_cancel=on_cancel)

    mlx_thread.MlxThread.run = timed_run  # type: ignore[method-assign]


def _time_steps() -> None:
    from mlxd.engine.core import EngineCore

    step = EngineCore.step

    def timed_step(self: Any, ops: Any) -> Any:
        start = time.perf_counter()
        rows = 0
        try:
            result = step(self, ops)
            rows = result.stats.batch_rows
            return result
        finally:
            STEPS.append((start, time.perf_counter(), rows))

    EngineCore.step = timed_step  # type: ignore[method-assign]


def _steps_report() -> dict[str, Any]:
    """The engine's steps and the gaps between them (under 20 ms: a decode's), whatever runs them,
    per batch size (consecutive steps with the same rows after them: 1 and 8 streams apart)."""
    import statistics

    by_rows: dict[str, Any] = {}
    for rows in sorted({r for _, _, r in STEPS if r}):
        pairs = [(a, b) for a, b in zip(STEPS, STEPS[1:], strict=False) if a[2] == b[2] == rows]
        gaps = [b[0] - a[1] for a, b in pairs if b[0] - a[1] < 0.02]
        if len(gaps) < 8:
            continue
        by_rows[str(rows)] = {
            "gaps": len(gaps), "step_median_us": statistics.median(b[1] - b[0] for _, b in pairs) * 1e6,
            "gap_median_us": statistics.median(gaps) * 1e6, "gap_mean_us": statistics.mean(gaps) * 1e6,
            "gap_p90_us": statistics.quantiles(gaps, n=10)[-1] * 1e6}
    return {"steps": len(STEPS), "by_rows": by_rows}


def _jobs_report() -> dict[str, Any]:
    import statistics

    gaps = [b[1] - a[2] for a, b in zip(JOBS, JOBS[1:], strict=False) if b[1] - a[2] < 0.02]
    if not gaps:
        return {"jobs": len(JOBS)}
    return {"jobs": len(JOBS), "steps_gaps": len(gaps),
            "job_median_us": statistics.median(e - s for _, s, e in JOBS) * 1e6,
            "gap_median_us": statistics.median(gaps) * 1e6, "gap_mean_us": statistics.mean(gaps) * 1e6,
            "wake_median_us": statistics.median(s - h for h, s, _ in JOBS) * 1e6}


def _where(code: Any) -> str:
    return f"{code.co_filename.rsplit('/site-packages/', 1)[-1].rsplit('/src/', 1)[-1]}:{code.co_name}"


def main() -> int:
    out = os.environ.get("MLXD_SAMPLE_OUT", "/tmp/mlxd-threads.json")
    every = float(os.environ.get("MLXD_SAMPLE_MS", "1")) / 1e3
    total: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    top: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    stop = threading.Event()
    me = threading.get_ident()

    def sample() -> None:
        while not stop.wait(every):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                total[name] += 1
                top[name][_where(frame.f_code)] += 1
                seen = set()
                f = frame
                while f is not None:
                    w = _where(f.f_code)
                    if w not in seen:
                        seen.add(w)
                        inclusive[name][w] += 1
                    f = f.f_back

    _time_jobs()
    _time_steps()
    if os.environ.get("MLXD_STEPS_AHEAD"):  # a variant: steps the engine thread runs ahead of delivery
        from mlxd.actors import engine

        engine.STEPS_AHEAD = int(os.environ["MLXD_STEPS_AHEAD"])
    if os.environ.get("MLXD_SWITCH_MS"):  # a variant: the GIL's switch interval (default 5 ms)
        sys.setswitchinterval(float(os.environ["MLXD_SWITCH_MS"]) / 1e3)
    t = threading.Thread(target=sample, daemon=True)
    me = 0
    t.start()
    me = t.ident or 0
    prof = None
    if os.environ.get("MLXD_CPROFILE"):  # the main thread (trio: actors' shells, HTTP) under cProfile too
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        return cli.main(sys.argv[1:], exit_at_once=False)  # the report below runs after it
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["MLXD_CPROFILE"])
        stop.set()
        t.join()
        report = {name: {"samples": n,
                         "self": {k: round(v / n, 4) for k, v in top[name].most_common(40)},
                         "inclusive": {k: round(v / n, 4) for k, v in inclusive[name].most_common(60)}}
                  for name, n in total.most_common()}
        jobs, steps = _jobs_report(), _steps_report()
        print("engine jobs:", json.dumps(jobs), file=sys.stderr, flush=True)
        print("engine steps:", json.dumps(steps), file=sys.stderr, flush=True)
        with open(out, "w") as f:
            json.dump({"every_s": every, "at": time.time(), "engine_jobs": jobs, "engine_steps": steps,
                       # each step (perf_counter start, end, rows): CLOCK_MONOTONIC, so a driver slices by its windows
                       "steps_raw": [(round(a, 6), round(b, 6), r) for a, b, r in STEPS],
                       "threads": report}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
