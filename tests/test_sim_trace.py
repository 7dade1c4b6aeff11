"""Trace formats, token synthesis, and the recorder."""

import json

import numpy as np
import pytest

from mlxd.sim.trace import (
    TraceRecorder,
    block_tokens,
    check_block_structure,
    half_block_tokens,
    load_trace,
)


def test_mooncake_and_mlxd_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [3, 4]},
        {"t": 1.5, "namespace": "ad", "session": "s1", "text": "hé", "output_tokens": 2},
        {"t": 1.0, "tokens": [1, 2, 3], "output_tokens": 1, "cached_tokens": 0},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = load_trace(path)
    assert [r.t for r in reqs] == [0.0, 0.5, 1.0]  # sorted, rebased
    assert reqs[0].tokens == (1, 2, 3) and reqs[0].cached_tokens == 0
    assert reqs[1].tokens == tuple("hé".encode()) and reqs[1].namespace == "ad"
    assert reqs[2].hash_ids == (3, 4) and reqs[2].input_length == 600


def test_block_tokens_expand_ids_and_cut_the_last_block():
    toks = block_tokens([3, 4], 600)
    assert len(toks) == 600 and toks[0] == 3 * 512 and toks[512] == 4 * 512
    assert np.array_equal(block_tokens([3, 7], 600)[:512], toks[:512])
    assert list(half_block_tokens([3, 4])) == [6, 7, 8, 9]


def test_check_block_structure_rejects_mixed_fill(tmp_path):
    from mlxd.sim.trace import TraceRequest

    ok = [TraceRequest(index=0, t=0, input_length=600, output_tokens=1, hash_ids=(1, 2))]
    check_block_structure(ok)
    bad = ok + [TraceRequest(index=1, t=0, input_length=1024, output_tokens=1, hash_ids=(1, 2))]
    with pytest.raises(ValueError):
        check_block_structure(bad)


def test_recorder_appends_and_flushes_each_line(tmp_path):
    rec = TraceRecorder(tmp_path / "live.jsonl")
    rec.record(t=0.25, tokens=[5, 6], output_tokens=3, session="s", cached_tokens=1)
    assert len((tmp_path / "live.jsonl").read_text().splitlines()) == 1  # visible before close
    rec.record(t=0.5, tokens=[5, 6, 7], output_tokens=1, output_ids=[9])
    rec.close()
    reqs = load_trace(tmp_path / "live.jsonl")
    assert [r.tokens for r in reqs] == [(5, 6), (5, 6, 7)]
    assert reqs[0].session == "s" and reqs[1].output_ids == (9,)


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read {path}: No such file or directory"),
    ('{"timestamp": 0, "hash_ids": [1]\n', "{path}: trace line 1: not JSON (Expecting ',' delimiter"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n[1, 2]\n',
     "{path}: trace line 2: not a JSON object"),
    ("{}\n", "{path}: trace line 1: needs hash_ids, tokens or text"),
])
def test_a_trace_that_cannot_be_read_ends_with_one_line_that_says_why(tmp_path, content, says):
    """`mlxd simulate` on a wrong path or a broken line says so (exit 1), not with a traceback."""
    from mlxd.sim.cli import main

    path = tmp_path / "trace.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stopped:
        main([str(path)])
    assert str(stopped.value.code).startswith("mlxd simulate: " + says.format(path=path)), stopped.value.code
