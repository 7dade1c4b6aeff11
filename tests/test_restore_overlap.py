"""Overlapped split: recompute a cold record's first part while its last part is read from SSD.

The pure choice (`RestoreAdvisor.plan` with `tails`) where it beats both arms and where it
does not, the tails a block layout offers (`tiers.restore_tails`), a block checkpoint's
last blocks read alone (`BlockStore.load(start=...)`) and appended to a row's caches
(`kinds.extend`), the engine's overlapped row on the real tiny model (a tail that landed,
one that did not, one whose read failed: the same tokens and logprobs every time), and a
live server whose forced overlap gives the cold prefill's greedy tokens and logprobs, its
simulator replay deciding alike.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

from mlxd import SamplingParams
from mlxd.actors.scheduler import first_token_split
from mlxd.cli import record_trace
from mlxd.engine import loading
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.engine.ops import RowStart
from mlxd.kv import blocks as bk
from mlxd.kv import kinds
from mlxd.kv.block_store import BlockStore
from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import OVERLAP, RECOMPUTE, RESTORE, RestoreAdvisor, RestoreCut
from mlxd.kv.tiers import CacheTiers, SsdMatch, restore_tails
from mlxd.runtime.kernel.messages import GenerationRequest, TailRestore
from test_restore_split import (
    IDENTITY,
    block_record,
    complete,
    conversation_kv,
    flush,
    simulate,
    stats,
)

from serving import ServerThread, config_for

PER_TOKEN = DEFAULT.kv_bytes_per_token
# A GPU's regime (H100 2026-12-06: a 16k-token recompute 0.43 s, its SSD restore 1.02 s): the read of a
# token about 2.4x its recompute's share; DEFAULT's prefill cost with a disk that slow.
GPU_LIKE = attrs.evolve(DEFAULT, restore_bytes_per_s=PER_TOKEN * 8000 / (2.4 * DEFAULT.prefill_seconds(8000)))


def whole_cuts(tokens: int, step: int) -> list[RestoreCut]:
    return [RestoreCut(end, end * PER_TOKEN) for end in range(step, tokens + 1, step)]


def tails(tokens: int, step: int, warm: int = 0) -> list[RestoreCut]:
    """The tails [start, tokens) of a `tokens`-token record in `step`-token blocks."""
    return [RestoreCut(tokens, (tokens - s) * PER_TOKEN, start=s) for s in range(step, tokens, step) if s > warm]


# --- the pure choice -------------------------------------------------------------------------------


def test_an_overlap_beats_both_arms_where_neither_is_much_faster():
    a = RestoreAdvisor(base=GPU_LIKE, weigh_overlap=True)
    plan = a.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert plan.arm == OVERLAP and 0 < plan.cut.start < 8000 and plan.cut.tokens == 8000
    assert plan.seconds < plan.recompute_seconds and plan.seconds < plan.restore_seconds
    # its cost: the longer of the head's recompute and the tail's read, then the rest on top of both
    head = a.prefill_seconds(plan.cut.start, 0)
    read = a.restore_seconds(plan.cut.nbytes)
    assert plan.seconds == pytest.approx(max(head, read) + a.prefill_seconds(100, 8000))
    assert plan.read_seconds == pytest.approx(read)  # what the engine waits for the tail by
    assert plan.head_seconds == pytest.approx(head)
    # both halves in the stats, as predicted (the restart bench sets them beside the served stages)
    assert a.stats()["last_overlap_head_s"] == pytest.approx(head, abs=1e-6)
    assert a.stats()["last_overlap_read_s"] == pytest.approx(read, abs=1e-6)
    # the best tail of those offered
    best = min(a.overlap_seconds(t, 0, 8100) for t in tails(8000, 500))
    assert plan.seconds == pytest.approx(best)
    assert a.stats()["overlaps_chosen"] == 1 and a.stats()["recomputes_chosen"] == 0
    # about half the record each way: ~0.6x the recompute arm here
    assert plan.seconds < 0.75 * plan.recompute_seconds


def test_no_overlap_where_one_arm_is_far_faster():
    fast = RestoreAdvisor(base=DEFAULT, weigh_overlap=True)  # the CPU: restores orders of magnitude faster
    assert fast.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100).arm == RESTORE
    slow = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e3), weigh_overlap=True)
    assert slow.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100).arm == RECOMPUTE
    assert fast.overlaps_chosen == slow.overlaps_chosen == 0


def test_overlaps_are_weighed_only_when_asked_and_forced_in_the_middle():
    off = RestoreAdvisor(base=GPU_LIKE)
    assert off.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100).arm != OVERLAP
    forced = RestoreAdvisor(base=DEFAULT, overlap=True)  # restores far faster: forced all the same
    plan = forced.plan(cuts=whole_cuts(8000, 1000), tails=tails(8000, 1000, 2000), warm_tokens=2000, prompt_tokens=8100)
    assert plan.arm == OVERLAP and plan.seconds > plan.restore_seconds
    assert plan.cut.start == 3000  # its best tail: here the least head to recompute, reads being cheap
    # tails starting within the warm prefix are ignored; none left: the arms decide
    none_left = forced.plan(cuts=whole_cuts(8000, 1000), tails=tails(8000, 1000), warm_tokens=7500, prompt_tokens=8100)
    assert none_left.arm != OVERLAP
    # the advisors of --restore-choice / --restore-overlap
    assert RestoreAdvisor.for_choice("measured").weigh_overlap
    assert not RestoreAdvisor.for_choice("measured", overlap=False).weigh_overlap
    assert not RestoreAdvisor.for_choice("always").weigh_overlap and RestoreAdvisor.for_choice("overlap").overlap
    # a quantized KV cache is never extended by a read tail: its server weighs none
    from mlxd import RuntimeConfig

    assert RuntimeConfig().overlaps_weighed and not RuntimeConfig(restore_overlap=False).overlaps_weighed
    assert not RuntimeConfig(kv_bits=4).overlaps_weighed
    from mlxd.cli import build_parser, serve_config

    def served(*flags: str) -> RuntimeConfig:
        return serve_config(build_parser().parse_args(["serve", "--ssd-cache", "/tmp/unused-ssd", *flags]))

    assert served().restore_overlap and not served("--restore-overlap", "off").restore_overlap
    assert served("--restore-choice", "overlap").restore_choice == "overlap"


def test_a_head_is_predicted_at_its_own_scale_and_moves_the_tail():
    # A head is prefilled apart, with no first token to sample: on the CPU it ran 10-25% faster than the
    # whole prompts' scale put it, so the advisor paired it with too long a tail and the engine waited for the
    # read (190-220 ms of ~1 s turns). Heads now calibrate their own scale, and only it.
    a = RestoreAdvisor(base=GPU_LIKE, weigh_overlap=True)
    before = a.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert before.arm == OVERLAP and before.head_seconds == pytest.approx(a.prefill_seconds(before.cut.start, 0))
    a.observe_prefill(new_tokens=before.cut.start, context=0, seconds=0.5 * before.head_seconds, head=True)
    assert a.prefill_scale == 1.0 and a.prefill_samples == 0  # a head does not move the whole prompts' scale
    assert a.head_samples == 1 and a.head_scale == pytest.approx(0.5)
    after = a.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert after.arm == OVERLAP and after.cut.start > before.cut.start  # a longer head, a shorter read
    assert after.head_seconds == pytest.approx(0.5 * a.prefill_seconds(after.cut.start, 0))
    assert after.seconds < before.seconds and after.recompute_seconds == before.recompute_seconds
    # the next heads move it as a moving average; a restarted server's advisor starts from it
    a.observe_prefill(new_tokens=4000, context=0, seconds=GPU_LIKE.prefill_seconds(4000, 0), head=True)
    assert a.head_scale == pytest.approx(0.7 * 0.5 + 0.3 * 1.0)
    resumed = RestoreAdvisor(base=GPU_LIKE, weigh_overlap=True)
    resumed.resume(a.calibration())
    assert (resumed.head_scale, resumed.head_samples) == (a.head_scale, 2)
    assert resumed.stats()["overlap_head_scale"] == round(a.head_scale, 4)
    fresh = RestoreAdvisor(base=GPU_LIKE)
    fresh.resume(RestoreAdvisor(base=GPU_LIKE).calibration())  # no head timed: the prefill scale stands in
    assert fresh.head_samples == 0 and fresh.head_seconds(4000, 0) == fresh.prefill_seconds(4000, 0)


def test_a_tail_not_taken_leaves_the_advisor_s_queue():
    # Each measured restore is filed under the residency of the oldest restore chosen and not yet measured; an
    # overlap whose tail was recomputed is never measured, and its (cold) share then filed the next restore, a
    # page-cache read, as the disk's (CPU 13:04: the disk believed at 0.58 GB/s, capped at 4 MB/s).
    a = RestoreAdvisor(base=GPU_LIKE, weigh_overlap=True, resident_bytes_per_s=1e12)
    assert a.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100).arm == OVERLAP
    a.forget_restore()  # the engine's RestoreMeasured(taken=False)
    nbytes = 8000 * PER_TOKEN
    resident = a.plan(cuts=[RestoreCut(8000, nbytes, nbytes)], warm_tokens=0, prompt_tokens=8100)
    assert resident.arm == RESTORE
    a.observe_restore(nbytes=nbytes, seconds=1e-3)
    assert a.resident_samples == 1 and a.restore_samples == 0


def test_an_exploration_is_not_replaced_by_an_overlap():
    # An unmeasured restore predicted slower than recompute is tried once what recomputing forwent covers
    # it (kv/restore_decision.py): that try measures the whole read, which an overlap would not.
    a = RestoreAdvisor(base=GPU_LIKE, weigh_overlap=True, explore=True, forgone_s=1e6)
    plan = a.plan(cuts=whole_cuts(8000, 500), tails=tails(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert plan.arm == RESTORE and plan.explore


# --- the tails a block layout offers ----------------------------------------------------------------


def test_tails_start_on_block_boundaries_past_the_warm_prefix_and_cost_their_blocks():
    rec = block_record(100, 32)
    found = restore_tails(SsdMatch(rec, 90), 20, lambda n: n)
    assert [(c.start, c.tokens, c.nbytes) for c, _ in found] == [(32, 90, 640), (64, 90, 320)]
    assert [(m.usable, m.read_tokens, m.read_from) for _, m in found] == [(90, 96, 32), (90, 96, 64)]
    last = restore_tails(SsdMatch(rec, 99), 40, lambda n: n)  # to the record's last block: read to its end
    assert [(c.start, c.nbytes, m.read_tokens) for c, m in last] == [(64, 360, 0), (96, 40, 0)]
    assert restore_tails(SsdMatch(block_record(100, 32, trimmable=False, state=True), 99), 0, lambda n: n) == []
    from mlxd.kv.tiers import SsdRecord

    assert restore_tails(SsdMatch(SsdRecord("", tuple(range(1, 101)), 1000, 0.0, True), 99), 0, lambda n: n) == []


def test_the_lookup_returns_the_overlap_and_the_prefetcher_reads_its_tail():
    tiers = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(overlap=True))
    tiers.load_records([block_record(128, 32)])
    lookup = tiers.lookup(tuple(range(1, 140)))
    assert lookup.plan.arm == OVERLAP and lookup.plan.cut.start == 32  # reads cheap: the least head
    assert (lookup.restore.usable, lookup.restore.read_from, lookup.restore.read_tokens) == (128, 32, 0)
    assert tiers.stats().restore_decisions["overlaps_chosen"] == 1
    ahead = tiers.prefetch_match(tuple(range(1, 140)))
    assert ahead.read_from == 32 and tiers.stats().restore_decisions["overlaps_chosen"] == 1
    # with rows in the engine the lookup weighs no overlap, and the read ahead reads no tail it would not take
    busy = tiers.prefetch_match(tuple(range(1, 140)), overlap=False)
    assert busy.read_from == 0 and busy.usable == 128
    assert tiers.lookup(tuple(range(1, 140)), overlap=False).restore.read_from == 0
    # without the knob (or --restore-overlap off) no tail is weighed
    plain = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(base=GPU_LIKE))
    plain.load_records([block_record(128, 32)])
    assert plain.lookup(tuple(range(1, 140))).plan.arm in (RESTORE, RECOMPUTE)


# --- a block checkpoint's last blocks read alone and appended --------------------------------------


def test_trailing_blocks_load_as_the_kv_of_their_tokens_and_extend_a_head(tmp_path):
    store = BlockStore(tmp_path, IDENTITY, block_tokens=16)
    tokens = list(range(1, 61))
    record = store.write(kinds.plan_snapshot(conversation_kv(tokens), meta=IDENTITY.meta(tokens, ""))).record
    tail = store.load(record, start=32)
    assert tail.header.tokens == tuple(tokens[32:]) and tail.nbytes == sum(b.nbytes for b in record.blocks[2:])
    middle = store.load(record, start=16, upto=48)
    assert middle.header.tokens == tuple(tokens[16:48]) and middle.nbytes == sum(b.nbytes for b in record.blocks[1:3])
    assert store.load(record, start=20) is None  # not a block boundary: no such part
    assert record.path.exists() and all(p.exists() for p in store.block_paths(record))  # and nothing was removed
    full = conversation_kv(tokens)
    for head_len in (32, 40):  # from the tail's start, and from part way into it
        row = kinds.lend(conversation_kv(tokens[:head_len]), head_len)
        assert kinds.extend(row, kinds.adopt(tail), skip=head_len - 32, upto=59 - 32)
        assert [c.offset for c in row] == [59, 59]
        for got, want in zip(row, full, strict=True):
            assert np.array_equal(np.asarray(got.keys[..., :59, :]), np.asarray(want.keys[..., :59, :]))
            assert np.array_equal(np.asarray(got.values[..., :59, :]), np.asarray(want.values[..., :59, :]))
    # layers that do not pair up change nothing
    row = conversation_kv(tokens[:32])
    rotating = [mlc.RotatingKVCache(max_size=8) for _ in row]
    assert not kinds.extend(row, rotating, skip=0, upto=10)
    assert not kinds.extend(row, kinds.adopt(tail), skip=0, upto=99)
    assert [c.offset for c in row] == [32, 32]


def test_trailing_refuses_what_the_layout_cannot_read_alone():
    rec = block_record(100, 32)
    manifest = bk.Manifest(IDENTITY.meta(list(rec.tokens), ""), (), rec.blocks)
    assert bk.trailing(manifest, 0) is None and bk.trailing(manifest, 100) is None
    assert bk.trailing(manifest, 40) is None  # not a boundary
    assert bk.trailing(manifest, 32, 70) is None  # nor is its end
    part = bk.trailing(manifest, 32, 96)
    assert part.tokens == rec.tokens[32:96] and [(b.start, b.end) for b in part.blocks] == [(0, 32), (32, 64)]
    assert [b.name for b in part.blocks] == [b.name for b in rec.blocks[1:3]]


# --- the engine's overlapped row ---------------------------------------------------------------------


def test_a_late_tail_is_waited_for_no_longer_than_its_recompute_or_its_predicted_read():
    import time

    from mlxd.engine.overlap import WAIT_SLACK, tail_wait_s

    rec = block_record(100, 32)
    unknown = TailRestore(rec, 32, 96)
    assert tail_wait_s(unknown, 1.0, 100, 50) == pytest.approx(0.5)  # the head's rate: 50 tokens more
    now = time.monotonic()
    slow_read = TailRestore(rec, 32, 96, expect_s=10.0, asked_at=now)
    assert tail_wait_s(slow_read, 1.0, 100, 50) == pytest.approx(0.5)  # recomputing is sooner
    soon = TailRestore(rec, 32, 96, expect_s=100.0, asked_at=now)  # read predicted sooner than a slow recompute
    assert WAIT_SLACK * 100.0 - 60 < tail_wait_s(soon, 1000.0, 100, 50) <= WAIT_SLACK * 100.0
    overdue = TailRestore(rec, 32, 96, expect_s=0.2, asked_at=now - 5.0)
    assert tail_wait_s(overdue, 1.0, 100, 50) == 0.0  # long past its predicted read: recompute at once

rng = np.random.default_rng(31)
PREFIX = tuple(int(x) for x in rng.integers(3, 250, 192))
PROMPT = PREFIX + tuple(int(x) for x in rng.integers(3, 250, 24))
NO_EOS = ((0, -100.0), (2, -100.0))


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    c = EngineCore(config_for(tiny_model_dir))
    c.load()
    yield c
    c.close()


def _request(rid: str) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, logit_bias=NO_EOS)
    return GenerationRequest(request_id=rid, prompt=PROMPT, sampling=sampling)


def prefix_record(engine: EngineCore, tmp_path) -> tuple[BlockStore, Any]:
    """PREFIX's KV, computed outside the engine's steps, written as a 32-token block record."""
    store = BlockStore(tmp_path, engine.store_identity, block_tokens=32)
    caches = loading.fresh_caches(engine.model, engine._config)
    engine.model(mx.array([list(PREFIX)]), cache=caches)
    mx.eval([c.state for c in caches])
    return store, store.write(kinds.plan_snapshot(caches, meta=engine.store_identity.meta(list(PREFIX), ""))).record


def noted_steps(engine: EngineCore, monkeypatch) -> list:
    """Every note the engine's steps hand the cache owner from now on (the list fills as it steps)."""
    notes: list = []
    step = engine.step

    def noting(ops):
        result = step(ops)
        notes.extend(result.notes)
        return result

    monkeypatch.setattr(engine, "step", noting)
    return notes


