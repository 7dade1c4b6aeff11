"""The paged RAM tier (`--ram-pages on`, kv/ram_pages.py + kv/page_pool.py): shared prefixes held once."""

from __future__ import annotations

import gc

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.kv import kinds
from mlxd.kv.page_pool import PagedCaches, PagePool
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.ram_pages import PageRef
from mlxd.runtime.config import RuntimeConfig

from serving import ServerThread, config_for

SYSTEM = "You are the agent. Tools: search, read, write, run. Rules: be brief, cite files, never guess. " * 6
TOPICS = ["caches", "rivers", "trains", "lamps"]


# --- the ledger (pure) -------------------------------------------------------------


def test_shared_pages_count_once_and_eviction_frees_only_unreferenced_pages():
    ram = PromptCache(max_bytes=10_000)
    shared = (PageRef("a", 0, 4, 400), PageRef("b", 4, 8, 400))
    ram.put((1,) * 8 + (2, 2), payload="x", nbytes=1000, trimmable=True, pages=(*shared, PageRef("x", 8, 10, 200)))
    ram.put((1,) * 8 + (3, 3), payload="y", nbytes=1000, trimmable=True, pages=(*shared, PageRef("y", 8, 10, 200)))
    stats = ram.stats
    assert ram.bytes == stats.bytes == stats.page_bytes == 1200 and stats.pages == 4
    assert stats.checkpoint_bytes == 2000  # what two contiguous entries would hold
    # The cap: the oldest entry goes, and frees only its own page.
    ram.max_bytes = 1100
    eviction = ram.evict()
    assert [e.payload for e in eviction.evicted] == ["x"] and eviction.freed_bytes == 200
    assert ram.bytes == 1000 and "a" in ram.pages and "x" not in ram.pages
    # A contiguous entry beside them counts its own bytes; the last paged entry frees the shared pages.
    ram.max_bytes = 10_000
    ram.put((5, 5, 5), payload="z", nbytes=300, trimmable=True)
    assert ram.bytes == 1300
    released = ram.release(1)
    assert released.freed_bytes == 1000 and len(ram.pages) == 0 and ram.bytes == 300


# --- the pool (MLX) ------------------------------------------------------------------


def _caches(n: int, *, seed: int, quantized: bool = False) -> list:
    mx.random.seed(seed)
    out = []
    for _ in range(2):
        c = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def _arrays(cache) -> list:
    return [v for _, v in tree_flatten(cache.state)]


