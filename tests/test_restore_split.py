"""Restore and recompute split: restore a cold record's first k tokens, prefill the rest.

The pure choice (`RestoreAdvisor.plan`) in each regime, the cuts a layout offers
(`tiers.restore_cuts`), a block checkpoint's leading blocks read alone
(`BlockStore.load(upto=...)`), and a live server whose forced split gives the
same greedy tokens and logprobs as a full restore and as a cold prefill.
"""

from __future__ import annotations

import json

import attrs
import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlc

from mlxd.cli import record_trace
from mlxd.kv import blocks as bk
from mlxd.kv import kinds
from mlxd.kv.block_store import BlockStore
from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.restore_decision import RECOMPUTE, RESTORE, SPLIT, RestoreAdvisor, RestoreCut
from mlxd.kv.ssd_store import StoreIdentity, compute_fingerprint
from mlxd.kv.tiers import CacheTiers, SsdMatch, SsdRecord, restore_cuts
from mlxd.sim.cli import main as sim_main

from serving import ServerThread, config_for

PER_TOKEN = DEFAULT.kv_bytes_per_token


def cuts(tokens: int, step: int, *, resident_upto: int = 0) -> list[RestoreCut]:
    """Block cuts of a `tokens`-token record, the first `resident_upto` tokens already in a fast medium."""
    return [
        RestoreCut(end, end * PER_TOKEN, min(end, resident_upto) * PER_TOKEN)
        for end in range(step, tokens + 1, step)
    ]


def advisor(**kw) -> RestoreAdvisor:
    return RestoreAdvisor(base=DEFAULT, **kw)


# --- the pure choice -------------------------------------------------------------------------------


def test_fast_restore_restores_everything():
    a = advisor()
    plan = a.plan(cuts=cuts(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert plan.arm == RESTORE and plan.cut.tokens == 8000
    assert plan.seconds == plan.restore_seconds < plan.recompute_seconds
    assert a.stats()["restores_chosen"] == 1 and a.stats()["splits_chosen"] == 0


def test_slow_restore_recomputes():
    a = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=1e6))
    plan = a.plan(cuts=cuts(8000, 500), warm_tokens=0, prompt_tokens=8100)
    assert plan.arm == RECOMPUTE and plan.cut is None and plan.seconds == plan.recompute_seconds
    assert a.recomputes_chosen == 1


@pytest.mark.parametrize("bandwidth", [1e5, 1e6, 3e6, 1e7, 3e7, 1e8, 1e9, 1e10])
def test_a_proportional_restore_never_splits(bandwidth):
    # Restoring token i costs the same for every i; recomputing it costs more the later it is:
    # the sum is concave in the cut, so one arm or the other is always at least as good.
    a = RestoreAdvisor(base=attrs.evolve(DEFAULT, restore_bytes_per_s=bandwidth))
    for warm in (0, 1000):
        plan = a.plan(cuts=cuts(8000, 250), warm_tokens=warm, prompt_tokens=8200)
        assert plan.arm in (RESTORE, RECOMPUTE)
        best = min(a._cut_seconds(c, 8200) for c in cuts(8000, 250) if c.tokens > warm)
        assert plan.seconds <= min(best, plan.recompute_seconds) + 1e-12


def test_a_record_partly_in_a_fast_medium_splits_where_the_fast_part_ends():
    # The first 3,000 tokens' blocks are resident (page cache, host memory) and read 100,000x
    # faster; the rest must come from a disk slower than recomputing them.
    slow = attrs.evolve(DEFAULT, restore_bytes_per_s=3e5)
    a = RestoreAdvisor(base=slow, resident_bytes_per_s=3e10)
    plan = a.plan(cuts=cuts(8000, 500, resident_upto=3000), warm_tokens=0, prompt_tokens=8100)
    assert plan.arm == SPLIT and plan.cut.tokens == 3000
    assert plan.seconds < plan.recompute_seconds and plan.seconds < plan.restore_seconds
    assert a.stats()["splits_chosen"] == 1
    # The same record all resident: restore it all; none resident: recompute.
    assert a.plan(cuts=cuts(8000, 500, resident_upto=8000), warm_tokens=0, prompt_tokens=8100).arm == RESTORE
    assert a.plan(cuts=cuts(8000, 500), warm_tokens=0, prompt_tokens=8100).arm == RECOMPUTE


def test_cuts_within_the_warm_prefix_are_not_offered():
    a = advisor()
    plan = a.plan(cuts=cuts(8000, 500), warm_tokens=8000, prompt_tokens=8100)
    assert plan.arm == RECOMPUTE


