"""Request fields over real HTTP: each is honoured, or refused with a 400 that names it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mlxd.http.schemas import parse_chat_options

from serving import ServerThread, config_for

# The tiny model's end tokens (<|endoftext|>, <|im_end|>) banned, so a generation runs its length.
NO_EOS = {"0": -100, "2": -100}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir)) as s:
        yield s


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def post(server: ServerThread, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base_url.removesuffix("/v1") + path, timeout=60, **kw)


def complete(server, **kw) -> str:
    kw.setdefault("max_tokens", 16)
    r = client(server).completions.create(model="tiny", prompt="Once upon a time", logit_bias=NO_EOS, **kw)
    return r.choices[0].text


def refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# --- model aliases -----------------------------------------------------------------


def test_mlx_lm_default_model_alias_is_the_served_model(server):
    r = client(server).chat.completions.create(model="default_model", messages=ASK, max_tokens=2, temperature=0)
    assert r.model == server.runtime.info.model_name
    assert client(server).models.retrieve("default_model").id == server.runtime.info.model_name
    assert client(server).models.retrieve("default").id == server.runtime.info.model_name


# --- min_p and repetition_context_size -----------------------------------------------


def test_min_p_one_keeps_only_the_likeliest_token(server):
    greedy = complete(server, temperature=0)
    hot = [complete(server, temperature=2.0, seed=s, extra_body={"min_p": 1.0}) for s in range(3)]
    assert hot == [greedy] * 3


def test_min_p_out_of_range_is_refused(server):
    refused(post(server, "/v1/completions", json={"prompt": "x", "min_p": 1.5}), "min_p")


def test_repetition_context_size_sets_the_penalty_window(server):
    def run(size: int) -> str:
        return complete(server, temperature=0, max_tokens=24,
                        extra_body={"repetition_penalty": 10.0, "repetition_context_size": size})

    assert run(1) != run(64)
    refused(post(server, "/v1/completions", json={"prompt": "x", "repetition_context_size": 0}),
            "repetition_context_size")


# --- functions / function_call ---------------------------------------------------------


def test_functions_render_like_tools(server):
    def prompt_tokens(**body) -> int:
        r = post(server, "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with_tools = prompt_tokens(tools=[{"type": "function", "function": WEATHER}])
    assert prompt_tokens(functions=[WEATHER]) == with_tools > prompt_tokens()
    assert prompt_tokens(functions=[WEATHER], function_call="auto") == with_tools


def test_function_call_maps_to_tool_choice():
    tool = {"type": "function", "function": WEATHER}
    assert parse_chat_options({"functions": [WEATHER]}).tools == (tool,)
    assert parse_chat_options({"functions": [WEATHER], "function_call": "none"}).tool_choice == "none"
    named = parse_chat_options({"functions": [WEATHER], "function_call": {"name": "get_weather"}})
    assert named.forced is not None


@pytest.mark.parametrize(("body", "param"), [
    ({"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]}, "functions"),
    ({"functions": [WEATHER], "function_call": "sometimes"}, "function_call"),
    ({"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
    ({"functions": {"name": "get_weather"}}, "functions"),
])
def test_bad_function_fields_are_refused(server, body, param):
    refused(post(server, "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body}), param)


# --- reasoning_effort ----------------------------------------------------------------------


def test_reasoning_effort_is_a_template_variable(server):
    assert parse_chat_options({"reasoning_effort": "low"}).template_kwargs == {"reasoning_effort": "low"}
    explicit = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert parse_chat_options(explicit).template_kwargs == {"reasoning_effort": "high"}
    r = client(server).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=1, temperature=0, reasoning_effort="low")
    assert r.choices[0].finish_reason in ("stop", "length")
    refused(post(server, "/v1/chat/completions", json={"messages": ASK, "reasoning_effort": "extreme"}),
            "reasoning_effort")


# --- legacy completions logprobs --------------------------------------------------------------


def test_completion_text_offset_is_each_tokens_place_in_the_text(server):
    r = client(server).completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, logit_bias=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.text_offset) == len(lp.tokens) == 8
    ends = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == ends
    assert "".join(lp.tokens) == r.choices[0].text

    stream = client(server).completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, logit_bias=NO_EOS,
        stream=True)
    offsets = [o for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for o in chunk.choices[0].logprobs.text_offset]
    assert offsets == ends


# --- bodies that parse but cannot be read ------------------------------------------------------


def test_lone_surrogate_is_a_400(server):
    body = '{"prompt": "hello \\ud800 world", "max_tokens": 2}'
    r = post(server, "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    chat = json.dumps({"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2})
    r = post(server, "/v1/chat/completions", content=chat, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text


def test_deeply_nested_json_is_a_400(server):
    body = '{"prompt": "x", "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = post(server, "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nested" in r.json()["error"]["message"]


@pytest.mark.parametrize(("route", "body"), [
    ("/chat/completions", {"messages": ASK}),
    ("/completions", {"prompt": "Hi"}),
    ("/messages", {"messages": ASK}),
    ("/responses", {"input": "Hi"}),
])
def test_null_is_an_unset_field_for_the_boolean_ones_too(server, route, body):
    """Clients send null for fields they leave unset; the boolean fields (stream, logprobs, store,
    parallel_tool_calls) refused it with 400 while every other field took it as its default."""
    nulls = {"stream": None, "logprobs": None, "parallel_tool_calls": None, "store": None}
    if route == "/completions":
        nulls.pop("logprobs")  # an integer there, null already its default
    r = httpx.post(f"{server.base_url}{route}", json={"model": "tiny", "max_tokens": 2, "max_output_tokens": 2,
                                                      **body, **nulls}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # not streamed
    for name in ("stream", "logprobs", "parallel_tool_calls"):
        wrong = httpx.post(f"{server.base_url}/chat/completions",
                           json={"model": "tiny", "messages": ASK, "max_tokens": 2, name: "yes"}, timeout=60)
        refused(wrong, name)