def _same(a: list, b: list) -> bool:
    return all(
        x.offset == y.offset and all(mx.array_equal(p, q).item() for p, q in zip(_arrays(x), _arrays(y), strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("quantized", [False, True])
def test_pages_lend_what_the_contiguous_entry_lends_and_die_with_their_last_entry(quantized):
    pool = PagePool(fingerprint="fp", page_tokens=32)
    tokens_a = list(range(100))
    a = _caches(100, seed=1, quantized=quantized)
    paged_a = pool.page(a, tokens_a, "")
    assert isinstance(paged_a, PagedCaches) and [(p.start, p.end) for p in paged_a.pages] == [
        (0, 32), (32, 64), (64, 96), (96, 100)]
    assert paged_a.nbytes == kinds.nbytes(a)
    for n in (1, 31, 32, 70, 100):
        assert _same(paged_a.lend(n), kinds.lend(a, n, total=100))
    # A borrower writing into what it was lent leaves the pages as they were.
    lent = paged_a.lend(64)
    before = [mx.array(x) for x in paged_a.pages[0].layers[0]]
    lent[0].trim(40)
    lent[0].update_and_fetch(*([mx.ones((1, 2, 16, 32))] * 2))
    mx.eval([c.state for c in lent])
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, paged_a.pages[0].layers[0], strict=True))
    # A second conversation over the first 80 tokens takes their pages as they are, and cuts its own
    # page where it stops sharing with the page it found there, so a third one shares that too.
    tokens_b = tokens_a[:80] + [1000 + i for i in range(20)]
    b = _caches(100, seed=2, quantized=quantized)
    paged_b = pool.page(b, tokens_b, "")
    assert paged_b.pages[:2] == paged_a.pages[:2] and paged_b.pages[2].end == 80
    tokens_c = tokens_a[:80] + [2000 + i for i in range(20)]
    paged_c = pool.page(_caches(100, seed=3, quantized=quantized), tokens_c, "")
    assert paged_c.pages[:3] == paged_b.pages[:3]
    # Only pages no payload references are freed.
    names_a = {p.name for p in paged_a.pages}
    del a, paged_a, lent, before
    gc.collect()
    alive = {p.name for p in paged_b.pages} | {p.name for p in paged_c.pages}
    assert len(pool) == len(alive) and not (names_a - alive) & set(pool._live)
    del paged_b, paged_c
    gc.collect()
    assert len(pool) == 0


def test_other_cache_kinds_stay_contiguous():
    from mlx_lm.models.cache import RotatingKVCache

    from mlxd.kv.page_pool import unpaged_reason

    assert unpaged_reason([KVCache(), QuantizedKVCache()]) is None
    assert "RotatingKVCache" in unpaged_reason([KVCache(), RotatingKVCache(max_size=8)])
    pool = PagePool(fingerprint="fp", page_tokens=32)
    ring = RotatingKVCache(max_size=64)
    ring.update_and_fetch(mx.zeros((1, 2, 10, 32)), mx.zeros((1, 2, 10, 32)))
    assert pool.page([ring], list(range(10)), "") is None


def test_pages_refused_where_they_cannot_work_yet(tiny_model_dir):
    with pytest.raises(ValueError, match="--distributed"):
        RuntimeConfig(model=str(tiny_model_dir), ram_pages="on", distributed=True)
    with pytest.raises(ValueError, match="--host-cache-gb"):
        RuntimeConfig(model=str(tiny_model_dir), ram_pages="on", host_cache_bytes=1 << 20)


# --- a real server --------------------------------------------------------------------


def _chat(http: httpx.Client, messages: list[dict]) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, "logprobs": True,
            "top_logprobs": 2}
    r = http.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _seen(reply: dict) -> tuple:
    content = reply["choices"][0]["logprobs"]["content"]
    return (tuple(c["token"] for c in content), tuple(c["logprob"] for c in content),
            reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def _agents(server: ServerThread) -> tuple[list[tuple], dict]:
    """Four conversations over one system prompt, two turns each: every reply, and /stats' RAM tier."""
    seen = []
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {t}."}]
                         for t in TOPICS]
        for _turn in range(2):
            for conv in conversations:
                reply = _chat(http, conv)
                seen.append(_seen(reply))
                conv += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And then?"}]
        ram = http.get(server.base_url.removesuffix("/v1") + "/stats").json()["cache"]["ram"]
    return seen, ram


def _unique_tokens(entries) -> int:
    """Tokens of the union of the entries' prefixes (the deduplicated KV, in tokens)."""
    keys = sorted(tuple(int(t) for t in e.tokens) for e in entries)
    total = sum(len(k) for k in keys)
    for prev, key in zip(keys, keys[1:], strict=False):
        common = next((i for i, (x, y) in enumerate(zip(prev, key, strict=False)) if x != y), min(len(prev), len(key)))
        total -= common
    return total


def test_ram_hits_are_the_same_with_pages_and_the_shared_prefix_is_held_once(tiny_model_dir):
    runs = {}
    for mode in ("off", "on"):
        with ServerThread(config_for(tiny_model_dir, ram_pages=mode, ram_page_tokens=32)) as server:
            seen, ram = _agents(server)
            rt = server.runtime
            assert rt is not None
            entries = list(rt.cache_owner.tiers.ram.entries())
            runs[mode] = (seen, ram, _unique_tokens(entries) * rt.info.kv_bytes_per_token)
    (off, ram_off, dedup_off), (on, ram_on, dedup) = runs["off"], runs["on"]
    # RAM hits served from pages: the same greedy tokens, logprobs and cached tokens as contiguous entries.
    assert sum(1 for *_, cached in on if cached > 0) >= 7
    assert on == off
    # Contiguous entries hold the system prompt once per conversation; pages hold it once.
    assert ram_off["pages"] == 0 and ram_off["bytes"] == ram_off["checkpoint_bytes"]
    assert dedup == dedup_off and ram_on["checkpoint_bytes"] == ram_off["checkpoint_bytes"]
    assert ram_on["bytes"] == ram_on["page_bytes"] > 0 and ram_on["pages"] > len(TOPICS)
    assert ram_on["bytes"] <= 1.2 * dedup < 0.6 * ram_off["bytes"]