def test_forced_choices():
    slow = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3)
    split = RestoreAdvisor(base=slow, split=True)
    plan = split.plan(cuts=cuts(8000, 1000), warm_tokens=2000, prompt_tokens=8100)
    assert plan.arm == SPLIT and plan.cut.tokens == 5000  # the middle of what the record adds
    always = RestoreAdvisor(base=slow, always=True)
    assert always.plan(cuts=cuts(8000, 1000), warm_tokens=0, prompt_tokens=8100).arm == RESTORE
    # A look ahead (the prefetcher's) counts nothing.
    before = split.stats()
    split.plan(cuts=cuts(8000, 1000), warm_tokens=0, prompt_tokens=8100, count=False)
    assert split.stats() == before


# --- the cuts a layout offers ---------------------------------------------------------------------


def block_record(n: int, span: int, *, trimmable: bool = True, state: bool = False) -> SsdRecord:
    blocks = bk.model_blocks(list(range(1, n + 1)), namespace="", fingerprint="f" * 32, stored=lambda _: False,
                             bytes_per_token=10, block_tokens=span, state_bytes=7 if state else 0)
    return SsdRecord("", tuple(range(1, n + 1)), 10 * n + (7 if state else 0), 0.0, trimmable, None, blocks)


def test_block_cuts_end_on_block_boundaries_and_cost_the_leading_blocks():
    rec = block_record(100, 32)
    found = restore_cuts(SsdMatch(rec, 90), 20, lambda n: n)
    assert [(c.tokens, c.nbytes) for c, _ in found] == [(32, 320), (64, 640), (90, 960)]
    assert [(m.usable, m.read_tokens) for _, m in found] == [(32, 32), (64, 64), (90, 96)]
    whole = restore_cuts(SsdMatch(rec, 99), 0, lambda n: n)[-1]
    assert whole[0].nbytes == 1000 and whole[1].read_tokens == 0  # the last block: read it all
    # A state block (recurrent or window caches) cannot be cut: one cut, the whole record.
    stateful = block_record(100, 32, trimmable=False, state=True)
    assert [(c.tokens, m.read_tokens) for c, m in restore_cuts(SsdMatch(stateful, 100), 0, lambda n: n)] == [(100, 0)]


def test_a_whole_file_is_one_cut_unless_a_split_is_forced():
    rec = SsdRecord("", tuple(range(1, 101)), 1000, 0.0, True)
    assert [(c.tokens, c.nbytes) for c, _ in restore_cuts(SsdMatch(rec, 99), 10, lambda n: n)] == [(99, 1000)]
    forced = restore_cuts(SsdMatch(rec, 99), 10, lambda n: n, split=True)
    assert [(c.tokens, c.nbytes, m.usable, m.read_tokens) for c, m in forced] == [(54, 1000, 54, 0), (99, 1000, 99, 0)]


def test_the_lookup_returns_the_split_and_counts_it():
    tiers = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(split=True))
    rec = block_record(128, 32)
    tiers.load_records([rec])
    lookup = tiers.lookup(tuple(range(1, 140)))
    assert lookup.plan is not None and lookup.plan.arm == SPLIT
    assert (lookup.restore.usable, lookup.restore.read_tokens) == (64, 64)
    assert tiers.stats().restore_decisions["splits_chosen"] == 1
    # The prefetcher is told to read the same leading blocks, without counting a decision.
    ahead = tiers.prefetch_match(tuple(range(1, 140)))
    assert ahead.read_tokens == 64 and tiers.stats().restore_decisions["splits_chosen"] == 1


# --- a block checkpoint's leading blocks read alone -------------------------------------------------

IDENTITY = StoreIdentity(model_id="tiny", fingerprint=compute_fingerprint({"t": "split"}), tokenizer_hash="tok")


def conversation_kv(tokens, layers: int = 2) -> list:
    caches = []
    t = mx.array(np.cumsum(np.asarray(tokens, dtype=np.float64)) % 9973, dtype=mx.float32)
    for layer in range(layers):
        base = t[None, None, :, None] * (layer + 1) + mx.arange(8, dtype=mx.float32)[None, None, None, :]
        keys = mx.concatenate([base, -base], axis=1)
        c = mlc.KVCache()
        c.update_and_fetch(keys, keys * 0.5)
        caches.append(c)
    return caches


