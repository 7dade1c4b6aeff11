"""The engine core, synchronous: one `StepOps` in, one `StepResult` out, over a scripted generator.

The generator (tests/fake_generator.py) keeps mlx-lm's step timing and response
objects and real `KVCache`s that hold token ids, so checkpoints can be read back.
With a prefill chunk of 4, a cold 5-token prompt takes: step 1 prefills 4 tokens
(end of segment), step 2 starts decoding (end of prompt), steps 3.. emit one token
each; the script counts up from the prompt's last token.
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx
import pytest
from tests.fake_generator import FakeGenerator, feed, prefix_caches, tokens_in

from mlxd.engine import core as engine_core
from mlxd.engine import loading
from mlxd.engine.core import EngineCore
from mlxd.engine.ops import Emit, Rejected, RowStart, StepOps, StepResult
from mlxd.kv import kinds
from mlxd.kv.prompt_cache import CacheEntry, CacheHit
from mlxd.kv.ssd_store import StoreIdentity
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import (
    CheckpointGeneration,
    GenerationAbandoned,
    GenerationCompleted,
    GenerationFinished,
    GenerationRequest,
    MemoryMeasured,
    PrefillMeasured,
    PromptAccepted,
    PublishPrefix,
    SamplingParams,
    TokenGenerated,
)

EOS = 63
PROMPT = (10, 11, 12, 13, 14)
CACHE_ON = {"prompt_cache_bytes": 1 << 20}  # the prompt cache's checkpoints (no boundary below 256 new tokens)


def make(*, identity: StoreIdentity | None = None, **config) -> tuple[EngineCore, FakeGenerator]:
    cfg = RuntimeConfig(**{"prompt_cache_bytes": 0, "prefill_step_size": 4, **config})
    generator = FakeGenerator(prefill_step_size=cfg.prefill_step_size)
    return EngineCore.over(cfg, generator, eos=frozenset({EOS}), store_identity=identity), generator


def start(rid: str, prompt=PROMPT, *, hit: CacheHit | None = None, key: str | None = None,
          session: str | None = None, queued_s: float = 0.0, **sampling) -> RowStart:
    params = SamplingParams(**{"max_tokens": 3, **sampling})
    request = GenerationRequest(request_id=rid, prompt=tuple(prompt), sampling=params, session=session)
    return RowStart(request=request, hit=hit, checkpoint_key=key, queued_s=queued_s)


def ram_hit(tokens, usable: int, *, holds=None) -> CacheHit:
    """A RAM entry for `tokens` whose payload holds `holds` (default: exactly `tokens`)."""
    payload = prefix_caches(tokens if holds is None else holds)
    entry = CacheEntry(namespace="", tokens=tuple(tokens), payload=payload, nbytes=kinds.nbytes(payload),
                       trimmable=True, created_at=0.0, last_used=0.0)
    return CacheHit(entry, usable)


def steps(core: EngineCore, n: int, ops: StepOps = StepOps()) -> list[StepResult]:
    """`ops`, then empty steps: n steps in all."""
    return [core.step(ops), *(core.step(StepOps()) for _ in range(n - 1))]


def run(core: EngineCore, ops: StepOps = StepOps(), *, limit: int = 50) -> list[StepResult]:
    """`ops`, then empty steps until the batch is empty."""
    results = [core.step(ops)]
    while results[-1].stats.batch_rows:
        assert len(results) < limit, "the batch never emptied"
        results.append(core.step(StepOps()))
    return results


def events(results: list[StepResult], rid: str) -> list:
    return [e.event for r in results for e in r.emits if e.request_id == rid]


def notes(results: list[StepResult], kind: type) -> list:
    return [n for r in results for n in r.notes if isinstance(n, kind)]


def published(results: list[StepResult], reason: str) -> list[PublishPrefix]:
    return [n for n in notes(results, PublishPrefix) if n.reason == reason]


def finished(results: list[StepResult]) -> GenerationFinished:
    (last,) = [e for e in events(results, "a") if isinstance(e, GenerationFinished)]
    return last


# --- a row's life -------------------------------------------------------------------------


def test_a_cold_row_is_accepted_streams_its_tokens_and_finishes():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", queued_s=0.25),)))
    assert events(results, "a") == [
        PromptAccepted(5, 0, "none", 0.25),
        TokenGenerated(15), TokenGenerated(16), TokenGenerated(17),
        GenerationFinished("length", 5, 0, 3),
    ]
    assert results[0].emits == (Emit("a", PromptAccepted(5, 0, "none", 0.25)),)
    assert [r.finished for r in results] == [(), (), (), (), ("a",)]
    assert results[-1].stats.batch_rows == 0 and not results[-1].rejected


def test_a_ram_hit_inserts_only_the_suffix_from_the_lent_prefix():
    core, generator = make(**CACHE_ON)
    prompt = tuple(range(10, 22))
    hit = ram_hit(range(10, 20), 8)  # a 10-token entry trimmed to the 8 tokens the prompt shares
    results = run(core, StepOps(starts=(start("a", prompt, hit=hit, max_tokens=2),)))
    (inserted,) = generator.inserted
    assert inserted.prompt == prompt[8:]
    assert inserted.cached == inserted.all_tokens == prompt[:8]
    assert events(results, "a")[0] == PromptAccepted(12, 8, "ram", 0.0)
    assert finished(results) == GenerationFinished("length", 12, 8, 2)
    assert results[-1].stats.prompt_tokens == 4
    # The row's final checkpoint holds the lent prefix, the suffix and its tokens; the entry is untouched.
    (final,) = published(results, "final")
    assert final.tokens == (*prompt, 22, 23) and tokens_in(final.payload) == list(final.tokens)
    assert tokens_in(hit.entry.payload) == list(range(10, 20))


def test_stop_token_ids_end_a_row_with_stop():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", stop_token_ids=(16,), max_tokens=10),)))
    assert events(results, "a")[1:] == [TokenGenerated(15), TokenGenerated(16), GenerationFinished("stop", 5, 0, 2)]


def test_the_models_eos_ends_a_row_with_stop():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", (60, 61), max_tokens=10),)))
    assert events(results, "a")[1:] == [TokenGenerated(62), TokenGenerated(EOS), GenerationFinished("stop", 2, 0, 2)]


def test_logprobs_come_with_tokens_when_asked():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", max_tokens=1, logprobs=True, top_logprobs=2),)))
    token = events(results, "a")[1]
    assert token.token == 15 and token.logprob is not None and token.logprob < 0
    assert len(token.top_logprobs) == 2 and token.top_logprobs[0] == (15, pytest.approx(token.logprob))


def test_logprobs_of_a_step_are_read_together_as_each_row_alone_reads_them():
    """A step's logprobs are read in one evaluation on a side stream (not behind the next step's queued
    forward): the same values as each token read alone, for rows asking for none, the chosen one only,
    or a top k; a row with several tokens in one step (a verifying step) gets each token's own."""
    import types

    import mlx.core as mx

    from mlxd.engine.features import read_logprobs

    logits = mx.random.normal((4, 50), key=mx.random.key(7))
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(rows)
    responses = [types.SimpleNamespace(token=t, logprobs=rows[i]) for i, t in enumerate((3, 9, 40, 0))]
    asks = [(responses[0], 0), (responses[1], 2), (responses[2], 5), (responses[3], 60), (responses[1], 0)]
    side = mx.new_stream(mx.default_device())
    slow = mx.random.normal((512, 512))
    for _ in range(6):
        slow = slow @ slow  # queued on the default stream, not waited for by the reads
    mx.async_eval(slow)
    got = read_logprobs(asks, side)
    for (r, k), (chosen, top) in zip(asks, got, strict=True):
        lp = r.logprobs
        assert chosen == pytest.approx(float(lp[r.token].item()))
        want = sorted(((int(t), float(lp[t].item())) for t in range(lp.shape[-1])), key=lambda p: -p[1])[: max(k, 0)]
        assert [t for t, _ in top] == [t for t, _ in want] and [v for _, v in top] == pytest.approx([v for _, v in want])
    mx.eval(slow)