def test_spill_and_restore_with_pages_on(tmp_path, tiny_model_dir):
    cache = tmp_path / "ssd"
    conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about caches."}]
    config = config_for(tiny_model_dir, ram_pages="on", ram_page_tokens=32, ssd_cache_dir=cache)
    with ServerThread(config) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        first = _chat(http, conv)
        conv += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And then?"}]
        warm = _chat(http, conv)  # a RAM hit, lent from pages
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        r = http.post(server.base_url.removesuffix("/v1") + "/admin/cache/flush")
        assert r.status_code == 200 and r.json()["durable"] is True
    # A restart restores the checkpoint from SSD into pages and answers as the RAM hit did.
    with ServerThread(config) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        cold = _chat(http, conv)
        stats = http.get(server.base_url.removesuffix("/v1") + "/stats").json()
        assert stats["ssd_cache"]["restores"] == 1
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm["usage"]["prompt_tokens_details"][
            "cached_tokens"]
        assert _seen(cold)[0] == _seen(warm)[0]
        assert _seen(cold)[1] == pytest.approx(_seen(warm)[1], abs=1e-4)
        assert stats["cache"]["ram"]["pages"] > 0 and stats["cache"]["ram"]["bytes"] == stats["cache"]["ram"][
            "page_bytes"]


# --- the simulator --------------------------------------------------------------------


def test_simulate_reports_ram_retained_with_pages_and_contiguous():
    import numpy as np

    from mlxd.kv.cost_model import DEFAULT
    from mlxd.sim.replay import replay_mlxd
    from mlxd.sim.trace import TraceRequest

    rng = np.random.default_rng(3)
    shared = tuple(int(t) for t in rng.integers(0, 30000, 5000))
    reqs = [TraceRequest(index=i, t=float(i), input_length=5064, output_tokens=16, session=f"s{i}",
                         tokens=shared + tuple(int(t) for t in rng.integers(0, 30000, 64)),
                         output_ids=tuple(int(t) for t in rng.integers(0, 30000, 16)))
            for i in range(64)]
    runs = {paged: replay_mlxd(reqs, policy="lru", cost=DEFAULT, ram_bytes=None, slots=1, ram_pages=paged,
                               ram_page_tokens=1024) for paged in (False, True)}
    dedup = DEFAULT.kv_bytes(5000 + 64 * 80)
    contiguous, pages = runs[False], runs[True]
    assert contiguous.ram_hits == pages.ram_hits == 63  # the same hits: pages change bytes, not lookups
    assert contiguous.ram_bytes_retained == contiguous.ram_checkpoint_bytes == pages.ram_checkpoint_bytes
    assert contiguous.ram_bytes_retained > 30 * dedup
    assert pages.ram_pages and pages.ram_bytes_retained <= 1.2 * dedup


def test_a_recorded_trace_replays_to_the_live_page_bytes(tiny_model_dir, tmp_path):
    import attrs

    from mlxd.cli import record_trace
    from mlxd.kv.cost_model import DEFAULT
    from mlxd.sim.replay import replay_mlxd
    from mlxd.sim.trace import load_recording

    trace = tmp_path / "live.jsonl"
    with ServerThread(config_for(tiny_model_dir, ram_pages="on", ram_page_tokens=32)) as server:
        record_trace(server.runtime, trace)
        _agents(server)
        live = server.call(server.runtime.stats).cache.tiers.ram
        kv_per_token = server.runtime.info.kv_bytes_per_token
    recording = load_recording(trace)
    assert recording.server is not None and recording.server["ram_pages"] == "on"
    assert recording.server["ram_page_tokens"] == 32
    cost = attrs.evolve(DEFAULT, kv_bytes_per_token=kv_per_token)
    result = replay_mlxd(recording.reqs, policy="lru", cost=cost, ram_bytes=None, slots=1, granularity="token",
                         ram_pages=True, ram_page_tokens=32)
    assert result.ram_hits == live.hits and result.ram_hit_tokens == live.hit_tokens
    assert result.ram_checkpoint_bytes == live.checkpoint_bytes
    assert result.ram_bytes_retained == live.bytes < live.checkpoint_bytes