def test_the_engine_recomputes_the_head_appends_the_tail_and_answers_as_a_cold_prefill(core, tmp_path, monkeypatch):
    store, record = prefix_record(core, tmp_path)
    cold = run_rows(core, [_request("cold")])
    notes = noted_steps(core, monkeypatch)
    monkeypatch.setattr("mlxd.engine.core.WHOLE_PREFILL_MIN", 64)  # this test's 96-token head is timed

    def overlapped(rid: str, land: str):
        tail = TailRestore(record, 96, len(PREFIX))
        if land == "landed":
            tail.slot.land(store.load(record, start=96))
        elif land == "failed":
            tail.slot.land(None)
        before = core.stats()
        notes.clear()
        run = run_rows(core, [RowStart(request=_request(rid), tail=tail)])
        after = core.stats()
        counts = {k: getattr(after, k) - getattr(before, k) for k in (
            "overlap_tails", "overlap_tail_tokens", "overlap_tails_recomputed", "overlap_tails_unplaced",
            "prompt_tokens")}
        accepted = next(n for n in run.notes if type(n).__name__ == "PublishPrefix" and n.reason == "restore") \
            if land == "landed" else None
        return run, counts, accepted

    for land in ("landed", "late", "failed"):
        run, counts, published = overlapped(land, land)
        assert run.tokens[land] == cold.tokens["cold"], land
        np.testing.assert_allclose(run.logprobs[land], cold.logprobs["cold"], atol=1e-5)
        if land == "landed":
            assert counts["overlap_tails"] == 1 and counts["overlap_tail_tokens"] == len(PREFIX) - 96
            assert counts["prompt_tokens"] == len(PROMPT) - (len(PREFIX) - 96)  # the tail alone was not prefilled
            assert published.tokens == PREFIX and published.durable  # the prefix in RAM, as a restore's
        else:  # recomputed: the whole prompt prefilled, nothing published as a restore
            assert counts["overlap_tails"] == 0 and counts["overlap_tails_recomputed"] == 1
            assert counts["overlap_tails_unplaced"] == int(land == "late")  # a failed read landed None: placed
            assert counts["prompt_tokens"] == len(PROMPT)
        measured = [n for n in notes if type(n).__name__ == "RestoreMeasured"]
        assert [(m.taken, m.nbytes > 0) for m in measured] == [(land == "landed", land == "landed")]
        # the head timed as a head (the advisor's head scale), not as a whole prompt (its prefill scale)
        heads = [(n.new_tokens, n.context, n.head, n.whole) for n in notes if type(n).__name__ == "PrefillMeasured"
                 and n.head]
        assert heads == [(96, 0, True, False)], heads


