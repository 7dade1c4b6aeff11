"""A tool loop with reasoning on real public chat templates serves the ideal reusable prefix (issue 25).

The short CI form of benchmarks/bench_agent_templates.py: a recorded agent session (reasoning and
one tool call per assistant turn, then its result) replayed over /v1/chat/completions on a server
started with `--chat-template` one of the vendored templates (benchmarks/templates/). At each step
the ideal is the common prefix of the step's prompt with the previous step's, both rendered by
the server's template.

- A trimmable cache (KVCache) serves exactly the ideal, also where DeepSeek-R1's template
  re-renders the end of the previous prompt (reuse up to the divergence).
- An untrimmable one (the hybrid gated delta-net + attention model) serves the previous step's
  prompt-boundary checkpoint when Qwen3's template keeps the prompt a prefix: every token but the
  last, which the step before prefilled together with its first output token.
- Where DeepSeek-R1's template rewrites the tail, the untrimmable cache serves up to the rewrite
  from the checkpoint at the template's stable prefix, on the chat route, on /v1/messages and on
  /v1/responses continued by previous_response_id (all three share the chat route's rendering).
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.http.responses import input_messages, output_messages
from mlxd.model import build_model

from serving import ServerThread, config_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_agent_templates import SYSTEM, TEMPLATE_FILES, TOOL, TOOLS, common, run_loop, session  # noqa: E402

STEPS = session(4, result_words=12)


def loop(model_dir: Path, template: str) -> list[dict]:
    config = config_for(model_dir, chat_template=str(TEMPLATE_FILES[template]))
    with ServerThread(config) as server, \
            httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=120) as http:
        return run_loop(server, http, STEPS, timed=False)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / "hybrid", "test-qwen3next", seed=0)


def test_qwen3_template_keeps_the_prompt_a_prefix_and_kvcache_serves_all_of_it(tiny_model_dir):
    rows = loop(tiny_model_dir, "qwen3")
    assert all(r["prompt"] == r["rendered"] for r in rows)  # the server's prompt is the template's
    assert rows[0]["cached"] == 0
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row["kept"] == 1.0  # reasoning and calls of this loop's turns are re-rendered as sent
        assert row["ideal"] == prev["prompt"]
        assert row["cached"] == row["ideal"]


def test_deepseek_r1_template_rerenders_the_tail_and_kvcache_reuses_up_to_the_divergence(tiny_model_dir):
    rows = loop(tiny_model_dir, "deepseek-r1")
    for prev, row in zip(rows, rows[1:], strict=False):
        # The generation prompt '<｜Assistant｜><think>\n' / '<｜tool▁outputs▁end｜>' is not in the next prompt.
        assert row["ideal"] < prev["prompt"]
        assert row["cached"] == row["ideal"]


def test_an_untrimmable_hybrid_cache_serves_all_but_the_last_token_of_each_step(hybrid_dir):
    rows = loop(hybrid_dir, "qwen3")
    for row in rows[1:]:
        assert row["kept"] == 1.0
        assert row["cached"] == row["ideal"] - 1
        assert row["cached"] / row["ideal"] >= 0.99


def greedy(server: ServerThread, http: httpx.Client, messages: list[dict]) -> tuple[str, int]:
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 6, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    doc = r.json()
    return json.dumps(doc["choices"][0]["message"], sort_keys=True), doc["usage"]["prompt_tokens_details"][
        "cached_tokens"]


def test_an_untrimmable_hybrid_cache_reuses_deepseek_r1s_prompt_up_to_its_rewritten_tail(hybrid_dir):
    # DeepSeek-R1's template rewrites the last 2-20 tokens of each step's prompt in the next one;
    # the route finds that stable prefix and the engine checkpoints there (runtime/chat/stable_prefix.py).
    config = config_for(hybrid_dir, chat_template=str(TEMPLATE_FILES["deepseek-r1"]))
    with ServerThread(config) as server, \
            httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=120) as http:
        assert server.runtime is not None and not server.runtime.info.trimmable
        rows = run_loop(server, http, STEPS, timed=False)
        last = [*STEPS[-1], {"role": "user", "content": "Summarize."}]
        warm, warm_cached = greedy(server, http, last)
    for row in rows[1:]:
        assert row["ideal"] < row["rendered"]  # the template re-rendered the previous prompt's tail
        assert row["cached"] == row["ideal"]  # served up to the divergence
    assert warm_cached > 0
    with ServerThread(config) as cold_server, \
            httpx.Client(base_url=cold_server.base_url.removesuffix("/v1"), timeout=120) as http:
        cold, cold_cached = greedy(cold_server, http, last)
    assert cold_cached == 0
    assert warm == cold  # the cut changes where a checkpoint is published, never the output


def rendered_and_cut(server: ServerThread, messages: list[dict]) -> tuple[tuple[int, ...], int | None]:
    """The prompt a chat route makes of `messages` and its checkpoint cut (the routes' own call)."""
    assert server.runtime is not None
    return server.call(partial(server.runtime.render_chat_cut, messages, tools=TOOLS))


def to_anthropic(messages: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """A recorded chat session as a Messages body: thinking + tool_use blocks, tool_result blocks."""
    assert messages[0]["role"] == "system"
    out: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            blocks = [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""}]
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
    return messages[0]["content"], out


@pytest.fixture
def deepseek_hybrid(hybrid_dir):
    """A fresh server per test: each loop starts from an empty cache."""
    config = config_for(hybrid_dir, chat_template=str(TEMPLATE_FILES["deepseek-r1"]))
    with ServerThread(config) as server, \
            httpx.Client(base_url=server.base_url.removesuffix("/v1"), timeout=120) as http:
        assert server.runtime is not None and not server.runtime.info.trimmable
        yield server, http


def test_anthropic_messages_tool_loop_reads_deepseek_r1s_prompt_up_to_its_rewritten_tail(deepseek_hybrid):
    # The chat test's session as Messages: thinking and tool_use blocks, tool_result blocks. Each step
    # reads exactly the previous step's cut, which ends where the template rewrote that prompt's tail.
    server, http = deepseek_hybrid
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
    prev: tuple[int, ...] = ()
    prev_cut: int | None = None
    for k, messages in enumerate(STEPS):
        ids, cut = rendered_and_cut(server, messages)
        system, turns = to_anthropic(messages)
        r = http.post("/v1/messages", json={"model": "tiny", "system": system, "messages": turns, "tools": tools,
                                            "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached = usage["cache_read_input_tokens"]
        assert usage["input_tokens"] + cached == len(ids)  # the chat route's prompt, counted the same way
        assert cut is not None and cut < len(ids) - 1
        if k == 0:
            assert cached == 0
        else:
            ideal = common(prev, ids)
            assert ideal < len(prev) - 1  # the template rewrote the previous prompt's tail
            assert cached == ideal == prev_cut  # served up to it, from the checkpoint at the previous cut
        prev, prev_cut = ids, cut


def test_responses_tool_loop_through_previous_response_id_reads_up_to_the_rewritten_tail(deepseek_hybrid):
    # Each step continues the stored response with the agent's turn (reasoning, function call, its
    # output). Where the template rewrote the previous prompt's tail (the first step's '<think>' at
    # least), the step reads exactly the previous cut; elsewhere the tail is kept and it reads at least
    # the whole previous prompt but its last token (the prompt-boundary checkpoint, or past it).
    server, http = deepseek_hybrid
    tools = [{"type": "function", **TOOL}]
    conversation: list[dict[str, Any]] = []
    prev: tuple[int, ...] = ()
    prev_cut: int | None = None
    previous_id = None
    rewritten = 0
    for k, messages in enumerate(STEPS):
        if k == 0:
            items: list[dict[str, Any]] = [{"role": "user", "content": messages[-1]["content"]}]
        else:
            turn, result = messages[-2], messages[-1]
            call = turn["tool_calls"][0]
            items = [{"type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": turn["reasoning_content"]}]},
                     {"type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]},
                     {"type": "function_call_output", "call_id": call["id"], "output": result["content"]}]
        conversation += input_messages(items)
        ids, cut = rendered_and_cut(server, [{"role": "system", "content": SYSTEM}, *conversation])
        body = {"model": "tiny", "instructions": SYSTEM, "input": items, "tools": tools, "max_output_tokens": 4,
                "temperature": 0, **({"previous_response_id": previous_id} if previous_id else {})}
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        doc = r.json()
        usage = doc["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert usage["input_tokens"] == len(ids)  # the stored conversation rendered as the chat route would
        if k == 0:
            assert cached == 0
        elif common(prev, ids) < len(prev) - 1:  # the template rewrote the previous prompt's tail
            rewritten += 1
            assert cached == common(prev, ids) == prev_cut
        else:
            assert cached >= len(prev) - 1
        conversation += output_messages(doc["output"])
        prev, prev_cut, previous_id = ids, cut, doc["id"]
    assert rewritten >= 1


def test_a_conversation_sent_again_reuses_its_probed_cut(deepseek_hybrid):
    # Anthropic clients count tokens, then send the same conversation: the second request takes the
    # cut from the first one's probes (no re-render) and is served up to it like any other step.
    server, http = deepseek_hybrid
    tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]

    def probes() -> dict[str, int]:
        return http.get("/stats").json()["template_probes"]

    def body(k: int) -> dict[str, Any]:
        system, turns = to_anthropic(STEPS[k])
        return {"model": "tiny", "system": system, "messages": turns, "tools": tools, "max_tokens": 1,
                "temperature": 0}

    r = http.post("/v1/messages", json=body(0))
    assert r.status_code == 200, r.text
    assert probes() == {"hits": 0, "misses": 1, "entries": 1}
    counted = http.post("/v1/messages/count_tokens", json=body(1))
    assert counted.status_code == 200, counted.text
    assert probes() == {"hits": 0, "misses": 2, "entries": 2}
    r = http.post("/v1/messages", json=body(1))
    assert r.status_code == 200, r.text
    assert probes() == {"hits": 1, "misses": 2, "entries": 2}
    usage = r.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted.json()["input_tokens"]
    _, cut = rendered_and_cut(server, STEPS[0])
    assert usage["cache_read_input_tokens"] == cut  # the first request's cut, as before