def test_leading_blocks_load_as_the_checkpoint_of_their_tokens(tmp_path):
    store = BlockStore(tmp_path, IDENTITY, block_tokens=16)
    tokens = list(range(1, 61))
    record = store.write(kinds.plan_snapshot(conversation_kv(tokens), meta=IDENTITY.meta(tokens, ""))).record
    assert [(b.start, b.end) for b in record.blocks] == [(0, 16), (16, 32), (32, 48), (48, 60)]
    whole = store.load(record)
    part = store.load(record, upto=32)
    assert part.header.tokens == tuple(tokens[:32]) and part.nbytes == sum(b.nbytes for b in record.blocks[:2])
    assert part.nbytes < whole.nbytes
    restored = kinds.adopt(part)
    expected = conversation_kv(tokens[:32])
    assert [c.offset for c in restored] == [32, 32]
    meta = IDENTITY.meta([], "")
    got, want = kinds.plan_snapshot(restored, meta=meta), kinds.plan_snapshot(expected, meta=meta)
    assert bk.blank(got.caches) == bk.blank(want.caches)
    for x, y in zip(got.buffers, want.buffers, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    # Not a block boundary, or the whole record: the whole checkpoint is read.
    assert store.load(record, upto=40).header.tokens == tuple(tokens)
    assert bk.leading(part_manifest := bk.Manifest(whole.header.meta, whole.header.caches, record.blocks), 60) is None
    assert bk.leading(part_manifest, 48).tokens == tuple(tokens[:48])


# --- a live server: a forced split is exact ---------------------------------------------------------

PREFIX = tuple(int(x) for x in np.random.default_rng(28).integers(1, 1000, 200))
PROMPT = PREFIX + tuple(int(x) for x in np.random.default_rng(29).integers(1, 1000, 40))
OTHER = tuple(int(x) for x in np.random.default_rng(30).integers(1, 1000, 240))


def complete(server, ids: tuple[int, ...]) -> dict:
    r = httpx.post(server.base_url + "/completions", timeout=120, json={
        "model": "tiny", "prompt": list(ids), "max_tokens": 6, "logprobs": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def stats(server) -> dict:
    r = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def flush(server) -> None:
    assert httpx.post(server.base_url.removesuffix("/v1") + "/admin/cache/flush", timeout=60).status_code == 200


def simulate(trace, capsys) -> dict:
    capsys.readouterr()
    assert sim_main([str(trace), "--cache-model", "mlxd", "--format", "json"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return json.loads(line)


@pytest.mark.parametrize("layout", ["blocks", "whole"])
def test_forced_split_matches_full_restore_and_cold_prefill(tiny_model_dir, tmp_path, capsys, layout):
    runs = {}
    for choice in ("always", "split"):
        config = config_for(
            tiny_model_dir, ssd_cache_dir=tmp_path / choice, restore_choice=choice, ssd_layout=layout,
            ssd_block_tokens=32, ssd_demote_idle_s=0, prompt_cache_bytes=150_000,  # about one conversation
        )
        trace = tmp_path / f"{choice}.jsonl"
        with ServerThread(config) as s:
            record_trace(s.runtime, trace)
            for ids in (PREFIX, OTHER, PROMPT):  # OTHER pushes PREFIX's checkpoints out of RAM, to SSD
                reply = complete(s, ids)
                flush(s)
            runs[choice] = (reply, stats(s), simulate(trace, capsys))
    with ServerThread(config_for(tiny_model_dir)) as s:  # no cache: a cold prefill
        cold = complete(s, PROMPT)

    (full, full_stats, full_sim), (split, split_stats, split_sim) = runs["always"], runs["split"]
    cached = {k: r["usage"]["prompt_tokens_details"]["cached_tokens"] for k, (r, _, _) in runs.items()}
    assert cached["always"] >= 199 and 0 < cached["split"] < 199, cached
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    decisions = split_stats["ssd_cache"]["restore_decisions"]
    assert decisions["splits_chosen"] == 1 and decisions["restores_chosen"] == 0, decisions
    assert full_stats["ssd_cache"]["restore_decisions"]["splits_chosen"] == 0
    read = {k: st["ssd_cache"]["prefetch"]["bytes_read"] for k, (_, st, _) in runs.items()}
    if layout == "blocks":  # only the leading blocks were read
        assert cached["split"] % 32 == 0 and read["split"] < read["always"], read
    else:  # a whole file is read whole, then trimmed
        assert read["split"] == read["always"], read
    lp = {k: r["choices"][0]["logprobs"] for k, r in (("cold", cold), ("always", full), ("split", split))}
    assert lp["split"]["tokens"] == lp["always"]["tokens"] == lp["cold"]["tokens"]
    assert lp["split"]["token_logprobs"] == lp["always"]["token_logprobs"] == lp["cold"]["token_logprobs"]
    # The simulator replays each recording with the same decisions and the same SSD hits.
    assert split_sim["restore_decisions"]["splits_chosen"] == 1
    assert full_sim["restore_decisions"]["splits_chosen"] == 0 and full_sim["restore_decisions"]["restores_chosen"] >= 1
    assert (split_sim["ssd_hit_tokens"], full_sim["ssd_hit_tokens"]) == (cached["split"], cached["always"])


# --- a record partly in the page cache: the split serving prices with mincore -----------------------


def test_a_record_half_in_the_page_cache_splits_at_its_resident_blocks(tmp_path):
    import os

    from mlxd.kv.ssd_store import SsdStore

    store = SsdStore(tmp_path, IDENTITY, layout="blocks", block_tokens=16)
    tokens = list(range(1, 65))
    record = store.write(kinds.plan_snapshot(conversation_kv(tokens), meta=IDENTITY.meta(tokens, ""))).record
    paths = store.blocks.block_paths(record)
    for path in paths[2:]:  # the last two blocks leave the page cache (written and synced: clean pages)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for path in paths[:2]:
        path.read_bytes()  # the first two are in it
    resident = store.resident_bytes(record)
    if resident[2:] != (0, 0):
        pytest.skip("this filesystem keeps pages after DONTNEED")
    assert resident[:2] == tuple(b.nbytes for b in record.blocks[:2])
    # A disk slower than recomputing; the page cache far faster.
    slow = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3, page_cache_bytes_per_s=1e12)
    tiers = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(base=slow),
                       residency=store.resident_bytes)
    tiers.load_records([record])
    prompt = tuple(tokens) + (7, 8, 9, 10, 11, 12)
    lookup = tiers.lookup(prompt)
    assert lookup.plan.arm == SPLIT and (lookup.restore.usable, lookup.restore.read_tokens) == (32, 32)
    assert lookup.plan.cut.resident_nbytes == lookup.plan.cut.nbytes
    decisions = tiers.stats().restore_decisions  # as /stats shows them
    assert decisions["splits_chosen"] == 1 and decisions["last_resident_bytes"] == lookup.plan.cut.nbytes
    # All of it resident: the whole record is restored; none: recomputed (the same advisor, no page-cache price).
    for path in paths:
        path.read_bytes()
    assert tiers.lookup(prompt).plan.arm == RESTORE
    blind = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=RestoreAdvisor(base=slow))
    blind.load_records([record])
    assert blind.lookup(prompt).plan.arm == RECOMPUTE
    # The served restore of the resident split then calibrates the page cache's bandwidth, not the disk's.
    advisor = tiers.advisor
    advisor.observe_restore(nbytes=1 << 20, seconds=1e-3)  # the split's (resident) restore
    assert advisor.resident_samples == 1 and advisor.restore_samples == 0
    assert advisor.resident_bytes_per_s == pytest.approx((1 << 20) / 1e-3)


def test_nothing_is_read_ahead_for_a_prompt_the_advisor_will_recompute():
    # After a restart the prefetcher read whole records (1.88 GB on the H200) that the advisor then
    # recomputed: the read, its landing's memory and the engine thread's time for it were spent for nothing.
    rec = block_record(128, 32)
    prompt = tuple(range(1, 140))
    for advisor, read in ((RestoreAdvisor(never=True), False), (RestoreAdvisor(always=True), True)):
        tiers = CacheTiers(PromptCache(max_bytes=10**9), ssd=True, advisor=advisor)
        tiers.load_records([rec])
        ahead = tiers.prefetch_match(prompt)
        assert (ahead is not None) is read
        assert (tiers.lookup(prompt).plan.arm == RESTORE) is read  # the lookup decides as the read-ahead did


def test_a_prompt_s_lookup_reuses_its_prefetch_hint_s_page_cache_check():
    # A residency check walks every page of the record (460k for a 16k-token record of the 1.7B shape:
    # the H200's returning turns waited 121-127 ms for a hint's check and the lookup's): the lookup right
    # after its hint takes the hint's figure; a later lookup, or one without a hint, checks again.
    rec = block_record(128, 32)
    prompt = tuple(range(1, 140))
    checks: list[SsdRecord] = []

    def residency(record: SsdRecord) -> tuple[int, ...]:
        checks.append(record)
        return tuple(b.nbytes for b in record.blocks)  # all of it in the page cache

    clock = [100.0]
    ram = PromptCache(max_bytes=10**9)
    ram.clock = lambda: clock[0]
    fast = attrs.evolve(DEFAULT, restore_bytes_per_s=1e3, page_cache_bytes_per_s=1e12)
    tiers = CacheTiers(ram, ssd=True, advisor=RestoreAdvisor(base=fast), residency=residency)
    tiers.load_records([rec])
    assert tiers.prefetch_match(prompt) is not None and len(checks) == 1
    lookup = tiers.lookup(prompt)
    assert len(checks) == 1 and lookup.plan.arm == RESTORE and lookup.plan.cut.resident_nbytes == rec.nbytes
    assert tiers.lookup(prompt).plan.arm == RESTORE and len(checks) == 2  # the hint served one lookup
    tiers.prefetch_match(prompt)
    clock[0] += 5.0  # a lookup long after its hint: the page cache may have changed
    tiers.lookup(prompt)
    assert len(checks) == 4


# --- the advisor's restore hands the engine what a forced one does ------------------------------------


def _admitted(caches) -> list[dict]:
    """What a row starts from at `EngineCore._admit`: per layer its class and offset; per array its dtype,
    shape, strides, the MLX graph still pending behind it (0 once evaluated) and its bytes."""
    import io

    out = []
    for c in caches or []:
        arrays = {k: v for k, v in vars(c).items() if isinstance(v, mx.array)}
        dot = io.StringIO()
        if arrays:
            mx.export_to_dot(dot, *arrays.values())  # before anything here evaluates them
        row = {"class": type(c).__name__, "offset": c.offset, "pending_ops": dot.getvalue().count("shape=rectangle")}
        for name, a in arrays.items():
            mv = memoryview(a)
            row[name] = (str(a.dtype), a.shape, mv.strides, mv.c_contiguous, np.asarray(a).tobytes())
        out.append(row)
    return out


def test_the_advisor_s_restore_hands_the_engine_what_a_forced_one_does(tiny_model_dir, tmp_path, monkeypatch):
    # On the CPU the advisor's restored turns ran slower in the forward after the restore than a forced
    # restore's (docs/benchmarks.md, "After a restart on the CPU, end to end"): the same record restored
    # by either branch must start its row from the same evaluated, contiguous arrays of the same bytes.
    import shutil

    from mlxd.engine.core import EngineCore
    from mlxd.kv.advisor_file import FILE_NAME, VERSION

    seen: list[dict] = []
    admit = EngineCore._admit

    def spy(self, row, prompt, max_tokens, caches, history, cuts=()):
        seen.append({"prompt": len(prompt), "history": len(history), "cuts": cuts, "caches": _admitted(caches)})
        admit(self, row, prompt, max_tokens, caches, history, cuts)

    base = config_for(tiny_model_dir, host_cache_bytes=1 << 30, ssd_block_tokens=32)
    with ServerThread(attrs.evolve(base, ssd_cache_dir=tmp_path / "ssd", restore_choice="always")) as s:
        complete(s, PREFIX)
        flush(s)
    # the advisor's file as a restarted server reads it: restores measured fast, so it chooses them
    (saved,) = (tmp_path / "ssd").rglob(FILE_NAME)
    saved.write_text(json.dumps({"version": VERSION, "device": "", "calibration": {
        "restore_bytes_per_s": 1e12, "restore_samples": 5, "page_cache_bytes_per_s": 1e12, "page_cache_samples": 5}}))
    monkeypatch.setattr(EngineCore, "_admit", spy)
    runs = {}
    for choice in ("measured", "always"):
        shutil.copytree(tmp_path / "ssd", tmp_path / choice)
        seen.clear()
        with ServerThread(attrs.evolve(base, ssd_cache_dir=tmp_path / choice, restore_choice=choice)) as s:
            reply = complete(s, PREFIX)
            decisions = stats(s)["ssd_cache"]["restore_decisions"]
        assert decisions["restores_chosen"] == 1 and decisions["explorations"] == 0, (choice, decisions)
        (admitted,) = seen
        runs[choice] = (admitted, reply["choices"][0]["logprobs"])
    (advised, advised_lp), (forced, forced_lp) = runs["measured"], runs["always"]
    assert advised["history"] == len(PREFIX) - 1 and advised["prompt"] == 1  # the record's usable tokens restored
    assert all(layer["pending_ops"] == 0 for layer in advised["caches"]), advised["caches"]
    assert advised == forced
    assert advised_lp == forced_lp