def test_a_cold_process_s_first_head_is_not_timed(tiny_model_dir, tmp_path, monkeypatch):
    # A process that reused its saved probe runs no forward before its first request; on a GPU its first
    # overlapped head then built its kernels (H100: 0.77-0.87 s against 0.24 predicted) and that timing
    # inflated the head scale for the turns after it. The head run first is not timed; the next one is.
    monkeypatch.setattr("mlxd.engine.core.WHOLE_PREFILL_MIN", 64)
    fresh = EngineCore(config_for(tiny_model_dir))
    fresh.load()
    try:
        store, record = prefix_record(fresh, tmp_path)  # no engine step: the engine is still cold
        notes = noted_steps(fresh, monkeypatch)
        heads = []
        for rid in ("first", "second"):
            tail = TailRestore(record, 96, len(PREFIX))
            tail.slot.land(store.load(record, start=96))
            notes.clear()
            run_rows(fresh, [RowStart(request=_request(rid), tail=tail)])
            heads.append([n.new_tokens for n in notes if type(n).__name__ == "PrefillMeasured" and n.head])
        assert heads == [[], [96]], heads
    finally:
        fresh.close()


@pytest.mark.parametrize("warmup", ["on", "off"])
def test_a_reused_probe_s_process_warms_up_so_its_first_head_is_timed(tiny_model_dir, tmp_path, monkeypatch, warmup):
    # A restarted server reuses its predecessor's saved probe and so ran no forward before serving; on a GPU
    # its first overlapped head built its kernels on the request's path. With the warm-up (`--device-warmup`,
    # on a GPU by default) it runs the probe's longest prefill at start by the head's own path: warm, its
    # first head is timed.
    monkeypatch.setattr("mlxd.engine.core.WHOLE_PREFILL_MIN", 64)
    config = config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", device_probe="auto",
                        device_probe_budget_s=0.2, device_warmup=warmup)
    first = EngineCore(config)
    measured = first.load().probe
    first.close()
    engine = EngineCore(config)
    probe = engine.load().probe
    try:
        assert measured is not None and not measured.reused
        assert probe is not None and probe.reused
        if warmup == "on":  # the longest prefill the probe timed, once, untimed
            assert probe.warmup_tokens == measured.warmup_tokens == measured.prefill[-1][0] and probe.warmup_s > 0
            assert engine.generator.prefill_step_size == probe.prefill_step_size  # serving's chunks, rows gone
        else:
            assert (probe.warmup_tokens, probe.warmup_s) == (0, 0.0)
        assert not engine._rows
        store, record = prefix_record(engine, tmp_path)  # no engine step
        notes = noted_steps(engine, monkeypatch)
        tail = TailRestore(record, 96, len(PREFIX))
        tail.slot.land(store.load(record, start=96))
        run_rows(engine, [RowStart(request=_request("first"), tail=tail)])
        heads = [n.new_tokens for n in notes if type(n).__name__ == "PrefillMeasured" and n.head]
        assert heads == ([96] if warmup == "on" else []), heads
    finally:
        engine.close()


