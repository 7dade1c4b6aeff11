"""The session checkpoint index (seed §5.12): the pure index, eviction preference, and the HTTP surface."""

from __future__ import annotations

from mlxd.kv.prefix_index import token_key
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.sessions import SessionIndex


def test_a_session_points_at_its_latest_checkpoint_and_falls_back_when_it_does_not_fit():
    idx = SessionIndex()
    idx.advance("s1", "", (1, 2, 3))
    idx.advance("s1", "", (1, 2, 3, 4, 5))
    assert idx.latest("s1", "") == token_key((1, 2, 3, 4, 5))
    assert not idx.referenced("", (1, 2, 3)), "advancing drops the old reference"
    assert idx.referenced("", (1, 2, 3, 4, 5))
    assert idx.usable_for("s1", "", token_key((1, 2, 3, 4, 5, 6, 7))) == token_key((1, 2, 3, 4, 5))
    assert idx.usable_for("s1", "", token_key((1, 2, 9, 4, 5, 6))) is None  # an edited history
    assert idx.usable_for("s1", "", token_key((1, 2, 3, 4, 5))) is None  # not shorter than the prompt
    assert idx.usable_for("s1", "other-ns", token_key((1, 2, 3, 4, 5, 6))) is None  # namespaces are apart
    assert idx.usable_for("nobody", "", token_key((1, 2))) is None
    assert (idx.stats.hits, idx.stats.fallbacks) == (1, 2)


def test_close_drops_references_in_every_namespace():
    idx = SessionIndex()
    idx.advance("s1", "", (1, 2))
    idx.advance("s1", "lora", (1, 2))
    idx.advance("s2", "", (1, 2))  # two sessions share one checkpoint
    assert idx.close("s1")
    assert not idx.close("s1"), "closing twice: unknown"
    assert idx.referenced("", (1, 2)) and not idx.referenced("lora", (1, 2))
    assert idx.close("s2") and not idx.referenced("", (1, 2))
    assert len(idx) == 0 and idx.stats.closed == 2


def _fill(cache: PromptCache, n: int) -> list:
    out = []
    for i in range(n):
        out.append(cache.put((i, i + 1000), payload=None, nbytes=10, trimmable=True).entry)
    return out


def test_eviction_prefers_entries_no_session_references_but_does_not_pin():
    idx = SessionIndex()
    cache = PromptCache(max_bytes=100)
    entries = _fill(cache, 10)
    for e in entries[:3]:  # the three least recently used belong to sessions
        idx.advance(f"s{e.tokens[0]}", "", e.tokens)
    cache.put((99, 1), payload=None, nbytes=30, trimmable=True)  # 30 bytes over the cap

    def anonymous(entry) -> bool:
        return not idx.referenced(entry.namespace, entry.tokens)

    gone = cache.evict(prefer=anonymous).evicted
    assert [e.tokens for e in gone] == [entries[i].tokens for i in (3, 4, 5)]
    assert all(cache.find_exact(e.tokens) is not None for e in entries[:3])
    # Under more pressure than anonymous entries can relieve, referenced ones go too.
    cache.put((98, 1), payload=None, nbytes=90, trimmable=True)
    idx.advance("s-new", "", (98, 1))
    gone = cache.evict(prefer=anonymous).evicted
    assert [e.tokens for e in gone][-2:] == [entries[0].tokens, entries[1].tokens]
    assert cache.find_exact((98, 1)) is not None
    assert cache.bytes <= cache.max_bytes


def test_take_exact_counts_a_hit_without_a_scan():
    cache = PromptCache(max_bytes=1000)
    cache.put((1, 2, 3), payload=None, nbytes=10, trimmable=True)
    hit = cache.take_exact((1, 2, 3), "", prompt_tokens=5)
    assert hit is not None and hit.usable == 3
    assert cache.take_exact((1, 2), "", prompt_tokens=5) is None
    # Not resident: nothing counted (the caller falls back to `take`, which counts).
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_tokens) == (1, 0, 3)


