"""MLXD_FIRST_TOKEN_EARLY (engine/core.py `_first_tokens_now`): rows that joined no decoding row (one alone, or
several starting together) get their first token with the step that sampled it, one step before mlx-lm hands it
out, and everything they emit is what they emit without; MLXD_JOIN_FIRST_EARLY: rows joining decoding rows too, at
most once every `JOIN_EARLY_GAP` steps.
"""

from __future__ import annotations

import pytest
from tests.serving import config_for

from mlxd.engine.core import EngineCore
from mlxd.engine.ops import RowStart, StepOps
from mlxd.runtime.kernel.messages import (
    GenerationFinished,
    GenerationRequest,
    SamplingParams,
    TokenGenerated,
)
from mlxd.structured.spec import constraint_from_request

PROMPT = tuple(20 + (i * 7) % 900 for i in range(120))
OTHER = tuple(40 + (i * 3) % 500 for i in range(90))


def _core(model_dir, monkeypatch, early: bool, *, join: bool = False, **config) -> EngineCore:
    monkeypatch.setenv("MLXD_FIRST_TOKEN_EARLY", "1" if early else "0")
    monkeypatch.setenv("MLXD_JOIN_FIRST_EARLY", "1" if join else "0")
    core = EngineCore(config_for(model_dir, prefill_step_size=64, max_context=4096, **config))
    core.load()
    return core


def _run(core: EngineCore, batches: list[tuple[tuple[int, ...], SamplingParams]], together: int = 1) -> dict:
    """The first `together` (prompt, sampling) start in the first step, each later one at the step after the one
    before got its first token; per request: its events (token, logprob, top logprobs, finish reason) and the step
    of its first token."""
    pending = [RowStart(request=GenerationRequest(request_id=f"r{i}", prompt=p, sampling=s))
               for i, (p, s) in enumerate(batches)]
    events: dict[str, list] = {s.request.request_id: [] for s in pending}
    first: dict[str, int] = {}
    ops, step = StepOps(starts=tuple(pending[:together])), 0
    del pending[:together]
    while True:
        result = core.step(ops)
        step += 1
        for e in result.emits:
            if isinstance(e.event, TokenGenerated):
                first.setdefault(e.request_id, step)
                events[e.request_id].append((e.event.token, e.event.logprob, e.event.top_logprobs))
            elif isinstance(e.event, GenerationFinished):
                events[e.request_id].append(e.event.reason)
        joined = pending and any(r in first for r in events if r != pending[0].request.request_id)
        ops = StepOps(starts=(pending.pop(0),)) if joined else StepOps()
        if not result.stats.batch_rows and not pending:
            return {"events": events, "first": first}
        assert step < 500


def _both(model_dir, monkeypatch, batches, *, join: bool = False, together: int = 1, **config) -> tuple[dict, dict]:
    """(early, late): the run with the first token early (and with MLXD_JOIN_FIRST_EARLY as `join` says), then
    with mlx-lm's timing."""
    out = []
    for early in (True, False):
        core = _core(model_dir, monkeypatch, early, join=join and early, **config)
        try:
            out.append(_run(core, batches, together))
        finally:
            core.close()
    return out[0], out[1]


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=5),
    SamplingParams(max_tokens=5, logprobs=True, top_logprobs=3),
    SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, repetition_penalty=1.3),
])
def test_a_lone_rows_first_token_comes_a_step_sooner_and_the_same(tiny_model_dir, monkeypatch, sampling):
    early, late = _both(tiny_model_dir, monkeypatch, [(PROMPT, sampling)])
    assert early["events"] == late["events"]
    assert len(early["events"]["r0"]) == sampling.max_tokens + 1  # its tokens, then its finish
    assert early["first"]["r0"] == late["first"]["r0"] - 1


def test_a_first_token_that_ends_the_reply_goes_with_its_finish(tiny_model_dir, monkeypatch):
    """A one-token reply, and a first token that is a stop token: handed out with the step that finishes the
    row (never early), so a token and its row's end arrive together."""
    greedy, _ = _both(tiny_model_dir, monkeypatch, [(PROMPT, SamplingParams(max_tokens=3))])
    stop = greedy["events"]["r0"][0][0]
    for sampling in (SamplingParams(max_tokens=1), SamplingParams(max_tokens=4, stop_token_ids=(stop,))):
        early, late = _both(tiny_model_dir, monkeypatch, [(PROMPT, sampling)])
        assert early == late
        assert len(early["events"]["r0"]) == 2  # one token and the finish
    assert greedy["first"]["r0"] < late["first"]["r0"]  # (the first token of a longer reply came sooner)


