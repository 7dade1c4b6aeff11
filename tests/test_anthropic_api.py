"""Anthropic's Messages API over real HTTP with the official `anthropic` client.

The scripted model (tests/scripted_model.py) emits a real tool call by greedy
decoding, and reasoning + an answer when tool calls are banned (tool_choice
none), so tool_use and thinking blocks come from tokens the server generated.
The route runs through the chat route's path: the second turn of a tool loop
reads its prefix from the prompt cache.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from scripted_model import ANSWER, REASONING, build_scripted_model

from serving import ServerThread, config_for

SYSTEM = "You are a careful assistant who answers briefly. " * 12
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CLOCK = {
    "name": "get_time",
    "description": "The time in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                     "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_scripted_model(tmp_path_factory.mktemp("scripted") / "model")
    with ServerThread(config_for(model, model_name="tiny")) as s:
        yield s


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=120)


# This SDK has no `temperature` argument any more; the API field still exists.
GREEDY = {"temperature": 0}


def create(server, messages, *, system=SYSTEM, **kw):
    kw.setdefault("extra_body", GREEDY)
    kw.setdefault("max_tokens", 40)
    return client(server).messages.create(model="tiny", system=system, messages=messages, **kw)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_a_tool_loop_reads_its_prefix_from_the_cache(server):
    first = create(server, ask("What is the weather in Oslo?"), tools=[WEATHER])
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {}
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 0
    assert first.usage.output_tokens > 0

    turn2 = ask("What is the weather in Oslo?") + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
    ]
    second = create(server, turn2, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[0].thinking == REASONING and second.content[1].text == ANSWER
    # The system prompt, the tools and the first question come from the cache.
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > first.usage.input_tokens


def test_the_stream_builds_the_same_message(server):
    messages = ask("Stream me the weather in Lima.")
    body = create(server, messages, tools=[WEATHER], tool_choice={"type": "none"})
    kinds = []
    with client(server).messages.stream(model="tiny", system=SYSTEM, messages=messages, max_tokens=40,
                                        extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"}) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in body.content]
    assert final.stop_reason == body.stop_reason == "end_turn"
    # The same prompt again: the stream's usage reports it read from the cache.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.output_tokens == body.usage.output_tokens


def test_a_streamed_tool_call_is_a_tool_use_block(server):
    with client(server).messages.stream(model="tiny", system=SYSTEM, messages=ask("Weather in Cairo?"),
                                        max_tokens=40, extra_body=GREEDY, tools=[WEATHER]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", {})]


def test_tool_choice_tool_forces_that_call(server):
    reply = create(server, ask("Weather in Rome?"), tools=[WEATHER, CLOCK], max_tokens=60,
                   tool_choice={"type": "tool", "name": "get_time"})
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and calls
    assert all(c.name == "get_time" and c.input["city"] in ("Paris", "Rome") for c in calls)


def test_stop_sequences_and_max_tokens(server):
    stopped = create(server, ask("Weather?"), tools=[WEATHER], tool_choice={"type": "none"},
                     stop_sequences=["sunny"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "sunny"
    assert stopped.content[-1].text == "It is "
    short = create(server, ask("Weather?"), max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_the_chat_route_reports_the_same_prompt(server):
    """One conversation on both routes: the same prompt tokens, cached tokens counted the same way."""
    question = "Is it raining in Lisbon?"
    reply = create(server, ask(question), tools=[WEATHER], max_tokens=1)
    chat = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0).chat.completions.create(
        model="tiny", max_tokens=1, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
    )
    u = reply.usage
    assert chat.usage.prompt_tokens == u.input_tokens + u.cache_read_input_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens > 0  # what the Messages call left in the cache
    counted = client(server).messages.count_tokens(model="tiny", system=SYSTEM, messages=ask(question),
                                                   tools=[WEATHER])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_system_blocks_with_cache_control_render_as_the_string(server):
    """cache_control is accepted (it pins, tests/test_pins.py) and does not change the prompt."""
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    plain = client(server).messages.count_tokens(model="tiny", system=SYSTEM, messages=ask("Hi"))
    marked = client(server).messages.count_tokens(model="tiny", system=blocks, messages=ask("Hi"))
    assert marked.input_tokens == plain.input_tokens


def test_prefill_continues_the_assistant_turn(server):
    plain = create(server, ask("Weather?"), tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=1)
    filled = create(server, ask("Weather?") + [{"role": "assistant", "content": "Well,"}], max_tokens=1,
                    tools=[WEATHER], tool_choice={"type": "none"})
    assert filled.usage.input_tokens + filled.usage.cache_read_input_tokens > (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


@pytest.mark.parametrize(("body", "needle"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({"max_tokens": 5, "messages": []}, "'messages' must be a non-empty list"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": "Sure"}]}, "'messages' needs a user turn"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source must be"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "does not read images"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, "between 0 and 1"),
    ({"max_tokens": 5, "tool_choice": {"type": "maybe"}, "messages": [{"role": "user", "content": "hi"}]},
     "tool_choice.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]}, "cache_control"),
    ({"max_tokens": 5, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 5,
      "messages": [{"role": "user", "content": "hi"}]}, "at most 4 blocks with cache_control"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]}, "server tool type"),
])
def test_bad_requests_answer_in_anthropics_error_shape(server, body, needle):
    r = httpx.post(server.base_url + "/messages", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_the_client_raises_typed_errors(server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        client(server).messages.create(model="claude-unknown", max_tokens=5, messages=ask("hi"))
    assert missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.base_url + "/messages", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key_is_the_api_key(tiny_model_dir):
    """Anthropic clients authenticate with x-api-key; it is accepted as the API key."""
    with ServerThread(config_for(tiny_model_dir, api_key="sekrit")) as s:
        ok = anthropic.Anthropic(base_url=s.base_url.removesuffix("/v1"), api_key="sekrit", max_retries=0)
        assert ok.messages.create(model="tiny", max_tokens=1, messages=ask("hi")).usage.output_tokens == 1
        bad = anthropic.Anthropic(base_url=s.base_url.removesuffix("/v1"), api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as denied:
            bad.messages.create(model="tiny", max_tokens=1, messages=ask("hi"))
        assert json.loads(denied.value.response.text)["error"]["type"] == "authentication_error"
        # the hint names the header an Anthropic client sends, not only the bearer token
        assert "'x-api-key: <key>'" in json.loads(denied.value.response.text)["error"]["message"]


def test_an_image_is_the_same_prompt_on_every_route(tmp_path_factory):
    """On a vision model, one image + question through chat, Messages (base64 source) and Responses
    (input_image): the same prompt, and each route after the first reads it from the cache."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from mlxd.model import build_model

    buf = io.BytesIO()
    pixels = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    url = f"data:image/png;base64,{data}"
    vlm = build_model(tmp_path_factory.mktemp("models") / "vlm", "test-vlm", seed=0)
    with ServerThread(config_for(vlm)) as s:
        chat = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0).chat.completions.create(
            model="tiny", max_tokens=1, temperature=0, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}])
        message = anthropic.Anthropic(base_url=s.base_url.removesuffix("/v1"), api_key="x", max_retries=0
                                      ).messages.create(model="tiny", max_tokens=1, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": data}},
                                         {"type": "text", "text": "What is it?"}]}])
        response = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0).responses.create(
            model="tiny", max_output_tokens=1, temperature=0, store=False, input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "What is it?"}]}])
    prompt = chat.usage.prompt_tokens
    assert prompt > 12  # the image's span counts as prompt tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt
    assert message.usage.cache_read_input_tokens >= prompt - 1
    assert response.usage.input_tokens == prompt
    assert response.usage.input_tokens_details.cached_tokens >= prompt - 1
