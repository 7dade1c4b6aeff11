"""Pinned prefixes and retention classes in the tier core (fake clock), and over HTTP."""

from __future__ import annotations

import attrs
import httpx
import pytest

from mlxd.kv.cost_model import DEFAULT
from mlxd.kv.prompt_cache import PromptCache
from mlxd.kv.tiers import IMPLICIT_PIN_SESSION, CacheTiers, Persist, SsdRecord
from mlxd.kv.write_queue import WriteQueue
from mlxd.sim.replay import replay_mlxd
from mlxd.sim.trace import TraceRequest

from serving import ServerThread, config_for

PROMPT_CACHE_BYTES = 400_000  # the tiny model: ~140 kB per conversation here


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(ram: int = 1000, *, ssd: bool = False, idle: float = 0.0, pin_max: int = -1):
    clock = Clock()
    tiers = CacheTiers(PromptCache(max_bytes=ram, clock=clock), ssd=ssd, demote_idle_s=idle, pin_max_bytes=pin_max)
    return tiers, clock


def publish(tiers: CacheTiers, tokens, nbytes: int, *, session: str | None = None):
    return tiers.publish(tuple(tokens), "", payload=None, nbytes=nbytes, trimmable=True, session=session)


def resident(tiers: CacheTiers, tokens) -> bool:
    return tiers.ram.find_exact(tuple(tokens)) is not None


def test_eviction_passes_over_a_pinned_entry_and_takes_the_next():
    tiers, clock = make(ram=300)
    assert tiers.pin_session("a", 60)
    publish(tiers, range(10), 100, session="a")  # the coldest entry, pinned
    clock.now = 1
    publish(tiers, range(100, 110), 100)
    clock.now = 2
    publish(tiers, range(200, 210), 100)
    publish(tiers, range(300, 310), 100)  # over the cap: the coldest unpinned entry goes
    assert resident(tiers, range(10)) and not resident(tiers, range(100, 110))
    pins = tiers.stats().pins
    assert (pins.sessions, pins.entries, pins.bytes, pins.max_bytes) == (1, 1, 100, 150)


def test_a_pin_ends_at_its_deadline():
    tiers, clock = make(ram=200)
    anon = IMPLICIT_PIN_SESSION + "1"  # a request without a session: its made-up session closes at expiry
    tiers.pin_session(anon, 10)
    publish(tiers, range(10), 100, session=anon)
    publish(tiers, range(100, 110), 100)
    clock.now = 5
    publish(tiers, range(200, 210), 100)
    assert resident(tiers, range(10)) and not resident(tiers, range(100, 110))
    clock.now = 10  # expired: the oldest entry is an ordinary victim again
    publish(tiers, range(300, 310), 100)
    assert not resident(tiers, range(10))
    pins = tiers.stats().pins
    assert (pins.sessions, pins.expired, pins.bytes) == (0, 1, 0)
    assert tiers.stats().sessions.sessions == 0


def test_deleting_the_session_releases_its_pin():
    tiers, _ = make(ram=200)
    tiers.pin_session("a", 3600)
    publish(tiers, range(10), 100, session="a")
    assert tiers.close_session("a")
    publish(tiers, range(100, 110), 100)
    publish(tiers, range(200, 210), 100)
    assert not resident(tiers, range(10))
    assert tiers.stats().pins.released == 1
    assert not tiers.close_session("a")  # unknown now


def test_pinned_bytes_never_pass_the_cap():
    tiers, _ = make(ram=400)  # pins may hold 200 bytes
    tiers.pin_session("a", 60)
    publish(tiers, range(10), 150, session="a")
    assert tiers.pin_session("b", 60)  # nothing yet: granted
    publish(tiers, range(100, 110), 100, session="b")  # 250 pinned: b's pin is refused
    pins = tiers.stats().pins
    assert (pins.sessions, pins.bytes, pins.refused) == (1, 150, 1)
    assert not tiers.pin_session("a2", 60) or tiers.stats().pins.bytes <= 200
    # A checkpoint larger than the cap cannot be pinned at all; RAM stays within its own cap.
    tiers.pin_session("c", 60)
    publish(tiers, range(500, 510), 300, session="c")
    assert tiers.stats().pins.refused == 2 and tiers.ram.bytes <= 400
    # A pin that can never be honoured: no RAM tier.
    off, _ = make(ram=0)
    assert not off.pin_session("x", 60) and off.stats().pins.refused == 1


def test_a_pinned_conversation_follows_its_latest_checkpoint():
    tiers, _ = make(ram=300)
    tiers.pin_session("a", 60)
    publish(tiers, range(10), 100, session="a")
    publish(tiers, range(20), 120, session="a")  # the next turn supersedes the first
    pins = tiers.stats().pins
    assert (pins.entries, pins.bytes) == (1, 120)
    publish(tiers, range(100, 110), 100)
    publish(tiers, range(200, 210), 100)
    assert resident(tiers, range(20))


def test_idle_demotion_and_the_memory_budget_keep_pinned_entries():
    tiers, clock = make(ram=1000, ssd=True, idle=10)
    tiers.pin_session("a", 3600)
    for tokens, session in ((range(10), "a"), (range(100, 110), None)):
        (persist,) = publish(tiers, tokens, 100, session=session)
        assert isinstance(persist, Persist)
        tiers.durable(SsdRecord("", persist.tokens, persist.nbytes, 0.0, True))
    clock.now = 20
    tiers.demote_idle()
    assert resident(tiers, range(10)) and not resident(tiers, range(100, 110))
    publish(tiers, range(300, 310), 100)
    tiers.durable(SsdRecord("", tuple(range(300, 310)), 100, 0.0, True))
    tiers.memory_budget = 100
    tiers.observe_memory(1000)  # far over the budget: every durable unpinned entry leaves
    assert resident(tiers, range(10)) and not resident(tiers, range(300, 310))



