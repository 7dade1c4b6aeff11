"""Does the ahead mask worker finish before the join, or wait for the GIL? A simulation in pure Python.

An engine thread holds the GIL for `--build` ms (mlx-lm building a step's graph: Python and MLX calls
that never release it), then joins a worker that waited with the GIL released for the step's tokens
(ready `--ready` ms into the build), fed the matchers holding it (`--feed`), filled the masks with it
released (`--fill`, llguidance) and unpacked them holding it (`--unpack`). Python hands the GIL to a
waiting thread only after the switch interval (5 ms by default) unless the holder releases it, so with
a build shorter than that the worker's whole job can land at the join. Printed per switch interval:
when the worker got the GIL, the join's wait, and the step (build + join).

    python benchmarks/sim_gil_handoff.py [--build 6] [--ready 0.5] [--feed 0.08] [--fill 0.3] [--unpack 0.05]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def spin(seconds: float) -> None:
    """Hold the GIL for `seconds` (pure Python)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker(t0: float, args: argparse.Namespace) -> float:
    time.sleep(max(0.0, t0 + args.ready / 1000 - time.perf_counter()))  # the tokens' read: the GIL released
    got = time.perf_counter() - t0
    spin(args.feed / 1000)  # try_consume_tokens per row: the GIL held
    time.sleep(args.fill / 1000)  # llguidance's batched fill: the GIL released
    spin(args.unpack / 1000)  # numpy's unpack and the return: the GIL held
    return got


def step(pool: ThreadPoolExecutor, args: argparse.Namespace) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    job = pool.submit(worker, t0, args)
    spin(args.build / 1000)  # the engine thread builds the step's graph
    joined = time.perf_counter()
    got = job.result()
    return got, time.perf_counter() - joined, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("build", 6.0), ("ready", 0.5), ("feed", 0.08), ("fill", 0.3), ("unpack", 0.05)):
        parser.add_argument(f"--{name}", type=float, default=default, help="ms")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--intervals", type=float, nargs="+", default=[5.0, 1.0, 0.5], help="switch intervals, ms")
    args = parser.parse_args()
    default = sys.getswitchinterval()
    with ThreadPoolExecutor(1) as pool:
        for interval in args.intervals:
            sys.setswitchinterval(interval / 1000)
            runs = [step(pool, args) for _ in range(args.steps)]
            got, wait, total = (1000 * statistics.median(r[i] for r in runs) for i in range(3))
            print(f"switch interval {interval:4.1f} ms: the worker got the GIL at {got:.2f} ms, "
                  f"join wait {wait:.3f} ms, step {total:.3f} ms (build {args.build} ms)", flush=True)
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