def test_the_engine_waits_for_a_placed_tail_and_never_for_one_whose_landing_would_queue_behind_it(core, tmp_path):
    # A tail read whose memory is not placed yet may have its landing queued as a job on the engine's own
    # thread: waiting for it there would wait out the whole bound (a live server once hung its requests
    # for the 120 s it was pinned to). So the engine waits only for a placed tail, and recomputes the rest.
    import threading
    import time

    from mlxd.engine import overlap

    store, record = prefix_record(core, tmp_path)

    def run(tail: TailRestore):
        t0 = time.monotonic()
        done = overlap.recompute_then_append(core.model, loading.fresh_caches(core.model, core._config), PROMPT, 0,
                                             tail, step=64, wait_s=60.0)
        return done, time.monotonic() - t0

    unplaced = TailRestore(record, 96, len(PREFIX))
    done, took = run(unplaced)
    assert done.appended is None and done.at == len(PREFIX) and took < 30  # recomputed, no 60 s wait
    assert not done.placed  # counted apart (EngineStats.overlap_tails_unplaced)
    placed = TailRestore(record, 96, len(PREFIX))
    placed.slot.place()
    later = threading.Timer(0.3, lambda: placed.slot.land(store.load(record, start=96)))
    later.start()
    done, took = run(placed)
    later.join()
    assert done.appended is not None and done.at == len(PREFIX) and done.recomputed_to == 96  # waited, appended
    (head, head_at), (wait, waited_at) = done.stamps
    assert (head, wait) == ("overlap_head", "overlap_wait") and head_at <= waited_at  # the row's stages, in order


