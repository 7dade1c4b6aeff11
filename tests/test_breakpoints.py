"""`cache_control` breakpoints pin the prefix up to their block (issue 25), over HTTP with the `anthropic` SDK."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from mlxd.http.anthropic import _cuts, parse_request

from serving import ServerThread, config_for

PROMPT_CACHE_BYTES = 600_000  # the tiny model: about four conversations (~140 kB each); pins may hold two
SYSTEM = "You are a careful assistant who answers briefly and names every colour you know. " * 6


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, prompt_cache_bytes=PROMPT_CACHE_BYTES)) as s:
        yield s


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=120)


def ask(server, system: str, question: str, *, breakpoint: bool = False, session: str | None = None):
    block: dict = {"type": "text", "text": system}
    if breakpoint:
        block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    headers = {"X-Session-Id": session} if session else {}
    return client(server).messages.create(
        model="tiny", max_tokens=2, system=[block], extra_body={"temperature": 0},
        messages=[{"role": "user", "content": question}], extra_headers=headers,
    ).usage


def pins(server) -> dict:
    return httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["cache"]["pins"]


def test_each_breakpoint_cuts_the_conversation_at_the_end_of_its_block():
    body = {
        "max_tokens": 1, "system": [{"type": "text", "text": "S1"},
                                    {"type": "text", "text": "S2", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral",
                                                                                       "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "U1", "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "U2"}]},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "U3"},
        ],
        "cache_control": {"type": "ephemeral"},
    }
    parse_request(body, max_tokens_limit=100)  # valid
    cuts = [([(m["role"], m["content"]) for m in msgs], ttl) for msgs, ttl in _cuts(body)]
    system = ("system", "S1S2")
    assert cuts == [
        ([system], 300.0),  # the system block
        ([system], 3600.0),  # the tools render into the system turn
        ([system, ("user", "U1")], 300.0),  # the first user block, not the whole turn
        ([system, ("user", "U1U2"), ("assistant", "A1"), ("user", "U3")], 300.0),  # automatic: everything
    ]


def test_a_breakpoint_keeps_its_prefix_for_a_request_that_diverges_after_it(server):
    marked, unmarked = "Marked. " + SYSTEM, "Unmarked. " + SYSTEM
    ask(server, marked, "Which colour is the sky?", breakpoint=True, session="a")
    assert pins(server)["prefixes"] == 1
    ask(server, unmarked, "Which colour is the sky?", session="b")  # the same, without a breakpoint
    # Both sessions move on to other conversations: the session pin follows session "a", not the prefix.
    ask(server, "Elsewhere. " + SYSTEM, "Hello?", session="a")
    ask(server, "Elsewhere too. " + SYSTEM, "Hello?", session="b")
    for name in "cdef":  # RAM pressure: the oldest entries go
        ask(server, f"Pressure {name}. " + SYSTEM, "Hi.")
    stats = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["cache"]
    assert stats["ram"]["evictions"] >= 2 and stats["pins"]["prefixes"] == 1
    # A new question after each system prompt: the marked prefix is still in RAM, the unmarked one is not.
    prefix = len(server.runtime.encode(marked))
    hit = ask(server, marked, "What colour is grass?")
    miss = ask(server, unmarked, "What colour is grass?")
    assert hit.cache_read_input_tokens >= prefix
    assert miss.cache_read_input_tokens < prefix // 2
    # Deleting the session releases its breakpoint pins too.
    assert httpx.delete(f"{server.base_url}/sessions/a", timeout=30).status_code == 200
    assert pins(server)["prefixes"] == 0


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    """A hybrid recurrent model: its caches cannot be cut back, so only an exact checkpoint serves a prefix."""
    from mlxd.model import build_model

    model = build_model(tmp_path_factory.mktemp("models") / "qwen3next", "test-qwen3next", seed=0)
    with ServerThread(config_for(model)) as s:
        yield s


def test_an_untrimmable_model_checkpoints_where_the_breakpoint_ends(hybrid_server):
    server = hybrid_server
    marked, unmarked = "Marked. " + SYSTEM, "Unmarked. " + SYSTEM
    prefix = len(server.runtime.encode(marked))
    ask(server, marked, "Which colour is the sky?", breakpoint=True, session="h")
    ask(server, unmarked, "Which colour is the sky?", session="u")
    # The engine kept a checkpoint where the marked system prompt ends: another question reuses it.
    hit = ask(server, marked, "What colour is grass?")
    assert hit.cache_read_input_tokens >= prefix
    # Without the breakpoint, the prompt's checkpoints end past the divergence: nothing to reuse.
    miss = ask(server, unmarked, "What colour is grass?")
    assert miss.cache_read_input_tokens < prefix // 2


def test_every_rank_cuts_its_prefill_alike():
    """--distributed: the followers get the cuts with the start, or their prefill would take other steps."""
    from mlxd.engine.ops import RowStart, StepOps
    from mlxd.runtime.distributed import decode_ops, encode_ops
    from mlxd.runtime.kernel.messages import GenerationRequest

    start = RowStart(request=GenerationRequest(request_id="a", prompt=tuple(range(3, 40))), checkpoint_at=(9, 21))
    ops = StepOps(starts=(start, RowStart(request=GenerationRequest(request_id="b", prompt=(5, 6)))))
    assert decode_ops(encode_ops(ops)) == ops
