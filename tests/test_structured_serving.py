"""Structured output over real HTTP with the `openai` client: every constrained reply parses.

The tiny random-weight model's free output is never JSON; under a constraint
each reply must parse and validate against its schema, streamed or not, with
n > 1, in a batch beside free rows, on both routes, and when a generation is
resumed from its checkpoint (the matcher replays the resumed tokens).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from mlxd import RuntimeConfig, SamplingParams, open_runtime
from mlxd.structured.spec import constraint_from_request

from procs import ServeProcess, kill_mid_request
from serving import ServerThread, checkpoints_settled, config_for, drop_after

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
EMAIL = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(config_for(tiny_model_dir, max_batch=8)) as s:
        yield s


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    kw.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    return client(server).chat.completions.create(model="tiny", **kw)


def streamed_text(server, **kw) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in chat(server, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_nested_json_schema_reply_parses_and_validates(server, stream):
    if stream:
        text, reason = streamed_text(server, response_format=PERSON_FORMAT)
    else:
        r = chat(server, response_format=PERSON_FORMAT)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_the_docs_example_runs_and_its_replies_end(server):
    """docs/structured-output.md's example as written (sampled, on a random-weight model like the built-in
    one): its schema and regex are bounded, so both replies end by "stop" and parse, every time."""
    doc = (Path(__file__).parent.parent / "docs" / "structured-output.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1).replace('"mlxd-default"', '"tiny"')
    code = code.replace("client.completions.create(", "email = client.completions.create(")
    for _ in range(3):
        scope = {"client": client(server), "json": json}
        exec(code, scope)
        reply, email = scope["reply"].choices[0], scope["email"].choices[0]
        assert reply.finish_reason == "stop", reply.message.content
        assert set(json.loads(reply.message.content)) == {"name", "age"}
        assert email.finish_reason == "stop", email.text
        assert re.fullmatch(r"[a-z]{1,8}@[a-z]{1,8}\.com", email.text)


def test_free_output_of_the_same_request_is_not_json(server):
    """The control: without the constraint the model's reply does not parse (so the constraint does the work)."""
    text = chat(server).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_replies_parse(server):
    for seed in (0, 1):
        r = chat(server, response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_too_long_for_max_tokens_ends_at_length_with_a_valid_prefix(server):
    thirty = {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 30, "maxItems": 30}}}
    cut = chat(server, response_format=thirty, max_tokens=12)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 12
    text = cut.choices[0].message.content
    assert re.fullmatch(r'\["(alpha|beta)(", "(alpha|beta))*("(, "?)?|, )?|\["?[a-z]*', text), text


def test_a_regex_reply_fullmatches_on_both_routes(server):
    r = chat(server, extra_body={"regex": EMAIL})
    assert re.fullmatch(EMAIL, r.choices[0].message.content)
    done = client(server).completions.create(model="tiny", prompt="My address:", max_tokens=40, temperature=0.7,
                                            seed=3, extra_body={"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, done.choices[0].text) and done.choices[0].finish_reason == "stop"


def test_a_grammar_and_a_choice(server):
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
    r = chat(server, extra_body={"grammar": grammar})
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", r.choices[0].message.content)
    picked = chat(server, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].message.content in ("red", "green", "blue")


def test_n_choices_each_follow_the_schema(server):
    r = chat(server, response_format=PERSON_FORMAT, n=2, temperature=0.9, seed=11)
    assert len(r.choices) == 2
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_constrained_and_free_rows_share_a_batch(server):
    def constrained(i: int) -> str:
        return chat(server, response_format=PERSON_FORMAT, temperature=0.8, seed=i).choices[0].message.content

    def free(i: int) -> str:
        return chat(server, max_tokens=60, temperature=0.8, seed=i).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(constrained if i % 2 else free, i) for i in range(6)]
        replies = [f.result(timeout=120) for f in futures]
    for i, text in enumerate(replies):
        if i % 2:
            jsonschema.validate(json.loads(text), PERSON)
    assert server.call(server.runtime.stats).engine.steps > 0


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_is_always_a_valid_call(server, choice, stream):
    kw = dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER, TIME],
              tool_choice=choice, parallel_tool_calls=False)
    reason, got = tool_calls_of(server, stream, **kw)
    assert reason == "tool_calls" and len(got) == 1
    name = got[0]["name"]
    assert name == "get_time" if isinstance(choice, dict) else name in ("get_weather", "get_time")
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(got[0]["arguments"]), schema)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
     "response_format", ["not"]),
    ({"regex": "(unclosed"}, "regex", ["regex"]),
    ({"regex": "a+", "response_format": {"type": "json_object"}}, "regex", ["not several"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["nope"]),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "tool_choice", ["cannot be combined"]),
])
def test_bad_constraints_get_a_400_naming_the_field(server, body, param, words):
    base = server.base_url.removesuffix("/v1")
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(f"{base}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


# --- every constraint streamed, both routes, n > 1, parallel calls, errors through the client --

NO_EOS_BIAS = {"0": -100, "2": -100}  # the tiny model's end tokens (<|endoftext|>, <|im_end|>)
LETTERS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 30, "maxItems": 30}


