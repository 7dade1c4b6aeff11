"""--draft-model: the draft's KV follows the target's prefix cache, and output stays identical.

The draft's checkpoints are cache entries in their own namespace, published when
the target publishes (prompt boundary, row end) and looked up with the same
tokens. Checked on the real tiny model: the checkpoints a row publishes; a RAM
hit in one EngineCore (greedy, seeded, a mixed batch of a cached, a recomputing
and a cold row) equal to speculation off, with the draft's KV from the cache
equal to the one it recomputes; a runtime RAM hit and a restart over the same
SSD directory (the draft's prefix restored from disk); /stats and /metrics.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
import trio

from mlxd import SamplingParams, open_runtime
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.engine.ops import RowStart
from mlxd.engine.speculative import draft_namespace
from mlxd.kv.ngram import SpeculationGate
from mlxd.kv.prompt_cache import PromptCache
from mlxd.model import build_model
from mlxd.runtime.kernel.messages import (
    DraftPrefix,
    GenerationRequest,
)

from serving import ServerThread, checkpoints_settled, config_for, drop_after

NO_EOS = ((0, -100.0), (2, -100.0))  # the tiny model's end tokens never win: rows run to max_tokens
rnd = random.Random(23)
PREFIX = tuple(rnd.randrange(3, 250) for _ in range(90))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model with the target's tokenizer (seed 1): a draft whose KV differs from the target's."""
    return build_model(tmp_path_factory.mktemp("draft") / "draft", "test", seed=1)


@pytest.fixture(scope="module")
def cores(tiny_model_dir: Path, draft_dir: Path):
    off = EngineCore(config_for(tiny_model_dir))
    on = EngineCore(config_for(tiny_model_dir, speculative="draft", draft_model=str(draft_dir)))
    off.load()
    info = on.load()
    yield off, on, info.draft_tag
    off.close()
    on.close()


def _request(rid: str, prompt: tuple[int, ...], **sampling: object) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def _drive(core: EngineCore, starts: list[RowStart]):
    """Run rows to their end: tokens and logprobs per request, and every checkpoint published.

    The engine gate starts afresh: this file checks what the draft's first step reads, and the
    unrelated draft's rejected drafts would otherwise pause drafting across runs (kv/ngram.py)."""
    core._drafts.gate = SpeculationGate()
    run = run_rows(core, starts)
    return run.tokens, run.logprobs, run.notes


def _prefix_counts(core: EngineCore) -> tuple[int, int]:
    spec = core.stats().speculation
    assert spec is not None
    return spec.draft_prefix_reused, spec.draft_prefix_recomputed


