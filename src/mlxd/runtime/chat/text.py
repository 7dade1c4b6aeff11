"""Turn generated token ids into text deltas: streaming detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class TextAssembler:
    """Detokenize one generation incrementally, hiding EOS and cutting at stop strings.

    `add(token)` returns the new text that is safe to show: text that could still
    turn into a stop string is held back until it can't.
    """

    def __init__(self, tokenizer: Any, *, stop: Iterable[str] = (), eos_ids: Iterable[int] = ()) -> None:
        self._detok = tokenizer.detokenizer
        self._stop = [s for s in stop if s]
        self._eos = frozenset(eos_ids)
        self._shown = 0
        self.stopped_by_string = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self.done = False

    @property
    def text(self) -> str:
        """Everything shown so far."""
        return self._detok.text[: self._shown]

    def add(self, token: int) -> str:
        if self.done:
            return ""
        if token in self._eos:
            return self.finish()
        self._detok.add_token(token)
        return self._release(final=False)

    def finish(self) -> str:
        if self.done:
            return ""
        self._detok.finalize()
        delta = self._release(final=True)
        self.done = True
        return delta

    def _release(self, *, final: bool) -> str:
        text = self._detok.text
        start = self._shown
        cut = self._find_stop(text, start)
        if cut is not None:
            self.stopped_by_string = True
            self.done = True
            self._shown = max(start, cut)
            return text[start:cut]
        safe = len(text) if final else len(text) - self._holdback(text)
        safe = max(safe, start)
        self._shown = safe
        return text[start:safe]

    def _find_stop(self, text: str, start: int) -> int | None:
        best = None
        for s in self._stop:
            i = text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best):
                best = i
                self.stop_string = s
        return best

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        hold = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return hold