@pytest.mark.parametrize("kw, valid", [
    ({"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 0, "max_tokens": 200},
     lambda text: isinstance(json.loads(text), dict)),
    ({"extra_body": {"regex": EMAIL}}, lambda text: re.fullmatch(EMAIL, text)),
    ({"extra_body": {"grammar": 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'}},
     lambda text: re.fullmatch(r"The answer is (yes|no)\.", text)),
], ids=["json_object", "regex", "grammar"])
def test_each_constraint_holds_when_streamed(server, kw, valid):
    text, reason = streamed_text(server, **kw)
    assert reason == "stop" and valid(text), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_completions_route_takes_a_json_schema_with_n_2(server, stream):
    kw = dict(model="tiny", prompt="A person, as JSON:", max_tokens=120, n=2, temperature=0.9, seed=21,
              extra_body={"response_format": PERSON_FORMAT})
    texts, reasons = ["", ""], [None, None]
    if stream:
        for chunk in client(server).completions.create(stream=True, **kw):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    else:
        done = client(server).completions.create(**kw)
        texts = [c.text for c in sorted(done.choices, key=lambda c: c.index)]
        reasons = [c.finish_reason for c in sorted(done.choices, key=lambda c: c.index)]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def tool_calls_of(server, stream: bool, **kw) -> tuple[str | None, list[dict]]:
    """A chat reply's finish reason and its tool calls ({"name", "arguments"}), streamed or whole."""
    if not stream:
        choice = chat(server, **kw).choices[0]
        return choice.finish_reason, [{"name": tc.function.name, "arguments": tc.function.arguments}
                                      for tc in choice.message.tool_calls or ()]
    calls: dict[int, dict] = {}
    reason = None
    for chunk in chat(server, stream=True, **kw):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
    return reason, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_give_several_valid_calls_and_false_gives_one(server, stream):
    """The grammar allows calls back to back unless parallel_tool_calls is false; a bias on the
    <tool_call> marker (id 1022) makes a second call likely, never an invalid one."""
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    counts = {}
    for parallel in (True, False):
        for seed in range(3):
            kw = dict(messages=[{"role": "user", "content": "Weather and time, please."}], tools=[WEATHER, TIME],
                      tool_choice="required", temperature=1.0, seed=seed, max_tokens=400, logit_bias={"1022": 3})
            if not parallel:
                kw["parallel_tool_calls"] = False
            reason, calls = tool_calls_of(server, stream, **kw)
            assert reason == "tool_calls" and calls, (parallel, seed, reason)
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]]["function"]["parameters"])
            counts[parallel, seed] = len(calls)
    assert max(counts[True, s] for s in range(3)) >= 2, counts
    assert all(counts[False, s] == 1 for s in range(3)), counts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_cut_by_max_tokens_ends_at_length_with_what_was_written(server, stream):
    """No call parses from a cut call: the reply is the text written so far, no end marker added."""
    kw = dict(messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], tool_choice="required",
              max_tokens=6)
    if stream:
        text, reason = streamed_text(server, **kw)
    else:
        choice = chat(server, **kw).choices[0]
        text, reason = choice.message.content, choice.finish_reason
        assert not choice.message.tool_calls
    assert reason == "length" and text.startswith("<tool_call>") and "</tool_call>" not in text, text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'.startswith(text), text  # the forced start


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_unsupported_schema_keyword_is_a_400_naming_it_through_the_client(server, route):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}}}
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            chat(server, response_format=bad, max_tokens=4)
        else:
            client(server).completions.create(model="tiny", prompt="x", max_tokens=4,
                                              extra_body={"response_format": bad})
    error = err.value.body if isinstance(err.value.body, dict) and "param" in err.value.body else err.value.body["error"]
    assert error["param"] == "response_format" and '"if"' in error["message"], error


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_unsatisfiable_schema_ends_at_length_when_streamed_too(server, route):
    """A 100,000-item array cannot close within 16 tokens: the stream ends with "length" and a valid prefix."""
    huge = {"type": "json_schema", "json_schema": {"name": "huge", "schema": {
        "type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 100000}}}
    text, reason, usage = "", None, None
    if route == "chat":
        chunks = chat(server, stream=True, response_format=huge, max_tokens=16,
                      stream_options={"include_usage": True})
        for chunk in chunks:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
    else:
        chunks = client(server).completions.create(model="tiny", prompt="Words:", max_tokens=16, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"response_format": huge})
        for chunk in chunks:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
    assert reason == "length" and usage.completion_tokens == 16
    assert is_prefix_of_a_word_array(text, ("alpha", "beta")), text


def is_prefix_of_a_word_array(text: str, words: tuple[str, ...]) -> bool:
    """`text` is how a JSON array of `words` (as json.dumps writes it) can begin."""
    done = "|".join(words)
    m = re.fullmatch(rf'\[(?:"(?:{done})", )*(?:"(?P<part>[a-z]*)(?P<closed>"(?:,( )?)?)?)?', text)
    if m is None:
        return False
    part = m.group("part") or ""
    return part in words if m.group("closed") else any(w.startswith(part) for w in words)


def test_constrained_rows_run_beside_a_free_row_in_one_batch(server):
    """A free row (no end token, 1,000 tokens) is decoding when constrained requests arrive, and still
    decoding when they have all answered: they shared its batch; each constrained reply validates."""
    started, free = {}, {}

    def free_row() -> None:
        text, reason = "", None
        for chunk in chat(server, stream=True, max_tokens=1000, temperature=0.8, seed=2, logit_bias=NO_EOS_BIAS,
                          messages=[{"role": "user", "content": "Talk for a long time."}]):
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
            if text and "at" not in started:
                started["at"] = True
        free.update(text=text, reason=reason)

    def constrained(i: int) -> str:
        fmt = PERSON_FORMAT if i % 2 else {"type": "json_schema", "json_schema": {"name": "l", "schema": LETTERS}}
        return chat(server, response_format=fmt, max_tokens=300, temperature=0.8, seed=i).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        background = pool.submit(free_row)
        while "at" not in started:
            assert not background.done(), background.result()
            time.sleep(0.01)
        replies = [f.result(timeout=120) for f in [pool.submit(constrained, i) for i in range(3)]]
        assert server.call(server.runtime.stats).engine.batch_rows >= 1  # the free row is still decoding
        assert not background.done()
        background.result(timeout=300)
    assert free["reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(free["text"])
    for i, text in enumerate(replies):
        jsonschema.validate(json.loads(text), PERSON if i % 2 else LETTERS)


def test_the_prompt_cache_serves_constrained_requests_as_free_ones(server):
    """The constraint is on output only: a prompt cached by a free request is reused under any constraint."""
    messages = [{"role": "user", "content": "Remember this long preamble about the weather. " * 12}]
    first = chat(server, messages=messages, max_tokens=8)
    shaped = chat(server, messages=messages, max_tokens=120, response_format=PERSON_FORMAT)
    regex = chat(server, messages=messages, max_tokens=40, extra_body={"regex": EMAIL})
    for r in (shaped, regex):
        assert r.usage.prompt_tokens == first.usage.prompt_tokens
        assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2, r.usage
    jsonschema.validate(json.loads(shaped.choices[0].message.content), PERSON)
    assert re.fullmatch(EMAIL, regex.choices[0].message.content)


# --- resumed generations: the matcher replays what the checkpoint holds ----------------------

LONG = {"regex": "[a-z ]{0,20000}"}
NO_EOS = ((0, -100.0), (2, -100.0))


async def test_a_resumed_constrained_generation_continues_identically(tiny_model_dir, tmp_path):
    config = RuntimeConfig(model=str(tiny_model_dir), ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    grammar = constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "letters", "schema": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                      "minItems": 30, "maxItems": 30}}}})
    sampling = SamplingParams(max_tokens=400, temperature=0.9, seed=5, constraint=grammar)
    async with open_runtime(config) as rt:
        prompt = rt.encode("List thirty words. " * 4)
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            full = await stream.tokens()
        assert stream.finished.reason == "stop" and len(full) > 40
        assert await drop_after(rt, rt.request(prompt, sampling=sampling), 36) == full[:36]  # the client goes away
        ckpt = rt.cold.checkpointer
        await checkpoints_settled(rt)
        assert ckpt.snapshot_stats()["entries"] == 1
        async with rt.submit(rt.request(prompt, sampling=sampling)) as stream:
            again = await stream.tokens()
            assert stream.accepted.cache_tier == "checkpoint"
        assert again == full
        text = rt.tokenizer.decode([t for t in again if t not in rt.info.eos_token_ids])
        words = json.loads(text)
        assert len(words) == 30 and set(words) <= {"alpha", "beta", "gamma"}


