"""Test helper: a real Qwen3 model whose weights make greedy decoding follow a script.

Every layer's output projections are zero, so the residual stream at a position
is just the embedding of its token, and the logits are a bigram table: each
"script" token has its own orthogonal embedding direction, and the (untied)
LM head maps that direction to the token that must follow. The forward pass,
KV cache, batching and sampling are mlx-lm's own; only the weights are chosen.

From the last token of an assistant generation prompt the model emits, by
greedy decoding, `TOOL_CALL_TEXT` (a Hermes-style tool call), then <|im_end|>.
Its second choice there (reached when `<tool_call>` is banned with logit_bias)
is `ANSWER_TEXT`: reasoning in <think>...</think>, then an answer. A bigram
needs each token to have one successor, so the scripts are spelled in pieces
whose tokens never repeat (checked when the model is built).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.model import bpe, get_preset
from mlxd.model.tiny import model_config

# A bigram gives every token one successor, and JSON repeats `": "`; so the call is
# spelled in pieces (JSON whitespace included) whose tokens never repeat.
TOOL_CALL_PIECES = ['{"', "name", '":', ' "', "get", "_", "weather", '",', "\t", '"', "arguments", '"\n', ":", " {}", "}"]
TOOL_CALL = {"name": "get_weather", "arguments": {}}
TOOL_CALL_TEXT = "<tool_call>" + "".join(TOOL_CALL_PIECES) + "</tool_call>"
REASONING = "I should answer now"
ANSWER = "It is sunny."
ANSWER_TEXT = f"<think>{REASONING}</think>{ANSWER}"


def _chain(tok: Any, pieces: list[str]) -> list[int]:
    return [t for piece in pieces for t in tok.encode(piece, add_special_tokens=False)]


def build_scripted_model(dest: Path) -> Path:
    """Write the scripted model into `dest` (the "default" preset's tokenizer: enough quote tokens)."""
    dest.mkdir(parents=True, exist_ok=True)
    preset = attrs.evolve(get_preset("test"), vocab_size=get_preset("default").vocab_size, hidden_size=128,
                          tie_word_embeddings=False)
    bpe.write_tokenizer(dest, bpe.train_tokenizer(preset.vocab_size), model_max_length=4096)
    eos_ids = [bpe.SPECIAL_TOKENS.index(t) for t in (bpe.IM_END, bpe.ENDOFTEXT)]
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    (dest / "config.json").write_text(json.dumps(model_config(preset), indent=2))
    tok = load_tokenizer(dest, eos_token_ids=eos_ids)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)
    start = prompt[-1]
    call = _chain(tok, ["<tool_call>", *TOOL_CALL_PIECES, "</tool_call>"])
    answer = _chain(tok, ["<think>", REASONING, "</think>", ANSWER])
    chains = [[start, *call, eos], [*answer, eos]]
    succ: dict[int, int] = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:], strict=False):
            if succ.setdefault(a, b) != b:
                raise RuntimeError(f"token {tok.decode([a])!r} needs two successors")
    think_open = answer[0]
    cfg = model_config(preset)
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    d = preset.hidden_size
    tokens = sorted({t for chain in chains for t in chain[:-1]})
    assert len(tokens) <= d
    embed = mx.random.normal((preset.vocab_size, d)) * 0.02
    head = mx.zeros((preset.vocab_size, d))
    for k, t in enumerate(tokens):
        embed[t] = mx.zeros((d,))
        embed[t, k] = 1.0
    column = {t: k for k, t in enumerate(tokens)}
    for chain in chains:
        for a, b in zip(chain, chain[1:], strict=False):
            head[b, column[a]] = 2.0
    head[think_open, column[start]] = 1.0  # the second choice after the generation prompt
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest
