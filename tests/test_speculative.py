"""Speculative decoding (--speculative ngram): the pure proposer, and output identical to plain decoding.

Every identity test runs the same requests with speculation off and on, on the
real tiny model, and compares tokens and logprobs: in one EngineCore (batch of
one, mixed batches with constrained, penalized and plain rows, stop tokens
inside accepted drafts), in a runtime (a RAM hit afterwards, a generation
checkpoint resumed) and over HTTP (stop strings, logprobs, /stats, /metrics).
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import httpx
import pytest

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.kv.ngram import Backoff, DraftCounters, PromptLookup, SpeculationGate
from mlxd.model import build_model
from mlxd.runtime.kernel.messages import GenerationRequest
from mlxd.structured.spec import constraint_from_request

from models import falcon_h1_dir
from serving import ServerThread, checkpoints_settled, config_for, drop_after

NO_EOS = ((0, -100.0), (2, -100.0))  # the tiny model's end tokens never win: rows run to max_tokens

# --- the pure proposer --------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_longest_suffix_match():
    lookup = PromptLookup(max_n=3, min_n=2)
    lookup.observe([1, 2, 3, 4, 5, 9, 2, 3])
    assert lookup.propose(2) == [4, 5], "the 2-gram (2, 3) was followed by 4, 5"
    lookup.observe([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert lookup.propose(3) == [4, 5, 9], "the longest suffix that occurred before wins: (1, 2, 3)"
    pairs = PromptLookup(max_n=2, min_n=2)
    pairs.observe([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert pairs.propose(3) == [7, 8, 1], "of (2, 3)'s occurrences, the latest one"
    assert lookup.propose(0) == []
    fresh = PromptLookup()
    fresh.observe([5, 6, 7, 8])
    assert fresh.propose(4) == [], "nothing repeats: no drafts"


def test_a_loop_is_read_on_past_the_end():
    lookup = PromptLookup(max_n=2, min_n=2)
    lookup.observe([9, 4, 5, 4, 5])  # (4, 5) last seen 2 back: the loop 4 5 4 5 ... continues
    assert lookup.propose(5) == [4, 5, 4, 5, 4]


def test_a_lookup_knows_without_the_next_token_when_it_cannot_find_anything():
    """`may_propose_after` is False only where every possible next token's lookup finds nothing (so
    the engine need not read the pending token from the device to back off)."""
    rnd = random.Random(5)
    for _ in range(300):
        tokens = [rnd.randrange(1, 12) for _ in range(rnd.randrange(1, 30))]
        lookup = PromptLookup()
        lookup.observe(tokens)
        if lookup.may_propose_after():
            continue
        for nxt in range(1, 12):
            probe = PromptLookup()
            probe.observe([*tokens, nxt])
            assert probe.propose(4) == [], (tokens, nxt)
    lookup = PromptLookup()
    lookup.observe([5, 6, 7])
    assert not lookup.may_propose_after(), "7 never occurred before with a token after it"
    lookup.observe([5, 6, 7, 5])
    assert lookup.may_propose_after(), "5 was followed by 6: (5, 6) may match"


def test_backoff_waits_longer_after_each_rejection_and_resets_on_acceptance():
    b = Backoff(max_wait=4)
    assert b.ready()
    waits = []
    for _ in range(4):
        b.verified(3, 0)
        n = 0
        while not b.ready():
            n += 1
        waits.append(n)
    assert waits == [1, 2, 4, 4]
    b.verified(3, 1)
    assert b.ready(), "an accepted draft resets the wait"
    c = DraftCounters()
    c.add(4, 4)
    c.add(4, 0)
    assert c.acceptance_rate == 0.5 and c.tokens_per_forward == 3.0


def test_the_gate_pauses_drafting_while_verifying_steps_are_slower_than_plain_ones():
    gate = SpeculationGate()
    now = 0.0

    def step(verifying: bool, tokens: int, seconds: float, rows: int = 8) -> None:
        nonlocal now
        gate.started(now)
        gate.ran(rows=rows, verifying=verifying, tokens=tokens, start=now)
        now += seconds

    for _ in range(4):  # nothing to beat yet: verifying steps are not judged
        gate.started(now)
        assert gate.allow(8)
        step(True, 20, 0.020)
    gate.started(now)
    assert not gate.allow(8), "plain steps until one is measured"
    step(False, 8, 0.010)  # a kind's first step is not measured (the forward before it may land in it)
    gate.started(now)
    assert not gate.allow(8)
    step(False, 8, 0.010)  # plain: 800 tokens/s, measured
    gate.started(now)
    assert gate.allow(8) and gate.rates(8) == pytest.approx((800.0, 1000.0))
    for _ in range(5):  # the first is not measured: 1000 tokens/s, keep going
        step(True, 20, 0.020)
    gate.started(now)
    assert gate.allow(8) and gate.pauses == 0
    step(True, 20, 3.0)  # one step that waited (a prefill, a new shape compiled) is an outlier, not a verdict
    gate.started(now)
    assert gate.allow(8) and gate.rates(8)[1] == pytest.approx(1000.0)
    for slow, pause in ((2, 16), (4, 64), (4, 256)):
        # The median of the last 5 (with the outlier) turns on 2 slow steps; after a pause, 3 new
        # steps are judged.
        for n in range(slow):  # after a pause the first verifying step is not measured
            step(True, 10, 0.100)  # 100 tokens/s: slower than plain (though drafts were accepted)
            gate.started(now)
            assert gate.allow(8) == (n < slow - 1), (slow, n)
        # Not a verdict yet: plain is measured afresh (the first plain step after verifying is not
        # measured), then 3 verifying steps after the first are judged against it.
        probe = 1
        while not gate.allow(8):
            probe += 1
            step(False, 8, 0.010)
            gate.started(now)
        assert probe == 3 and gate.pauses == {16: 0, 64: 1, 256: 2}[pause]
        for n in range(4):
            step(True, 10, 0.100)
            gate.started(now)
            assert gate.allow(8) == (n < 3), (slow, n)
        waited = 1
        while not gate.allow(8):
            waited += 1
            step(False, 8, 0.010)
            gate.started(now)
        assert waited == pause
    step(True, 30, 0.020)  # not measured: it follows plain steps
    for _ in range(3):
        step(True, 30, 0.020)  # faster again: the pauses start over
    gate.started(now)
    assert gate.pauses == 0 and gate.allow(8)
    step(True, 30, 0.020)
    gate.idle(now + 5.0)  # the batch ran empty: the step ends at once, the wait is no step's
    step(True, 30, 0.020)
    gate.started(now)
    assert gate.rates(8)[1] == pytest.approx(1500.0)


def test_rejected_drafts_pause_the_gate_without_waiting_for_timings():
    gate = SpeculationGate()
    now = 0.0
    for tokens in (8, 9):  # batch 8: 1.06 tokens per row on average (one draft accepted in two steps)
        gate.started(now)
        assert gate.allow(8)
        gate.ran(rows=8, verifying=True, tokens=tokens, start=now)
        now += 0.010
    gate.started(now)
    assert gate.allow(8), "1.06 tokens per row: not judged by tokens"
    gate.ran(rows=8, verifying=True, tokens=8, start=now)  # nothing accepted
    gate.started(now + 0.01)
    assert not gate.allow(8) and gate.pauses == 1, "under 1.05 tokens per row: a pause, no plain rate needed"
    assert gate.rates(8) == (0.0, 0.0)
    assert gate.allow(1), "another batch size is judged on its own"


def test_the_gate_judges_each_batch_size_by_its_own_plain_rate_and_keeps_it_current():
    gate = SpeculationGate(probe_every=8)
    now = 0.0

    def step(rows: int, verifying: bool, tokens: int, seconds: float) -> None:
        nonlocal now
        gate.started(now)
        gate.ran(rows=rows, verifying=verifying, tokens=tokens, start=now)
        now += seconds

    # Batch 1: a plain step 10 ms (100 tokens/s), verifying 12 ms for 2.5 tokens: it pays.
    # Batch 8: a plain step 12 ms (667 tokens/s), verifying 40 ms for 20 tokens (500/s): it does not.
    for rows, plain_s, verify_s, verify_tokens in ((1, 0.010, 0.012, 2.5), (8, 0.012, 0.040, 20)):
        for _ in range(2):
            step(rows, False, rows, plain_s)
        for _ in range(6):
            gate.started(now)
            assert gate.allow(rows) or rows == 8
            step(rows, True, verify_tokens, verify_s)  # type: ignore[arg-type]
        gate.started(now)
    assert not gate.allow(8), "batch 8 pauses: verifying is slower there"
    assert gate.allow(1), "batch 1 keeps verifying: measured against its own plain steps"
    # A plain step right after a verifying one returns before its forward is done: not measured.
    step(1, True, 2.5, 0.012)
    step(1, False, 1, 0.0001)
    gate.started(now)
    assert gate.rates(1)[0] == pytest.approx(100.0)
    # Every `probe_every` verifying steps, plain steps run until one is measured.
    for _ in range(2):
        step(1, False, 1, 0.010)
    allowed = []
    for _ in range(12):
        gate.started(now)
        allowed.append(gate.allow(1))
        step(1, allowed[-1], 2.5 if allowed[-1] else 1, 0.012 if allowed[-1] else 0.010)  # type: ignore[arg-type]
    assert allowed == [True] * 8 + [False, False, True, True], allowed


# --- one EngineCore: speculation off and on give the same tokens and logprobs ----------------

rnd = random.Random(1)
BASE = tuple(rnd.randrange(3, 250) for _ in range(40))
JSON_LETTERS = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                  "minItems": 3, "maxItems": 3}}}}


def _run(model_dir: Path, speculative: str, requests: list[GenerationRequest], **config: object):
    core = EngineCore(config_for(model_dir, speculative=speculative, prompt_cache_bytes=0, **config))
    core.load()
    run = run_rows(core, requests)
    core.close()
    logprobs = {i: list(zip(run.logprobs[i], run.top_logprobs[i], strict=True)) for i in run.tokens}
    return run.tokens, logprobs, run.reasons, core.stats()


def _same_logprobs(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for (lp_a, top_a), (lp_b, top_b) in zip(a, b, strict=True):
        if lp_a is None:
            assert lp_b is None
            continue
        assert lp_b == pytest.approx(lp_a, abs=1e-4)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert [v for _, v in top_b] == pytest.approx([v for _, v in top_a], abs=1e-4)


def _request(rid: str, prompt: tuple[int, ...], **sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def test_one_row_greedy_and_seeded_are_identical(tiny_model_dir):
    for sampling in ({"max_tokens": 60}, {"max_tokens": 60, "temperature": 1.5, "seed": 3, "top_logprobs": 2}):
        requests = [_request("r", BASE + BASE[:20], **sampling)]
        off = _run(tiny_model_dir, "off", requests)
        on = _run(tiny_model_dir, "ngram", requests)
        assert on[0] == off[0] and on[2] == off[2]
        _same_logprobs(off[1]["r"], on[1]["r"])
        spec = on[3].speculation
        assert spec is not None and spec.active and spec.accepted > 0, spec
        assert spec.tokens_per_forward > 1.0
        assert off[3].speculation is None, "off: no speculation figures"


def test_a_row_s_draft_length_follows_what_verifying_costs():
    """`DraftLength` (issue 23): the length among 1, 2, 4 ... K with the most tokens per second, from the
    row's acceptance and the verifying step's seconds by width (`StepCosts`, as the gate times them)."""
    from mlxd.kv.ngram import DraftLength, StepCosts, draft_lengths

    assert draft_lengths(16) == [1, 2, 4, 8, 16] and draft_lengths(6) == [1, 2, 4, 6] and draft_lengths(1) == [1]
    assert draft_lengths(0) == []
    costs = StepCosts()
    rejected, accepted = DraftLength(16), DraftLength(16)
    for _ in range(10):
        rejected.verified(4, 0)
        accepted.verified(4, 4)
    assert rejected.acceptance < 0.1 < 0.95 < accepted.acceptance
    assert rejected.choose(lambda w: costs.seconds(1, w)) == 16, "no verifying step timed: the most"
    # The H200 at batch 1 (verify_shapes.py, 21:09): verifying costs about the same at any width.
    for width, ms in ((1, 6.9), (2, 12.2), (3, 12.2), (5, 12.2), (9, 11.8), (17, 11.1)) * 2:
        costs.record(1, width, ms / 1e3)
    for row in (rejected, accepted):
        assert row.choose(lambda w: costs.seconds(1, w)) == 16, "a longer draft costs nothing more"
    # A CPU-like step: 10 ms, and 3 ms more per position verified.
    for width in (1, 2, 3, 5, 9, 17) * 2:
        costs.record(8, width, (10 + 3 * (width - 1)) / 1e3)
    at_8 = lambda w: costs.seconds(8, w)  # noqa: E731
    assert rejected.choose(at_8) == 1 and accepted.choose(at_8) == 16
    half = DraftLength(16)
    for _ in range(10):
        half.verified(4, 2)  # acceptance 0.66: 2 drafts (1 is as fast within 10%: the longer one)
    assert half.choose(at_8) == 2
    # Widths not timed: between two timed ones linearly (a plain step is width 1), past the widest as it;
    # a width counts once timed twice, by the median of its last 5.
    partial = StepCosts()
    partial.record(1, 1, 0.010)
    partial.record(1, 5, 0.020)
    assert partial.seconds(1, 5) is None, "no verifying width timed twice"
    partial.record(1, 5, 0.020)
    assert partial.seconds(1, 3) == pytest.approx(0.015) and partial.seconds(1, 17) == pytest.approx(0.020)
    for ms in (20, 20, 40, 20, 20, 40):
        partial.record(1, 9, ms / 1e3)
    assert partial.seconds(1, 9) == pytest.approx(0.020) and partial.seconds(2, 9) is None
    # A width timed at a bad moment is timed again once the batch size's last 32 verifying steps are others.
    for _ in range(2):
        partial.record(1, 17, 0.200)
    assert partial.seconds(1, 17) == pytest.approx(0.200)
    for _ in range(32):
        partial.record(1, 5, 0.020)
    assert partial.seconds(1, 17) == pytest.approx(0.020), "not timed any more: as the widest timed width"
    # The gate times steps that follow a step of their kind into its StepCosts, with their width.
    gate, now = SpeculationGate(), 0.0
    for verifying, width, seconds in ((False, 1, 0.01), (False, 1, 0.01), (True, 9, 0.02), (True, 9, 0.03),
                                      (True, 9, 0.03)):
        gate.started(now)
        gate.ran(rows=1, verifying=verifying, tokens=3 if verifying else 1, start=now, width=width)
        now += seconds
    gate.started(now)
    assert gate.costs.seconds(1, 1) == pytest.approx(0.01) and gate.costs.seconds(1, 9) == pytest.approx(0.03)


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
@pytest.mark.parametrize("cuda_widths", [False, True], ids=["exact", "cuda-padded"])
def test_rows_whose_draft_length_changes_at_every_try_stay_identical(tiny_model_dir, monkeypatch, speculative,
                                                                     cuda_widths):
    """Each step's tries draft another length (4, 1, 3, 2 in turn, at K = 4): greedy and seeded rows,
    alone and in a mixed batch, give speculation off's tokens and logprobs, and /stats counts what was
    proposed and accepted. With CUDA's whole-buffer verify forced on, its widths are 1 + a length rows
    choose from (1, 2, 4: a try of 3 padded to 4), never another."""
    from mlxd.engine import spec_batch
    from mlxd.engine.speculative import Drafts
    from mlxd.kv.ngram import DraftLength

    monkeypatch.setattr(spec_batch, "WHOLE_BUFFER", cuda_widths)
    forwards = [0]  # verifying forwards so far: every row of a step is asked before its forward
    forward = Drafts.forward

    def counted(self):
        forwards[0] += 1
        return forward(self)

    monkeypatch.setattr(Drafts, "forward", counted)
    monkeypatch.setattr(DraftLength, "choose", lambda self, cost: (4, 1, 3, 2)[forwards[0] % 4])
    tries: list[tuple[int, int]] = []
    verified = Drafts.verified

    def spy(self, uid, proposed, accepted):
        tries.append((proposed, accepted))
        return verified(self, uid, proposed, accepted)

    monkeypatch.setattr(Drafts, "verified", spy)
    widths: list[int] = []
    width_of = spec_batch.verify_width

    def width(fed: int, k: int) -> int:
        widths.append(width_of(fed, k))
        return widths[-1]

    monkeypatch.setattr(spec_batch, "verify_width", width)
    config = {"draft_model": str(tiny_model_dir)} if speculative == "draft" else {}
    requests = [
        _request("greedy", BASE + BASE[:20], max_tokens=60, logit_bias=NO_EOS),
        _request("seeded", BASE[5:] + BASE[5:25], max_tokens=50, temperature=1.5, seed=3, top_logprobs=2,
                 logit_bias=NO_EOS),
        _request("penalty", BASE[3:30], max_tokens=40, repetition_penalty=1.3),
    ]
    for batch in ([requests[0]], [requests[1]], requests):
        tries.clear()
        off = _run(tiny_model_dir, "off", batch)
        on = _run(tiny_model_dir, speculative, batch, **config)
        assert on[0] == off[0] and on[2] == off[2]
        for r in batch:
            _same_logprobs(off[1][r.request_id], on[1][r.request_id])
        spec = on[3].speculation
        assert spec is not None and spec.accepted > 0, spec
        assert spec.proposed == sum(p for p, _ in tries) and spec.accepted == sum(a for _, a in tries), spec
        assert {1, 2, 3} <= {p for p, _ in tries}, f"the lengths changed from try to try: {tries}"
    if cuda_widths:
        assert set(widths) <= {2, 3, 5}, sorted(set(widths))
    else:
        assert 4 in widths, "a try of 3 drafts verified at its own width on the CPU"


def test_every_row_of_a_step_drafts_the_longest_length_any_of_them_chooses():
    """At batch > 1 the step's forward is as wide as its longest row, and a row that fed fewer positions is
    moved in the batch's KV to drop its padding: each row drafts the longest length chosen (or its limit)."""
    from types import SimpleNamespace

    from mlxd.engine.speculative import Drafts, Speculation
    from mlxd.kv.ngram import StepCosts

    rejected, accepted = Speculation(16), Speculation(16)
    for _ in range(10):
        rejected.length.verified(4, 0)
        accepted.length.verified(4, 4)
    costs = StepCosts()
    for width in (1, 2, 3, 5, 9, 17) * 2:  # a CPU-like step: 10 ms, 3 ms more per position
        costs.record(2, width, (10 + 3 * (width - 1)) / 1e3)
        costs.record(1, width, (10 + 3 * (width - 1)) / 1e3)
    drafts = Drafts({1: SimpleNamespace(features=[rejected]), 2: SimpleNamespace(features=[accepted])})
    drafts.gate.costs = costs
    assert rejected.length.choose(lambda w: costs.seconds(2, w)) == 1
    asks = [(1, [5, 6], 7, 16), (2, [5, 6], 7, 3)]
    assert [a[3] for a in drafts._lengths(asks, 2)] == [16, 3], "the longest chosen, cut at each row's limit"
    assert [a[3] for a in drafts._lengths(asks[:1], 1)] == [1], "a row alone: its own choice"


