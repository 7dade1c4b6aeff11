"""Tokenize a chat prompt piece by piece, reusing the ids of pieces seen before.

A client resends the whole conversation every turn, and the server tokenizes
all of it again, before the request reaches the engine: for a long prompt
that is more than the RAM hit itself takes on a GPU (docs/benchmarks.md, H200).
Almost all of that text was tokenized on the previous turn.

Tokenizers extract added tokens (`<|im_start|>`, `<|im_end|>`, ...) before
anything else and tokenize the text between them independently. So a prompt
cut right after each such token is a sequence of pieces whose ids, encoded
alone and concatenated, are the ids of the whole text. `PieceEncoder` keeps
the ids of recent pieces (a bounded LRU, by tokens) and encodes only the
pieces it has not seen: a conversation's earlier messages, the tools and the
system prompt come back as cache hits.

That equality is a property of the tokenizer, so it is checked, not assumed:
only added tokens that strip no whitespace and match the raw text cut pieces;
a sample conversation through the model's own chat template must give the
same ids both ways at startup; and the first prompts served are encoded
whole as well, on a background thread (so the check costs no request any
time). Any difference turns reuse off for the process (logged), and every
prompt is then encoded whole, as before. (A prompt served in the meantime
had ids that spell its text exactly, only not the canonical ones.)
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mlxd.runtime.logging import get_logger

log = get_logger("mlxd.prompt_tokens")

# A sample conversation for the startup check: words right after the cut
# points, leading spaces and newlines, digits, non-ASCII text, a reply.
_SAMPLE = [
    {"role": "system", "content": "You are terse. Rules:\n - one\n - two"},
    {"role": "user", "content": " leading space, then digits 12345 and ünïcödé"},
    {"role": "assistant", "content": "Sure.\n\nDone"},
    {"role": "user", "content": "\nnewline first\tand a tab"},
]


class PieceEncoder:
    """`encode(text)` with the ids of previously seen pieces reused (thread-safe)."""

    def __init__(self, tokenizer: Any, *, max_tokens: int = 4 << 20, verify_first: int = 8) -> None:
        self._tokenizer = tokenizer
        self._max_tokens = max_tokens
        self._pieces: OrderedDict[str, np.ndarray] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._verify_left = verify_first
        self._checker: ThreadPoolExecutor | None = None
        self._checks: list[Future[None]] = []
        self.hits = 0  # pieces reused
        self.misses = 0  # pieces encoded
        self.reused_tokens = 0
        self._cut, why = _cut_pattern(tokenizer)
        self.enabled = self._cut is not None
        if self.enabled:
            why = self._self_check()
            self.enabled = why is None
        log.info("prompt_tokens.reuse", enabled=self.enabled, **({"why_not": why} if why else {}))

    def encode(self, text: str) -> tuple[int, ...]:
        """The ids of `text` (no special tokens added), as `tokenizer.encode` gives them."""
        if not self.enabled:
            return self._whole(text)
        ids = self._by_pieces(text)
        with self._lock:
            check = self._verify_left > 0
            if check:
                self._verify_left -= 1
                if self._checker is None:
                    self._checker = ThreadPoolExecutor(1, thread_name_prefix="mlxd-prompt-check")
                self._checks.append(self._checker.submit(self._check, text, ids))
        return ids

    def drain(self) -> None:
        """Wait for the background checks submitted so far (tests, shutdown)."""
        with self._lock:
            checks, self._checks = self._checks, []
        for f in checks:
            f.result()

    def close(self) -> None:
        """Stop the background checker thread (the runtime closes it when it stops)."""
        with self._lock:
            checker, self._checker, self._verify_left = self._checker, None, 0
        if checker is not None:
            checker.shutdown(wait=False, cancel_futures=True)

    def _check(self, text: str, ids: tuple[int, ...]) -> None:
        if self._whole(text) != ids:
            self._disable("a served prompt encoded differently by pieces")

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {"enabled": self.enabled, "piece_hits": self.hits, "piece_misses": self.misses,
                    "reused_tokens": self.reused_tokens, "held_tokens": self._held}

    # --- internals --------------------------------------------------------------------

    def _whole(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))

    def _by_pieces(self, text: str) -> tuple[int, ...]:
        assert self._cut is not None
        pieces = _split(self._cut, text)
        parts: list[np.ndarray | None] = []
        with self._lock:
            for p in pieces:
                got = self._pieces.get(p)
                if got is not None:
                    self._pieces.move_to_end(p)
                    self.hits += 1
                    self.reused_tokens += len(got)
                parts.append(got)
        fresh = {p: np.asarray(self._tokenizer.encode(p, add_special_tokens=False), dtype=np.int64)
                 for p, got in zip(pieces, parts, strict=True) if got is None}
        if fresh:
            with self._lock:
                self.misses += len(fresh)
                for p, ids in fresh.items():
                    if p not in self._pieces:
                        self._pieces[p] = ids
                        self._held += len(ids)
                while self._held > self._max_tokens and self._pieces:
                    _, old = self._pieces.popitem(last=False)
                    self._held -= len(old)
        out = [got if got is not None else fresh[p] for p, got in zip(pieces, parts, strict=True)]
        return tuple(np.concatenate(out).tolist()) if out else ()

    def _self_check(self) -> str | None:
        assert self._cut is not None
        samples = []
        try:
            samples.append(self._tokenizer.apply_chat_template(_SAMPLE, add_generation_prompt=True, tokenize=False))
        except Exception:  # no chat template: the cut tokens themselves around the same texts
            pass
        tokens = [t for t in _safe_added(self._tokenizer) if t]
        samples.append("".join(f"{t}{m['content']}" for t, m in zip(tokens * len(_SAMPLE), _SAMPLE, strict=False)))
        for text in samples:
            if _join(self._tokenizer, _split(self._cut, text)) != self._whole(text):
                return "the sample conversation encodes differently by pieces"
        return None

    def _disable(self, why: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._pieces.clear()
            self._held = 0
        log.warning("prompt_tokens.reuse_off", why=why)


def _join(tokenizer: Any, pieces: list[str]) -> tuple[int, ...]:
    return tuple(t for p in pieces for t in tokenizer.encode(p, add_special_tokens=False))


def _added_tokens(tokenizer: Any) -> list[Any]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    decoder = getattr(hf, "added_tokens_decoder", None)
    return list(decoder.values()) if isinstance(decoder, dict) else []


def _safe_added(tokenizer: Any) -> list[str]:
    """Added tokens after which the text is tokenized independently (no stripping, raw match)."""
    return [str(t.content) for t in _added_tokens(tokenizer)
            if not getattr(t, "lstrip", True) and not getattr(t, "rstrip", True)
            and not getattr(t, "normalized", True) and not getattr(t, "single_word", True)]


def _cut_pattern(tokenizer: Any) -> tuple[tuple[re.Pattern[str], frozenset[str]] | None, str | None]:
    every = sorted({str(t.content) for t in _added_tokens(tokenizer) if str(t.content)}, key=len, reverse=True)
    safe = frozenset(_safe_added(tokenizer))
    if not safe:
        return None, "the tokenizer has no added tokens that cut the text cleanly"
    # Every added token is matched (longest first), so a safe one inside a longer one never cuts.
    return (re.compile("|".join(map(re.escape, every))), safe), None


def _split(cut: tuple[re.Pattern[str], frozenset[str]], text: str) -> list[str]:
    pattern, safe = cut
    pieces, start = [], 0
    for m in pattern.finditer(text):
        if m.group(0) in safe:
            pieces.append(text[start:m.end()])
            start = m.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces
