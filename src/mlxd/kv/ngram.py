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

import statistics
from collections.abc import Callable, Sequence
from typing import Literal

import attrs


@attrs.define
class PromptLookup:
    """An n-gram index over one row's tokens: n-gram -> the position just after its latest occurrence."""

    max_n: int = 4
    min_n: int = 2
    _tokens: list[int] = attrs.Factory(list)
    _after: dict[tuple[int, ...], int] = attrs.Factory(dict)
    _followed: set[int] = attrs.Factory(set)  # tokens that occur with a token after them

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
        if p:
            self._followed.add(toks[p - 1])
        toks.append(token)

    def may_propose_after(self) -> bool:
        """Whether a lookup could find anything once one more token is appended, whichever it is.

        The lookup then matches an n-gram (n ≥ `min_n` ≥ 2) ending with that token, so the row's
        current last token must have occurred earlier with a token after it; when it has not, the
        lookup would find nothing, and the next token need not be known (read from the device) to
        say so."""
        if self.min_n < 2:  # a lookup of the new token alone: anything seen before may match
            return True
        return bool(self._tokens) and self._tokens[-1] in self._followed

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
    draft_steps: int = 0  # steps where a draft model proposed (one forward per draft position for all its rows)
    draft_rows: int = 0  # rows' proposals the draft model made in those steps
    pending_reads: int = 0  # steps that read the rows' pending tokens back to the host for drafting
    probes: int = 0  # rows' drafts made for a gate probe (not verified: compared with what the row emitted)
    probe_accepted: int = 0  # of those drafts, the ones the row then emitted (what verifying would have kept)

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


def draft_lengths(most: int) -> list[int]:
    """The draft lengths a row chooses from under `--num-draft-tokens most`: the powers of two below it,
    and it (1, 2, 4, 8, 16 at 16; 1, 2, 4, 6 at 6), so a verifying forward has few widths (1 + a length)."""
    out, k = [], 1
    while k < most:
        out.append(k)
        k *= 2
    return [*out, most] if most > 0 else []


@attrs.define
class StepCosts:
    """Seconds of a decode step, by batch size (rows) and width (positions a row feeds: 1 for a plain
    step, 1 + drafts for a verifying one), as the gate times them.

    A plain step's: the median of the last `window`. A verifying step that follows a plain one first
    waits for that step's forward (mlx-lm pipelines it), so the gate records it less a plain step's
    median. A verifying step's width: the median of its last
    `window` among the batch size's last `recent` verifying steps, once `least` of them are there (one
    step is noisy: a loaded host, a prefill beside it). A width no longer among the recent ones is not
    timed any more, so a width measured at a bad moment is tried again later, not avoided for good.

    `seconds` answers for a width not timed too: between two timed widths (a plain step is width 1),
    linearly; past the widest timed one, as that one (optimistic: a longer draft is then tried, and
    timed); None when no verifying width is timed at that batch size. `best=True` takes each width's
    fastest recent step instead of the median: what a step could cost at best (`SpeculationGate.can_pay`
    refuses by it, so one slow step, a GPU's first forward of a new width compiling its kernels, cannot
    refuse drafts that pay: the H200 at batch 1, 2026-12-05, refused every n-gram step of a repetitive
    workload by a median of two timed steps, one of them the first)."""

    window: int = 5
    recent: int = 32
    least: int = 2
    _plain: dict[int, list[float]] = attrs.Factory(dict)
    _verify: dict[int, list[tuple[int, float]]] = attrs.Factory(dict)

    def record(self, rows: int, width: int, seconds: float) -> None:
        if width <= 1:
            plain = self._plain.setdefault(rows, [])
            plain.append(seconds)
            del plain[: -self.window]
        else:
            verify = self._verify.setdefault(rows, [])
            verify.append((width, seconds))
            del verify[: -self.recent]

    def plain(self, rows: int) -> float | None:
        """A plain step's seconds at this batch size (None: none timed yet)."""
        plain = self._plain.get(rows)
        return statistics.median(plain) if plain else None

    def seconds(self, rows: int, width: int, *, best: bool = False) -> float | None:
        by_width: dict[int, list[float]] = {}
        for w, s in self._verify.get(rows, ()):
            by_width.setdefault(w, []).append(s)
        pick = min if best else statistics.median
        known = {w: pick(s[-self.window:]) for w, s in by_width.items() if len(s) >= self.least}
        if not known:
            return None
        widest = known[max(known)]
        if self._plain.get(rows):
            known[1] = statistics.median(self._plain[rows])
        if width in known:
            return known[width]
        below = max((w for w in known if w < width), default=None)
        above = min((w for w in known if w > width), default=None)
        if above is None:
            return widest
        if below is None:
            return known[above]
        return known[below] + (known[above] - known[below]) * (width - below) / (above - below)