def test_a_step_whose_drafts_could_not_pay_reads_nothing_verifies_nothing_and_stays_identical(tiny_model_dir):
    """Verifying timed at 10 s a step at every batch size (no plain step on any host comes near: the plain
    steps timed during the run replace the seeded 1 ms) (`StepCosts`): no try can pay even with
    every draft accepted (`SpeculationGate.can_pay`), so a batch whose rows' lookups find drafts makes plain
    steps: no pending-token read, no verifying forward, tokens and logprobs equal to off's; /stats counts
    the refused steps. The same rows with nothing seeded (and no refusal let stand) verify."""
    requests = [
        _request("greedy", BASE + BASE[:20], max_tokens=40, logit_bias=NO_EOS),
        _request("seeded", BASE[5:] + BASE[5:25], max_tokens=36, temperature=1.5, seed=3, top_logprobs=2,
                 logit_bias=NO_EOS),
        _request("hot", BASE[7:] + BASE, max_tokens=30, temperature=3.0, seed=11, logit_bias=NO_EOS),
    ]
    off = _run(tiny_model_dir, "off", requests)
    for timed in (True, False):
        core = EngineCore(config_for(tiny_model_dir, speculative="ngram", prompt_cache_bytes=0))
        core.load()
        # Timed: never let through to re-time; untimed: every refusal let through (what the run itself times on
        # a loaded host must not refuse steps there).
        core._drafts.gate = SpeculationGate(min_samples=1 << 30, explore_every=1 << 30 if timed else 1)
        if timed:
            for rows in (1, 2, 3):
                for _ in range(3):
                    core._drafts.gate.costs.record(rows, 1, 0.001)
                for width in (2, 3, 5):
                    for _ in range(2):
                        core._drafts.gate.costs.record(rows, width, 10.0)
        run = run_rows(core, requests)
        spec = core.stats().speculation
        core.close()
        assert run.tokens == off[0] and run.reasons == off[2]
        for r in requests:
            _same_logprobs(off[1][r.request_id], list(zip(run.logprobs[r.request_id], run.top_logprobs[r.request_id],
                                                          strict=True)))
        assert spec is not None
        if timed:
            assert (spec.verify_steps, spec.pending_reads, spec.proposed) == (0, 0, 0), spec
            assert spec.gate_cannot_pay_steps > 10 and spec.gate_withheld_steps >= spec.gate_cannot_pay_steps, spec
        else:
            assert spec.verify_steps > 0 and spec.pending_reads > 0 and spec.gate_cannot_pay_steps == 0, spec


