"""--draft-model: the draft proposes for every speculating row in one forward per draft position.

Checked on the real tiny model: rows proposed together give the drafts and the
draft KV that each row proposing alone gives (different prompt lengths, a row
starting from a lent cache, rejected drafts, a row that sat out steps, a row of
one token, different K), and an engine's mixed batch (a RAM hit with the
draft's cached prefix, cold rows of other lengths, seeded, constrained and
short rows) stays token for token identical to speculation off while its draft
steps propose for several rows at once.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd import SamplingParams
from mlxd.engine.core import EngineCore
from mlxd.engine.draft import DraftModel, ModelDrafts, propose_rows
from mlxd.engine.drive import run_rows
from mlxd.engine.ops import RowStart
from mlxd.engine.speculative import draft_namespace
from mlxd.kv.prompt_cache import PromptCache
from mlxd.model import build_model
from mlxd.model.detok import load_model
from mlxd.runtime.kernel.messages import DraftPrefix, GenerationRequest
from mlxd.structured.spec import constraint_from_request

from serving import config_for

NO_EOS = ((0, -100.0), (2, -100.0))  # the tiny model's end tokens never win: rows run to max_tokens
rnd = random.Random(2323)


def _tokens(n: int) -> list[int]:
    return [rnd.randrange(3, 250) for _ in range(n)]


def _same_kv(a: ModelDrafts, b: ModelDrafts) -> None:
    """`a` (proposed with others) holds what `b` (alone) holds; with a smaller K than the batch's,
    `a` was fed the batch's further drafts too (cut back at its next step like rejected ones)."""
    n = len(b.held)
    assert a.held[:n] == b.held and a.accepted == b.accepted
    assert a.caches is not None and b.caches is not None
    for ca, cb in zip(a.caches, b.caches, strict=True):
        assert ca.offset == len(a.held) and cb.offset == n
        for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)):
            assert mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-4).item()


def test_rows_proposed_together_equal_rows_proposed_one_by_one(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir)
    model.set_dtype(mx.float32)
    draft = DraftModel(tiny_model_dir, model, prefill_step=16)  # small chunks: a long catch-up is chunked
    prompts = [_tokens(1), _tokens(7), _tokens(40), _tokens(90)]
    ks = [4, 4, 2, 4]

    # The last row starts from a lent cache (a RAM hit over its first 60 tokens).
    seed = ModelDrafts(draft)
    seed.propose(prompts[3][:59], prompts[3][59], 4)
    lent, lent_tokens = seed.checkpoint(prompts[3][:60])
    assert lent_tokens == prompts[3][:60]

    def rows() -> list[ModelDrafts]:
        out = [ModelDrafts(draft) for _ in prompts]
        out[3].start(seed.checkpoint(prompts[3][:60])[0], lent_tokens)
        return out

    together, alone = rows(), rows()
    tokens = [p[:-1] for p in prompts]
    pending = [p[-1] for p in prompts]
    sat_out = {1: 2}  # row 1 does not draft at step 2: at step 3 it catches up on more than 1 + K tokens
    for step in range(4):
        asking = [i for i in range(len(prompts)) if sat_out.get(i) != step]
        got = propose_rows([(together[i], tokens[i], pending[i], ks[i]) for i in asking])
        want = [alone[i].propose(tokens[i], pending[i], ks[i]) for i in asking]
        assert got == want, step
        for i, drafts in zip(asking, got, strict=True):
            _same_kv(together[i], alone[i])
            # The target accepts a row-dependent number of drafts, then samples its own next token.
            n = (i + step) % (len(drafts) + 1)
            tokens[i] = [*tokens[i], pending[i], *drafts[:n]]
            pending[i] = rnd.randrange(3, 250)
        for i in set(range(len(prompts))) - set(asking):  # a row that sat out still emits tokens
            tokens[i] = [*tokens[i], pending[i], *_tokens(5)]
            pending[i] = rnd.randrange(3, 250)
    assert seed.checkpoint(prompts[3][:60])[1] == lent_tokens, "the lent cache was left as it was"
    # A checkpoint from a row's view of the batch cache holds its accepted tokens.
    caches, held = together[2].checkpoint()
    assert held == together[2].held[: together[2].accepted] and caches[0].offset == len(held)
    with pytest.raises(ValueError, match="different draft models"):
        propose_rows([(together[0], tokens[0], pending[0], 4),
                      (ModelDrafts(DraftModel(tiny_model_dir, model)), tokens[1], pending[1], 4)])


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("draft") / "draft", "test", seed=1)