@attrs.define
class DraftLength:
    """A row's draft length, chosen at each try from what verifying costs (issue 23).

    The row's per-token acceptance `a` is estimated from its tries (accepted drafts over accepted
    drafts + tries cut by a rejection, each try's weight decaying by `decay`, a prior of one each);
    a try of k drafts emits (1 - a^(k+1)) / (1 - a) tokens on average, and costs a verifying step of
    width 1 + k (`cost`: seconds, the engine's `StepCosts` at this batch size, the draft model's
    forwards included since they are in the step). The longest length among `draft_lengths(most)`
    within `tolerance` of the most tokens per second is chosen; at the row's first try, or with no
    verifying step timed yet, `most`. Where verifying costs
    about the same at any width (a GPU at batch 1: the H200 verifies 5 positions in 12.2 ms, 17 in 11.1),
    that is `most` whatever the acceptance; where a wider step costs more (a CPU, a wide batch, a draft
    model's forward per draft), rows whose drafts are rejected draft fewer."""

    most: int
    decay: float = 0.8
    hits: float = 1.0
    misses: float = 1.0
    tolerance: float = 1.1  # the longest length within this factor of the best rate (timed steps are noisy)
    tried: bool = False  # verified once: until then the row drafts `most`

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    def choose(self, cost: Callable[[int], float | None]) -> int:
        if not self.tried:  # a row's first try: `most`, as before (a new row knows nothing of its drafts)
            return self.most
        a = self.acceptance
        rates: list[tuple[int, float]] = []
        for k in draft_lengths(self.most):
            seconds = cost(1 + k)
            if seconds is None or seconds <= 0:
                return self.most
            rates.append((k, sum(a**i for i in range(k + 1)) / seconds))
        best = max(rate for _, rate in rates)
        return max(k for k, rate in rates if rate * self.tolerance >= best)

    def verified(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.tried = True
        self.hits = self.decay * self.hits + accepted
        self.misses = self.decay * self.misses + (accepted < proposed)


Step = Literal["plain", "probe", "verify"]  # what a decode step does (SpeculationGate.decide)


@attrs.define
class _Rates:
    """The gate's measurements at one batch size (rows in the step)."""

    plains: list[float] = attrs.Factory(list)  # tokens/s of the last plain steps measured
    verifies: list[float] = attrs.Factory(list)  # tokens/s of the last verifying steps measured since a pause
    tried: int = 0  # verifying steps since the last pause (measured or not)
    gain: float = 0.0  # tokens per row of those steps, a moving average (1.0: drafts bought nothing)
    since_plain: int = 0  # verifying steps since a plain step was last measured
    pause: int = 0  # steps left in the current pause
    refused: int = 0  # steps `can_pay` refused since a step last verified past it (SpeculationGate.explore_every)
    pauses: int = 0  # pauses in a row (the next one is 4 times longer)
    suspect: bool = False  # verifying measured slower once: plain is measured afresh before a pause
    charged_s: float = 0.0  # drafting's one-off seconds since the last pause (a draft model's catch-ups)
    charged_tokens: int = 0  # tokens the verifying steps emitted since the last pause (timed or not)
    proven: bool = False  # the probe rows' drafts would have been accepted: the whole batch verifies
    probe_hits: int = 0  # probes since the last pause whose first draft the row emitted
    probe_misses: int = 0  # probes since the last pause whose first draft it did not
    speedup: float = 0.0  # verifying's rate over plain's when last compared (kept across pauses)
    hit: bool = False  # a verifying step since the last pause emitted `min_gain` tokens a row or more

    @property
    def plain(self) -> float:
        return statistics.median(self.plains) if self.plains else 0.0

    @property
    def verify(self) -> float:
        """Verifying's rate: the median of its timed steps, with the one-off seconds (`charge`) spread
        over the tokens verifying emitted since the last pause."""
        if not self.verifies:
            return 0.0
        rate = statistics.median(self.verifies)
        if self.charged_s > 0 and self.charged_tokens > 0:
            rate = 1.0 / (1.0 / rate + self.charged_s / self.charged_tokens)
        return rate


@attrs.define
class SpeculationGate:
    """Verify drafts only while verifying steps emit tokens faster than plain ones, as measured here,
    at this batch size.

    A step's time runs from its start to the next step's start (so the engine's own work on its
    results, and the draft model's forwards, count), or to `idle` when the batch ran empty, and
    its tokens are what it emitted. Each batch size (rows in the step) keeps the rates of its last
    `window` plain and verifying steps and compares their medians (a step that also waited for a
    prefill, or compiled a new shape, is one outlier, not a verdict):
    a wider forward costs almost nothing on a GPU at batch 1 and nearly its width on a CPU at
    batch 8. Only a step that follows a step of the same kind and batch size is measured: a plain
    step after a verifying one returns before its forward ends (mlx-lm pipelines it), and that
    forward's time lands in the step after it.

    Where no plain step is measured yet at a batch size, after `min_samples` + 1 verifying steps,
    and after every `probe_every` verifying steps, plain steps run until one is measured (the
    rate verifying must beat, kept current). Once `min_samples` verifying steps are in and
    verifying is not `min_speedup` times faster (medians), plain steps are measured afresh (the
    earlier ones may come from a moment when the host was less loaded) and then `min_samples`
    verifying steps again; if verifying still does not pay, drafting pauses for 16, 64, 256 steps
    (at most `max_pause`); verifying that keeps up resets that.

    Acceptance needs no clock: a verifying step costs at least a plain one, so while its tokens
    per row stay under `min_gain` (drafts are rejected: an unrelated draft model, text that does
    not repeat) it cannot pay, and drafting pauses after `min_tries` such steps, timed or not.

    Work drafting pays once rather than per step (a draft model's prefill of a row's prompt at
    its first draft, its catch-up on the tokens of steps it sat out) is reported with the step it
    fell in (`started(now, charged=...)`): it is taken out of that step's time, so a timed step
    measures the steady cost, and spread over the tokens verifying steps emitted since the last
    pause, which lowers verifying's rate by as much. Such a step after plain ones, never timed,
    is counted too.

    A probe can cost less than a verifying step (`probe_rows`, set for a draft model, whose first
    draft of a row prefills the row's prompt, and whose verifying forward is as wide at any
    acceptance): at a batch of that many rows or more (batch 1 too: there a verifying try costs K
    draft forwards, a read of the pending token and a wider forward, a probe one draft forward),
    at first and after each pause, the step is a plain one
    (`decide` says "probe") in which that many rows draft without verifying; the batch compares
    their drafts with the tokens the rows then emit and reports how many would have been accepted
    (`probed`: exactly what verifying would have kept, since the emitted tokens are the ones
    verifying gives). A probe row makes `probe_drafts` drafts (one: its draft forward is the
    probe's cost, and when the first draft is not kept no later one is). `min_tries` probes whose
    first draft the row did not emit pause drafting as above, having paid one row's draft
    forward and no wider target forward; `min_tries` probes whose first draft it did emit (one
    chance match among sampled tokens is not enough) let
    the whole batch verify from the next step and is judged by the clock. Probe steps are not
    timed (a plain step with a draft's forwards in it is neither kind's steady cost).

    After a pause, one failed try is a verdict (`retries`: a verifying step whose tokens per row stay
    under `min_gain`, or a probe whose first draft the row did not emit): the next pause follows at
    once, not after `min_tries` more (the H200 at batch 1, an unrelated draft model, 48-token rounds:
    2 tries, pause 16, 2 tries, pause 64, 2 tries cost 0.84x of off; issue 23). Two exceptions keep a
    good draft whose tries sometimes keep nothing (acceptance 0.7 a token: 30% of verifying steps) from
    being given up: where verifying last measured faster than plain (`speedup` > 1, kept across pauses)
    `paid_retries` failed tries make the verdict; and a pause for failed tries after a verifying step that
    gained (`min_gain` tokens a row, since the last pause) is as long as the last one, not 4 times longer.
    A draft never accepted neither measures a speedup nor gains: its pauses are as before. A pause by the
    clock (verifying measured slower) grows as before.

    A draft model that costs too much to pay whatever its acceptance never gets a step (`ceiling`:
    the most a verifying step can gain over a plain one, from what the draft's forwards cost,
    `draft_ceiling`; under `min_speedup` no step verifies, so no probe pays a draft prefill).

    Nor does a step whose drafting rows could not beat a plain step even if every draft were
    accepted, by the widths timed at its batch size (`can_pay`: one row of eight on a CPU).
    """

    window: int = 5  # steps of each kind whose median rate is compared
    max_pause: int = 256
    first_pause: int = 16  # each pause in a row is 4 times longer, up to max_pause
    min_samples: int = 3  # verifying steps measured before they are judged (one step is noisy)
    min_tries: int = 2  # verifying steps before their tokens per row are judged
    retries: int = 1  # after a pause: failed tries (verifying steps, probes) before the next pause
    paid_retries: int = 2  # those tries instead, where verifying last measured faster than plain (speedup > 1)
    hold_after_hit: bool = True  # a pause after a verifying step that gained does not grow (the same length again)
    min_gain: float = 1.05  # tokens per row a verifying step must average
    probe_every: int = 64  # verifying steps between measured plain steps
    # How much faster than plain a verifying step must measure: what the timed steps leave out (a
    # draft model's catch-up after plain steps, its prefill at a row's first draft) is paid too.
    min_speedup: float = 1.1
    ceiling: float = float("inf")  # the most verifying can gain (set at load for a draft model)
    explore_every: int = 256  # steps `can_pay` refused at a batch size before one verifies anyway (timed afresh)
    probe_rows: int = 0  # rows a probe drafts without verifying, at a batch of as many or more (0: no such probe)
    probe_drafts: int = 1  # drafts a probe row makes (one draft forward: no later draft is kept if the first is not)
    _by_rows: dict[int, _Rates] = attrs.Factory(dict)
    _open: tuple[int, Step, int, float, int] | None = None  # the step in progress: (rows, kind, tokens, start, width)
    costs: StepCosts = attrs.Factory(StepCosts)  # timed steps' seconds by batch size and width (DraftLength)
    _last: tuple[int, Step] | None = None  # the step before it: (rows, kind)
    steps: int = 0  # decode steps seen (any batch size, verifying or not)
    withheld: int = 0  # of those, steps the gate kept from verifying (paused, or a plain rate to measure)
    cannot_pay: int = 0  # of those, steps whose drafts could not pay even if all were accepted (`can_pay`)

    @property
    def pauses(self) -> int:
        """Pauses in a row, at the batch size where drafting is paused longest (0: it pays everywhere)."""
        return max((r.pauses for r in self._by_rows.values()), default=0)

    def rates(self, rows: int) -> tuple[float, float]:
        """(plain, verifying) tokens/s measured at this batch size (0: not yet)."""
        r = self._by_rows.get(rows, _Rates())
        return r.plain, r.verify

    def allow(self, rows: int) -> bool:
        """Whether a step of `rows` rows may verify drafts (counts a paused step when not)."""
        return self.decide(rows) == "verify"

    def decide(self, rows: int) -> Step:
        """What a step of `rows` rows does: verify drafts, a plain step, or a plain step in which
        `probe_rows` rows draft without verifying (see the class docstring). A step that does not
        verify is counted as withheld."""
        self.steps += 1
        if self.ceiling < self.min_speedup:  # cannot pay at any acceptance: not even a probe
            self.withheld += 1
            return "plain"
        r = self._by_rows.setdefault(rows, _Rates())
        if r.pause > 0:
            r.pause -= 1
            self.withheld += 1
            return "plain"
        if 0 < self.probe_rows <= rows and not r.proven:
            self.withheld += 1
            return "probe"
        allowed = r.since_plain < (self.probe_every if r.plain > 0 else self.min_samples + 1)
        self.withheld += not allowed
        return "verify" if allowed else "plain"

    def can_pay(self, rows: int, tries: Sequence[tuple[int, int]]) -> bool:
        """Whether a verifying step of `rows` rows could emit tokens faster than a plain step even at
        best: `tries` lists, for each width the step could have (1 + a draft length), the tokens it
        would emit if every draft were accepted, at the fastest recent step timed at that width. No
        by the timed costs (`StepCosts`) only: a batch
        size with no plain or no verifying step timed yet may verify (that step is how it gets
        timed), and after `explore_every` refusals at a batch size one step verifies anyway (a cost
        timed at a bad moment is timed again). Where a verifying forward costs about its width (a CPU
        at batch 8) a few rows of many drafting cannot pay; where it costs about a plain one (a GPU at
        batch 1) one row can. A refusal is a withheld step, and no row's pending token is read for it."""
        plain = self.costs.plain(rows)
        if plain is None:
            return True
        for width, tokens in tries:
            seconds = self.costs.seconds(rows, width, best=True)
            if seconds is None or tokens / seconds >= rows / plain:
                return True
        r = self._by_rows.setdefault(rows, _Rates())
        r.refused += 1
        if r.refused >= self.explore_every:
            r.refused = 0
            return True
        self.cannot_pay += 1
        self.withheld += 1
        return False

    def unprobed(self, rows: int) -> None:
        """No row of a step of `rows` rows can probe (each one's grammar checks its drafts): the
        batch verifies, judged as a batch without probes is."""
        self._by_rows.setdefault(rows, _Rates()).proven = True

    def probed(self, rows: int, accepted: int) -> None:
        """A probe row's drafts from a step of `rows` rows: `accepted` of them were what the row
        then emitted. `min_tries` probes missed (their first draft not emitted): a pause; as many
        hit: the whole batch verifies (one chance match among random tokens does not make it)."""
        r = self._by_rows.setdefault(rows, _Rates())
        if r.proven:
            return
        if accepted > 0:
            r.probe_hits += 1
        else:
            r.probe_misses += 1
        if r.probe_misses >= self._tries(r):
            self._pause(r)
        elif r.probe_hits >= self.min_tries:  # its verifying steps judged afresh, by their tokens and the clock
            r.proven, r.probe_hits, r.probe_misses = True, 0, 0

    def started(self, now: float, *, charged: float = 0.0) -> None:
        """A step starts: the previous one ends here. `charged`: seconds of the previous step that
        drafting paid once (see the class docstring)."""
        if self._open is None:
            return
        rows, kind, tokens, start, width = self._open
        self._open = None
        after_plain = self._last in ((rows, "plain"), (rows, "probe"))
        follows = self._last == (rows, kind) and kind != "probe"  # a probe step is not timed
        self._last = (rows, kind)
        verifying = kind == "verify"
        r = self._by_rows.setdefault(rows, _Rates())
        if charged > 0:
            r.charged_s += charged
            start = min(now, start + charged)  # the step's own time, without it
        if verifying and tokens > 0 and now > start:  # its seconds by width, whatever the verdict below
            if follows:
                self.costs.record(rows, width, now - start)
            elif after_plain and (plain := self.costs.plain(rows)) is not None and now - start > plain:
                self.costs.record(rows, width, now - start - plain)  # it first waited for the plain step's forward
        if verifying:
            r.charged_tokens += tokens
            r.since_plain += 1
            r.tried += 1
            r.gain = tokens / rows if r.tried == 1 else r.gain + 0.5 * (tokens / rows - r.gain)
            r.hit = r.hit or tokens / rows >= self.min_gain
            if r.tried >= self._tries(r) and r.gain < self.min_gain:
                self._pause(r, failed_try=True)
                return
        if not follows or now <= start or tokens <= 0:
            return
        rate = tokens / (now - start)
        if not verifying:
            self.costs.record(rows, 1, now - start)
            r.plains = [*r.plains[1 - self.window:], rate]
            r.since_plain = 0
            return
        r.verifies = [*r.verifies[1 - self.window:], rate]
        if not r.plains or len(r.verifies) < self.min_samples:
            return
        r.speedup = r.verify / r.plain
        if r.verify >= self.min_speedup * r.plain:
            r.pauses, r.suspect = 0, False
        elif r.suspect:  # slower again, against a plain rate measured just before: a verdict
            self._pause(r)
        else:
            # A loaded host slows every step for a while: the plain rate, measured earlier, may
            # come from a quieter moment. Measure plain again now, and verifying after it.
            r.suspect = True
            r.plains, r.verifies, r.since_plain = [], [], self.probe_every

    def _tries(self, r: _Rates) -> int:
        """Failed tries that make a verdict: `min_tries` at first, `retries` after a pause."""
        if r.pauses == 0:
            return self.min_tries
        return min(self.paid_retries if r.speedup > 1.0 else self.retries, self.min_tries)

    def _pause(self, r: _Rates, *, failed_try: bool = False) -> None:
        if failed_try and self.hold_after_hit and r.hit and r.pauses > 0:
            r.pauses -= 1  # the same length as the last pause, not 4 times longer
        r.pause = min(self.max_pause, self.first_pause << (2 * r.pauses))
        r.pauses += 1
        r.hit = False
        r.verifies, r.tried, r.gain, r.suspect = [], 0, 0.0, False  # measured afresh after the pause
        r.proven, r.probe_hits, r.probe_misses = False, 0, 0  # probed again after it
        r.charged_s, r.charged_tokens = 0.0, 0

    def ran(self, *, rows: int, verifying: bool, tokens: int, start: float, probe: bool = False,
            width: int = 1) -> None:
        """A step of `rows` rows ran from `start` and emitted `tokens`: verifying drafts, or plain
        (`probe`: rows drafted in it without verifying); `width`: positions a row fed (1 + most drafts)."""
        self._open = (rows, "verify" if verifying else "probe" if probe else "plain", tokens, start, width)

    def idle(self, now: float, *, charged: float = 0.0) -> None:
        """The batch ran empty: the last step ends here (not when rows arrive again), and the next
        step follows nothing. The rows that come next are judged by their own tokens per row: what
        the last ones averaged is dropped (after rows whose drafts were all accepted, rows whose drafts
        are not would otherwise verify until the average decays, 7 steps from 5 tokens a row)."""
        self.started(now, charged=charged)
        self._last = None
        for r in self._by_rows.values():
            r.tried, r.gain = 0, 0.0