# --- a live server: a forced overlap is exact ---------------------------------------------------------

S_PREFIX = tuple(int(x) for x in np.random.default_rng(28).integers(1, 1000, 200))
S_PROMPT = S_PREFIX + tuple(int(x) for x in np.random.default_rng(29).integers(1, 1000, 40))
S_OTHER = tuple(int(x) for x in np.random.default_rng(30).integers(1, 1000, 240))


def forced_overlap_config(tiny_model_dir, tmp_path):
    """A live server that overlaps every returning conversation's restore, on 32-token SSD blocks."""
    return config_for(
        tiny_model_dir, ssd_cache_dir=tmp_path / "ssd", restore_choice="overlap", ssd_layout="blocks",
        ssd_block_tokens=32, ssd_demote_idle_s=0, prompt_cache_bytes=150_000,  # about one conversation
        restore_overlap_wait_s=120.0,  # the tail is appended however slowly this machine reads it
    )


def test_a_forced_overlap_on_a_live_server_matches_a_cold_prefill_and_replays(tiny_model_dir, tmp_path, capsys):
    config = forced_overlap_config(tiny_model_dir, tmp_path)
    trace = tmp_path / "overlap.jsonl"
    records: list = []
    with ServerThread(config) as s:
        record_trace(s.runtime, trace)
        s.runtime.scheduler.observers.append(records.append)
        for ids in (S_PREFIX, S_OTHER, S_PROMPT):  # S_OTHER pushes S_PREFIX's checkpoints out of RAM, to SSD
            reply = complete(s, ids)
            flush(s)
        st = stats(s)
    # where the engine's half went (request.done first_token_ms): the head, the wait for its tail, the rest
    split = first_token_split(records[-1])
    assert split is not None and split["overlap_head"] > 0 and split["overlap_wait"] >= 0 <= split["overlap_rest"]
    assert abs(split["overlap_head"] + split["overlap_wait"] + split["overlap_rest"] - split["lend"]) < 0.05, split
    assert "overlap_head" not in first_token_split(records[0])  # a miss has no such stages
    with ServerThread(config_for(tiny_model_dir)) as s:  # no cache: a cold prefill
        cold = complete(s, S_PROMPT)
    decisions = st["ssd_cache"]["restore_decisions"]
    assert decisions["overlaps_chosen"] == 1 and decisions["restores_chosen"] == 0, decisions
    engine = st["engine"]
    assert engine["overlap_tails"] == 1 and engine["overlap_tails_recomputed"] == 0, engine
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the record's 200 tokens: those before a block boundary recomputed, the rest read
    assert cached == engine["overlap_tail_tokens"] and 0 < cached < 200 and (200 - cached) % 32 == 0, (cached, engine)
    lp, cold_lp = reply["choices"][0]["logprobs"], cold["choices"][0]["logprobs"]
    assert lp["tokens"] == cold_lp["tokens"]
    assert lp["token_logprobs"] == cold_lp["token_logprobs"]
    # the simulator replays the recording with the same decision and the same SSD hit tokens
    sim = simulate(trace, capsys)
    assert sim["restore_decisions"]["overlaps_chosen"] == 1
    assert sim["ssd_hit_tokens"] == cached