def test_draft_checkpoints_follow_the_target_and_a_ram_hit_reuses_them(cores):
    off, on, tag = cores
    ns = draft_namespace("", tag)
    turn1 = [_request("t1", PREFIX, max_tokens=24, logit_bias=NO_EOS)]
    tokens1, _, notes = _drive(on, [RowStart(request=r) for r in turn1])
    assert tokens1 == _drive(off, [RowStart(request=r) for r in turn1])[0]
    drafts = {n.reason: n for n in notes if n.namespace == ns}
    targets = {n.reason: n for n in notes if n.namespace == ""}
    assert set(drafts) == set(targets) == {"boundary", "final"}, "the draft publishes when the target does"
    assert drafts["boundary"].tokens == PREFIX, "the draft's prompt boundary: the whole prompt"
    final = drafts["final"].tokens
    assert final == targets["final"].tokens, "every accepted token (the draft reads those after its last proposal)"
    assert final == PREFIX + tuple(tokens1["t1"])[: len(final) - len(PREFIX)]

    ram = PromptCache(max_bytes=1 << 30)
    for n in notes:
        ram.put(n.tokens, n.namespace, payload=n.payload, nbytes=n.nbytes, trimmable=n.trimmable)
    follow = PREFIX + tuple(tokens1["t1"]) + tuple(rnd.randrange(3, 250) for _ in range(12))
    hit, dhit = ram.peek(follow, ""), ram.peek(follow, ns)
    assert hit is not None and dhit is not None and dhit.usable > len(PREFIX)

    for sampling in ({"max_tokens": 30}, {"max_tokens": 30, "temperature": 1.3, "seed": 9, "logprobs": True}):
        req = _request("t2", follow, logit_bias=NO_EOS, **sampling)
        plain, plain_lp, _ = _drive(off, [RowStart(request=req, hit=hit)])
        before = _prefix_counts(on)
        cached, cached_lp, cached_notes = _drive(on, [RowStart(request=req, hit=hit, draft=DraftPrefix(ns, dhit))])
        mid = _prefix_counts(on)
        again, again_lp, again_notes = _drive(on, [RowStart(request=req, hit=hit)])  # the draft recomputes
        after = _prefix_counts(on)
        assert cached == again == plain
        assert cached_lp["t2"] == pytest.approx(plain_lp["t2"], abs=1e-4)
        assert again_lp["t2"] == pytest.approx(plain_lp["t2"], abs=1e-4)
        assert (mid[0] - before[0], mid[1] - before[1]) == (dhit.usable, len(follow) - dhit.usable)
        assert (after[0] - mid[0], after[1] - mid[1]) == (0, len(follow))
        # The draft's KV built on the cached prefix equals the one it recomputes from scratch.
        a = next(n for n in cached_notes if n.namespace == ns and n.reason == "final")
        b = next(n for n in again_notes if n.namespace == ns and n.reason == "final")
        assert a.tokens == b.tokens and len(a.tokens) > len(follow)
        for ca, cb in zip(a.payload, b.payload, strict=True):
            assert ca.offset == cb.offset == len(a.tokens)
            for x, y in ((ca.keys, cb.keys), (ca.values, cb.values)):
                n = ca.offset
                assert mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-4).item()
        assert not [n for n in cached_notes if n.namespace == ns and n.reason == "boundary"], (
            "no boundary: the target's hit leaves too few new prompt tokens"
        )

    # A mixed batch: a row on the draft's cached prefix, one recomputing it, a cold row, seeded and greedy.
    other = tuple(rnd.randrange(3, 250) for _ in range(40))
    reqs = [
        _request("cached", follow, max_tokens=20, logit_bias=NO_EOS),
        _request("recompute", follow, max_tokens=25, temperature=0.9, seed=4, logit_bias=NO_EOS),
        _request("cold", other, max_tokens=20, temperature=1.5, seed=2),
    ]
    draft_of = {"cached": DraftPrefix(ns, dhit), "recompute": None, "cold": None}
    plain = _drive(off, [RowStart(request=r, hit=hit if r.prompt == follow else None) for r in reqs])[0]
    mixed = _drive(on, [RowStart(request=r, hit=hit if r.prompt == follow else None, draft=draft_of[r.request_id])
                        for r in reqs])[0]
    assert mixed == plain
    assert dhit.entry.tokens == final, "lending left the cached entry as it was"
    # A row that ends before its draft ever runs publishes no draft checkpoint (it would repeat the lent one).
    one = _request("one", follow, max_tokens=1)
    assert not [n for n in _drive(on, [RowStart(request=one, hit=hit, draft=DraftPrefix(ns, dhit))])[2]
                if n.namespace == ns]


@pytest.mark.parametrize("ram_pages", ["off", "on"])
async def test_a_ram_hit_and_a_restart_bring_the_draft_prefix(tiny_model_dir, draft_dir, tmp_path, ram_pages):
    """Contiguous RAM entries and paged ones (--ram-pages on: the draft's pages are its namespace's own)."""
    sampling = SamplingParams(max_tokens=32, temperature=1.1, seed=5, logit_bias=NO_EOS)
    text = "The draft follows the cache: " + "a prefix worth keeping, " * 6
    plain = config_for(tiny_model_dir)
    spec = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", speculative="draft", draft_model=str(draft_dir),
                      ram_pages=ram_pages)
    reference: list[list[int]] = []
    async with open_runtime(plain) as rt:
        first = rt.encode(text)
        async with rt.submit(rt.request(first, sampling=sampling)) as stream:
            reference.append(await stream.tokens())
        second = tuple(first) + tuple(reference[0]) + tuple(rt.encode(" and again"))
        async with rt.submit(rt.request(second, sampling=sampling)) as stream:
            reference.append(await stream.tokens())
    async with open_runtime(spec) as rt:
        for prompt, ref in zip((first, second), reference, strict=True):
            async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
                assert await stream.tokens() == ref
        async with rt.submit(rt.request(second, sampling=sampling)) as stream:
            assert await stream.tokens() == reference[1]
            assert stream.accepted.cache_tier == "ram"
        stats = (await rt.stats()).engine.speculation
        assert stats is not None and stats.draft_prefix_reused >= len(first), stats
        assert stats.draft_prefix_recomputed < 2 * len(second), "the follow-ups reused the draft's prefix"
    # A restart over the same SSD directory (leaving the runtime flushed it): both prefixes come back from disk.
    async with open_runtime(spec) as rt:
        async with rt.submit(rt.request(second, sampling=sampling)) as stream:
            assert await stream.tokens() == reference[1]
            assert stream.accepted.cache_tier == "ssd"
        everything = await rt.stats()
        stats = everything.engine.speculation
        assert stats is not None and stats.draft_prefix_reused >= len(second) - 8, stats
        assert stats.draft_prefix_recomputed <= 8, stats
        prefetch = everything.as_dict()["ssd_cache"]["prefetch"]
        assert prefetch["prefetches"] == 2, "the request named both files to read ahead: the target's and the draft's"