def test_draft_lengths_are_fixed_with_mlxd_draft_length_fixed(monkeypatch):
    from mlxd.engine.speculative import engine_drafts

    assert engine_drafts({}, draft_model=False).lengths
    monkeypatch.setenv("MLXD_DRAFT_LENGTH", "fixed")
    assert not engine_drafts({}, draft_model=False).lengths
    monkeypatch.setenv("MLXD_DRAFT_LENGTH", "short")
    with pytest.raises(ValueError, match="MLXD_DRAFT_LENGTH='short': adaptive or fixed"):
        engine_drafts({}, draft_model=False)
    for empty in ("", " "):  # set but empty is the default, as for every other MLXD_ arm (env_switch)
        monkeypatch.setenv("MLXD_DRAFT_LENGTH", empty)
        assert engine_drafts({}, draft_model=False).lengths
    monkeypatch.setenv("MLXD_DRAFT_LENGTH", "Fixed")  # any case, as env_switch reads
    assert not engine_drafts({}, draft_model=False).lengths


def test_a_mixed_batch_is_identical_row_for_row(tiny_model_dir):
    """Greedy, seeded (high temperature: drafts get rejected), penalized and constrained rows in one batch."""
    grammar = constraint_from_request(JSON_LETTERS)
    requests = [
        _request("greedy", BASE, max_tokens=50, logit_bias=NO_EOS),
        _request("hot", BASE[7:] + BASE, max_tokens=70, temperature=3.0, seed=11, logprobs=True, logit_bias=NO_EOS),
        _request("warm", BASE[::-1], max_tokens=40, temperature=0.9, top_p=0.9, seed=5, top_logprobs=3),
        _request("penalty", BASE[3:30], max_tokens=45, repetition_penalty=1.3, presence_penalty=0.5),
        _request("json", BASE[:12], max_tokens=60, temperature=0.7, seed=2, constraint=grammar),
    ]
    off = _run(tiny_model_dir, "off", requests)
    on = _run(tiny_model_dir, "ngram", requests)
    for r in requests:
        assert on[0][r.request_id] == off[0][r.request_id], r.request_id
        assert on[2][r.request_id] == off[2][r.request_id], r.request_id
        _same_logprobs(off[1][r.request_id], on[1][r.request_id])
    spec = on[3].speculation
    assert spec is not None and spec.constrained_rows == 1, "the constrained row's grammar checks its drafts"
    assert spec.accepted > 0 and spec.verified_rows > spec.verify_steps, "several rows verified per forward"