def test_the_head_scale_a_server_learned_picks_its_tail_and_the_replay_s(tiny_model_dir, tmp_path, capsys):
    # The tail an overlap reads depends on the head's scale (kv/restore_decision.py): here a head nearly free
    # leaves the read to decide, so the shortest tail is read. The recording's flush carries the scale, and the
    # replay reads the same tail.
    config = forced_overlap_config(tiny_model_dir, tmp_path)
    trace = tmp_path / "heads.jsonl"
    with ServerThread(config) as s:
        record_trace(s.runtime, trace)
        complete(s, S_PREFIX)
        flush(s)
        complete(s, S_OTHER)  # pushes S_PREFIX's checkpoints out of RAM, to SSD
        advisor = s.runtime.cache_owner.tiers.advisor  # as if heads had been timed (the engine is idle)
        advisor.head_scale, advisor.head_samples = 1e-9, 3
        flush(s)  # the recording's calibration for the returning turn
        reply = complete(s, S_PROMPT)
        flush(s)
        st = stats(s)
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert st["engine"]["overlap_tails"] == 1 and 0 < cached < 32, (cached, st["engine"])  # in the last block
    assert st["ssd_cache"]["restore_decisions"]["overlap_head_scale"] == 0.0
    sim = simulate(trace, capsys)
    assert sim["restore_decisions"]["overlaps_chosen"] == 1 and sim["ssd_hit_tokens"] == cached