def test_a_row_joining_a_decoding_row_gets_its_first_token_as_mlx_lm_hands_it_out(tiny_model_dir, monkeypatch):
    """Only a row alone is handed its first token early: beside a decoding row, reading it would wait for the
    other row's next forward, queued before it. Both decode what they decode without."""
    rows = [(PROMPT, SamplingParams(max_tokens=12)), (OTHER, SamplingParams(max_tokens=4))]
    early, late = _both(tiny_model_dir, monkeypatch, rows)
    assert early["events"] == late["events"]
    assert early["first"]["r0"] == late["first"]["r0"] - 1  # alone when its prompt ended
    # the second joined a step after the first one's first token, which came a step sooner: the same gap after
    assert early["first"]["r1"] - early["first"]["r0"] == late["first"]["r1"] - late["first"]["r0"]


def test_rows_starting_together_get_their_first_tokens_a_step_sooner_and_the_same(tiny_model_dir, monkeypatch):
    """Rows that start in one step, none decoding yet (eight clients at once): each first token with the step that
    sampled it, in one read; one whose first token ends its reply (max_tokens 1) gets it with its finish."""
    prompts = [tuple(20 + (i * k) % 900 for i in range(40)) for k in (7, 11, 13)]  # (one length: ending in one step)
    rows = [(prompts[0], SamplingParams(max_tokens=5)),
            (prompts[1], SamplingParams(max_tokens=6, logprobs=True, top_logprobs=2)),
            (prompts[2], SamplingParams(max_tokens=1))]
    early, late = _both(tiny_model_dir, monkeypatch, rows, together=3)
    assert early["events"] == late["events"]
    assert early["first"]["r0"] == early["first"]["r1"] == late["first"]["r0"] - 1 == late["first"]["r1"] - 1
    assert early["first"]["r2"] == late["first"]["r2"]  # (its one token ends it)


def test_a_row_joining_decoding_rows_gets_its_first_token_sooner_with_join_first_early(tiny_model_dir, monkeypatch):
    """MLXD_JOIN_FIRST_EARLY: beside a decoding row the joining row's first token comes with the step that sampled
    it too; every row emits what it emits without."""
    rows = [(PROMPT, SamplingParams(max_tokens=12)), (OTHER, SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3))]
    early, late = _both(tiny_model_dir, monkeypatch, rows, join=True)
    assert early["events"] == late["events"]
    assert early["first"]["r0"] == late["first"]["r0"] - 1
    assert early["first"]["r1"] - early["first"]["r0"] == late["first"]["r1"] - late["first"]["r0"] - 1


def test_join_first_early_reads_beside_decoding_rows_once_in_its_gap(tiny_model_dir, monkeypatch):
    """Two rows joining a decoding row in consecutive steps: the first is read early, the second (inside
    `JOIN_EARLY_GAP` steps of it) gets mlx-lm's timing; the same tokens either way."""
    core = _core(tiny_model_dir, monkeypatch, True, join=True)
    try:
        starts = [RowStart(request=GenerationRequest(request_id=f"j{i}", prompt=p, sampling=SamplingParams(max_tokens=n)))
                  for i, (p, n) in enumerate([(PROMPT, 20), (OTHER[:40], 5), (OTHER[:50], 5)])]
        first, step, ops = {}, 0, [StepOps(starts=(starts[0],))]
        while True:
            result = core.step(ops.pop(0) if ops else StepOps())
            step += 1
            for e in result.emits:
                if isinstance(e.event, TokenGenerated):
                    first.setdefault(e.request_id, step)
            if step == 3:  # j0 decodes by now; j1 and j2 join a step apart
                ops = [StepOps(starts=(starts[1],)), StepOps(starts=(starts[2],))]
            if not result.stats.batch_rows and step > 4:
                break
            assert step < 200
        assert first["j1"] - 4 == 1 and first["j2"] - 5 == 2  # early (1 step after joining) vs mlx-lm's (2 steps)
    finally:
        core.close()


def test_a_constrained_row_gets_its_first_token_as_mlx_lm_hands_it_out(tiny_model_dir, monkeypatch):
    """A grammar's masks follow the tokens mlx-lm hands out: its row keeps mlx-lm's timing, and its reply."""
    grammar = constraint_from_request({"regex": "[a-z]{4,8}"})
    early, late = _both(tiny_model_dir, monkeypatch, [(PROMPT, SamplingParams(max_tokens=6, constraint=grammar))])
    assert early == late


def test_off_by_the_environment_and_with_speculation(tiny_model_dir, monkeypatch):
    core = _core(tiny_model_dir, monkeypatch, False, join=True)
    try:
        assert not core._early_first and not core._join_early  # (join only with the first token early)
    finally:
        core.close()
    monkeypatch.delenv("MLXD_JOIN_FIRST_EARLY")
    core = EngineCore(config_for(tiny_model_dir, prefill_step_size=64, max_context=4096))
    try:
        assert not core._join_early  # off by default
    finally:
        core.close()
    core = _core(tiny_model_dir, monkeypatch, True, speculative="ngram")
    try:
        assert not core._early_first  # speculation's batch is another
    finally:
        core.close()
