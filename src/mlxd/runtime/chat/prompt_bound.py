"""A prompt's fewest possible tokens from its characters, so a prompt that cannot fit is refused untokenized.

No token of a vocabulary spells more characters than its longest entry: a
byte-level BPE entry has one character per byte, a SentencePiece entry one per
character (a byte-fallback entry like `<0x41>` spells one byte in six), an
added token is its own text. So a text of C characters needs at least
C / longest tokens, and encoding only ever adds tokens (a BOS). A normalizer
can shorten the text first (NFC composes up to three or four code points into
one), so with a normalizer the bound allows for that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import trio

# Code points a normalizer may compose into one (NFC/NFKC: a Hangul syllable from three jamo, a letter with marks).
NORMALIZED_SHRINK = 4


@attrs.frozen
class PromptBound:
    """`fewest_tokens(chars)`: a lower bound on a text's token count (0 = no bound known)."""

    chars_per_token: int = 0

    @classmethod
    def of(cls, tokenizer: Any) -> PromptBound:
        """The bound for a tokenizer (mlx-lm's wrapper or a Hugging Face one); none if it has no vocabulary."""
        try:
            vocab = tokenizer.get_vocab()
        except Exception:  # noqa: BLE001 - any tokenizer without a readable vocabulary: no bound
            return cls(0)
        if not vocab:
            return cls(0)
        longest = max(len(entry) for entry in vocab)
        return cls(max(1, longest) * (NORMALIZED_SHRINK if _normalizes(tokenizer) else 1))

    def fewest_tokens(self, chars: int) -> int:
        return 0 if self.chars_per_token == 0 else -(-chars // self.chars_per_token)


def _normalizes(tokenizer: Any) -> bool:
    """Whether the tokenizer normalizes text before splitting it (True when it cannot tell)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None) or getattr(inner, "_tokenizer", None)
    if backend is None or not hasattr(backend, "normalizer"):
        return True
    return backend.normalizer is not None


def chat_chars(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of the user, system and tool texts: every chat template copies them into the prompt.

    (Assistant turns are left out: a template may drop their reasoning.)
    """
    return sum(
        len(text.strip())
        for m in messages
        if m.get("role") != "assistant"
        for text in _texts(m.get("content"))
    )


def _texts(content: Any) -> Iterable[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]


async def encode_off_loop(encode: Callable[[str], Sequence[int]], text: str) -> tuple[int, ...]:
    """Tokenize on a worker thread: a long text takes seconds, and the event loop serves everyone else."""
    ids = await trio.to_thread.run_sync(encode, text)
    return tuple(ids)