async def test_a_resumed_generation_s_draft_looks_up_its_prefix(tiny_model_dir, draft_dir, tmp_path):
    """A dropped generation resumed from its checkpoint: the draft's lookup is made with the checkpoint's
    tokens (prompt + emitted), so it starts from the draft's entry the dropped row left (its final
    checkpoint, every accepted token) instead of recomputing; the tokens are the uninterrupted ones."""
    sampling = SamplingParams(max_tokens=60, temperature=1.1, seed=3, logit_bias=NO_EOS)
    text = "A resumed draft looks its prefix up: " + "the checkpoint's tokens, " * 5
    async with open_runtime(config_for(tiny_model_dir)) as rt:
        prompt = rt.encode(text)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            reference = await stream.tokens()
    config = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=8,
                        speculative="draft", draft_model=str(draft_dir))
    async with open_runtime(config) as rt:
        seen = await drop_after(rt, rt.request(prompt, sampling=sampling), 30)  # the client goes away
        assert seen == reference[:30]
        await checkpoints_settled(rt)
        await trio.sleep(0.05)
        before = (await rt.stats()).engine.speculation
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            again = await stream.tokens()
            assert stream.accepted.cache_tier == "checkpoint"
        assert again == reference
        after = (await rt.stats()).engine.speculation
        assert before is not None and after is not None
        reused, recomputed = (after.draft_prefix_reused - before.draft_prefix_reused,
                              after.draft_prefix_recomputed - before.draft_prefix_recomputed)
        assert reused > len(prompt) and recomputed <= 2, (reused, recomputed)


def test_stats_and_metrics_count_the_draft_prefix(tiny_model_dir, draft_dir):
    config = config_for(tiny_model_dir, speculative="draft", draft_model=str(draft_dir))
    with ServerThread(config) as server:
        messages = [{"role": "user", "content": "tell me about the cache " * 8}]
        for _ in range(2):  # the second is a RAM hit of the first prompt
            r = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                           json={"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
        root = server.base_url.removesuffix("/v1")
        spec = httpx.get(f"{root}/stats", timeout=30).json()["engine"]["speculation"]
        assert spec["draft_prefix_reused"] > 0 and spec["draft_prefix_recomputed"] > 0, spec
        metrics = httpx.get(f"{root}/metrics", timeout=30).text
        assert f"mlxd_speculation_draft_prefix_reused_tokens_total {float(spec['draft_prefix_reused'])}" in metrics
        assert "mlxd_speculation_draft_prefix_recomputed_tokens_total" in metrics
        # The four figures under a draft model too, /metrics equal to /stats.
        lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("mlxd_speculation_"))
        assert spec["proposed"] > 0, spec
        for name, field in (("mlxd_speculation_proposed_tokens_total", "proposed"),
                            ("mlxd_speculation_accepted_tokens_total", "accepted"),
                            ("mlxd_speculation_acceptance_rate", "acceptance_rate"),
                            ("mlxd_speculation_tokens_per_forward", "tokens_per_forward"),
                            ("mlxd_speculation_draft_steps_total", "draft_steps")):
            assert float(lines[name]) == pytest.approx(spec[field]), name