def test_rows_asking_for_logprobs_or_not_share_a_step():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", max_tokens=2, logprobs=True, top_logprobs=2),
                                         start("b", (20, 21, 22), max_tokens=2),
                                         start("c", (30, 31), max_tokens=2, logprobs=True))))
    a, b, c = ([e for e in events(results, rid) if isinstance(e, TokenGenerated)] for rid in "abc")
    assert [t.token for t in a] == [15, 16] and all(t.logprob is not None and len(t.top_logprobs) == 2 for t in a)
    assert all(t.top_logprobs[0][0] == t.token for t in a)
    assert [t.token for t in b] == [23, 24] and all(t.logprob is None and t.top_logprobs == () for t in b)
    assert [t.token for t in c] == [32, 33] and all(t.logprob is not None and t.top_logprobs == () for t in c)


# --- rows a client ends --------------------------------------------------------------------


def test_a_client_stop_ends_a_decoding_row_and_publishes_every_token():
    core, generator = make(**CACHE_ON)
    before = steps(core, 4, StepOps(starts=(start("a", max_tokens=10),)))
    assert events(before, "a")[1:] == [TokenGenerated(15), TokenGenerated(16)]
    result = core.step(StepOps(stops=("a",)))
    assert result.emits == (Emit("a", GenerationFinished("stop", 5, 0, 2)),)
    assert result.finished == ("a",)
    (final,) = result.notes
    assert final.reason == "final" and final.tokens == (*PROMPT, 15, 16)
    assert tokens_in(final.payload) == list(final.tokens)
    assert final.trimmable and final.nbytes == kinds.nbytes(final.payload)
    assert not generator.rows
    assert result.stats.batch_rows == 0 and result.stats.steps == 4  # no generator step without rows


