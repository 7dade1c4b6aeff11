"""Prompt-lookup drafts: propose the tokens that followed the last occurrence of the current n-gram.

Pure and synchronous (no MLX, no trio): the engine's speculative rows use it,
and so can the simulator. A `PromptLookup` indexes one row's tokens (prompt and
generation) as they grow, append-only; `propose(k)` looks the row's last
`max_n` .. `min_n` tokens up and returns up to `k` tokens that followed their
most recent earlier occurrence. `Backoff` decides when a row stops trying: each
proposal that the target rejected outright doubles the steps it waits before
the next one (so does a lookup that found nothing), so a row whose text does
not repeat costs (almost) nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.define
class PromptLookup:
    """An n-gram index over one row's tokens: n-gram -> the position just after its latest occurrence."""

    max_n: int = 4
    min_n: int = 2
    _tokens: list[int] = attrs.Factory(list)
    _after: dict[tuple[int, ...], int] = attrs.Factory(dict)

    def observe(self, tokens: Sequence[int]) -> None:
        """Catch up with the row: `tokens` is its whole sequence so far; only the new tail is read."""
        for t in tokens[len(self._tokens):]:
            self.append(int(t))

    def append(self, token: int) -> None:
        """One more token of the row."""
        toks = self._tokens
        p = len(toks)
        # Index the n-grams that end just before `token`: `token` now follows them (position p).
        for n in range(self.min_n, self.max_n + 1):
            if p - n >= 0:
                self._after[tuple(toks[p - n:p])] = p
        toks.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram's latest earlier occurrence ([] if none)."""
        toks, size = self._tokens, len(self._tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            at = self._after.get(tuple(toks[size - n:]))
            if at is not None:
                # What followed, read on past the end through the proposal itself: a loop of
                # period size - at keeps going.
                out: list[int] = []
                for j in range(at, at + k):
                    out.append(toks[j] if j < size else out[j - size])
                return out
        return []

    def __len__(self) -> int:
        return len(self._tokens)


@attrs.define
class Backoff:
    """Skip drafting after rejections: wait 1, 2, 4 ... up to `max_wait` steps; any accepted draft resets it."""

    max_wait: int = 16
    _misses: int = 0
    _wait: int = 0

    def ready(self) -> bool:
        """Whether to draft at this step (counts a waited step when not)."""
        if self._wait > 0:
            self._wait -= 1
            return False
        return True

    def verified(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted > 0:
            self._misses = 0
            return
        self._misses += 1
        self._wait = min(self.max_wait, 1 << (self._misses - 1))

    def nothing_found(self) -> None:
        """No n-gram matched: back off as after a rejection (a lookup reads the pending token: a sync)."""
        self._misses += 1
        self._wait = min(self.max_wait, 1 << (self._misses - 1))


@attrs.define
class DraftCounters:
    """What speculation did (a row or the whole engine): the figures /stats and /metrics show."""

    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, the ones the target agreed with (emitted without their own forward)
    verified_rows: int = 0  # a row's drafts verified in one target forward (counted per row)
    verify_steps: int = 0  # target forwards that verified drafts (any number of rows)
    constrained_rows: int = 0  # speculating rows whose drafts their grammar checks
    grammar_refused: int = 0  # draft tokens cut before verification: the row's grammar refused them

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verified_rows += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens a speculating row emitted per target forward (1.0 = no gain)."""
        return (self.verified_rows + self.accepted) / self.verified_rows if self.verified_rows else 0.0


@attrs.define
class SpeculationGate:
    """Verify drafts only while verifying steps emit tokens faster than plain ones, as measured here.

    Each step's time runs from its start to the next step's start (so the engine's own work
    on its results counts), and its tokens are what it emitted. The rates of plain and of
    verifying steps are moving averages; once `min_samples` verifying steps are in and
    verifying is the slower, drafting pauses for 8, 16, 32 ... steps (at most `max_pause`),
    and verifying that keeps up resets that.
    The device decides: a wider forward costs almost nothing on a GPU at batch 1 and a
    lot on a CPU at batch 8.
    """

    alpha: float = 0.25
    max_pause: int = 256
    min_samples: int = 4  # verifying steps measured before they are judged (one step is noisy)
    plain_rate: float = 0.0  # tokens/s of plain steps (0: not measured yet)
    verify_rate: float = 0.0  # tokens/s of verifying steps
    pauses: int = 0  # pauses in a row (the next one is twice as long)
    _samples: int = 0  # verifying steps measured since the last pause
    _pause: int = 0
    _open: tuple[bool, int, float] | None = None  # the step in progress: (verifying, tokens, start)

    def allow(self) -> bool:
        """Whether this step may verify drafts (counts a paused step when not)."""
        if self._pause > 0:
            self._pause -= 1
            return False
        return True

    def started(self, now: float) -> None:
        """A step starts: the previous one ends here."""
        if self._open is None:
            return
        verifying, tokens, start = self._open
        self._open = None
        if now <= start or tokens <= 0:
            return
        rate = tokens / (now - start)
        if not verifying:
            self.plain_rate = rate if self.plain_rate == 0 else self.plain_rate + self.alpha * (rate - self.plain_rate)
            return
        self.verify_rate = rate if self.verify_rate == 0 else self.verify_rate + self.alpha * (rate - self.verify_rate)
        self._samples += 1
        if self.plain_rate <= 0 or self._samples < self.min_samples:
            return
        if self.verify_rate < self.plain_rate:
            self._pause = min(self.max_pause, 8 << self.pauses)
            self.pauses += 1
            self.verify_rate, self._samples = 0.0, 0  # measured afresh after the pause
        else:
            self.pauses = 0

    def ran(self, *, verifying: bool, tokens: int, start: float) -> None:
        self._open = (verifying, tokens, start)
