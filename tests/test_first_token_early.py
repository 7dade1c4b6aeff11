"""MLXD_FIRST_TOKEN_EARLY (engine/core.py `_first_token_now`): a row alone in the batch gets its first token with
the step that sampled it, one step before mlx-lm hands it out, and everything it emits is what it emits without.
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


def _core(model_dir, monkeypatch, early: bool, **config) -> EngineCore:
    monkeypatch.setenv("MLXD_FIRST_TOKEN_EARLY", "1" if early else "0")
    core = EngineCore(config_for(model_dir, prefill_step_size=64, max_context=4096, **config))
    core.load()
    return core


def _run(core: EngineCore, batches: list[tuple[tuple[int, ...], SamplingParams]]) -> dict:
    """Each (prompt, sampling) joins at the step after the one before got its first token; per request: its
    events (token, logprob, top logprobs, finish reason) and the step of its first token."""
    pending = [RowStart(request=GenerationRequest(request_id=f"r{i}", prompt=p, sampling=s))
               for i, (p, s) in enumerate(batches)]
    events: dict[str, list] = {s.request.request_id: [] for s in pending}
    first: dict[str, int] = {}
    ops, step = StepOps(starts=(pending.pop(0),)), 0
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


def _both(model_dir, monkeypatch, batches, **config) -> tuple[dict, dict]:
    out = []
    for early in (True, False):
        core = _core(model_dir, monkeypatch, early, **config)
        try:
            out.append(_run(core, batches))
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


def test_a_constrained_row_gets_its_first_token_as_mlx_lm_hands_it_out(tiny_model_dir, monkeypatch):
    """A grammar's masks follow the tokens mlx-lm hands out: its row keeps mlx-lm's timing, and its reply."""
    grammar = constraint_from_request({"regex": "[a-z]{4,8}"})
    early, late = _both(tiny_model_dir, monkeypatch, [(PROMPT, SamplingParams(max_tokens=6, constraint=grammar))])
    assert early == late


def test_off_by_the_environment_and_with_speculation(tiny_model_dir, monkeypatch):
    core = _core(tiny_model_dir, monkeypatch, False)
    try:
        assert not core._early_first
    finally:
        core.close()
    core = _core(tiny_model_dir, monkeypatch, True, speculative="ngram")
    try:
        assert not core._early_first  # speculation's batch is another
    finally:
        core.close()