def test_a_constrained_row_drafts_what_its_grammar_allows_and_stays_identical(tiny_model_dir):
    grammar = constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                      "minItems": 30, "maxItems": 30}}}})
    for sampling in ({"max_tokens": 300}, {"max_tokens": 300, "temperature": 0.9, "seed": 5, "logprobs": True}):
        requests = [_request("json", BASE[:12], constraint=grammar, **sampling)]
        off = _run(tiny_model_dir, "off", requests)
        on = _run(tiny_model_dir, "ngram", requests)
        assert on[0] == off[0] and on[2] == off[2] == {"json": "stop"}
        _same_logprobs(off[1]["json"], on[1]["json"])
        spec = on[3].speculation
        assert spec is not None and spec.constrained_rows == 1 and spec.accepted > 0, spec


@pytest.mark.parametrize("draft", ["self", "unrelated"])
def test_a_constrained_row_under_a_draft_model_is_masked_before_verifying_and_stays_identical(
        tiny_model_dir, tmp_path, draft):
    """A constrained row alone (batch 1), greedy and seeded, under a draft model: its drafts are walked
    through its grammar and cut at the first refused token before the target verifies them (an
    unrelated random draft proposes such tokens: `grammar_refused`), and the output is off's."""
    draft_dir = tiny_model_dir if draft == "self" else build_model(tmp_path / "other", "test", seed=1)
    grammar = constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                      "minItems": 20, "maxItems": 20}}}})
    for sampling in ({"max_tokens": 250}, {"max_tokens": 250, "temperature": 0.9, "seed": 5, "logprobs": True}):
        requests = [_request("json", BASE[:12], constraint=grammar, **sampling)]
        off = _run(tiny_model_dir, "off", requests)
        on = _run(tiny_model_dir, "draft", requests, draft_model=str(draft_dir))
        assert on[0] == off[0] and on[2] == off[2] == {"json": "stop"}
        _same_logprobs(off[1]["json"], on[1]["json"])
        spec = on[3].speculation
        assert spec is not None and spec.constrained_rows == 1 and spec.proposed > 0, spec
        if draft == "unrelated":
            assert spec.grammar_refused > 0, spec
        else:
            assert spec.accepted > 0, spec