def test_a_cancel_ends_a_row_as_cancelled():
    core, generator = make(**CACHE_ON)
    steps(core, 4, StepOps(starts=(start("a", max_tokens=10),)))
    result = core.step(StepOps(cancels=("a",)))
    assert result.emits == (Emit("a", GenerationFinished("cancelled", 5, 0, 2)),)
    assert result.finished == ("a",) and not generator.rows
    # A disconnect keeps what was computed, like a client stop.
    assert [(n.reason, n.tokens) for n in result.notes] == [("final", (*PROMPT, 15, 16))]


def test_cancels_and_stops_of_request_ids_the_core_does_not_hold_are_ignored():
    core, _ = make()
    idle = core.step(StepOps(cancels=("ghost",), stops=("nobody",)))
    assert idle == StepResult(stats=idle.stats) and idle.stats.steps == 0
    steps(core, 3, StepOps(starts=(start("a", max_tokens=10),)))
    result = core.step(StepOps(cancels=("ghost",), stops=("nobody",)))
    assert result.emits == (Emit("a", TokenGenerated(16)),)
    assert not result.finished and not result.rejected and result.stats.batch_rows == 1


# --- starts that cannot join ---------------------------------------------------------------


def test_a_start_mlx_lm_refuses_is_rejected_while_another_row_proceeds():
    core, generator = make()
    bad = start("bad", repetition_penalty=-1.0, key="k-bad")  # mlx-lm's make_repetition_penalty refuses it
    result = core.step(StepOps(starts=(bad, start("good"))))
    (rejected,) = result.rejected
    assert rejected.request_id == "bad"
    assert rejected.message.startswith("generation failed: ValueError: penalty must be a non-negative float")
    assert notes([result], GenerationAbandoned) == [GenerationAbandoned("k-bad", "bad")]  # kept for a retry
    assert [i.prompt for i in generator.inserted] == [PROMPT]
    assert result.emits == (Emit("good", PromptAccepted(5, 0, "none", 0.0)),)
    assert result.stats.batch_rows == 1 and result.stats.prompt_tokens == 5
    later = run(core)
    assert events(later, "good")[-1] == GenerationFinished("length", 5, 0, 3)
    assert not events(later, "bad")


def test_a_hit_whose_payload_is_broken_is_rejected_while_another_row_proceeds():
    core, generator = make()
    broken = ram_hit(range(10, 18), 6, holds=range(10, 15))  # the key says 8 tokens, the caches hold 5
    result = core.step(StepOps(starts=(start("bad", range(10, 22), hit=broken), start("good"))))
    assert result.rejected == (
        Rejected("bad", "generation failed: ValueError: caches hold 5 tokens, their key 8"),
    )
    assert notes([result], GenerationAbandoned) == []  # no checkpoint key: nothing to abandon
    assert [i.prompt for i in generator.inserted] == [PROMPT]
    assert events(run(core), "good")[-1] == GenerationFinished("length", 5, 0, 3)


# --- prompt checkpoints --------------------------------------------------------------------


def test_a_prompt_boundary_checkpoint_is_published_once_when_the_prompt_has_enough_new_tokens():
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    prompt = tuple(range(10, 19))  # 8 tokens before the last one: prefilled in 2 chunks of 4
    results = run(core, StepOps(starts=(start("a", prompt, max_tokens=1),)))
    (boundary,) = published(results, "boundary")
    assert boundary in results[1].notes  # the step whose chunk ended the segment
    assert boundary.tokens == prompt[:-1] and tokens_in(boundary.payload) == list(prompt[:-1])
    assert [n.tokens for n in published(results, "final")] == [(*prompt, 19)]


def test_no_prompt_boundary_checkpoint_below_snapshot_min_tokens():
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    results = run(core, StepOps(starts=(start("a", range(10, 18), max_tokens=1),)))  # 7 new tokens
    assert published(results, "boundary") == []
    assert len(published(results, "final")) == 1


def test_a_session_takes_a_prompt_boundary_checkpoint_below_the_threshold():
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    results = run(core, StepOps(starts=(start("a", (10, 11, 12), session="s", max_tokens=1),)))
    (boundary,) = published(results, "boundary")
    assert boundary.tokens == (10, 11) and boundary.session == "s"


def _first_token_step(results: list[StepResult], rid: str = "a") -> int:
    return min(i for i, r in enumerate(results) for e in r.emits
               if e.request_id == rid and isinstance(e.event, TokenGenerated))


