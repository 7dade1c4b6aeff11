"""Admission by the prompt work already waiting: refuse at once what would wait past the queue timeout.

Every admitted request holds prompt tokens that must be prefilled before its
first token: its whole prompt while it is queued, less its cached prefix once
the engine has taken it. Batched prefill with time slices shares the device
between the prefilling rows, each advancing by the same chunk a step, and a
short prompt is prefilled apart (engine/prefill_slices.py): a new prompt of n
tokens waits for about min(n, their tokens) of each row ahead of it, on top
of its own n. A request whose wait for the others alone would pass the budget
(`--queue-timeout`) is refused (503) before it queues, instead of occupying a
slot for minutes and being cancelled or left hanging; a prompt's own cost is
never held against it, so a lone long prompt is always served.

The rate is what the server achieved: prompt tokens brought to their first
token per second of time with work waiting (decode steps, other processes and
all included), over the last `WINDOW_S` such seconds. Until `MIN_SPAN_S` of it
is measured (a server just started, or idle so far), a prompt may wait for at
most `COLD_TOKENS` tokens of the others, about one prefill step: one long
prompt at a time, short ones beside it. Pure and clock-free: callers pass `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs

WINDOW_S = 120.0  # seconds of busy time the rate is measured over
MIN_SPAN_S = 1.0  # busy seconds measured before the rate is trusted (a GPU: a burst or two)
COLD_TOKENS = 2048  # until then: the most prompt tokens of the others a new prompt may wait for


@attrs.define
class _Pending:
    tokens: (
        int  # prompt tokens still to prefill (the whole prompt until its cached prefix is known)
    )
    alive: Callable[[], bool]  # False once its client gave up while it waited


@attrs.define
class PrefillBacklog:
    """`add` on submit, `accepted` when the engine took it, `done` at its first token, `drop` otherwise."""

    budget_s: float  # 0 = refuse nothing
    _pending: dict[str, _Pending] = attrs.Factory(dict)
    _busy_s: float = 0.0  # seconds with prompt work waiting, summed
    _busy_from: float | None = None  # when the current busy stretch began (None: no work waits)
    _done: deque[tuple[float, int]] = attrs.Factory(deque)  # (busy clock, tokens) per first token
    refused: int = 0

    def add(
        self, request_id: str, tokens: int, now: float, alive: Callable[[], bool] = lambda: True
    ) -> None:
        self._tick(now)
        self._pending[request_id] = _Pending(max(0, tokens), alive)
        self._tick(now)

    def accepted(self, request_id: str, cached: int) -> None:
        p = self._pending.get(request_id)
        if p is not None:
            p.tokens = max(0, p.tokens - cached)

    def done(self, request_id: str, now: float) -> None:
        """Its first token: its prompt tokens were prefilled (they count toward the rate)."""
        p = self._pending.pop(request_id, None)
        if p is None:
            return
        self._tick(now)
        self._done.append((self._busy_s, p.tokens))
        while self._done and self._done[0][0] < self._busy_s - WINDOW_S:
            self._done.popleft()
        self._tick(now)

    def drop(self, request_id: str, now: float) -> None:
        """It ended without a first token (cancelled, failed, its client gone): no credit."""
        if request_id in self._pending:
            self._tick(now)
            del self._pending[request_id]
            self._tick(now)

    @property
    def pending_tokens(self) -> int:
        return sum(p.tokens for p in self._pending.values() if p.alive())

    def rate(self, now: float) -> float:
        """Prompt tokens per busy second lately; 0 = not measured yet."""
        busy = self._busy_now(now)
        span = min(WINDOW_S, busy)
        if span < MIN_SPAN_S or not self._done:
            return 0.0
        return sum(t for at, t in self._done if at >= busy - WINDOW_S) / span

    def tokens_ahead(self, tokens: int) -> int:
        """Prompt tokens a new prompt of `tokens` waits for: at most its own length of each one ahead."""
        n = max(1, tokens)
        return sum(min(p.tokens, n) for p in self._pending.values() if p.alive())

    def wait_s(self, tokens: int, now: float) -> float:
        """Seconds a new prompt of `tokens` would wait for the others' prefill (0 when unmeasured)."""
        rate = self.rate(now)
        return self.tokens_ahead(tokens) / rate if rate > 0 else 0.0

    def refusal(self, tokens: int, now: float) -> str | None:
        """Why a new prompt of (at least) `tokens` is refused now, or None to admit it."""
        if self.budget_s <= 0:
            return None
        rate = self.rate(now)
        if rate <= 0:
            ahead = self.tokens_ahead(tokens)
            if ahead <= COLD_TOKENS:
                return None
            self.refused += 1
            return (
                f"{ahead} prompt tokens are ahead of this one and the server has not measured its prompt rate "
                f"yet (--queue-timeout {self.budget_s:g} s); retry later"
            )
        wait = self.tokens_ahead(tokens) / rate
        if wait <= self.budget_s:
            return None
        self.refused += 1
        return (
            f"the prompts ahead would take about {wait:.0f} s to prefill at the {rate:.0f} tokens/s "
            f"measured, over the {self.budget_s:g} s limit (--queue-timeout); retry later"
        )

    def _busy_now(self, now: float) -> float:
        return self._busy_s + (now - self._busy_from if self._busy_from is not None else 0.0)

    def _tick(self, now: float) -> None:
        """Advance the busy clock to `now`; it runs while some prompt work waits."""
        if self._busy_from is not None:
            self._busy_s += max(0.0, now - self._busy_from)
        self._busy_from = now if self._pending else None