def _request(rid: str, prompt: tuple[int, ...], **sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize("draft", ["self", "unrelated"])
def test_a_mixed_batch_drafts_together_and_stays_identical(tiny_model_dir: Path, unrelated: Path, draft: str) -> None:
    draft_dir = tiny_model_dir if draft == "self" else unrelated
    off = EngineCore(config_for(tiny_model_dir))
    on = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(draft_dir)))
    off.load()
    tag = on.load().draft_tag
    try:
        prefix = tuple(_tokens(70))
        first = run_rows(on, [_request("turn1", prefix, max_tokens=16, logit_bias=NO_EOS)])
        ram = PromptCache(max_bytes=1 << 30)
        for n in first.notes:
            ram.put(n.tokens, n.namespace, payload=n.payload, nbytes=n.nbytes, trimmable=n.trimmable)
        follow = prefix + tuple(first.tokens["turn1"]) + tuple(_tokens(9))
        ns = draft_namespace("", tag)
        hit, dhit = ram.peek(follow, ""), ram.peek(follow, ns)
        assert hit is not None and dhit is not None and dhit.usable > len(prefix)

        grammar = constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
            "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                          "minItems": 6, "maxItems": 6}}}})
        reqs = [
            _request("hit", follow, max_tokens=40, logit_bias=NO_EOS),
            _request("cold", tuple(_tokens(13)), max_tokens=36, temperature=1.2, seed=4, logit_bias=NO_EOS),
            _request("long", tuple(_tokens(50)) * 2, max_tokens=44, logit_bias=NO_EOS),
            _request("short", tuple(_tokens(3)), max_tokens=3),  # ends before it could draft much
            _request("json", tuple(_tokens(5)), max_tokens=80, temperature=0.8, seed=6, constraint=grammar),
        ]
        starts = {r.request_id: RowStart(request=r, hit=hit if r.prompt == follow else None) for r in reqs}
        plain = run_rows(off, list(starts.values()))
        starts["hit"] = RowStart(request=reqs[0], hit=hit, draft=DraftPrefix(ns, dhit))
        before = on.stats().speculation
        mixed = run_rows(on, list(starts.values()))
        after = on.stats().speculation
        assert before is not None and after is not None
        assert mixed.tokens == plain.tokens and mixed.reasons == plain.reasons
        for rid in plain.tokens:
            assert mixed.logprobs[rid] == pytest.approx(plain.logprobs[rid], abs=1e-4), rid
        steps, rows = after.draft_steps - before.draft_steps, after.draft_rows - before.draft_rows
        assert steps > 0 and rows > steps, (steps, rows)  # several rows per draft forward
        assert after.draft_prefix_reused - before.draft_prefix_reused >= dhit.usable
        if draft == "self":
            assert after.accepted - before.accepted > 0.5 * (after.proposed - before.proposed)
    finally:
        off.close()
        on.close()


def test_the_draft_batch_is_kept_and_copies_only_rows_that_changed(tiny_model_dir: Path) -> None:
    """Steps of the same rows write their new positions only (no KV copied, the same batch); a row
    that sat out catches up in its slot (the rows' catch-ups fed together, nothing copied); a new row takes
    the slot of a row that ended; every row's drafts and KV stay what it gives alone."""
    import gc

    from mlxd.engine import draft as draft_mod

    model, _ = load_model(tiny_model_dir)
    model.set_dtype(mx.float32)
    draft = DraftModel(tiny_model_dir, model, prefill_step=16)
    prompts = [_tokens(30), _tokens(45), _tokens(60)]
    together = [ModelDrafts(draft) for _ in prompts]
    alone = [ModelDrafts(draft) for _ in prompts]
    tokens = [p[:-1] for p in prompts]
    pending = [p[-1] for p in prompts]

    def step(rows: list[int]) -> None:
        got = propose_rows([(together[i], tokens[i], pending[i], 4) for i in rows])
        assert got == [alone[i].propose(tokens[i], pending[i], 4) for i in rows]
        for i, drafts in zip(rows, got, strict=True):
            _same_kv(together[i], alone[i])
            n = (i + len(tokens[i])) % (len(drafts) + 1)  # rows accept different numbers of drafts
            tokens[i] = [*tokens[i], pending[i], *drafts[:n]]
            pending[i] = rnd.randrange(3, 250)

    step([0, 1, 2])
    batch, c = draft.batch[0](), draft_mod.COPIED
    before = (c.bytes, c.builds, c.adopted)
    for _ in range(3):
        step([0, 1, 2])
    assert draft.batch[0]() is batch and (c.bytes, c.builds, c.adopted) == before
    tokens[1] = [*tokens[1], pending[1], *_tokens(12)]  # row 1 sat out: it catches up in its slot
    pending[1] = rnd.randrange(3, 250)
    step([0, 2])  # row 1 keeps its slot, not advanced
    step([0, 1, 2])
    assert draft.batch[0]() is batch and (c.bytes, c.builds, c.adopted) == before
    # Row 2 ends; a new row takes its slot (its own KV copied in), nothing else is copied.
    del together[2], alone[2], tokens[2], pending[2]
    gc.collect()
    newcomer = _tokens(20)
    together.append(ModelDrafts(draft))
    alone.append(ModelDrafts(draft))
    tokens.append(newcomer[:-1])
    pending.append(newcomer[-1])
    step([0, 1, 2])
    assert draft.batch[0]() is batch and c.builds == before[1]
    # A checkpoint of a row in the batch is a copy of its tokens' KV, not a view of the batch.
    caches, held = together[0].checkpoint()
    assert held == together[0].held[: together[0].accepted] and caches[0].offset == len(held)
    assert caches[0].keys.shape[2] == len(held)
    # The batch lives while rows' caches are its slots: when the rows go, so does the draft KV it held.
    together.clear()
    alone.clear()
    del batch, caches
    gc.collect()
    assert draft.batch[0]() is None


@pytest.mark.parametrize("draft", ["self", "unrelated"])
def test_a_batch_probes_with_one_row_s_unverified_draft(tiny_model_dir: Path, unrelated: Path, draft: str) -> None:
    """At batch 3 the gate's first steps are probes: one row drafts one token in a plain step (no
    verifying forward), compared with what the row then emits. Rows sampled at t = 8 (nearly
    uniform over the tiny vocabulary; at t = 1 its rows collapse onto tokens any draft predicts) and
    an unrelated draft: the probes find nothing accepted, no step ever verifies and drafting pauses (1 row's
    drafts paid, not 3 rows' prefills); the model as its own draft on greedy rows: the probes are
    accepted and the whole batch verifies after them. Tokens equal speculation off's either way."""
    draft_dir = tiny_model_dir if draft == "self" else unrelated
    off = EngineCore(config_for(tiny_model_dir))
    on = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(draft_dir)))
    off.load()
    on.load()
    try:
        if draft == "self":
            reqs = [_request(f"g{i}", tuple(_tokens(20 + 9 * i)), max_tokens=30, logit_bias=NO_EOS) for i in range(3)]
        else:
            reqs = [_request(f"s{i}", tuple(_tokens(20 + 9 * i)), max_tokens=30, temperature=8.0, seed=40 + i,
                             logit_bias=NO_EOS) for i in range(3)]
        plain = run_rows(off, reqs)
        got = run_rows(on, reqs)
        spec = on.stats().speculation
        assert spec is not None
        assert got.tokens == plain.tokens
        for rid in plain.tokens:
            assert got.logprobs[rid] == pytest.approx(plain.logprobs[rid], abs=1e-4), rid
        assert spec.gate_probes >= 2, spec  # the gate's min_tries probes, one row each
        if draft == "unrelated":
            assert (spec.verify_steps, spec.draft_steps, spec.gate_probe_accepted) == (0, 0, 0), spec
            assert spec.gate_pauses >= 1 and spec.draft_prefix_recomputed < 20 + 9 * 3, spec  # one row's prefix
        else:
            assert spec.gate_probe_accepted >= 2 and spec.verify_steps > 0, spec
            assert spec.draft_rows > spec.draft_steps, spec  # the whole batch drafts after the probes
    finally:
        off.close()
        on.close()


def test_a_batch_of_constrained_rows_only_verifies_without_probes(tiny_model_dir: Path) -> None:
    """A constrained row is never a probe row (its matcher is not at the tokens a probe drafts
    after); a batch of constrained rows only is verified as before probes existed, and gives off's
    tokens."""
    grammar = constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                      "minItems": 8, "maxItems": 8}}}})
    reqs = [_request(f"j{i}", tuple(_tokens(6 + i)), max_tokens=80, constraint=grammar) for i in range(2)]
    off = EngineCore(config_for(tiny_model_dir))
    on = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir)))
    off.load()
    on.load()
    try:
        plain, got = run_rows(off, reqs), run_rows(on, reqs)
        spec = on.stats().speculation
        assert spec is not None and got.tokens == plain.tokens
        assert spec.gate_probes == 0 and spec.verify_steps > 0 and spec.draft_rows > spec.draft_steps, spec
    finally:
        off.close()
        on.close()