def test_a_stop_token_inside_accepted_drafts_ends_the_row_there(tiny_model_dir):
    plain = _run(tiny_model_dir, "off", [_request("r", BASE + BASE[:20], max_tokens=60)])[0]["r"]
    stop = plain[30]  # deep in the loop the tiny model falls into: drafts of several tokens are accepted there
    requests = [_request("r", BASE + BASE[:20], max_tokens=60, stop_token_ids=(stop,))]
    off = _run(tiny_model_dir, "off", requests)
    on = _run(tiny_model_dir, "ngram", requests)
    assert on[0] == off[0] and on[2] == off[2] == {"r": "stop"}
    assert on[0]["r"][-1] == stop and len(on[0]["r"]) == plain.index(stop) + 1


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_checkpoints_hold_the_accepted_tokens_only(tiny_model_dir, mode):
    """The prompt cache's checkpoints under n-grams and under a draft model (the model itself), in a
    batch where drafts are accepted and rejected (rows rolled back by different amounts): the same
    checkpoints as speculation off, each one's KV holding exactly its tokens, equal to off's."""
    import mlx.core as mx

    requests = [
        _request("greedy", BASE + BASE[:20], max_tokens=40, logit_bias=NO_EOS),
        _request("hot", BASE[7:] + BASE, max_tokens=60, temperature=3.0, seed=11, logit_bias=NO_EOS),
    ]
    extra = {"draft_model": str(tiny_model_dir)} if mode == "draft" else {}
    notes = {}
    for arm in ("off", mode):
        core = EngineCore(config_for(tiny_model_dir, speculative=arm, **(extra if arm == "draft" else {})))
        core.load()
        core._drafts.gate = SpeculationGate(min_samples=1 << 30)  # no pause by timing: drafts whatever the load
        # The target's own checkpoints (a draft model's are in a namespace of their own: test_speculative_draft_prefix).
        notes[arm] = {(n.namespace, n.reason, n.tokens): n for n in run_rows(core, requests).notes if not n.namespace}
        spec = core.stats().speculation
        core.close()
    assert spec is not None and 0 < spec.accepted < spec.proposed, "drafts were accepted and rejected"
    assert notes[mode].keys() == notes["off"].keys() and {k[1] for k in notes["off"]} >= {"boundary", "final"}
    for key, on in notes[mode].items():
        plain = notes["off"][key]
        for c_on, c_off in zip(on.payload, plain.payload, strict=True):
            assert c_on.offset == c_off.offset == len(key[2]), key[1]
            n = c_on.offset
            for x, y in ((c_on.keys, c_off.keys), (c_on.values, c_off.values)):
                assert mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-4).item(), key[1]


@pytest.mark.parametrize(("preset", "kinds", "kv_bits"), [
    ("test-gemma3", "RotatingKVCache", None),  # a sliding window
    ("test-qwen3next", "ArraysCache", None),  # hybrid: gated delta-net (recurrent state) + full attention
    ("test-mamba2", "ArraysCache", None),  # pure recurrent: no layer counts tokens
    ("falcon_h1", "CacheList", None),  # every layer a CacheList(ArraysCache, KVCache)
    ("test-wide", "--kv-bits 8", 8),  # QuantizedKVCache (--kv-bits needs head_dim >= 32)
])
def test_a_model_whose_caches_cannot_roll_back_does_not_speculate(
        tmp_path, tiny_model_dir, caplog, preset, kinds, kv_bits):
    """Every cache kind the engine serves but KVCache (recurrent state, a window, a CacheList, quantized
    KV) cannot drop rejected drafts per row: speculation is off for that model, with the reason logged
    and in the stats, under n-grams and a draft model alike; the output is plain decoding's."""
    model_dir = (falcon_h1_dir(tiny_model_dir, tmp_path / preset) if preset == "falcon_h1"
                 else build_model(tmp_path / preset, preset, seed=0))
    requests = [_request("r", BASE, max_tokens=12), _request("s", BASE[3:], max_tokens=12, temperature=1.2, seed=4)]
    off = _run(model_dir, "off", requests, kv_bits=kv_bits)
    for mode, extra in (("ngram", {}), ("draft", {"draft_model": str(tiny_model_dir)})):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mlxd"):
            on = _run(model_dir, mode, requests, kv_bits=kv_bits, **extra)
        assert on[0] == off[0] and on[2] == off[2], mode
        spec = on[3].speculation
        assert spec is not None and not spec.active and kinds in (spec.off_reason or ""), (mode, spec)
        assert spec.proposed == 0 and spec.verify_steps == 0
        logged = [r.getMessage() for r in caplog.records if "engine.speculation_off" in r.getMessage()]
        assert len(logged) == 1 and kinds in logged[0], (mode, logged)


def test_a_draft_model_with_recurrent_caches_is_refused_and_distributed_is_off(tiny_model_dir, tmp_path):
    from mlxd.engine.ops import ModelRefused
    from mlxd.engine.speculative import speculation_off_reason

    recurrent = build_model(tmp_path / "mamba2", "test-mamba2", seed=0)
    core = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(recurrent)))
    with pytest.raises(ModelRefused, match=r"its caches \(ArraysCache\) cannot drop rejected drafts"):
        core.load()
    reason = speculation_off_reason(None, RuntimeConfig(speculative="ngram", distributed=True))
    assert reason is not None and reason.startswith("--distributed")
    reason = speculation_off_reason(None, RuntimeConfig(speculative="ngram", kv_bits=8))
    assert reason is not None and reason.startswith("--kv-bits 8")


# --- --draft-model: a draft equal to the target, an unrelated one, a foreign tokenizer ---------


def test_a_draft_model_proposes_and_output_stays_identical(tiny_model_dir, tmp_path):
    # Same tokenizer, other weights (random tiny models still tend to fall into the same loop,
    # so its acceptance is not asserted).
    unrelated = build_model(tmp_path / "other", "test", seed=1)
    requests = [
        _request("greedy", BASE, max_tokens=40),
        _request("seeded", BASE[5:], max_tokens=40, temperature=1.5, seed=3, top_logprobs=2),
    ]
    off = _run(tiny_model_dir, "off", requests)
    for draft, accepted_all in ((tiny_model_dir, True), (unrelated, False)):
        on = _run(tiny_model_dir, "draft", requests, draft_model=str(draft))
        assert on[0] == off[0] and on[2] == off[2]
        for r in requests:
            _same_logprobs(off[1][r.request_id], on[1][r.request_id])
        spec = on[3].speculation
        assert spec is not None and spec.proposed > 0, spec
        if accepted_all:  # the target as its own draft: its greedy drafts are mostly right
            assert spec.accepted > 0.7 * spec.proposed and spec.tokens_per_forward > 2, spec


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    import json
    import shutil

    from mlxd.engine.ops import ModelRefused

    foreign = tmp_path / "foreign"
    shutil.copytree(tiny_model_dir, foreign)
    doc = json.loads((foreign / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids
    (foreign / "tokenizer.json").write_text(json.dumps(doc))
    core = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(foreign)))
    with pytest.raises(ModelRefused, match="tokenizer is not the model's"):
        core.load()
    with pytest.raises(ValueError, match="go together"):
        RuntimeConfig(speculative="draft")
    with pytest.raises(ValueError, match="go together"):
        RuntimeConfig(speculative="ngram", draft_model=str(foreign))


