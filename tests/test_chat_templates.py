"""`--chat-template FILE` replaces the model's template, and reuse survives a template that
re-renders history: the prompt diverges from a cached entry before its end, and the cache
serves the longest common prefix (a trimmable cache), prefilling only from the divergence.

The templates here are written for the test in two public formats: Llama-3-style headers with
JSON tool calls, and a reasoning template that (as Qwen3's and DeepSeek-R1's do) drops the
reasoning of assistant turns before the latest user message.
"""

from __future__ import annotations

from functools import partial

import openai
import pytest

from serving import ServerThread, config_for

LLAMA_STYLE = (
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'system' and tools %}{{- 'Tools: ' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '\\n' }}{%- endif %}"
    "{%- if m.get('tool_calls') %}{%- for c in m['tool_calls'] %}"
    "{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' + c['function']['arguments'] + '}' }}"
    "{%- endfor %}{%- else %}{{- m['content'] }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

DROPS_EARLIER_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') and loop.index0 > ns.last_user %}"
    "{{- '<think>' + m['reasoning_content'] + '</think>' }}{%- endif %}"
    "{{- m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{{- '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' + c['function']['arguments']"
    " + '}</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SYSTEM = "You are a careful agent. Think, then call tools or answer. " * 10


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("templates")
    (d / "llama.jinja").write_text(LLAMA_STYLE)
    (d / "drops.jinja").write_text(DROPS_EARLIER_REASONING)
    with ServerThread(config_for(tiny_model_dir, chat_template=str(d / "llama.jinja"))) as llama, \
            ServerThread(config_for(tiny_model_dir, chat_template=str(d / "drops.jinja"))) as drops:
        yield {"llama": llama, "drops": drops}


def chat(server, messages, **kw):
    c = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    return c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, **kw)


def render(server, messages, **kw) -> tuple[int, ...]:
    return server.call(partial(server.runtime.render_chat, messages, **kw))


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_file_replaces_the_models_template(servers):
    server = servers["llama"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Oslo?"}]
    text = server.runtime.tokenizer.decode(list(render(server, messages)))
    assert text.startswith("<|start_header_id|>system<|end_header_id|>\n\n" + SYSTEM)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    first = chat(server, messages)
    assert first.usage.prompt_tokens == len(render(server, messages))
    follow = messages + [{"role": "assistant", "content": "",
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in server.runtime.tokenizer.decode(
        list(render(server, follow)))
    assert chat(server, follow).usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_a_template_that_drops_earlier_reasoning_reuses_up_to_the_divergence(servers):
    server = servers["drops"]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}
    step1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Rome?"}]
    # The tool loop: the assistant turn (with its reasoning) comes after the last user message: kept.
    step2 = step1 + [{"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
                      "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    step3 = step2 + [{"role": "assistant", "content": "It is sunny.", "reasoning_content": "Now I answer."},
                     {"role": "user", "content": "And tomorrow?"}]
    p2, p3 = render(server, step2), render(server, step3)
    diverge = common(p2, p3)
    assert "<think>I need the weather tool.</think>" in server.runtime.tokenizer.decode(list(p2))
    assert "<think>" not in server.runtime.tokenizer.decode(list(p3))  # re-rendered without reasoning
    assert len(render(server, step1)) <= diverge < len(p2) - 20  # diverges inside the cached step-2 prompt

    chat(server, step1)
    r2 = chat(server, step2)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(render(server, step1)) - 1
    r3 = chat(server, step3)
    # The longest common prefix with the step-2 checkpoint is reused; only the rest is prefilled.
    assert r3.usage.prompt_tokens == len(p3)
    assert r3.usage.prompt_tokens_details.cached_tokens == diverge


def test_an_unreadable_template_file_is_refused_at_start(tiny_model_dir, tmp_path):
    from mlxd.engine.ops import ModelRefused

    with pytest.raises(BaseException) as failed, ServerThread(
            config_for(tiny_model_dir, chat_template=str(tmp_path / "missing.jinja"))):
        pass
    assert failed.group_contains(ModelRefused) if isinstance(failed.value, BaseExceptionGroup) else isinstance(
        failed.value, ModelRefused)


def test_a_template_file_with_a_syntax_error_is_refused_at_start(tiny_model_dir, tmp_path):
    """It used to start, then answer every chat request 400 'could not apply the chat template'."""
    from mlxd.engine.ops import ModelRefused

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }\n")
    with pytest.raises(BaseException) as failed, ServerThread(config_for(tiny_model_dir, chat_template=str(broken))):
        pass
    refusals = failed.value.exceptions if isinstance(failed.value, BaseExceptionGroup) else (failed.value,)
    flat = [e for r in refusals for e in (r.exceptions if isinstance(r, BaseExceptionGroup) else (r,))]
    assert any(isinstance(e, ModelRefused) and "not a valid Jinja template (line 1" in str(e) for e in flat), flat