def test_with_the_ssd_tier_a_boundary_checkpoint_is_published_once_its_rows_first_token_was_delivered(tmp_path):
    # Its write plan's host reads (on CUDA a conversion to managed memory, 80-258 ms at 16k tokens) waited
    # for the first token; the caches are copied at the boundary, the plan made at the start of the step
    # after the second token's (the step loop runs one step ahead of delivery: the first token is out).
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    prompt = tuple(range(10, 19))
    results = run(core, StepOps(starts=(start("a", prompt, max_tokens=4),)))
    (boundary,) = published(results, "boundary")
    first = _first_token_step(results)
    # not before: not with the first token, nor in the step run beside its delivery
    assert boundary in results[first + engine_core.PUBLISH_AFTER_TOKENS].notes
    # what the prompt's KV held at the boundary, not the token decoded since
    assert boundary.tokens == prompt[:-1] and tokens_in(boundary.payload) == list(prompt[:-1])
    assert boundary.plan is not None and [c.offset for c in boundary.plan.caches] == [8, 8]
    (final,) = published(results, "final")
    assert [n.reason for n in notes(results, PublishPrefix)] == ["boundary", "final"]
    assert final.tokens[: len(prompt)] == prompt


def test_a_deferred_boundary_checkpoint_is_published_when_its_row_ends_before_the_next_step(tmp_path):
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    for ending in ("finish", "cancel"):
        core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
        prompt = tuple(range(10, 19))
        if ending == "finish":  # max_tokens 1: its first token is its last
            results = run(core, StepOps(starts=(start("a", prompt, max_tokens=1),)))
        else:  # cancelled right after the boundary, before any token
            results = steps(core, 2, StepOps(starts=(start("a", prompt, max_tokens=4),)))
            assert published(results, "boundary") == []  # deferred: no token out yet
            results += run(core, StepOps(cancels=("a",)))
        # (a row cancelled before its first token has no final checkpoint: nothing past the boundary)
        expected = ["boundary", "final"] if ending == "finish" else ["boundary"]
        assert [n.reason for n in notes(results, PublishPrefix)] == expected, ending
        assert published(results, "boundary")[0].tokens == prompt[:-1]
        assert core.stats().batch_rows == 0 and not core._deferred


def test_a_prompt_others_will_borrow_publishes_its_boundary_checkpoint_before_its_first_token(tmp_path):
    # The first of n > 1 choices: the others are submitted once its first token is out, to borrow its prefill.
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    row = start("a", tuple(range(10, 19)), max_tokens=4)
    row = attrs.evolve(row, request=attrs.evolve(row.request, prompt_shared=True))
    results = run(core, StepOps(starts=(row,)))
    (boundary,) = published(results, "boundary")
    assert boundary in results[1].notes and 1 < _first_token_step(results) and boundary.plan is not None


def test_a_deferred_checkpoint_that_cannot_be_planned_is_skipped_and_its_row_goes_on(tmp_path, monkeypatch):
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)

    def broken(*args, **kwargs):
        raise OSError("no plan today")

    monkeypatch.setattr(core, "_snapshot", broken)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),)))
    assert published(results, "boundary") == [] and core.counters.checkpoints_skipped == 2  # boundary and final
    assert [e.token for e in events(results, "a") if isinstance(e, TokenGenerated)] == [19, 20, 21, 22]
    assert finished(results).reason == "length" and not core._deferred


def assert_a_cancel_while_leaving_is_ignored(core: EngineCore) -> None:
    """A late final plan: a cancel that arrives while the row waits for its finish is ignored, the row finishes as
    it ended, its boundary checkpoint and then its final one published."""
    results, ops = [], StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=2),))
    while not core._leaving:
        results.append(core.step(ops))
        ops = StepOps()
    results += run(core, StepOps(cancels=("a",)))
    assert finished(results).reason == "length" and [n.reason for n in notes(results, PublishPrefix)] == [
        "boundary", "final"]


