# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""`mlxd serve` with a sampling profiler over every thread (issue 28: decode's host time).

py-spy is not installed here, and cProfile sees one thread: this samples
`sys._current_frames()` every `MLXD_SAMPLE_MS` (default 1) ms and, when the
server stops (SIGTERM / SIGINT), writes per thread the functions that were on the
stack (inclusive) and on top (self), as shares of that thread's samples, to
`MLXD_SAMPLE_OUT` (JSON). With `MLXD_CPROFILE=PATH` the main thread (trio: the actors'
shells and the HTTP side) also runs under cProfile, dumped to PATH (pstats). The sampler itself holds the GIL for a few µs per
sample: compare runs under it with each other, not with an unsampled server.

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
        return cli.main(sys.argv[1:])
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
        with open(out, "w") as f:
            json.dump({"every_s": every, "at": time.time(), "threads": report}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