# --- a live server: the header, DELETE, eviction pressure ---------------------------------------

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from mlxd import RuntimeConfig, SamplingParams, open_runtime  # noqa: E402

from serving import ServerThread, config_for  # noqa: E402

SYSTEM = "You answer briefly and keep track of the conversation. "
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]


def _chat(server: ServerThread, messages, headers=None, **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8, **kw}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stats(server: ServerThread) -> dict:
    return httpx.get(f"{server.base_url.removesuffix('/v1')}/stats", timeout=30).json()


def _delete(server: ServerThread, sid: str) -> httpx.Response:
    return httpx.delete(f"{server.base_url}/sessions/{sid}", timeout=30)


def test_a_session_follow_up_hits_its_checkpoint_and_delete_drops_only_the_reference(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, snapshot_min_tokens=256)) as server:
        anon = _chat(server, TURN1)
        assert _stats(server)["cache"]["ram"]["published_boundary"] == 0, "short prompt: below the threshold"
        r1 = _chat(server, TURN1 + [{"role": "user", "content": "Again."}], headers={"X-Session-Id": "s-1"})
        ram = _stats(server)["cache"]["ram"]
        assert ram["published_boundary"] == 1, "a session keeps checkpoints below the anonymous threshold"
        turn2 = TURN1 + [{"role": "user", "content": "Again."},
                         {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And another one?"}]
        r2 = _chat(server, turn2, headers={"X-Session-Id": "s-1"})
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
        sessions = _stats(server)["cache"]["sessions"]
        assert sessions["hits"] == 1 and sessions["sessions"] == 1 and sessions["fallbacks"] == 0
        # An edited history falls back to ordinary prefix matching (still a hit on the shared prefix).
        edited = TURN1 + [{"role": "user", "content": "Something else entirely."}]
        r3 = _chat(server, edited, headers={"X-Session-Id": "s-1"})
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _stats(server)["cache"]["sessions"]["fallbacks"] == 1

        deleted = _delete(server, "s-1")
        assert deleted.status_code == 200 and deleted.json() == {"id": "s-1", "object": "session", "deleted": True}
        again = _delete(server, "s-1")
        assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"
        assert _delete(server, "never-seen").status_code == 404
        too_long = _delete(server, "x" * 257)  # no request could have named it: 400, as export and import say
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "session_id", too_long.text
        assert _stats(server)["cache"]["sessions"]["sessions"] == 0
        # The cached state stays: the same conversation, now anonymous, still hits.
        r4 = _chat(server, turn2)
        assert r4["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"]
        assert anon["usage"]["prompt_tokens"] > 0


def test_the_header_wins_over_the_body_user_field(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as server:
        _chat(server, TURN1, headers={"X-Session-Id": "from-header"}, user="from-body")
        _chat(server, TURN1 + [{"role": "user", "content": "More."}], user="only-body")
        assert _delete(server, "from-body").status_code == 404
        assert _delete(server, "from-header").status_code == 200
        assert _delete(server, "only-body").status_code == 200
        bad = httpx.post(f"{server.base_url}/chat/completions", timeout=30,
                         json={"messages": TURN1, "max_tokens": 2, "user": 7})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "user"


async def test_sessions_survive_eviction_pressure_better_than_anonymous_entries(tiny_model_dir):
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(10, 1000, size=64)) for _ in range(8)]
    sampling = SamplingParams(max_tokens=4)

    async def run(rt, prompt, session=None):
        async with rt.submit(rt.request(prompt, sampling=sampling, session=session)) as stream:
            out = await stream.tokens()
        return out, stream.accepted

    # One conversation's checkpoint size, to size a RAM tier that holds about four.
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir))) as probe:
        await run(probe, prompts[0])
        entry_bytes = (await probe.cache_stats())["ram"]["bytes"]
    config = RuntimeConfig(model=str(tiny_model_dir), prompt_cache_bytes=int(entry_bytes * 4.5))
    async with open_runtime(config) as rt:
        gen_s, _ = await run(rt, prompts[0], session="kept")  # the oldest entry belongs to a session
        gen_a, _ = await run(rt, prompts[1])  # the next oldest is anonymous
        for filler in prompts[2:]:
            await run(rt, filler)  # pressure: six more conversations than fit
        assert (await rt.cache_stats())["ram"]["evictions"] >= 3
        _, s_hit = await run(rt, prompts[0] + tuple(gen_s) + (5, 6, 7), session="kept")
        _, a_hit = await run(rt, prompts[1] + tuple(gen_a) + (5, 6, 7))
        assert s_hit.cache_tier == "ram" and s_hit.cached_tokens >= len(prompts[0])
        assert a_hit.cached_tokens == 0, "the anonymous conversation of the same age was evicted"
        assert (await rt.cache_stats())["sessions"]["hits"] == 1


