"""Where a chat template's rendering stops being stable under continuation (runtime/chat/stable_prefix.py).

DeepSeek-R1's template (vendored in benchmarks/templates/) rewrites the end of the previous prompt:
the generation prompt opens with `<think>`, and a run of tool results is closed only after the
last one. The stable prefix ends before that rewrite, and the next step's real rendering keeps it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlxd.model.detok import load_model
from mlxd.runtime.chat.stable_prefix import (
    MIN_CUT_TOKENS,
    ProbedPrefixes,
    common_prefix,
    cut_for,
    stable_prefix,
    template_identity,
)
from mlxd.runtime.chat.token_history import render

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_agent_templates import TEMPLATE_FILES, TOOLS, session  # noqa: E402

STEPS = session(4, result_words=12)


def tokenizer_with(model_dir: Path, template: str):
    _, tok = load_model(model_dir, tokenizer_config={"chat_template": TEMPLATE_FILES[template].read_text()})
    return tok


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir):
    return tokenizer_with(tiny_model_dir, "deepseek-r1")


def ids_of(tok, messages) -> tuple[int, ...]:
    return render(tok, messages, tools=TOOLS)[1]


def test_deepseek_r1_stable_prefix_ends_where_the_next_step_diverges(deepseek):
    for messages, following in zip(STEPS, STEPS[1:], strict=False):
        prompt = ids_of(deepseek, messages)
        stable = stable_prefix(lambda m: ids_of(deepseek, m), messages, prompt, tools=TOOLS)
        shared = common_prefix(prompt, ids_of(deepseek, following))
        assert stable < len(prompt) - 1  # the template rewrites the prompt's tail
        assert stable <= shared  # the next step's real rendering keeps every stable token
        assert len(prompt) - stable <= 24  # and only the rewritten tail (2-20 tokens) is left out
        text = deepseek.decode(list(prompt[stable:]))
        assert "<think>" in text or "tool▁outputs▁end" in text


def test_qwen3_drops_reasoning_after_a_new_question_so_its_stable_prefix_stays_at_the_question(tiny_model_dir):
    # A tool call keeps Qwen3's prompt a prefix; a new user turn drops the reasoning of every turn
    # since the last question, so the minimum over both continuations is where that question's
    # generation prompt ends: the first step's prompt, the same at every later step.
    tok = tokenizer_with(tiny_model_dir, "qwen3")
    first = ids_of(tok, STEPS[0])
    for messages in STEPS:
        prompt = ids_of(tok, messages)
        stable = stable_prefix(lambda m: ids_of(tok, m), messages, prompt, tools=TOOLS)
        assert stable == len(first)
        assert prompt[:stable] == first
    assert cut_for(len(first), first, first) is None  # the prompt-boundary checkpoint already ends there


def test_a_probe_the_template_refuses_is_skipped(deepseek):
    messages = STEPS[1]
    prompt = ids_of(deepseek, messages)

    def refusing(m):
        if any(x.get("role") == "tool" for x in m[len(messages):]):
            raise ValueError("no tools here")
        return ids_of(deepseek, m)

    both = stable_prefix(lambda m: ids_of(deepseek, m), messages, prompt, tools=TOOLS)
    replies_only = stable_prefix(refusing, messages, prompt, tools=TOOLS)
    assert replies_only >= both
    assert stable_prefix(lambda m: (_ for _ in ()).throw(ValueError("none")), messages, prompt) == len(prompt)


def test_the_cut_keeps_its_distance_from_the_end_in_realigned_ids():
    plain = tuple(range(100))
    assert cut_for(90, plain, plain) == 90
    realigned = (7, 7, 7, *plain[5:])  # a reply earlier in the history re-spelled with fewer ids
    assert cut_for(90, plain, realigned) == 90 - 2
    assert cut_for(90, plain, (*plain[:-1], 999)) is None  # a different tail: no cut
    assert cut_for(99, plain, plain) is None  # the boundary checkpoint covers it
    assert cut_for(MIN_CUT_TOKENS - 1, plain, plain) is None  # too short to pay for a copy


def test_a_conversation_probed_before_is_not_rendered_again(deepseek, tiny_model_dir):
    renders: list[int] = []

    def counted(m):
        renders.append(len(m))
        return ids_of(deepseek, m)

    probed = ProbedPrefixes(template_identity(deepseek))
    variables = {"tools": TOOLS}
    messages = STEPS[2]
    prompt = ids_of(deepseek, messages)
    first = probed.stable(counted, messages, prompt, variables=variables)
    assert first == stable_prefix(lambda m: ids_of(deepseek, m), messages, prompt, tools=TOOLS)
    assert len(renders) == 2  # one per probe continuation
    again = probed.stable(counted, [dict(m) for m in messages], prompt, variables={"tools": list(TOOLS)})
    assert again == first and len(renders) == 2  # an equal conversation (fresh objects): no render
    assert probed.stats().as_dict() == {"hits": 1, "misses": 1, "entries": 1}
    # Anything the template sees is in the key: another message list, other variables, another template.
    probed.stable(counted, STEPS[3], ids_of(deepseek, STEPS[3]), variables=variables)
    probed.stable(counted, messages, prompt, variables={"tools": TOOLS, "enable_thinking": False})
    ProbedPrefixes(template_identity(tokenizer_with(tiny_model_dir, "qwen3"))).stable(
        counted, messages, prompt, variables=variables)
    assert len(renders) == 2 + 3 * 2
    assert template_identity(deepseek) != template_identity(tokenizer_with(tiny_model_dir, "qwen3"))


def test_probed_prefixes_are_a_bounded_lru(deepseek):
    probed = ProbedPrefixes(template_identity(deepseek), max_entries=2)
    renders: list[int] = []

    def counted(m):
        renders.append(len(m))
        return ids_of(deepseek, m)

    def probe(step: int) -> None:
        probed.stable(counted, STEPS[step], ids_of(deepseek, STEPS[step]), variables={"tools": TOOLS})

    for step in (0, 1, 0, 2):  # 2 is new: the least recently used (1) goes
        probe(step)
    assert probed.stats().entries == 2 and len(renders) == 3 * 2
    probe(0)
    assert len(renders) == 3 * 2  # kept: used after 1
    probe(1)
    assert len(renders) == 4 * 2  # evicted: probed again
    # Not plain JSON: no key, so never remembered (probed each time).
    odd = [*STEPS[0][:-1], {"role": "user", "content": "x", "extra": {1, 2}}]
    assert probed.key(odd, {}) is None
