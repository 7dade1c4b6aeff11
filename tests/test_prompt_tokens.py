"""Chat prompts tokenized piece by piece (runtime/chat/prompt_tokens.py) give exactly the tokenizer's ids."""

from __future__ import annotations

import random

import pytest
from mlx_lm.utils import load_tokenizer

from mlxd.model import bpe
from mlxd.runtime.chat.prompt_tokens import PieceEncoder, _join, _split

WORDS = ["alpha", " beta", "gamma\n", "  delta", "ünï", "12", "\t", "x.y", "<|im", "end|>", "\n\n", "'s", "<think"]


@pytest.fixture()
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def wide_tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer alone (8,192 tokens: `|>` and `\n` merge when specials are spelled out)."""
    dest = tmp_path_factory.mktemp("tok8k")
    bpe.write_tokenizer(dest, bpe.train_tokenizer(8192), model_max_length=4096)
    return dest


def conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "".join(rng.choice(WORDS) for _ in range(200))}]
    for t in range(turns):
        msgs.append({"role": "user", "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))})
    return msgs


def test_growing_conversations_reuse_their_pieces_and_match_the_whole_encoding(tok):
    enc = PieceEncoder(tok, verify_first=0)  # every prompt below takes the piece path
    assert enc.enabled
    rng = random.Random(5)
    for convo in range(6):
        msgs = conversation(rng, 6)
        for turn in range(1, 7):
            part = msgs[: 2 * turn]
            text = tok.apply_chat_template(part, add_generation_prompt=True, tokenize=False)
            before = enc.stats()["reused_tokens"]
            assert enc.encode(text) == tuple(tok.encode(text, add_special_tokens=False)), (convo, turn)
            if turn > 1:  # everything up to the newest user message was seen on the previous turn
                previous = tok.apply_chat_template(msgs[: 2 * turn - 2], add_generation_prompt=False, tokenize=False)
                assert enc.stats()["reused_tokens"] - before >= len(tok.encode(previous)) - 8
    # Added tokens anywhere (adjacent, at the ends, inside words) and raw text around them.
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>"]
    for _ in range(300):
        text = "".join(rng.choice(specials + WORDS) for _ in range(rng.randint(0, 30)))
        assert enc.encode(text) == tuple(tok.encode(text, add_special_tokens=False)), repr(text)
    assert enc.stats()["piece_hits"] > 0


def test_the_held_pieces_stay_within_their_token_bound(tok):
    enc = PieceEncoder(tok, max_tokens=500, verify_first=0)
    rng = random.Random(9)
    for _ in range(20):
        text = tok.apply_chat_template(conversation(rng, 3), add_generation_prompt=True, tokenize=False)
        assert enc.encode(text) == tuple(tok.encode(text, add_special_tokens=False))
        assert enc.stats()["held_tokens"] <= 500 or len(enc._pieces) == 1


def test_a_tokenizer_that_does_not_cut_at_added_tokens_is_never_split(wide_tokenizer_dir):
    tok = load_tokenizer(wide_tokenizer_dir)
    tok._tokenizer.split_special_tokens = True  # "<|im_end|>" is then spelled out by BPE across the cut
    enc = PieceEncoder(tok)
    assert not enc.enabled  # the startup check on a sample conversation caught it
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    assert enc.encode(text) == tuple(tok.encode(text, add_special_tokens=False))
    assert enc.stats()["piece_misses"] == 0


def test_a_served_prompt_that_differs_turns_reuse_off(wide_tokenizer_dir):
    tok = load_tokenizer(wide_tokenizer_dir)
    enc = PieceEncoder(tok, verify_first=2)
    assert enc.enabled
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                   tokenize=False)
    tok._tokenizer.split_special_tokens = True  # the tokenizer changes its mind after the check
    whole = tuple(tok.encode(text, add_special_tokens=False))
    assert _join(tok, _split(enc._cut, text)) != whole  # the premise
    served = enc.encode(text)  # by pieces: the check runs beside it, costing the request nothing
    assert tok.decode(list(served)) == tok.decode(list(whole))  # still exactly this text
    enc.drain()
    assert not enc.enabled and enc.stats()["held_tokens"] == 0
    assert enc.encode(text) == whole  # from now on, whole
