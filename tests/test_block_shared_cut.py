"""Blocks end where conversations stop sharing: the tail of a shared prompt is stored once.

A system prompt that does not end on the block grid leaves its last partial
cell in every conversation's first block past the grid line; the block store
now cuts a new block where it stops matching a stored one
(`blocks.SharedStarts`), so the shared part is one block. Real files, and a
real process SIGKILLed in the middle of a checkpoint that makes such a cut.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

import block_writer as bw
from mlxd.kv import blocks as bk
from mlxd.kv.ssd_store import SsdStore, Stored

FP = "f" * 32
HELPER = Path(__file__).with_name("block_writer.py")
SYSTEM = bw.SYSTEM  # 300 tokens: 4 full 64-token cells, then 44 shared tokens in a partial cell


def spans(tokens, starts: bk.SharedStarts, stored: set[str], block_tokens: int = 16) -> list[bk.Span]:
    out = bk.choose_spans(tokens, namespace="", fingerprint=FP, exists=stored.__contains__,
                          block_tokens=block_tokens, starts=starts)
    stored.update(s.name for s in out)
    starts.add(tokens, [bk.BlockRef(s.name, s.start, s.end, s.end - s.start) for s in out])
    return out


def test_a_new_block_ends_where_it_stops_sharing_a_stored_one():
    starts, stored = bk.SharedStarts(), set()
    system = list(range(40))  # 2 full cells of 16, then 8 shared tokens: fewer than MIN_SHARED_CUT
    a = spans([*system, 100, 101], starts, stored)
    assert [(s.start, s.end) for s in a] == [(0, 16), (16, 32), (32, 42)]
    b = spans([*system, 200, 201], starts, stored)
    assert [(s.start, s.end, s.exists) for s in b] == [(0, 16, True), (16, 32, True), (32, 42, False)]

    starts, stored = bk.SharedStarts(), set()
    system = list(range(60))  # 3 full cells, then 12 shared tokens in a 32-token grid: 28 shared in cell 1
    a = spans([*system, 100, 101], starts, stored, block_tokens=32)
    assert [(s.start, s.end) for s in a] == [(0, 32), (32, 62)]
    b = spans([*system, 200, 201], starts, stored, block_tokens=32)
    # b shares 28 of a's 30 tokens after the first block: it stores those once, then its own.
    assert [(s.start, s.end, s.exists) for s in b] == [(0, 32, True), (32, 60, False), (60, 62, False)]
    c = spans([*system, 300], starts, stored, block_tokens=32)
    assert [(s.start, s.end, s.exists) for s in c] == [(0, 32, True), (32, 60, True), (60, 61, False)]
    # A conversation that grows still reuses its own tail, and the hint forgets collected blocks.
    a2 = spans([*system, 100, 101, 102], starts, stored, block_tokens=32)
    assert [(s.start, s.end, s.exists) for s in a2] == [(0, 32, True), (32, 62, True), (62, 63, False)]
    starts.discard([s.name for s in b] + [s.name for s in c])
    d = spans([*system, 400, 401], starts, stored - {b[1].name}, block_tokens=32)
    assert [(s.start, s.end) for s in d] == [(0, 32), (32, 60), (60, 62)]  # cut against a's block still


def _conversation(i: int) -> list[int]:
    return SYSTEM + [5000 + 100 * i + k for k in range(20)]


def test_shared_prompt_tail_is_stored_once_on_disk(tmp_path):
    store = SsdStore(tmp_path, bw.IDENTITY, layout="blocks", block_tokens=bw.BLOCK_TOKENS)
    store.scan()
    results = [store.write(bw.plan(_conversation(i))) for i in range(6)]
    assert all(isinstance(r, Stored) for r in results)
    per_token = bw.LAYERS * 2 * bw.HEADS * bw.DIM * 4
    kv = sum(b.nbytes for b in {b.name: b for r in results for b in r.record.blocks}.values())
    dedup = (len(SYSTEM) + 6 * 20) * per_token
    # Every token once, but for the first conversation's block past the grid: it was written before
    # anyone shared it, so it holds the prompt's last 44 tokens a second time.
    assert kv == dedup + (len(SYSTEM) - 256) * per_token
    # The second and later conversations reuse the cut block: only their own 20 tokens are new.
    assert [r.reused_blocks for r in results[2:]] == [5] * 4
    # A restart finds the cut from the manifests on disk, and every checkpoint loads exact.
    again = SsdStore(tmp_path, bw.IDENTITY, layout="blocks", block_tokens=bw.BLOCK_TOKENS)
    scan = again.scan()
    assert scan.report.indexed == 6 and scan.report.corrupt == 0
    for r in scan.records:
        loaded = again.load(r, verify=True)
        assert loaded is not None
        for got, want in zip(loaded.buffers, bw.expected(r.tokens), strict=True):
            assert np.array_equal(got, want)
    new = again.write(bw.plan(_conversation(9)))
    assert isinstance(new, Stored) and new.reused_blocks == 5


KILL_AFTER_CUT = """
import os, signal, sys
from pathlib import Path
import block_writer as bw
from mlxd.kv import block_store as bs
from mlxd.kv.ssd_store import SsdStore, Stored

store = SsdStore(Path(sys.argv[1]), bw.IDENTITY, layout="blocks", block_tokens=bw.BLOCK_TOKENS)
store.blocks.writers = 1  # one block at a time, in chain order: the kill lands after the cut block
store.scan()
first = store.write(bw.plan(bw.SYSTEM + list(range(5000, 5020))))
assert isinstance(first, Stored)
print(first.record.path, flush=True)
real = bs.BlockStore._write_block
written = []

def write_block(self, name, plan, pacer, prepare=None):
    written.append(len(plan.meta.tokens))
    if len(written) == 2:  # the shared cut block is committed; die inside the next block
        fd = os.open(self.block_path(name).with_name(name + bs.BLOCK_EXT + ".tmp"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"partial")
        print(written, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, name, plan, pacer, prepare)

bs.BlockStore._write_block = write_block
store.write(bw.plan(bw.SYSTEM + list(range(6000, 6020))))
"""


def test_sigkill_after_the_shared_cut_block_leaves_a_consistent_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPER.parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_CUT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    first_path, written = proc.stdout.splitlines()
    assert written == "[44, 20]"  # the cut block [256, 300) was committed, the kill came inside [300, 320)
    store = SsdStore(tmp_path, bw.IDENTITY, layout="blocks", block_tokens=bw.BLOCK_TOKENS)
    scan = store.scan()
    # The first checkpoint survives whole; the cut block no manifest names is collected, the tmp reaped.
    assert [str(r.path) for r in scan.records] == [first_path]
    assert scan.report.orphans == 1 and scan.report.corrupt == 0
    names = {p.stem for p in store.blocks.blocks_dir.iterdir()}
    assert names == {b.name for b in scan.records[0].blocks}
    assert store.load(scan.records[0], verify=True) is not None
    # Written again after the restart, the second conversation cuts at the same place and the
    # third reuses that block: the hint came back from the manifest on disk.
    second = store.write(bw.plan(bw.SYSTEM + list(range(6000, 6020))))
    third = store.write(bw.plan(bw.SYSTEM + list(range(7000, 7020))))
    assert isinstance(second, Stored) and isinstance(third, Stored)
    assert [(b.start, b.end) for b in second.record.blocks][-2:] == [(256, 300), (300, 320)]
    assert third.reused_blocks == 5
    for r in (second.record, third.record):
        loaded = store.load(r, verify=True)
        assert loaded is not None
        for got, want in zip(loaded.buffers, bw.expected(r.tokens), strict=True):
            assert np.array_equal(got, want)
