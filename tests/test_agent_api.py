"""The agent-facing API over real HTTP with the `openai` client: tools, tool calls,
reasoning, n > 1, unknown fields, quiet 404s, and cache reuse
across tool turns.

Tool calls and reasoning come from a real model whose weights make greedy
decoding emit them (tests/scripted_model.py); the server parses the tokens it
actually generated.
"""

from __future__ import annotations

import json
import re
import time
from functools import partial

import httpx
import openai
import pytest

from scripted_model import ANSWER, REASONING, build_scripted_model

from serving import ServerThread, config_for

SYSTEM = "You are a careful assistant who answers briefly. " * 12
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = build_scripted_model(tmp_path_factory.mktemp("scripted") / "model")
    with ServerThread(config_for(model, model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as s:
        yield s


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 40)
    return client(server).chat.completions.create(model="tiny", messages=messages, **kw)


def no_tool_call(server) -> dict[str, float]:
    """logit_bias banning the model's `<tool_call>` token."""
    (start,) = server.runtime.tokenizer.tool_call_start_tokens
    return {str(start): -100}


def ask(question: str = "What is the weather in Paris?"):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# --- tools in the prompt ------------------------------------------------------------


def test_tools_change_the_rendered_prompt(server):
    messages = ask()
    plain = server.call(partial(server.runtime.render_chat, messages))
    with_tools = server.call(partial(server.runtime.render_chat, messages, tools=TOOLS))
    text = server.runtime.tokenizer.decode(list(with_tools))
    assert len(with_tools) > len(plain)
    assert "<tools>" in text and '"name": "get_weather"' in text
    # Through HTTP: the same difference shows in the usage.
    a = chat(server, messages, max_tokens=1)
    b = chat(server, messages, max_tokens=1, tools=TOOLS, tool_choice="auto")
    assert b.usage.prompt_tokens == len(with_tools) > a.usage.prompt_tokens == len(plain)


def test_chat_template_kwargs_pass_through(server):
    on = server.call(partial(server.runtime.render_chat, ask()))
    off = server.call(partial(server.runtime.render_chat, ask(), template_kwargs={"enable_thinking": False}))
    assert server.runtime.tokenizer.decode(list(off)).endswith("<think>\n\n</think>\n\n")
    r = chat(server, ask(), max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off) > len(on)


# --- tool calls out -------------------------------------------------------------------


def test_tool_call_is_returned_as_tool_calls(scripted):
    r = chat(scripted, ask(), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {}


def test_tool_call_streams_as_delta_tool_calls(scripted):
    stream = client(scripted).chat.completions.create(
        model="tiny", messages=ask(), tools=TOOLS, temperature=0, max_tokens=40, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert content == ""
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {}


def test_without_tools_the_call_text_is_plain_content(scripted):
    r = chat(scripted, ask())
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>{")


def test_tool_choice_none_keeps_the_model_from_calling(scripted):
    r = chat(scripted, ask(), tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == ANSWER


# --- reasoning ------------------------------------------------------------------------


def test_reasoning_is_split_from_the_content(scripted):
    r = chat(scripted, ask(), logit_bias=no_tool_call(scripted))
    message = r.choices[0].message
    assert message.content == ANSWER
    assert message.reasoning_content == REASONING
    assert message.reasoning == REASONING  # the alias some clients read


def test_reasoning_streams_separately(scripted):
    stream = client(scripted).chat.completions.create(
        model="tiny", messages=ask(), temperature=0, max_tokens=40, stream=True,
        logit_bias=no_tool_call(scripted))
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


# --- cache reuse across tool turns ----------------------------------------------------------


def test_agent_loop_reuses_the_previous_turn_on_every_step(scripted):
    """call, result, call, result, answer: each request reuses the previous prompt and more."""
    messages = ask("Plan a trip: check the weather twice.")
    previous_prompt = 0
    for step in range(3):
        answer = step == 2
        r = chat(scripted, messages, tools=TOOLS, tool_choice="none" if answer else "auto")
        cached = r.usage.prompt_tokens_details.cached_tokens
        if step > 0:
            # The previous prompt, and the start of the call the model generated
            # (its ids are reused for the text the template renders the same way).
            assert cached > previous_prompt, (step, cached, previous_prompt)
        previous_prompt = r.usage.prompt_tokens
        message = r.choices[0].message
        if answer:
            assert r.choices[0].finish_reason == "stop" and message.content == ANSWER
            break
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        messages = messages + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, {20 + step} degrees."},
        ]


def test_a_stop_string_cut_publishes_its_checkpoint(server, tiny_model_dir):
    messages = ask("count to twelve")
    # The random model mostly repeats newlines: sample words only, so the text can be cut.
    tok = server.runtime.tokenizer
    words = {str(i): -100 for i in range(len(tok._tokenizer)) if not re.fullmatch(r" ?[A-Za-z]+", tok.decode([i]))}
    kw = {"max_tokens": 12, "logit_bias": words, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    # The same model without a prompt cache shows what the reply will be.
    with ServerThread(config_for(tiny_model_dir, prompt_cache_bytes=0)) as cold:
        text = chat(cold, messages, **kw).choices[0].message.content
    stop = text[-4:]
    assert text.find(stop) >= 6, text  # a cut after a few tokens
    before = server.call(server.runtime.stats)
    published = before.cache.published["final"]
    # Room for far more tokens: the row is still decoding when the stop string cuts it.
    cut = chat(server, messages, stop=[stop], **{**kw, "max_tokens": 1000})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.usage.completion_tokens < 12
    # The engine ended the row as a normal stop: completed, not cancelled.
    after = server.call(server.runtime.stats)
    assert after.scheduler.completed == before.scheduler.completed + 1
    assert after.scheduler.cancelled == before.scheduler.cancelled
    deadline = time.monotonic() + 60
    while server.call(server.runtime.stats).cache.published["final"] == published:
        assert time.monotonic() < deadline, "the cut generation published nothing"
        time.sleep(0.05)
    # The next turn reuses the prompt and the reply's tokens up to the cut.
    turn2 = messages + [{"role": "assistant", "content": cut.choices[0].message.content},
                        {"role": "user", "content": "again"}]
    again = chat(server, turn2, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > cut.usage.prompt_tokens


# --- n > 1 --------------------------------------------------------------------------------


def test_n_choices_share_one_prefill_and_seed_each(server):
    messages = ask("Say something random.")
    kw = {"temperature": 1.0, "seed": 1234, "max_tokens": 12}
    before = server.call(server.runtime.stats).engine.prompt_tokens
    r = chat(server, messages, n=2, **kw)
    prefilled = server.call(server.runtime.stats).engine.prompt_tokens - before
    assert [c.index for c in r.choices] == [0, 1]
    # One full prefill; the second choice borrows it from the cache.
    assert prefilled < r.usage.prompt_tokens + 8, (prefilled, r.usage.prompt_tokens)
    # Choice i samples with seed + i.
    again = chat(server, messages, n=1, **{**kw, "seed": 1235})
    assert r.choices[1].message.content == again.choices[0].message.content


def test_n_choices_share_one_prefill_with_the_ssd_tier_too(tiny_model_dir, tmp_path):
    # With the SSD tier a boundary checkpoint is published after its row's first token (its write plan off
    # that token's path), but not the first choice's: the others borrow it as soon as that token is out.
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=tmp_path / "ssd")) as ssd_server:
        for i in range(3):  # a new prompt each time
            before = ssd_server.call(ssd_server.runtime.stats).engine.prompt_tokens
            r = chat(ssd_server, ask(f"Round {i}. " + "Say something random, " * 8), n=3, temperature=1.0, seed=99,
                     max_tokens=4)
            prefilled = ssd_server.call(ssd_server.runtime.stats).engine.prompt_tokens - before
            assert len(r.choices) == 3 and prefilled < r.usage.prompt_tokens + 16, (prefilled, r.usage.prompt_tokens)


def test_n_choices_stream_with_their_index(server):
    stream = client(server).chat.completions.create(
        model="tiny", messages=ask("Stream two."), temperature=1.0, seed=7, max_tokens=6, n=2, stream=True,
        stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finishes = {}
    usage = None
    for c in stream:
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1}
    plain = chat(server, ask("Stream two."), temperature=1.0, seed=7, max_tokens=6, n=2)
    assert [texts[0], texts[1]] == [c.message.content for c in plain.choices]
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


# --- request hygiene -------------------------------------------------------------------------


def test_unknown_fields_are_ignored(server):
    r = chat(server, ask(), max_tokens=2, extra_body={
        "user": "u-1", "metadata": {"trace": "x"}, "parallel_tool_calls": True, "store": False,
        "x_gateway_route": "a/b", "service_tier": "auto"})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body", [
    {"tools": "get_weather"},
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"tool_choice": "required"},
    {"chat_template_kwargs": ["enable_thinking"]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
])
def test_bad_tool_fields_get_400(server, body):
    base = server.base_url.removesuffix("/v1")
    payload = {"messages": ask(), "max_tokens": 2, **body}
    r = httpx.post(f"{base}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_paths_get_a_quiet_404(server, capfd):
    base = server.base_url.removesuffix("/v1")
    capfd.readouterr()
    for method, path in [("GET", "/v1/engines"), ("GET", "/api/tags"), ("GET", "/favicon.ico"),
                         ("POST", "/v1/assistants"), ("GET", "/.well-known/security.txt")]:
        r = httpx.request(method, f"{base}{path}", timeout=30)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found_error"
    out = capfd.readouterr()
    logged = (out.out + out.err).lower()
    assert "error" not in logged and "traceback" not in logged, logged


# --- reading replies (mlx-lm's state machine and parser on the built-in tokenizer) -------------


def read_all(tokenizer, pieces: list[str], *, initial: str = "normal"):
    from mlxd.http.replies import ReplyReader

    reader = ReplyReader(tokenizer, tools=TOOLS, parse_tools=True, initial=initial)
    deltas = [reader.feed(p) for p in pieces] + [reader.finish()]
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    return content, reasoning, [c for d in deltas for c in d.tool_calls]


def test_markers_split_across_deltas_still_make_one_call(tiny_model):
    _, tok = tiny_model
    content, reasoning, calls = read_all(
        tok, ["Sure. <tool", '_call>{"name": "get_weather", "arg', 'uments": {"city": "Paris"}}</tool', "_call>"])
    assert content == "Sure. " and reasoning == ""
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]


def test_malformed_call_text_falls_back_to_content(tiny_model):
    _, tok = tiny_model
    content, _, calls = read_all(tok, ["<tool_call>{not json</tool_call> ok"])
    assert calls == []
    assert content == "<tool_call>{not json</tool_call> ok"


def test_a_cut_unparseable_call_is_content_as_written_with_no_end_marker_added(tiny_model):
    _, tok = tiny_model
    content, _, calls = read_all(tok, ['<tool_call>\n{"name": "get_t'])
    assert calls == [] and content == '<tool_call>\n{"name": "get_t'


def test_unterminated_call_is_parsed_at_the_end(tiny_model):
    _, tok = tiny_model
    _, _, calls = read_all(tok, ['<tool_call>{"name": "get_weather", "arguments": {}}'])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_a_prompt_that_opens_a_think_block_starts_in_reasoning(tiny_model):
    from mlxd.http.replies import initial_state

    _, tok = tiny_model
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert initial_state(tok, closed) == "normal"
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert initial_state(tok, opened) == "reasoning"
    content, reasoning, _ = read_all(tok, ["weighing it", "</think>Yes."], initial="reasoning")
    assert (reasoning, content) == ("weighing it", "Yes.")