# --- a runtime: a RAM hit afterwards, a generation checkpoint resumed, a restart ---------------


async def test_ram_hit_resumed_checkpoint_and_restart_stay_identical(tiny_model_dir, tmp_path):
    sampling = SamplingParams(max_tokens=60, temperature=1.2, seed=7, logit_bias=NO_EOS)
    text = "Repeat after me: the cache keeps the prefix, the cache keeps the prefix. " * 2
    reference: list[int] = []
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), device_probe="off")) as rt:
        async with rt.submit(rt.request(rt.encode(text), sampling=sampling)) as stream:
            reference = await stream.tokens()
    config = RuntimeConfig(model=str(tiny_model_dir), device_probe="off", ssd_cache_dir=tmp_path / "ssd",
                           generation_checkpoint=8, speculative="ngram")
    async with open_runtime(config) as rt:
        prompt = rt.encode(text)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            assert await stream.tokens() == reference
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            assert await stream.tokens() == reference
            assert stream.accepted.cache_tier == "ram" and stream.accepted.cached_tokens > 0
        seen = await drop_after(rt, rt.request(prompt, sampling=sampling), 30)  # the client goes away
        assert seen == reference[:30]
        await checkpoints_settled(rt)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            again = await stream.tokens()
            assert stream.accepted.cache_tier == "checkpoint"
        assert again == reference
        stats = (await rt.stats()).engine.speculation
        assert stats is not None and stats.accepted > 0
    # A restart over the same SSD directory (leaving the runtime flushed it): the prompt comes back
    # from disk and the speculating continuation is the same again.
    async with open_runtime(config) as rt:
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            assert await stream.tokens() == reference
            assert stream.accepted.cache_tier == "ssd" and stream.accepted.cached_tokens > 0


# --- over HTTP: chat completions, stop strings, logprobs, /stats and /metrics ------------------


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as off, \
            ServerThread(config_for(tiny_model_dir, speculative="ngram", num_draft_tokens=6)) as on:
        yield off, on


def _chat(server: ServerThread, **body: object) -> dict:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "say it again and again " * 6}],
               "max_tokens": 48, **body}
    r = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_http_replies_are_identical_with_speculation(servers):
    off, on = servers
    plain = _chat(off, temperature=0)["message"]["content"]
    stop = plain[len(plain) // 2: len(plain) // 2 + 3]
    for body in ({"temperature": 0, "logprobs": True, "top_logprobs": 2},
                 {"temperature": 1.3, "seed": 4, "logprobs": True},
                 {"temperature": 0, "stop": [stop]}):
        a, b = _chat(off, **body), _chat(on, **body)
        assert a["message"]["content"] == b["message"]["content"] and a["finish_reason"] == b["finish_reason"]
        if body.get("logprobs"):
            la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
            assert [x["token"] for x in la] == [x["token"] for x in lb]
            assert [x["logprob"] for x in lb] == pytest.approx([x["logprob"] for x in la], abs=1e-4)
    assert _chat(on, temperature=0, stop=[stop])["finish_reason"] == "stop"

    root = on.base_url.removesuffix("/v1")
    spec = httpx.get(f"{root}/stats", timeout=30).json()["engine"]["speculation"]
    assert spec["active"] and spec["proposed"] >= spec["accepted"] > 0
    assert 0 < spec["acceptance_rate"] <= 1 and spec["tokens_per_forward"] > 1
    metrics = httpx.get(f"{root}/metrics", timeout=30).text
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("mlxd_speculation_"))
    for name, field in (("mlxd_speculation_proposed_tokens_total", "proposed"),
                        ("mlxd_speculation_accepted_tokens_total", "accepted"),
                        ("mlxd_speculation_acceptance_rate", "acceptance_rate"),
                        ("mlxd_speculation_tokens_per_forward", "tokens_per_forward"),
                        ("mlxd_speculation_verify_steps_total", "verify_steps")):
        assert float(lines[name]) == pytest.approx(spec[field]), name
    assert float(lines["mlxd_speculation_active"]) == 1.0
    assert "speculation" not in httpx.get(f"{off.base_url.removesuffix('/v1')}/stats", timeout=30).json()["engine"]


def test_bad_speculation_settings_are_refused():
    with pytest.raises(ValueError):
        RuntimeConfig(speculative="eagle")
    with pytest.raises(ValueError):
        RuntimeConfig(speculative="ngram", num_draft_tokens=0)
    assert attrs.evolve(RuntimeConfig(), speculative="ngram").num_draft_tokens == 4


def test_serve_flags_make_the_speculation_config():
    from mlxd.cli import build_parser, serve_config

    parser = build_parser()
    ngram = serve_config(parser.parse_args(["serve", "--speculative", "ngram", "--num-draft-tokens", "6"]))
    assert (ngram.speculative, ngram.num_draft_tokens, ngram.draft_model) == ("ngram", 6, None)
    draft = serve_config(parser.parse_args(["serve", "--speculative", "draft", "--draft-model", "/d"]))
    assert (draft.speculative, draft.num_draft_tokens, draft.draft_model) == ("draft", 4, "/d")
    assert serve_config(parser.parse_args(["serve"])).speculative == "off"
    for bad in (["--speculative", "eagle"], ["--num-draft-tokens", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])
    with pytest.raises(ValueError, match="go together"):
        serve_config(parser.parse_args(["serve", "--speculative", "draft"]))


def test_drafts_stop_before_an_image_span_key() -> None:
    """Media key ids (kv/media.py) live in a row's prompt but are no vocabulary tokens: never drafted."""
    from mlxd.engine.speculative import Speculation
    from mlxd.kv.media import MEDIA_BASE

    image = [MEDIA_BASE + 11, MEDIA_BASE + 12]
    tokens = [5, 6, 7, 8, *image, 9, 5, 6, 7]
    part = Speculation(k=4)
    assert part.propose(tokens[:-1], tokens[-1], 4) == [8]  # cut where the image's span starts
    plain = Speculation(k=4)
    assert plain.propose([5, 6, 7, 8, 1, 2, 9, 5, 6], 7, 4) == [8, 1, 2, 9]


def test_verifying_over_the_whole_kv_buffer_is_identical_and_keeps_key_shapes(tiny_model_dir, monkeypatch):
    """CUDA's verifying forward (spec_batch.WHOLE_BUFFER) forced on here: the same tokens and logprobs as
    plain decoding, across a buffer growth (past 256 positions), in a padded mixed batch; attention sees
    keys of the buffer's size (it grows 256 positions at a time): one shape per size, not one per step.
    A draft model's forwards of several positions (one row alone, rows together) see theirs whole too."""
    from mlxd.engine import spec_batch

    monkeypatch.setattr(spec_batch, "WHOLE_BUFFER", True)
    key_lengths: list[int] = []
    fetch = spec_batch.WholeBuffer.update_and_fetch

    def recorded(self, keys, values):
        k, v = fetch(self, keys, values)
        key_lengths.append(k.shape[2])
        return k, v

    monkeypatch.setattr(spec_batch.WholeBuffer, "update_and_fetch", recorded)
    requests = [
        _request("long", BASE * 5, max_tokens=120, logit_bias=NO_EOS),  # 200 + 120 positions: the buffer grows
        _request("seeded", BASE[5:], max_tokens=60, temperature=1.5, seed=3, top_logprobs=2, logit_bias=NO_EOS),
        _request("penalty", BASE[3:30], max_tokens=45, repetition_penalty=1.3),
    ]
    arms = [("ngram", {}), ("draft", {"draft_model": str(tiny_model_dir)})]  # the draft's feed forwards too
    for batch, (speculative, config) in [(b, a) for b in (requests[:1], requests) for a in arms]:
        off = _run(tiny_model_dir, "off", batch)
        on = _run(tiny_model_dir, speculative, batch, **config)
        for r in batch:
            assert on[0][r.request_id] == off[0][r.request_id], r.request_id
            assert on[2][r.request_id] == off[2][r.request_id], r.request_id
            _same_logprobs(off[1][r.request_id], on[1][r.request_id])
        spec = on[3].speculation
        assert spec is not None and spec.verify_steps > 5 and spec.accepted > 0, spec
    assert key_lengths and min(key_lengths) >= 256, sorted(set(key_lengths))
    assert len(set(key_lengths)) <= 8, f"one key length per buffer size, not one per step: {sorted(set(key_lengths))}"


def test_on_cuda_speculation_s_forwards_reach_mlx_attention_in_few_shapes_and_stay_identical(
        tiny_model_dir, tmp_path, monkeypatch):
    """CUDA's paths forced on here (the whole-buffer view, model/suffix_attention.py's routing): a draft
    model (other weights, so the gate probes, pauses and probes again at batch 1, each probe catching the
    draft up on a new number of tokens) over rows of different prompt lengths decodes what plain
    decoding does, and the draft's forwards reach MLX's attention (cuDNN's per-shape plans on CUDA) in a
    few shapes: over the whole buffer (an array mask; its size changes once in 256 positions), or over
    exact keys only at a catch-up's bucket width (draft.fed_width: a fresh cache's first chunk); none of
    2..SHORT_QUERY queries over exact keys (those go the plain way)."""
    import mlx.core as mx

    from mlxd.engine import spec_batch
    from mlxd.engine.draft import fed_width
    from mlxd.model import suffix_attention

    draft = build_model(tmp_path / "wide", "test-wide", seed=1)  # head_dim 64: its calls tell themselves apart
    monkeypatch.setattr(spec_batch, "WHOLE_BUFFER", True)
    reached: list[tuple[int, int, bool]] = []  # the draft's (queries, keys, under an array mask) at MLX's kernel
    original = mx.fast.scaled_dot_product_attention

    def kernel(q, k, v, *, scale, mask=None, **kwargs):
        if q.shape[-1] == 64 and q.shape[2] > 1:  # one query: no per-shape plan (a vector kernel, or per buffer)
            reached.append((q.shape[2], k.shape[2], mask is not None and not isinstance(mask, str)))
        return original(q, k, v, scale=scale, mask=mask, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", kernel)
    requests = [_request(f"r{n}", BASE[:n] * 3, max_tokens=70, temperature=4.0, seed=n, logit_bias=NO_EOS)
                for n in (23, 31, 40)]
    suffix_attention.install(force=True)
    try:
        for batch in (requests[:1], requests[1:2], requests):
            off = _run(tiny_model_dir, "off", batch)
            on = _run(tiny_model_dir, "draft", batch, draft_model=str(draft))
            assert on[0] == off[0] and on[2] == off[2]
            for r in batch:
                _same_logprobs(off[1][r.request_id], on[1][r.request_id])
            spec = on[3].speculation
            assert spec is not None and spec.gate_probes >= 2, spec
    finally:
        suffix_attention.uninstall()
    exact = {(q, k) for q, k, masked in reached if not masked}
    assert exact, "the draft's prefix at its first probe: a fresh cache's chunk"
    widths = {fed_width(n, 2048) for n in range(1, 2049)}
    assert all(q > suffix_attention.SHORT_QUERY and q in widths and k == q for q, k in exact), sorted(exact)
    # Over the whole buffer: 1 + K = 5 queries at most (a draft's first forward) or a bucket width (a
    # catch-up), over a few buffer sizes (the rows' contexts stay under 512 + 256 positions).
    whole = {(q, k) for q, k, masked in reached if masked}
    assert all(q <= 5 or q in widths for q, _ in whole), sorted(whole)
    assert len({k for _, k in whole}) <= 3 and all(k >= 256 for _, k in whole), sorted(whole)


def test_a_withheld_step_makes_no_draft_forward_and_reads_nothing_back(tiny_model_dir, monkeypatch):
    """Steps the gate keeps from verifying cost what plain steps cost: no draft forward (no prefix
    prefill, no catch-up), no read of the pending tokens. Twice: a draft priced at its weights (the
    target as its own draft cannot pay at any acceptance, so no step verifies, not even a probe),
    and a draft that could pay but whose gate is paused at these batch sizes."""
    from mlxd.kv.ngram import _Rates

    requests = [
        _request("greedy", BASE, max_tokens=30, logit_bias=NO_EOS),
        _request("seeded", BASE[5:], max_tokens=24, temperature=1.5, seed=3, logit_bias=NO_EOS),
    ]
    off = _run(tiny_model_dir, "off", requests)
    for priced in (True, False):
        if priced:
            monkeypatch.delenv("MLXD_DRAFT_COST")
        else:
            monkeypatch.setenv("MLXD_DRAFT_COST", "0")
        core = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir),
                                     prompt_cache_bytes=0))
        core.load()
        gate = core._drafts.gate
        if priced:
            assert gate.ceiling == pytest.approx(1.0), "the target as its own draft: (1 + 4) / (1 + 4 x 1)"
        else:
            assert gate.ceiling == pytest.approx(5.0), "a free draft: 1 + 4 tokens at best"
            for rows in (1, 2):
                gate._by_rows[rows] = _Rates(pause=1 << 20)
        batch = [*requests[:1]], [*requests]
        for rows in batch:
            run = run_rows(core, rows)
            assert all(run.tokens[r.request_id] == off[0][r.request_id] for r in rows)
        spec, counters = core.stats().speculation, core._drafts.counters
        core.close()
        assert spec is not None and spec.decode_steps > 0 and spec.gate_withheld_steps == spec.decode_steps, spec
        assert (spec.verify_steps, spec.draft_steps, spec.draft_prefix_recomputed, spec.draft_prefix_reused) == (0,) * 4
        assert counters.pending_reads == 0, "no pending token read back for a draft"
        assert core._drafts.prefix.alone_s == 0.0, "no draft prefill nor catch-up"


def test_a_withheld_draft_s_steps_make_the_mlx_calls_of_speculation_off(tiny_model_dir, monkeypatch):
    """What a configured draft that never verifies (the target as its own draft: the ceiling) adds to
    a step, counted against speculation off on the same rows (the H200's draft=self repetitive batch-8
    arm measured 0.693x of off with 0 verifying steps): the same target forwards, the same MLX
    evaluations (`eval`, `async_eval`), no draft forward. Its per-step Python (the gate's calls, the
    rows' speculation parts) is all that differs; its weights sit beside the target's, unread."""
    import mlx.core as mx

    requests = [_request(f"r{i}", BASE[i:] + BASE[: 20 + i], max_tokens=24, logit_bias=NO_EOS) for i in range(4)]
    monkeypatch.delenv("MLXD_DRAFT_COST")
    calls: dict[str, int] = {}
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mx, name, counted)

    def count(speculative: str, **config: object) -> tuple[dict[str, int], dict[str, list[int]]]:
        core = EngineCore(config_for(tiny_model_dir, speculative=speculative, prompt_cache_bytes=0, **config))
        core.load()
        models = {"target": core.model}
        if core._draft is not None:
            models["draft"] = core._draft.model
        forwards = dict.fromkeys(models, 0)
        model_class = type(core.model)
        real_call = model_class.__call__

        def call(self, *args, **kwargs):
            for name, model in models.items():
                forwards[name] += self is model
            return real_call(self, *args, **kwargs)

        monkeypatch.setattr(model_class, "__call__", call)
        calls.clear()
        run = run_rows(core, requests)
        got = {**calls, **{f"{name} forwards": n for name, n in forwards.items()}}
        monkeypatch.setattr(model_class, "__call__", real_call)
        core.close()
        return got, run.tokens

    off, off_tokens = count("off")
    withheld, tokens = count("draft", draft_model=str(tiny_model_dir))
    assert tokens == off_tokens
    assert withheld.pop("draft forwards") == 0
    assert withheld == off and off["target forwards"] > 0, (withheld, off)


def test_a_draft_that_never_ran_for_a_row_publishes_no_checkpoint_and_computes_nothing_at_its_end(
        tiny_model_dir, monkeypatch):
    """With the prompt cache on (serving's default) a row's draft KV is published with the target's
    checkpoints. A draft that never ran for the row (one priced out by the gate's ceiling, or paused
    the whole row) holds no KV: publishing it at the row's end would first compute the draft over the
    whole prompt and generation, a second prefill on the engine thread that no step ever asked for
    (and, for a draft the ceiling refuses, that no later turn can use). Nothing is published, nothing
    computed; the target's checkpoints are as with speculation off."""
    requests = [_request("a", BASE, max_tokens=20, logit_bias=NO_EOS),
                _request("b", BASE[3:], max_tokens=12, temperature=1.2, seed=5, logit_bias=NO_EOS)]
    monkeypatch.delenv("MLXD_DRAFT_COST")  # the target as its own draft: priced out
    runs = {}
    for speculative in ("off", "draft"):
        config = {"draft_model": str(tiny_model_dir)} if speculative == "draft" else {}
        core = EngineCore(config_for(tiny_model_dir, speculative=speculative, **config))
        core.load()
        runs[speculative] = run_rows(core, requests)
        if speculative == "draft":
            assert core._drafts.gate.ceiling < core._drafts.gate.min_speedup
            prefix, spec = core._drafts.prefix, core.stats().speculation
            assert spec is not None and spec.verify_steps == 0
            assert (prefix.alone_s, prefix.recomputed) == (0.0, 0), "no draft prefill at the rows' ends"
        core.close()
    off, on = runs["off"], runs["draft"]
    assert on.tokens == off.tokens
    assert not [n for n in on.notes if "#draft-" in n.namespace], "no draft checkpoint"
    assert sorted((n.namespace, n.reason, n.tokens) for n in on.notes) == sorted(
        (n.namespace, n.reason, n.tokens) for n in off.notes)


def test_rows_moved_one_by_one_equal_the_batch_roll():
    """The target's rollback on the CPU moves only the rows that drop more than the others, each over
    its own span (`_shift_right` with the rows' left padding): the same KV, padding and offsets as
    rolling the whole batch, rows of different lengths (left padding) included."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlxd.engine.spec_batch import _shift_right

    def filled() -> BatchKVCache:
        mx.random.seed(7)
        cache = BatchKVCache([0, 3, 1, 6])
        kv = mx.random.normal((4, 2, 21, 8))
        cache.update_and_fetch(kv, kv * 2)
        return cache

    shifts = [0, 2, 4, 1]
    rolled, moved = filled(), filled()
    _shift_right(rolled, shifts)
    _shift_right(moved, shifts, moved.left_padding.tolist())
    assert moved.left_padding.tolist() == rolled.left_padding.tolist() == [0, 5, 5, 7]
    assert moved.offset.tolist() == rolled.offset.tolist() and moved._idx == rolled._idx == 21
    for i, lo in enumerate(rolled.left_padding.tolist()):
        for a, b in ((moved.keys, rolled.keys), (moved.values, rolled.values)):
            assert mx.array_equal(a[i, :, lo:21], b[i, :, lo:21]).item(), i


def test_a_buffer_copied_at_its_exact_length_then_trimmed_to_a_multiple_of_the_step_grows_to_a_multiple():
    """A row's KV copied at its exact length (260: a checkpoint lent back, a draft's KV out of its batch), then
    its rejected drafts trimmed to 256: a whole-buffer forward grows it to 512, as every other buffer of that
    size, not to 260 + 256 (a size of its own: on CUDA, attention plans of their own)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlxd.engine.spec_batch import _held, _reserve

    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 260, 4)), mx.zeros((1, 2, 260, 4)))
    c.keys, c.values = c.keys[..., :260, :], c.values[..., :260, :]
    c.trim(4)
    _reserve(c, _held(c), 5)
    assert c.keys.shape[2] == c.values.shape[2] == 512
    b = BatchKVCache([0, 0])
    b.update_and_fetch(mx.ones((2, 2, 260, 4)), mx.ones((2, 2, 260, 4)))
    b.keys, b.values = b.keys[..., :260, :], b.values[..., :260, :]
    b.trim(4)
    _reserve(b, _held(b), 5)
    assert b.keys.shape[2] == b.values.shape[2] == 512
    assert mx.all(b.keys[..., :256, :] == 1).item()  # the held positions kept
