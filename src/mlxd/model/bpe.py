"""A byte-level BPE tokenizer trained offline on the shipped corpus.

Qwen2-style: a regex split then byte-level mapping, no normalizer (so decoding
gives back the exact input), every one of the 256 bytes in the vocabulary (so
any UTF-8 text round-trips), and a ByteLevel decoder, which makes mlx-lm pick
its `BPEStreamingDetokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

# The split pattern of Qwen2/Qwen3 tokenizers: words, single digits, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Markers of the Hermes/Qwen tool-calling and reasoning format: ordinary added
# tokens (shown when decoded, like Qwen3's), so mlx-lm infers its `json_tools`
# parser and `<think>` reasoning from the vocabulary and template.
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
MARKER_TOKENS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)  # the last ids

# ChatML, with Hermes/Qwen-style tools: the tool list in the system turn, an
# assistant's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>,
# tool results as <tool_response> blocks in a user turn, reasoning as
# <think>...</think>, and `enable_thinking=false` closing an empty think block.
# A content given as a list of parts contributes its text parts.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n"
    "<tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.get('reasoning_content') %}"
    "{{- '<think>' + message['reasoning_content'] + '</think>' }}"
    "{%- endif %}"
    "{{- text(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set tool_call = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def corpus_sha256() -> str:
    """Hash of the shipped corpus, part of every build's identity."""
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()


def corpus_chunks(chunk_chars: int = 4096) -> list[str]:
    """The corpus in fixed-size pieces, in file order."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    return [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` tokens, specials and markers included.

    The marker tokens (`<think>`, `<tool_call>`, ...) take the last ids and stay
    whole in any input, like Qwen's added tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_chunks(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(f"corpus too small: trained {got} tokens, wanted {vocab_size}")
    return tokenizer


def tokenizer_config(model_max_length: int, vocab_size: int) -> dict:
    """tokenizer_config.json: ChatML template, eos <|im_end|>, no bos."""
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    for i, tok in enumerate(MARKER_TOKENS, start=vocab_size - len(MARKER_TOKENS)):
        added[str(i)] = {**added["0"], "content": tok, "special": False}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(dest: Path, tokenizer: Tokenizer, *, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into `dest`."""
    tokenizer.save(str(dest / "tokenizer.json"), pretty=False)
    config = tokenizer_config(model_max_length, tokenizer.get_vocab_size())
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