def test_after_token_final_plans_finish_a_row_in_the_next_step_with_its_checkpoint_first(tmp_path, monkeypatch):
    """MLXD_FINAL_PLAN=after-token (an arm to measure): with the SSD tier a row's last token goes out with its step,
    its final checkpoint (the write plan) and its finish with the next, a step with no forward (the other rows'
    next tokens come in the one after), the checkpoint in that step's notes (the actor delivers notes first: the
    cache owner has it before the reply ends); the batch counts the row until then, so the step loop runs that
    step; a cancel meanwhile is ignored. Without the SSD tier nothing changes."""
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    monkeypatch.setenv("MLXD_FINAL_PLAN", "after-token")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),
                                        start("b", (20, 21, 22), max_tokens=2))))
    for rid, tokens in (("a", 4), ("b", 2)):
        last = max(i for i, r in enumerate(results) for e in r.emits
                   if e.request_id == rid and isinstance(e.event, TokenGenerated))
        step = results[last + 1]
        assert [type(e.event) for e in step.emits if e.request_id == rid] == [GenerationFinished]
        assert rid in step.finished and rid not in results[last].finished
        assert len([n for n in step.notes if isinstance(n, PublishPrefix) and n.reason == "final"]) == 1
        assert results[last].stats.batch_rows >= 1  # still held: the loop takes the step that finishes it
        # that step does no forward: the finish goes out once the plan is done, not with the next tokens
        assert step.stats.steps == results[last].stats.steps
        assert not [e for e in step.emits if isinstance(e.event, TokenGenerated)]
        assert len([e for e in events(results, rid) if isinstance(e, TokenGenerated)]) == tokens
    assert results[-1].stats.batch_rows == 0 and not core._leaving
    late = sorted(published(results, "final"), key=lambda n: n.tokens)
    monkeypatch.setenv("MLXD_FINAL_PLAN", "with-token")  # the same rows, the checkpoint in the last token's step
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    at_once = sorted(published(run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),
                                                          start("b", (20, 21, 22), max_tokens=2)))), "final"),
                     key=lambda n: n.tokens)
    assert [n.tokens for n in late] == [n.tokens for n in at_once]
    assert [tokens_in(n.payload) for n in late] == [tokens_in(n.payload) for n in at_once]
    assert all(n.plan is not None for n in late)
    monkeypatch.setenv("MLXD_FINAL_PLAN", "after-token")
    assert_a_cancel_while_leaving_is_ignored(make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path,
                                                  identity=identity)[0])
    # without the SSD tier the final checkpoint is a RAM entry taken in the last token's step, as before
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=2),)))
    last = max(i for i, r in enumerate(results) for e in r.emits if isinstance(e.event, TokenGenerated))
    assert "a" in results[last].finished
    monkeypatch.setenv("MLXD_FINAL_PLAN", "later")
    with pytest.raises(ValueError, match="MLXD_FINAL_PLAN"):
        make()


@pytest.mark.parametrize("ssd", [False, True])
def test_after_forward_final_plans_leave_a_row_after_the_next_steps_forward(tmp_path, monkeypatch, ssd):
    """MLXD_FINAL_PLAN=after-forward (the default since 2026-12-06), with the RAM tier alone or the SSD tier: a row's last token
    goes out with its step, its KV copy dispatched and not waited for; its final checkpoint and finish come in the
    next step after that step's forward (the other rows' next tokens in the same step), the checkpoint in that
    step's notes (delivered first: the cache owner has it before the reply ends), holding the KV the default takes
    in the last token's step; a cancel meanwhile is ignored."""
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    disk = {"ssd_cache_dir": tmp_path, "identity": identity} if ssd else {}
    rows = (start("a", (10, 11, 12), max_tokens=4), start("b", (20, 21, 22), max_tokens=2))  # decoding together
    monkeypatch.delenv("MLXD_FINAL_PLAN", raising=False)  # the default
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, **disk)
    results = run(core, StepOps(starts=rows))
    last = {rid: max(i for i, r in enumerate(results) for e in r.emits
                     if e.request_id == rid and isinstance(e.event, TokenGenerated)) for rid in ("a", "b")}
    assert last["b"] < last["a"]
    for rid, tokens in (("a", 4), ("b", 2)):
        step = results[last[rid] + 1]
        assert [type(e.event) for e in step.emits if e.request_id == rid] == [GenerationFinished]
        assert rid in step.finished and rid not in results[last[rid]].finished
        assert len([n for n in step.notes if isinstance(n, PublishPrefix) and n.reason == "final"]) == 1
        assert results[last[rid]].stats.batch_rows >= 1  # still held: the loop takes the step that finishes it
        assert len([e for e in events(results, rid) if isinstance(e, TokenGenerated)]) == tokens
    # b's finish rides with a step that ran a forward and carries a's next token
    step = results[last["b"] + 1]
    assert step.stats.steps == results[last["b"]].stats.steps + 1
    assert [type(e.event) for e in step.emits if e.request_id == "a"] == [TokenGenerated]
    assert results[-1].stats.batch_rows == 0 and not core._leaving and not core._left
    assert core.stats().late_final_checkpoints == 2
    late = sorted(published(results, "final"), key=lambda n: n.tokens)
    monkeypatch.setenv("MLXD_FINAL_PLAN", "with-token")  # the same rows, the checkpoint in the last token's step
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, **disk)
    at_once = sorted(published(run(core, StepOps(starts=rows)), "final"), key=lambda n: n.tokens)
    assert [n.tokens for n in late] == [n.tokens for n in at_once]
    assert [tokens_in(n.payload) for n in late] == [tokens_in(n.payload) for n in at_once]
    assert all((n.plan is not None) == ssd for n in late)
    monkeypatch.setenv("MLXD_FINAL_PLAN", "after-forward")
    assert_a_cancel_while_leaving_is_ignored(make(**CACHE_ON, snapshot_min_tokens=8, **disk)[0])
    if ssd:
        return
    core, _ = make(snapshot_min_tokens=8)  # no prompt cache: nothing to take, the finish with its last token
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=2),)))
    last_token = max(i for i, r in enumerate(results) for e in r.emits if isinstance(e.event, TokenGenerated))
    assert "a" in results[last_token].finished and core.stats().late_final_checkpoints is None