def test_sigkill_mid_constrained_generation_then_restart_resumes_exactly(tmp_path, tiny_model_dir):
    def serve(cache: Path, name: str) -> ServeProcess:
        return ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                            "--generation-checkpoint", "32", log_path=tmp_path / f"{name}.log")

    body = {"model": "tiny", "prompt": "Write letters. " * 6, "max_tokens": 400, "temperature": 0.8, "seed": 7,
            "logit_bias": {"0": -100, "2": -100}, **LONG}
    with serve(tmp_path / "ref", "ref") as ref, ref.client() as http:
        reference = http.post("/v1/completions", json=body).json()
    assert reference["usage"]["completion_tokens"] == 400
    assert re.fullmatch(LONG["regex"], reference["choices"][0]["text"])

    cache = tmp_path / "ssd"
    kill_mid_request(serve(cache, "first").start(), "/v1/completions", body)

    with serve(cache, "second") as second, second.client() as http:
        again = http.post("/v1/completions", json=body).json()
        assert http.get("/stats").json()["generation_checkpoints"]["resumed"] == 1
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]


def test_sigkill_mid_json_schema_chat_then_restart_resumes_into_the_same_valid_json(tmp_path, tiny_model_dir):
    """The chat route through the openai client: a 150-word JSON array cut by SIGKILL resumes (streamed)
    after a restart into the reply an uninterrupted server gave, and it validates."""
    words = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 150, "maxItems": 150}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "A hundred and fifty words, as JSON."}],
              max_tokens=2000, temperature=0.8, seed=9,
              response_format={"type": "json_schema", "json_schema": {"name": "words", "schema": words}})

    def serve(cache: Path, name: str) -> ServeProcess:
        return ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                            "--generation-checkpoint", "32", log_path=tmp_path / f"{name}.log")

    def openai_client(proc: ServeProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    with serve(tmp_path / "ref", "ref") as ref:
        reference = openai_client(ref).chat.completions.create(**kw)
    text = reference.choices[0].message.content
    assert reference.choices[0].finish_reason == "stop" and reference.usage.completion_tokens > 200
    jsonschema.validate(json.loads(text), words)

    cache = tmp_path / "ssd"
    body = {**kw, "messages": kw["messages"]}
    kill_mid_request(serve(cache, "first").start(), "/v1/chat/completions", body)

    with serve(cache, "second") as second:
        again = ""
        for chunk in openai_client(second).chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                again += c.delta.content or ""
        with second.client() as http:
            assert http.get("/stats").json()["generation_checkpoints"]["resumed"] == 1
    assert again == text
