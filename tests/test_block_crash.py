"""Block store crash consistency and collection, with real processes (tests/block_writer.py).

A writer process is SIGKILLed at random moments and inside block writes,
manifest writes and collections; after each kill the directory must hold no
manifest that names a missing block, every manifest must load verified with
the exact tensors, and every checkpoint reported durable and not dropped
must still be there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import block_writer as bw
from mlxd.kv import block_store as bs

HELPER = Path(__file__).with_name("block_writer.py")


def spawn(root: Path, seed: int, mode: str, max_writes: int = 10**9) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPER.parent), *sys.path])}
    return subprocess.Popen(
        [sys.executable, str(HELPER), str(root), str(seed), mode, str(max_writes)],
        stdout=subprocess.PIPE, text=True, env=env,
    )


def events(proc: subprocess.Popen[str]) -> list[dict]:
    assert proc.stdout is not None
    return [json.loads(line) for line in proc.stdout.read().splitlines() if line.strip()]


def durable_paths(evs: list[dict]) -> dict[str, str]:
    """Manifests reported durable and not dropped since: path -> token digest."""
    out: dict[str, str] = {}
    for e in evs:
        if "durable" in e:
            out[e["durable"]] = e["digest"]
        elif "dropping" in e:
            out.pop(e["dropping"], None)
    return out


def check_directory(root: Path, promised: dict[str, str]) -> dict[str, int]:
    """What a restart must find; returns counts. Checks run before the scan repairs anything."""
    store = bs.BlockStore(root, bw.IDENTITY, block_tokens=bw.BLOCK_TOKENS)
    manifests = sorted(store.directory.rglob("*" + bs.MANIFEST_EXT))
    # (what a restart's SsdStore.scan runs for the blocks layout)
    for path in manifests:  # committed manifests are whole and name only committed blocks
        m = bs.read_manifest(path)
        for b in m.blocks:
            assert store.block_path(b.name).stat().st_size == b.file_bytes, f"{path} names missing block {b.name}"
    result = store.scan()
    assert result.report.corrupt == 0
    assert not list(root.rglob("*.tmp"))
    by_path = {str(r.path): r for r in result.records}
    for path, digest in promised.items():
        assert path in by_path, f"lost durable checkpoint {path}"
        assert bw.digest(by_path[path].tokens) == digest
    loads = 0
    for r in result.records:
        loaded = store.load(r, verify=True)
        assert loaded is not None, f"corrupt load of {r.path}"
        for got, want in zip(loaded.buffers, bw.expected(r.tokens), strict=True):
            assert np.array_equal(got, want)
        loads += 1
    # Nothing is left that no manifest names.
    names = {b.name for r in result.records for b in r.blocks}
    assert {p.stem for p in store.blocks_dir.glob("*" + bs.BLOCK_EXT)} == names
    return {"manifests": len(manifests), "loads": loads, "orphans": result.report.orphans}


def test_sigkill_during_block_manifest_and_gc_writes(tmp_path):
    rng = random.Random(3)
    promised: dict[str, str] = {}
    totals = {"loads": 0, "orphans": 0, "rounds": 0}
    modes = ["block", "manifest", "gc", "random"]
    for i, mode in enumerate(modes):
        proc = spawn(tmp_path, seed=i, mode=mode)
        first: list[dict] = []
        if mode == "random":
            assert proc.stdout is not None
            first.append(json.loads(proc.stdout.readline()))  # past start-up: writing now
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=120)
        evs = first + events(proc)
        assert rc == -signal.SIGKILL, (mode, rc, evs[-3:])
        assert not any(e.get("failed") for e in evs), [e for e in evs if e.get("failed")]
        # Earlier rounds' promises stand unless this round dropped them.
        for e in evs:
            if "dropping" in e:
                promised.pop(e["dropping"], None)
        promised.update(durable_paths(evs))
        counts = check_directory(tmp_path, promised)
        totals["loads"] += counts["loads"]
        totals["orphans"] += counts["orphans"]
        totals["rounds"] += 1
    assert promised, "no checkpoint became durable"
    assert totals["orphans"] >= 2  # kills did land inside block and manifest writes


def test_collection_under_concurrent_writers(tmp_path):
    """Two writer processes share one directory (and their system prompt's blocks) while this one collects."""
    writers = [spawn(tmp_path, seed=100 + i, mode="none", max_writes=15) for i in range(2)]
    store = bs.BlockStore(tmp_path, bw.IDENTITY, block_tokens=bw.BLOCK_TOKENS)
    stop = threading.Event()
    reports: list[bs.GcReport] = []

    def collect() -> None:
        while not stop.is_set():
            reports.append(store.collect())
            time.sleep(0.01)

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        outputs = []
        for w in writers:
            assert w.wait(timeout=240) == 0
            outputs.append(events(w))
    finally:
        stop.set()
        collector.join()
    promised: dict[str, str] = {}
    for evs in outputs:
        assert evs[-1] == {"done": True}
        assert not any(e.get("failed") for e in evs), [e for e in evs if e.get("failed")]
        promised.update(durable_paths(evs))
    assert len(reports) > 10 and sum(r.removed for r in reports) > 0  # it did collect, concurrently
    counts = check_directory(tmp_path, promised)
    assert counts["loads"] == len(promised)