def test_no_overlap_is_chosen_while_the_engine_holds_other_rows(tiny_model_dir, tmp_path, capsys):
    # The engine overlaps only with its batch empty (the head is prefilled apart); with another row decoding
    # it would decline, the tail's read and landing spent for nothing. So the scheduler's lookup asks for no
    # overlapped split while it has a row in the engine: the returning conversation is weighed between the
    # other arms, and its replay decides alike.
    config = forced_overlap_config(tiny_model_dir, tmp_path)
    trace = tmp_path / "busy.jsonl"
    with ServerThread(config) as s:
        record_trace(s.runtime, trace)
        for ids in (S_PREFIX, S_OTHER):  # S_OTHER pushes S_PREFIX's checkpoints out of RAM, to SSD
            complete(s, ids)
            flush(s)
        body = {"model": "tiny", "prompt": list(S_OTHER[:16]), "max_tokens": 800, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=120) as long:
            lines = long.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # decoding in the engine
            reply = complete(s, S_PROMPT)
            busy = stats(s)
            assert busy["scheduler"]["running"] == 1, busy["scheduler"]  # the long row still holds the engine
            done = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert done[-1]["choices"][0]["finish_reason"] == "length"  # it ran to its end: in the recording
        st = stats(s)
    decisions, engine = st["ssd_cache"]["restore_decisions"], st["engine"]
    assert decisions["overlaps_chosen"] == 0 and engine["overlaps_declined"] == 0, (decisions, engine)
    assert decisions["restores_chosen"] + decisions["recomputes_chosen"] >= 1, decisions
    assert reply["usage"]["prompt_tokens"] == len(S_PROMPT)
    sim = simulate(trace, capsys)
    assert sim["restore_decisions"]["overlaps_chosen"] == 0


# --- the prefetcher's half: a tail read into MLX memory, a lost block a miss --------------------------


async def test_the_prefetcher_lands_a_tail_in_mlx_memory_and_a_lost_block_lands_as_a_miss(tmp_path):
    """A tail's memory is allocated by the engine's landing (`TailSlot.placed` once it is, before the
    read is back: the scheduler starts the row then), the read fills it, and its adoption copies nothing;
    a landing the engine cannot give reads the host way; a lost block is a miss the cache owner hears of."""
    import trio

    from mlxd.actors.prefetcher import PrefetcherActor
    from mlxd.kv.ssd_store import SsdStore
    from mlxd.runtime.kernel.messages import FetchTail, RecordLost, TailSlot

    hold = trio.Event()  # a landed read's reader thread, held once its memory is placed

    class HeldStore(SsdStore):
        def load(self, record, **kw):  # the read waits until the test has seen `placed` (and not `landed`)
            if kw.get("land") is not None:
                landing = kw["land"]
                kw["land"] = lambda header: (landing(header), trio.from_thread.run(hold.wait))[0]
            return super().load(record, **kw)

    store = HeldStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    tokens = list(range(1, 61))
    kv = conversation_kv(tokens)
    record = store.write(kinds.plan_snapshot(kv, meta=IDENTITY.meta(tokens, ""))).record
    landings: list = []
    refuse = False

    async def land(header):  # the engine's landing (its thread; here the trio thread)
        landings.append(header)
        if refuse:
            raise MemoryError("no room for it")
        return kinds.landing(header)

    async def fetched(slot: TailSlot) -> None:  # as the engine thread waits for it
        assert await trio.to_thread.run_sync(slot.wait, 60.0)

    inbox_send, inbox = trio.open_memory_channel(8)
    cache_send, cache_inbox = trio.open_memory_channel(8)
    actor = PrefetcherActor(store, inbox=inbox, cache=cache_send, verify=True, land=land)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        good = FetchTail(record, 32, TailSlot())
        await inbox_send.send(good)
        with trio.fail_after(60):
            await good.slot.wait_placed()
        assert not good.slot.landed and len(landings) == 1  # memory allocated, nothing read yet
        hold.set()
        await fetched(good.slot)
        loaded = good.slot.loaded
        assert loaded is not None and loaded.header.tokens == tuple(tokens[32:])
        assert loaded.landed is not None and loaded.nbytes == sum(b.nbytes for b in record.blocks[2:])
        tail = kinds.adopt(loaded)
        assert tail[0].state[0] is not None  # adopted as it landed: the MLX arrays the read filled
        np.testing.assert_array_equal(np.array(tail[0].keys[..., : 60 - 32, :]), np.array(kv[0].keys[..., 32:60, :]))
        refuse = True  # the engine cannot give memory: the tail is read the host way
        host = FetchTail(record, 32, TailSlot())
        await inbox_send.send(host)
        await fetched(host.slot)
        assert host.slot.placed and host.slot.loaded is not None and host.slot.loaded.landed is None
        store.blocks.block_paths(record)[-1].unlink()  # the tail's last block is lost
        lost = FetchTail(record, 32, TailSlot())
        await inbox_send.send(lost)
        await fetched(lost.slot)
        assert lost.slot.placed and lost.slot.loaded is None  # a miss: the engine recomputes the tail
        with trio.fail_after(60):
            told = await cache_inbox.receive()
        assert isinstance(told, RecordLost) and told.record is record  # the cache owner forgets the record
        nursery.cancel_scope.cancel()
    assert len(landings) == 3


