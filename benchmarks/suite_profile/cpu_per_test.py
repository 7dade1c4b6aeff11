"""A pytest plugin: each test's wall time and CPU, its own and its child processes', one JSON line per test.

    PYTHONPATH=benchmarks/suite_profile python -m pytest -q -n 2 -p cpu_per_test
    python benchmarks/suite_profile/cpu_per_test.py [--top 40]    # the summary, by file and by test

A worker's CPU is `RUSAGE_SELF`; the CPU of the processes a test started and waited for (the `mlxd serve`
children, the benchmark drivers) is `RUSAGE_CHILDREN` plus that of the servers the worker's zygote forked
for it (tests/serve_zygote.py, through `procs.forked_cpu_s`), both as deltas around the test. Lines go to
`$SUITE_PROFILE_DIR` (default /tmp/suite-profile), one file per worker. `sitecustomize.py` beside this file
logs every Python process the run starts to `processes.txt` there (it is on `PYTHONPATH`, so the servers the
tests start load it too).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("SUITE_PROFILE_DIR", "/tmp/suite-profile"))


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    forked = getattr(sys.modules.get("procs"), "forked_cpu_s", 0.0) if who == resource.RUSAGE_CHILDREN else 0.0
    return usage.ru_utime + usage.ru_stime + forked


try:
    import pytest
except ImportError:  # the summary runs without pytest
    pytest = None

if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own, children, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
        yield
        line = {"id": item.nodeid, "wall": time.monotonic() - t0, "self": _cpu(resource.RUSAGE_SELF) - own,
                "children": _cpu(resource.RUSAGE_CHILDREN) - children}
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / f"cpu-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def summary(top: int) -> str:
    rows = [json.loads(line) for path in sorted(OUT.glob("cpu-*.jsonl")) for line in path.read_text().splitlines()]
    total = {k: sum(r[k] for r in rows) for k in ("wall", "self", "children")}
    lines = [f"{len(rows)} tests: wall {total['wall']:.0f} s, CPU {total['self']:.0f} s in the workers and "
             f"{total['children']:.0f} s in their child processes"]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for r in rows:
        f = files[r["id"].split("::")[0]]
        f[0] += r["self"] + r["children"]
        f[1] += r["children"]
        f[2] += r["wall"]
        f[3] += 1
    lines.append("\nby file: CPU s (of it children's), wall s, tests")
    for name, (cpu, child, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:7.1f} ({child:6.1f}) {wall:7.1f} {n:4d}  {name}")
    lines.append("\nby test: CPU s (of it children's), wall s")
    for r in sorted(rows, key=lambda r: -(r["self"] + r["children"]))[:top]:
        lines.append(f"{r['self'] + r['children']:7.1f} ({r['children']:6.1f}) {r['wall']:7.1f}  {r['id']}")
    processes = OUT / "processes.txt"
    if processes.exists():
        starts = processes.read_text().splitlines()
        serves = sum(" serve " in f" {line} " for line in starts)
        lines.append(f"\n{len(starts)} Python processes started, {serves} of them `mlxd serve`")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="summarize a profiled run")
    parser.add_argument("--top", type=int, default=40)
    print(summary(parser.parse_args(sys.argv[1:]).top))
