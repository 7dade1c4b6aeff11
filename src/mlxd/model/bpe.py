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

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

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

# ChatML; a content given as a list of parts contributes its text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_sha256() -> str:
    """Hash of the shipped corpus, part of every build's identity."""
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()


def corpus_chunks(chunk_chars: int = 4096) -> list[str]:
    """The corpus in fixed-size pieces, in file order."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    return [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` tokens, specials included."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_chunks(), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(f"corpus too small: trained {got} tokens, wanted {vocab_size}")
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
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
    config = tokenizer_config(model_max_length)
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