async def test_a_busy_engine_s_prefetch_hint_reads_ahead_no_tail(autojump_clock):
    # The hint is sent at submission; with rows in the engine's batch the request's lookup will weigh no
    # overlapped split (LookupPrefix.overlap), so the read ahead reads the record from its start, not a tail.
    from pathlib import Path

    import trio

    from mlxd import RuntimeConfig
    from mlxd.runtime.kernel.messages import EngineBusy, PrefetchHint
    from test_cache_actors import start_owner

    config = RuntimeConfig(prompt_cache_bytes=10_000, ssd_cache_dir=Path("/unused"))
    async with trio.open_nursery() as nursery:
        owner, inbox, _, prefetcher = await start_owner(nursery, config)
        owner.tiers.advisor = RestoreAdvisor(overlap=True)  # as the supervisor builds it for --restore-choice overlap
        owner.tiers.load_records([block_record(128, 32)])
        prompt = tuple(range(1, 140))
        ahead = []
        for busy in (False, True, False):
            await inbox.send(EngineBusy(busy))
            await inbox.send(PrefetchHint(prompt, ""))
            ahead.append(await prefetcher.receive())
        assert [(a.record.tokens[-1], a.start) for a in ahead] == [(128, 32), (128, 0), (128, 32)]
        nursery.cancel_scope.cancel()


S_THIRD = tuple(int(x) for x in np.random.default_rng(31).integers(1, 1000, 240))


def test_a_burst_of_returning_conversations_overlaps_one_and_declines_none(tiny_model_dir, tmp_path, capsys):
    # Two conversations come back at once (a restart's usual morning). The engine overlaps only with its batch
    # empty, so the second overlapped split would be declined behind the first, its tail's read spent for
    # nothing. A row now counts as the engine's from its lookup: the second lookup, made while the first row
    # is on its way to the engine, weighs no overlap.
    import threading

    config = forced_overlap_config(tiny_model_dir, tmp_path)
    other_prompt = S_OTHER + tuple(int(x) for x in np.random.default_rng(32).integers(1, 1000, 40))
    trace = tmp_path / "burst.jsonl"
    with ServerThread(config) as s:
        record_trace(s.runtime, trace)
        for ids in (S_PREFIX, S_OTHER, S_THIRD):  # each pushes the one before out of RAM, to SSD
            complete(s, ids)
            flush(s)
        go, replies = threading.Barrier(2), {}

        def returning(name: str, ids: tuple[int, ...]) -> None:
            go.wait()
            replies[name] = httpx.post(s.base_url + "/completions", timeout=120, json={
                "model": "tiny", "prompt": list(ids), "max_tokens": 64, "temperature": 0})

        both = [threading.Thread(target=returning, args=(n, ids)) for n, ids in
                (("a", S_PROMPT), ("b", other_prompt))]
        for t in both:
            t.start()
        for t in both:
            t.join()
        st = stats(s)
    assert all(r.status_code == 200 for r in replies.values()), {n: r.text for n, r in replies.items()}
    decisions, engine = st["ssd_cache"]["restore_decisions"], st["engine"]
    assert engine["overlaps_declined"] == 0, (decisions, engine)
    assert decisions["overlaps_chosen"] == engine["overlap_tails"] + engine["overlap_tails_recomputed"] >= 1
    sim = simulate(trace, capsys)  # the replay counts a row from its lookup too
    assert sim["restore_decisions"]["overlaps_chosen"] == decisions["overlaps_chosen"], sim["restore_decisions"]
