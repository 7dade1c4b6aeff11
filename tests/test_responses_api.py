"""OpenAI's Responses API over real HTTP with the official `openai` client.

The scripted model (tests/scripted_model.py) makes a real function call by
greedy decoding, and reasoning + an answer when tool calls are banned. A
conversation continues through `previous_response_id` (the stored response's
conversation, in its cache session) and reads its prefix from the prompt
cache; stored responses survive a restart of a real `mlxd serve` process with
the SSD tier.
"""

from __future__ import annotations

import os
import stat

import httpx
import openai
import pytest

from mlxd.http.response_store import ResponseStore
from mlxd.http.responses import input_messages, output_messages
from scripted_model import ANSWER, REASONING, build_scripted_model

from procs import ServeProcess
from serving import ServerThread, config_for

INSTRUCTIONS = "You are a careful assistant who answers briefly. " * 12
TOOLS = [{
    "type": "function", "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("scripted") / "model")


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(config_for(model, model_name="tiny")) as s:
        yield s


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def respond(base_url, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 40)
    kw.setdefault("instructions", INSTRUCTIONS)
    return client(base_url).responses.create(model="tiny", **kw)


def test_a_tool_loop_through_previous_response_id(server):
    first = respond(server.base_url, input="What is the weather in Oslo?", tools=TOOLS)
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == "{}"
    assert first.usage.input_tokens_details.cached_tokens == 0

    second = respond(server.base_url, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output[0].content[0].text == REASONING
    assert second.output_text == ANSWER
    assert second.previous_response_id == first.id
    # The instructions, tools, question and the call come from the cache.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > first.usage.input_tokens // 2
    assert second.usage.input_tokens > first.usage.input_tokens

    # The same conversation sent whole (no previous_response_id) is the same prompt.
    whole = respond(server.base_url, tools=TOOLS, tool_choice="none", max_output_tokens=1, input=[
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ])
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_streaming_events_build_the_same_response(server):
    kw = {"input": "Stream the weather in Lima.", "tools": TOOLS, "tool_choice": "none"}
    body = respond(server.base_url, **kw)
    events = list(respond(server.base_url, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == body.output_text == ANSWER
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt as `body`'s
    assert client(server.base_url).responses.retrieve(final.id).output_text == ANSWER


def test_a_streamed_function_call(server):
    with client(server.base_url).responses.stream(model="tiny", input="Weather in Cairo?", tools=TOOLS,
                                                  instructions=INSTRUCTIONS, temperature=0,
                                                  max_output_tokens=40) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(i.type, i.name) for i in final.output] == [("function_call", "get_weather")]


def test_get_delete_and_store_false(server):
    kept = respond(server.base_url, input="Weather?", max_output_tokens=2)
    assert kept.status == "incomplete" and kept.incomplete_details.reason == "max_output_tokens"
    again = client(server.base_url).responses.retrieve(kept.id)
    assert again.id == kept.id and again.usage.output_tokens == 2
    deleted = httpx.delete(f"{server.base_url}/responses/{kept.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client(server.base_url).responses.retrieve(kept.id)
    loose = respond(server.base_url, input="Weather?", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client(server.base_url).responses.retrieve(loose.id)
    with pytest.raises(openai.NotFoundError) as missing:
        respond(server.base_url, input="more", previous_response_id=loose.id)
    assert missing.value.body["param"] == "previous_response_id"


def test_input_items_of_a_stored_response(server):
    c = client(server.base_url)
    first = respond(server.base_url, input="Weather?", max_output_tokens=1)
    (item,) = c.responses.input_items.list(first.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Weather?"
    second = respond(server.base_url, previous_response_id=first.id, max_output_tokens=1, input=[
        {"role": "user", "content": "And Rome?"}, {"role": "user", "content": "And Lima?"}])
    listed = c.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in listed.data] == ["And Rome?", "And Lima?"]
    page = c.responses.input_items.list(second.id, limit=1)
    assert [i.content[0].text for i in page.data] == ["And Lima?"] and page.has_more


def test_a_reasoning_only_response_is_continued_with_its_reasoning(model):
    """A reply cut off inside its reasoning (max_output_tokens) is one reasoning item and no message.
    Its continuation renders that reasoning as the assistant turn the model generated, the same
    prompt a chat client sends back, and reads the same cached tokens as the chat route does."""
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    question, more = "Think about Oslo.", "Go on."
    with ServerThread(config_for(model, model_name="tiny")) as s:
        first = respond(s.base_url, input=question, tools=TOOLS, tool_choice="none", max_output_tokens=3)
        assert first.status == "incomplete" and [i.type for i in first.output] == ["reasoning"]
        reasoning = first.output[0].content[0].text
        assert reasoning and REASONING.startswith(reasoning)
        second = respond(s.base_url, previous_response_id=first.id, input=more, tools=TOOLS, tool_choice="none",
                         max_output_tokens=1)
        # A stateless client sends the reasoning item back in its input: the same prompt.
        whole = respond(s.base_url, tools=TOOLS, tool_choice="none", max_output_tokens=1, input=[
            {"role": "user", "content": question}, first.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": more}])
    with ServerThread(config_for(model, model_name="tiny")) as s:
        chat = client(s.base_url).chat.completions
        kw = {"model": "tiny", "tools": chat_tools, "tool_choice": "none", "temperature": 0}
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
        reply = chat.create(messages=messages, max_tokens=3, **kw).choices[0].message
        assert reply.content == "" and reply.model_extra["reasoning_content"] == reasoning
        messages += [{"role": "assistant", "content": "", "reasoning_content": reasoning},
                     {"role": "user", "content": more}]
        after = chat.create(messages=messages, max_tokens=1, **kw).usage
    assert second.usage.input_tokens == whole.usage.input_tokens == after.prompt_tokens
    # The first reply's prompt and its generated '<think>' + reasoning come from the cache, on both routes.
    assert second.usage.input_tokens_details.cached_tokens == after.prompt_tokens_details.cached_tokens
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


@pytest.mark.parametrize(("output", "messages"), [
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}],
     [{"role": "assistant", "content": "", "reasoning_content": "hm"}]),
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
      {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}],
     [{"role": "assistant", "content": "", "reasoning_content": "hm",
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
     [{"role": "assistant", "content": "ok", "reasoning_content": "hm"}]),
])
def test_output_items_keep_their_reasoning(output, messages):
    assert output_messages(output) == messages


def test_reasoning_stays_in_its_own_turn():
    # A reasoning item followed by a user message is that turn's reasoning, not the next assistant's.
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]}
    assert input_messages([{"role": "user", "content": "a"}, thought, {"role": "user", "content": "b"},
                           {"role": "assistant", "content": "c"}]) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "", "reasoning_content": "hm"},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    # Reasoning before an assistant's second message is that message's.
    assert input_messages([{"role": "assistant", "content": "a"}, thought, {"role": "assistant", "content": "b"}]) == [
        {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "hm"}]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": "json"}, "text"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
])
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(f"{server.base_url}/responses", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # the chat route's names, not this body's
    assert "response_format" not in r.json()["error"]["message"] and "reasoning_effort" not in r.text


def test_stored_responses_survive_a_restart(model, tmp_path):
    """A real `mlxd serve` with the SSD tier: stored, stopped, restarted, continued."""
    args = ("--model", str(model), "--model-name", "tiny", "--ssd-cache", str(tmp_path / "ssd"))
    with ServeProcess(*args, log_path=tmp_path / "a.log") as p:
        first = respond(p.url + "/v1", input="What is the weather in Oslo?", tools=TOOLS)
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert httpx.post(p.url + "/admin/cache/flush", timeout=60).status_code == 200
    with ServeProcess(*args, log_path=tmp_path / "b.log") as p:
        assert client(p.url + "/v1").responses.retrieve(first.id).output[0].name == "get_weather"
        second = respond(p.url + "/v1", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                         input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        assert second.output_text == ANSWER
        # The conversation's prefix comes back from the SSD tier.
        assert second.usage.input_tokens_details.cached_tokens > 0


def test_the_agents_sdk_drives_a_five_step_tool_loop(server):
    """The OpenAI Agents SDK (Responses model): four tool calls, then an answer; every step reads the
    previous step's prompt from the cache."""
    from agents import Agent, ModelSettings, RunHooks, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []
    usages: list = []

    @function_tool
    def get_weather(city: str = "Oslo") -> str:
        """The current weather of a city."""
        calls.append(city)
        if len(calls) == 4:  # the fifth step answers
            agent.model_settings = ModelSettings(temperature=0, max_tokens=40, tool_choice="none")
        return f"sunny, {20 + len(calls)} C"

    class Usage(RunHooks):
        async def on_llm_end(self, context, agent, response) -> None:
            usages.append(response.usage)

    model = OpenAIResponsesModel(model="tiny", openai_client=AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=40), reset_tool_choice=False)
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=5, hooks=Usage())
    assert result.final_output == ANSWER
    assert len(calls) == 4 and len(usages) == 5
    for before, after in zip(usages, usages[1:], strict=False):
        # Each step's prompt extends the last; the cache serves at least the last step's whole prompt.
        assert after.input_tokens > before.input_tokens
        assert after.input_tokens_details.cached_tokens >= before.input_tokens


def test_a_stored_response_s_rename_is_made_durable_by_fsyncing_its_directory(tmp_path, monkeypatch):
    """A rename is durable only once its directory is fsynced: without that, a power loss after the reply can
    lose a stored response (`previous_response_id` then 404s) as it would any other file of the SSD tier's."""
    directory = tmp_path / "responses"
    synced: list[tuple[str, int]] = []  # (kind, inode) of every fsync, in order
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    rid = "resp_" + "a" * 32
    ResponseStore(directory).put(rid, {"response": {"id": rid}, "messages": []})
    path = directory / f"{rid}.json"
    assert synced[0] == ("file", path.stat().st_ino)  # the body, before its rename
    assert ("dir", directory.stat().st_ino) in synced[1:]  # the rename, after it
    assert sorted(p.name for p in directory.iterdir()) == [path.name]  # no tmp left
    assert ResponseStore(directory).get(rid) == {"response": {"id": rid}, "messages": []}  # read back from its file