def test_a_pinned_checkpoint_is_written_to_ssd_first():
    tiers, _ = make(ram=1000, ssd=True)
    tiers.pin_session("a", 60)
    (waiting,) = publish(tiers, range(100, 110), 100)
    (pinned,) = publish(tiers, range(10), 100, session="a")
    assert not waiting.first and pinned.first
    # The write queue puts it ahead of what was already waiting.
    queue = WriteQueue()
    for effect in (waiting, pinned):
        queue.mark(effect.namespace, effect.tokens, plan=None, trimmable=True, nbytes=effect.nbytes,
                   first=effect.first)
    job = queue.next_job()
    assert job is not None and tuple(job.record.tokens) == tuple(range(10))



def test_the_simulator_replays_a_pin_through_the_same_core():
    def req(i: int, tokens: list[int], pin_s: float = 0.0) -> TraceRequest:
        return TraceRequest(index=i, t=float(i), input_length=len(tokens), output_tokens=1, tokens=tuple(tokens),
                            pin_s=pin_s)

    a, b, c = list(range(100)), list(range(1000, 1100)), list(range(2000, 2100))

    def hit_of_a(pin_s: float) -> int:
        seen: dict[int, int] = {}
        trace = [req(0, a, pin_s), req(1, b), req(2, c), req(3, [*a, 7])]
        replay_mlxd(trace, policy="lru", cost=attrs.evolve(DEFAULT, kv_bytes_per_token=1), ram_bytes=250,
                    slots=1, snapshot_min_tokens=1, on_request=lambda r, hit, src: seen.setdefault(r.index, hit))
        return seen[3]

    assert hit_of_a(3600.0) == 100  # pinned: still in RAM after two other prompts
    assert hit_of_a(0.0) == 0  # the same trace unpinned: evicted


# --- over HTTP: a pinned conversation survives RAM pressure that evicts an unpinned one ----------

SYSTEM = "You are a careful assistant who answers briefly and names every colour you know. " * 6


@pytest.fixture(scope="module")
def small_cache_server(tiny_model_dir):
    # RAM only, room for about two conversations: a third pushes the coldest out.
    with ServerThread(config_for(tiny_model_dir, prompt_cache_bytes=PROMPT_CACHE_BYTES)) as s:
        yield s


def messages(server, text: str, *, pin: bool, session: str) -> dict:
    system: list[dict] = [{"type": "text", "text": text}]
    if pin:
        system[0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": "Which colour is the sky?"}]}
    r = httpx.post(server.base_url + "/messages", json=body, headers={"X-Session-Id": session}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def pins(server) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["cache"]["pins"]



def test_a_pinned_conversation_survives_pressure_that_evicts_an_unpinned_one(small_cache_server):
    server = small_cache_server
    pinned = "Pinned conversation. " + SYSTEM
    first = messages(server, pinned, pin=True, session="a")
    # Four unpinned sessions after it, each sharing a long prefix with the one before (so their
    # lookups refresh each other, not the pinned one): the pinned one is the coldest by far.
    for name in "bcde":
        messages(server, f"Unpinned conversation. {SYSTEM} ({name})", pin=False, session=name)
    stats = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["cache"]
    assert stats["ram"]["evictions"] >= 2 and stats["ram"]["bytes"] <= PROMPT_CACHE_BYTES
    assert stats["pins"]["sessions"] == 1 and 0 < stats["pins"]["bytes"] <= stats["pins"]["max_bytes"]
    # The pinned conversation is still in RAM: its next request reads the whole prompt from cache.
    again = messages(server, pinned, pin=False, session="a")
    assert again["cache_read_input_tokens"] == first["input_tokens"] - 1
    # Deleting the session releases its pin.
    assert httpx.delete(f"{server.base_url}/sessions/a", timeout=30).status_code == 200
    stats = pins(server)
    assert stats["sessions"] == 0 and stats["released"] == 1


def test_a_pin_holds_the_descendant_that_superseded_its_checkpoint():
    tiers, _ = make(ram=300)
    tiers.pin_session("a", 60)
    publish(tiers, range(10), 100, session="a")
    publish(tiers, range(20), 120)  # another request extends the pinned prefix: the ancestor is superseded
    assert not resident(tiers, range(10))
    pins = tiers.stats().pins
    assert (pins.entries, pins.bytes) == (1, 120)
    publish(tiers, range(100, 110), 100)
    publish(tiers, range(200, 210), 100)
    assert resident(tiers, range(20))  # the pinned prefix is still in RAM, inside its descendant


def test_a_descendant_too_large_for_the_cap_ends_the_pin():
    tiers, _ = make(ram=300)  # pins may hold 150 bytes
    tiers.pin_session("a", 60)
    publish(tiers, range(10), 100, session="a")
    publish(tiers, range(20), 200)  # supersedes the pinned checkpoint with more than the cap
    pins = tiers.stats().pins
    assert (pins.sessions, pins.bytes, pins.refused) == (0, 0, 1)
    publish(tiers, range(100, 110), 200)  # RAM stays within its cap: the descendant can go
    assert tiers.ram.bytes <= 300
