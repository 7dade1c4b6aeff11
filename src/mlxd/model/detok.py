"""An exact streaming detokenizer for byte-level BPE tokenizers, and a loader.

mlx-lm picks its `BPEStreamingDetokenizer` for a tokenizer.json whose decoder is
ByteLevel. In mlx-lm 0.32 that class drops a leading space of the stream (the
GPT-2 `add_prefix_space` convention, wrong for Qwen-style tokenizers like ours)
and decodes a NUL byte as "Ā". This one keeps the documented contract:
`text == tokenizer.decode(tokens)` once finalized.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from mlx_lm.tokenizer_utils import StreamingDetokenizer, _byte_decoder


def token_byte_table(tokenizer) -> list[bytes]:
    """The UTF-8 bytes each token id decodes to (added tokens as their text)."""
    byte_decoder = _byte_decoder()
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    table = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in added:
            table.append(added[i].encode())
        elif token is None:
            table.append(b"")
        else:
            table.append(bytes(byte_decoder[c] for c in token))
    return table


class ByteLevelStreamingDetokenizer(StreamingDetokenizer):
    """Streams text from byte-level BPE tokens, holding back partial UTF-8 only."""

    def __init__(self, tokenizer):
        self._token_bytes = token_byte_table(tokenizer)  # shared by copies
        self.reset()

    def reset(self):
        self.offset = 0
        self.text = ""
        self.tokens = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add_token(self, token):
        self.tokens.append(token)
        table = self._token_bytes
        self.text += self._utf8.decode(table[token] if token < len(table) else b"")

    def finalize(self):
        self.text += self._utf8.decode(b"", final=True)


def has_byte_level_decoder(model_dir: Path) -> bool:
    """True when the tokenizer.json in `model_dir` decodes with ByteLevel."""
    try:
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    decoder = spec.get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


def load_model(model_dir: Path | str, **load_kwargs):
    """`mlx_lm.load` from a local dir, with the exact detokenizer for byte-level BPE."""
    import mlx_lm

    loaded = mlx_lm.load(str(model_dir), **load_kwargs)
    model, tokenizer = loaded[0], loaded[1]
    if has_byte_level_decoder(Path(model_dir)):
        tokenizer._detokenizer = ByteLevelStreamingDetokenizer(tokenizer._tokenizer)
    return model, tokenizer