def test_a_finished_row_carries_the_time_its_final_checkpoint_held_its_last_step(tmp_path, monkeypatch):
    """`GenerationFinished.leave_s`: the engine's time leaving each row in the step of its last token (its final
    checkpoint's write plan with the SSD tier), which every token of that step waited for; a client stop too."""
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    planned = kinds.plan_snapshot

    def slow_plan(caches, *, meta, **options):
        time.sleep(0.03)
        return planned(caches, meta=meta, **options)

    monkeypatch.setattr(kinds, "plan_snapshot", slow_plan)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),
                                        start("b", (20, 21, 22), max_tokens=2))))
    done = {e.request_id: e.event for r in results for e in r.emits if isinstance(e.event, GenerationFinished)}
    assert done["a"].leave_s >= 0.03 and done["b"].leave_s >= 0.03  # each its own final plan
    assert done["a"] == GenerationFinished("length", 9, 0, 4)  # a timing: not part of the value
    # without the SSD tier there is no plan: the final checkpoint is a RAM entry only
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),)))
    assert [n.plan for n in published(results, "final")] == [None]
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, ssd_cache_dir=tmp_path, identity=identity)
    results = steps(core, 4, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=8),)))
    results += run(core, StepOps(stops=("a",)))
    assert finished(results).reason == "stop" and finished(results).leave_s >= 0.03


def test_without_the_ssd_tier_a_boundary_checkpoint_is_published_where_the_segment_ends():
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=4),)))
    (boundary,) = published(results, "boundary")
    assert boundary in results[1].notes and 1 < _first_token_step(results)


# --- generation checkpoints ------------------------------------------------------------------


def test_generation_checkpoints_snapshot_every_n_tokens_then_complete(tmp_path):
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, ssd_cache_dir=tmp_path, generation_checkpoint=2, identity=identity)
    results = run(core, StepOps(starts=(start("a", (10, 11, 12), key="k", max_tokens=5),)))
    taken = notes(results, CheckpointGeneration)
    assert [(c.key, c.request_id, c.emitted) for c in taken] == [("k", "a", 2), ("k", "a", 4)]
    first = taken[0].plan.meta
    assert first.tokens == (10, 11, 12, 13, 14)  # what the caches hold: the prompt and the tokens emitted
    assert first.generation is not None
    assert (first.generation["prompt_tokens"], first.generation["emitted"]) == (3, 2)
    assert first.generation["pending"] == 15 and first.generation["rng_key"] is None
    assert [c.offset for c in taken[1].plan.caches] == [7, 7]
    assert notes(results, GenerationCompleted) == [GenerationCompleted("k", "a")]
    assert notes(results, GenerationCompleted)[0] in results[-1].notes
    assert notes(results, GenerationAbandoned) == []


def test_a_row_with_a_checkpoint_key_completes_on_a_natural_finish():
    core, _ = make()
    results = run(core, StepOps(starts=(start("a", key="k", stop_token_ids=(16,), max_tokens=10),)))
    assert finished(results).reason == "stop"
    assert results[-1].notes == (GenerationCompleted("k", "a"),)


def test_a_row_with_a_checkpoint_key_completes_on_a_client_stop():
    core, _ = make()
    steps(core, 3, StepOps(starts=(start("a", key="k", max_tokens=10),)))
    assert core.step(StepOps(stops=("a",))).notes == (GenerationCompleted("k", "a"),)


def test_a_row_with_a_checkpoint_key_is_abandoned_on_cancel():
    core, _ = make()
    steps(core, 3, StepOps(starts=(start("a", key="k", max_tokens=10),)))
    assert core.step(StepOps(cancels=("a",))).notes == (GenerationAbandoned("k", "a"),)


# --- reset, stats, measurements --------------------------------------------------------------


def test_a_reset_drops_every_row_and_the_next_step_works():
    core, generator = make()
    steps(core, 3, StepOps(starts=(start("a", max_tokens=10), start("b", range(20, 40), max_tokens=10))))
    mx.eval(mx.zeros((1 << 18,)) + 1)  # a freed buffer in MLX's cache, as a failed batch's would be
    assert mx.get_cache_memory() > 0
    result = core.step(StepOps(reset=True))
    assert result == StepResult(stats=result.stats)
    assert result.stats.batch_rows == 0 and generator.closed == 1 and not generator.rows
    assert mx.get_cache_memory() == 0  # given back (a failed allocation must not leave the next steps short)
    later = run(core, StepOps(starts=(start("c"),), cancels=("a",)))
    assert {e.request_id for r in later for e in r.emits} == {"c"}
    assert events(later, "c")[-1] == GenerationFinished("length", 5, 0, 3)