def _session_trace(path) -> None:
    """Three multi-turn sessions interleaved with one-off anonymous prompts (RAM pressure)."""
    import json

    rng = np.random.default_rng(1)
    lines, t = [], 0.0
    convo = {s: [int(x) for x in rng.integers(10, 1000, 600)] for s in ("a", "b", "c")}
    for _turn in range(4):
        for s in convo:
            out = [int(x) for x in rng.integers(10, 1000, 40)]
            lines.append({"t": t, "session": s, "tokens": convo[s], "output_tokens": 40, "output_ids": out})
            convo[s] = convo[s] + out + [int(x) for x in rng.integers(10, 1000, 60)]
            t += 1.0
            for _ in range(3):
                lines.append({"t": t, "tokens": [int(x) for x in rng.integers(10, 1000, 700)], "output_tokens": 8})
                t += 1.0
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_simulate_reports_what_the_session_index_changes(tmp_path, capsys):
    from mlxd.sim.cli import main

    trace = tmp_path / "sessions.jsonl"
    _session_trace(trace)
    argv = [str(trace), "--cache-model", "mlxd", "--policy", "lru", "--ram-blocks", "8", "--granularity", "token"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "session index (3 sessions in the trace)" in out
    policy, blocks, session_hits, fallbacks, tok_hit, ram_hits, *_ = out.splitlines()[-1].split()
    assert int(session_hits) == 9, "every follow-up turn finds its session's checkpoint"
    with_ram, without_ram = (int(x) for x in ram_hits.split("/"))
    assert with_ram == 9 and without_ram == 0, "under pressure only the session entries survive"
    assert main([*argv, "--no-sessions"]) == 0
    assert "session index" not in capsys.readouterr().out


def test_a_session_checkpoint_evicted_to_ssd_is_the_restore_candidate_without_a_scan():
    from mlxd.kv.prompt_cache import PromptCache as _PC
    from mlxd.kv.restore_decision import RestoreAdvisor
    from mlxd.kv.tiers import CacheTiers, Persist, SsdRecord

    tiers = CacheTiers(_PC(max_bytes=150), ssd=True, advisor=RestoreAdvisor())
    convo = tuple(range(100))
    (persist,) = tiers.publish(convo, "", payload=None, nbytes=100, trimmable=True, session="s")
    tiers.durable(SsdRecord("", persist.tokens, 100, 0.0, True))
    for i in range(3):  # anonymous entries push the (durable) session entry out of RAM
        for effect in tiers.publish(tuple(range(1000 * (i + 1), 1000 * (i + 1) + 100)), "", payload=None,
                                    nbytes=100, trimmable=True):
            if isinstance(effect, Persist):
                tiers.durable(SsdRecord("", effect.tokens, 100, 0.0, True))
    assert tiers.ram.find_exact(convo) is None
    lookup = tiers.lookup(convo + (7, 8, 9), "", session="s")
    assert lookup.restore is not None and tuple(lookup.restore.record.tokens) == convo
    assert lookup.restore.usable == len(convo)
    assert tiers.sessions.stats.hits == 1 and tiers.sessions.stats.fallbacks == 0