def test_stats_count_steps_generated_tokens_and_prompt_tokens_prefilled():
    core, _ = make()
    cold = run(core, StepOps(starts=(start("a"),)))
    stats = cold[-1].stats
    assert (stats.steps, stats.generated_tokens, stats.prompt_tokens) == (5, 3, 5)
    hit = ram_hit(range(10, 18), 8)
    warm = run(core, StepOps(starts=(start("b", range(10, 22), hit=hit, max_tokens=2),)))
    stats = warm[-1].stats
    assert (stats.steps, stats.generated_tokens, stats.prompt_tokens) == (9, 5, 9)  # the 8 cached not counted
    assert stats.failed_steps == 0 and stats.checkpoints_skipped == 0
    assert stats == core.stats()


def test_a_lone_prefill_chunk_is_measured_from_its_context():
    core, _ = make()
    hit = ram_hit(range(10, 18), 8)
    results = run(core, StepOps(starts=(start("a", range(10, 24), hit=hit, max_tokens=1),)))
    measured = [(m.new_tokens, m.context) for m in notes(results, PrefillMeasured)]
    assert measured == [(4, 8), (1, 12)]  # 5 new tokens before the last: a chunk of 4, then 1


def test_a_lone_prefill_after_an_unaligned_prefix_ends_its_chunks_on_multiples_of_the_chunk():
    # A 3-token cached prefix (a chat header): chunks counted from it had key lengths no prompt from 0 has
    # (on CUDA a new cuDNN graph each, engine/prefill_slices.py); cut once, the rest end on multiples of 4.
    core, _ = make()
    hit = ram_hit(range(10, 13), 3)
    results = run(core, StepOps(starts=(start("a", range(10, 24), hit=hit, max_tokens=1),)))
    measured = [(m.new_tokens, m.context) for m in notes(results, PrefillMeasured)]
    assert measured == [(1, 3), (4, 4), (4, 8), (1, 12)]  # was (4, 3), (4, 7), (2, 11)
    assert events(results, "a")[0] == PromptAccepted(14, 3, "ram", 0.0)


def test_a_prompt_that_fits_one_chunk_is_not_cut_to_align_it():
    core, _ = make()
    hit = ram_hit(range(10, 13), 3)
    results = run(core, StepOps(starts=(start("a", range(10, 17), hit=hit, max_tokens=1),)))
    assert [(m.new_tokens, m.context) for m in notes(results, PrefillMeasured)] == [(3, 3)]  # one step, not 1 + 2


def test_rows_prefilling_together_keep_their_whole_chunks():
    core, generator = make(prefill_slice_s=0)
    steps(core, 1, StepOps(starts=(start("a", range(10, 23), hit=ram_hit(range(10, 13), 3)),
                                   start("b", range(30, 45)))))
    assert generator.prefill_step_size == 4  # a whole chunk each: one alignment cannot suit both rows
    alone, generator = make(prefill_slice_s=0)
    steps(alone, 1, StepOps(starts=(start("a", range(10, 23), hit=ram_hit(range(10, 13), 3)),)))
    assert generator.prefill_step_size == 1  # alone, cut to end at 4


def test_a_suffix_prefilled_apart_ends_its_chunks_on_multiples_of_the_step(monkeypatch):
    """MLXD_SUFFIX_APART: a suffix joining an idle engine is prefilled outside the batch, cut as the batch cuts
    a lone row's chunks; the row then decodes from every token."""
    core, _ = make()
    monkeypatch.setattr(engine_core, "SUFFIX_APART", 64)
    chunks: list[tuple[int, int]] = []

    def model(tokens, cache):
        chunks.append((cache[0].offset, tokens.shape[1]))
        feed(cache, [int(t) for t in tokens[0].tolist()])

    core.model = model
    results = run(core, StepOps(starts=(start("a", range(10, 24), hit=ram_hit(range(10, 13), 3), max_tokens=2),)))
    assert chunks == [(3, 1), (4, 4), (8, 4), (12, 1)]  # to 4, then whole steps, then what is left
    assert finished(results).completion_tokens == 2
    assert [e.token for e in events(results, "a") if isinstance(e, TokenGenerated)] == [24, 25]


def test_a_prefill_measure_counts_only_the_chunk_it_timed():
    core, _ = make(prefill_slice_s=0)  # whole chunks (slices would shrink them once b waits for its token)
    results = steps(core, 3, StepOps(starts=(start("a", range(10, 23)), start("b"))))
    # Step 1 prefills a chunk of each row (not measured: two chunks); step 2 a's second chunk alone.
    measured = [(m.new_tokens, m.context) for m in notes(results, PrefillMeasured)]
    assert measured == [(4, 4), (4, 8)]  # once reported as (8, 0): two chunks in one chunk's time


def test_no_prefill_measure_while_another_row_decodes():
    core, _ = make()
    steps(core, 3, StepOps(starts=(start("a", max_tokens=10),)))
    results = steps(core, 2, StepOps(starts=(start("b", range(20, 30)),)))
    assert notes(results, PrefillMeasured) == []


def test_no_memory_readings_without_a_memory_budget():
    core, _ = make()
    assert not core.measures_memory
    assert notes(run(core, StepOps(starts=(start("a", max_tokens=10),))), MemoryMeasured) == []


def test_memory_readings_at_prefill_boundaries_and_every_few_decode_steps(monkeypatch):
    # `load()` sets the budget (loading.memory_budget); a core built `over` a generator loads
    # nothing, so the test sets what load() would have from the config. (MLXD_FINAL_PLAN=with-token: the row's
    # finish in the step of its last token; after-forward adds a step after it, without a reading.)
    monkeypatch.setenv("MLXD_FINAL_PLAN", "with-token")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=1, memory_budget_bytes=1 << 30)
    core._memory_budget = loading.memory_budget(core._config)
    assert core.measures_memory
    monkeypatch.setattr(engine_core, "MEASURE_MEMORY_EVERY", 3)
    results = run(core, StepOps(starts=(start("a", max_tokens=8),)))
    reasons = [[n.reason for n in r.notes if isinstance(n, MemoryMeasured)] for r in results]
    assert reasons == [["prefill"], ["prefill"], [], [], ["decode"], [], [], ["decode"], [], []]
    first = [type(n).__name__ for n in results[0].notes]
    assert first == ["PrefillMeasured", "PublishPrefix", "MemoryMeasured"]  # the reading comes last
    assert results[0].notes[-1].active_bytes > 0


def test_no_memory_reading_while_a_deferred_checkpoint_copy_waits_then_one_after_its_publication(tmp_path):
    # The copy would be read as memory outside the cache, then counted again inside it once published (the
    # cache owner's budget would relieve it twice over): the reading waits for the publication.
    identity = StoreIdentity(model_id="m", fingerprint="f", tokenizer_hash="t")
    core, _ = make(**CACHE_ON, snapshot_min_tokens=8, memory_budget_bytes=1 << 30, ssd_cache_dir=tmp_path,
                   identity=identity)
    core._memory_budget = loading.memory_budget(core._config)
    results = run(core, StepOps(starts=(start("a", tuple(range(10, 19)), max_tokens=6),)))
    (boundary,) = published(results, "boundary")
    at = next(i for i, r in enumerate(results) if boundary in r.notes)
    kinds_there = [type(n).__name__ for n in results[at].notes]
    assert kinds_there[kinds_there.index("PublishPrefix") + 1] == "MemoryMeasured"
    assert at > 1
    for r in results[1:at]:  # from the step that took the boundary's copy (the second chunk's) to its publication
        assert not [n for n in r.notes if isinstance(n, MemoryMeasured)]


def test_a_second_start_with_a_request_id_already_generating_is_refused_alone():
    core, _ = make()
    first = steps(core, 1, StepOps(starts=(start("a", max_tokens=10),)))
    again = core.step(StepOps(starts=(start("a"),), cancels=("a", "a")))
    assert [r.request_id for r in again.rejected] == ["a"] and "already generating" in again.rejected[0].message
    assert again.finished == ("a",) and core.stats().batch_rows == 0  # the cancel, once
    assert first


def test_a_long_prompt_prefilled_alone_is_timed_whole_to_its_first_token():
    core, _ = make(prefill_step_size=64)
    prompt = tuple(range(100, 400))  # 300 tokens: long enough to be timed whole
    results = run(core, StepOps(starts=(start("a", prompt, max_tokens=2),)), limit=20)
    whole = [m for m in notes(results, PrefillMeasured) if m.whole]
    assert [(m.new_tokens, m.context) for m in whole] == [(300, 0)] and whole[0].seconds > 0
    chunks = [m for m in notes(results, PrefillMeasured) if not m.whole]
    assert chunks and all(m.new_tokens <= 64 for m in chunks)
    # Beside another row the wall time is not its own: no whole timing; nor for a short prompt.
    core, _ = make(prefill_step_size=64)
    shared = run(core, StepOps(starts=(start("b", prompt, max_tokens=2), start("c", range(500, 800)))), limit=20)
    short = run(core, StepOps(starts=(start("d", range(900, 1100), max_tokens=2),)), limit=20)
    assert [m for m in notes(shared + short, PrefillMeasured) if m.whole] == []
