"""Restore or recompute: decide per request with costs measured on the running engine.

Restoring a cold prefix is not always cheaper than prefill: on a fast
accelerator a long prefill can beat reading and adopting gigabytes of KV; on a
CPU the restore wins by orders of magnitude. The advisor starts from a
`CostModel` and calibrates it online from the engine's own timings: an
exponentially weighted scale on prefill cost, and the observed restore
bandwidth. Pure: no trio, no MLX.

Between the two arms lies a split: restore the first `k` tokens of a cold
record and prefill the rest (`plan`). A cut's cost is its restore (the bytes
read for those tokens) plus the prefill of the rest on top of them. With a
restore cost proportional to the bytes, the sum is concave in `k` (restoring
token i costs the same for every i, recomputing it costs more the later it
is), so the best cut is an arm; a split wins where the bytes behind a cut are
cheaper to read than the rest (a record partly in a fast medium: page cache,
host memory). Only cuts the layout can read alone are offered (a block
layout's block boundaries; a whole file's only cut is the whole file).
The other way round the parts need not wait for each other: an overlapped
split (`OVERLAP`) reads the KV of the record's tokens [j, n) from disk while
the engine recomputes [warm, j) on top of the warm prefix, then appends the
read KV and prefills the rest of the prompt; it costs max(prefill(j), read(n -
j)) + prefill(rest), so it beats both arms where neither the read nor the
recompute is much faster than the other (a GPU after a restart). Attention KV
at a position depends only on the tokens before it, so the read tail is
exactly what recomputing it would give. Its cuts (`tails`:
`RestoreCut.start` > 0) start on a block layout's block boundaries; it is
weighed in the measured mode (`weigh_overlap`) and never chosen over an
exploration or a recompute try (those measure something it would not).
benchmarks/gpu/probe_reverse_split.py measures the overlap alone.
Its head is predicted at its own scale (`head_scale`, from the heads the engine timed: a head is
prefilled apart, in whole steps, with no first token to sample, so a whole prompt's scale put it
slow and the advisor paired it with too long a tail; docs/benchmarks.md), falling back to the
prefill scale until a head was timed; heads do not move the prefill scale.

Exploration: until a restore has been measured (here or by the server
before a restart), the bandwidth is the startup probe's guess. A guess that is
too low would make every restore lose and never be measured, so a restore the
costs do not choose is still taken once (`explore`; counted in `explorations`)
to measure it, only where it brings at least half the prompt (little or no RAM
hit), and not at once: as in ski rental, recomputing is kept while it is the
cheaper bet, and the restore is tried when what the recomputed turns may have
forgone (each turn's recompute minus the restore as it would be were the read
`EXPLORE_RATIO` times faster than guessed; `forgone_s`) has reached what trying
it is predicted to cost (restore minus recompute). So a right guess no longer
costs the first returning turns after a restart (H200 19:28: trying a restore
predicted 1.8x recompute on the first turn cost that turn 1.75x the recompute
arm's); a guess too low costs at most about twice what trying at once would
have (what was forgone, then the try); a restore that would lose even with
its read `EXPLORE_RATIO` times faster is never tried (nothing is forgone).

After a restore was measured the same holds with `RETRY_RATIO` (served restores of the same bytes run up to
~1.6x apart: a restarted server's first restore shares the disk with the startup warm-up), and each try
since a restore last won on its cost doubles what the next must cover (`retries`): one slow measurement no
longer means recompute for good (nor across restarts: `forgone_s` and `retries` are carried), a restore that
keeps losing is tried ever more rarely, and one measured slower than recompute by more than `RETRY_RATIO`
is not tried again. A try's measurement replaces the estimate rather than joining its average.

The other way round too: a restore chosen on its cost stops the prefill scale from being measured on
returning turns, and the scale that chose it may be stale (H100 15:10: learned from a process's first
prefills, it put a 16k-token recompute at 1.76 s, where warm ones took 0.51-1.22 s; the advisor then restored
11 turns at 1.21-1.82 s that the recompute arm served in 0.51-1.90). So a restore that wins on its predicted cost
forgoes, each turn, what it would lose to a recompute `RETRY_RATIO` times faster than predicted
(`recompute_forgone_s`); once that covers what a recompute is predicted to cost over the restore, a
recompute is tried (`recompute_tries`; a try's whole prefill timing replaces the scale), and each try since a
recompute last won on its cost doubles the next wait (`recompute_retries`). Only over a restore that
brings at least half the prompt (a recompute long enough to be timed whole), carried across restarts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from mlxd.kv.cost_model import DEFAULT, CostModel

_WEIGHT = 0.3  # weight of a new observation in the moving averages
# How much faster than the startup probe's guess an unmeasured restore's read may really be: the guess is the
# probe's cold read; on the H200 served restores after a restart ran 1.2-1.8x faster than it (18:26, 19:28:
# 1.38-1.60 GB/s served against the probe's 0.87-1.09) and 2.1-2.8x before the probe read as serving does
# (docs/benchmarks.md). A restore predicted slower than recomputing is tried once when, were its read this
# much faster, recomputing would have forgone as much as trying it costs (`RestoreAdvisor.forgone_s`).
EXPLORE_RATIO = 2.5
# The same once a restore was served and measured: served restores of the same bytes ran up to ~1.6x apart (H200
# 20:23: 1.13-1.85 s for 1.88 GB; CPU with capped reads: a restarted server's first restore, beside the startup
# warm-up, at 0.55-0.67x the later ones). A restore measured slower than recomputing is tried again once the
# recomputes have forgone its extra cost, were its read this much faster, times 2 for each try since a restore
# last won on its cost (`RestoreAdvisor.retries`): one slow measurement no longer means recompute for good.
RETRY_RATIO = 1.6
# Decisions after which a chosen restore that was never measured (its request cancelled before it joined, its
# record lost on the read) no longer counts as in flight: as many as the unmeasured restores kept (_chosen_resident).
IN_FLIGHT_PLANS = 16

RECOMPUTE, RESTORE, SPLIT, OVERLAP = "recompute", "restore", "split", "overlap"


@attrs.frozen
class RestoreCut:
    """Restoring the first `tokens` tokens of a cold record reads `nbytes`.

    `resident_nbytes` of them are already in a faster medium (read at the
    advisor's `resident_bytes_per_s`). Tokens are model tokens. `start` > 0: an
    overlapped split's tail, the tokens [start, tokens) read (`nbytes`) while the
    tokens before `start` are recomputed.
    """

    tokens: int
    nbytes: int
    resident_nbytes: int = 0
    start: int = 0


@attrs.frozen
class RestorePlan:
    """The chosen arm: prefill on the warm prefix, restore all of the record, or its first `tokens`."""

    arm: str  # RECOMPUTE | RESTORE | SPLIT | OVERLAP
    cut: RestoreCut | None  # None for RECOMPUTE
    seconds: float  # predicted: restore (if any) + prefill of the rest (OVERLAP: the longer part + the rest)
    recompute_seconds: float
    restore_seconds: float  # the whole record restored, then the rest prefilled
    explore: bool = False  # a restore the costs would not choose, taken to measure its bandwidth
    # A recompute chosen over an unmeasured restore it may have been slower than: recompute minus the
    # restore were its read EXPLORE_RATIO times faster than guessed (seconds, >= 0; added to forgone_s).
    forgoes: float = 0.0
    recompute_try: bool = False  # a recompute the costs would not choose, taken to time the prefill afresh
    # A restore chosen over a recompute it may have been slower than: the restore minus recompute were the
    # prefill RETRY_RATIO times faster than the scale says (seconds, >= 0; added to recompute_forgone_s).
    recompute_forgoes: float = 0.0
    read_seconds: float = 0.0  # OVERLAP: the tail's predicted read (the engine waits for it no longer than this allows)
    head_seconds: float = 0.0  # OVERLAP: the head's predicted recompute on the warm prefix, beside that read


@attrs.define
class RestoreAdvisor:
    base: CostModel = DEFAULT
    prefill_scale: float = 1.0
    restore_bytes_per_s: float = attrs.field(default=None)
    prefill_samples: int = 0
    whole_prefill_samples: int = 0  # of them, whole prompts timed as served (observe_prefill)
    # An overlapped split's head: its time over the base model's prediction, and the heads timed (0: none yet,
    # the prefill scale stands in)
    head_scale: float = 1.0
    head_samples: int = 0
    restore_samples: int = 0
    always: bool = False  # restore whatever the costs say (RuntimeConfig.restore_choice "always")
    split: bool = False  # restore a middle cut whatever the costs say (restore_choice "split": tests)
    never: bool = False  # recompute whatever the costs say (restore_choice "never": the other arm)
    # an overlapped split (its best tail by the costs) whatever the arms cost (restore_choice "overlap": tests, benchmarks)
    overlap: bool = False
    weigh_overlap: bool = False  # weigh overlapped splits (`tails`) against the arms (serving's measured mode)
    explore: bool = False  # try an unmeasured restore once (restore_choice "measured": serving and its replay)
    # Bytes already in a fast medium (the page cache); None: the base model's page_cache_bytes_per_s;
    # 0: as fast as the rest.
    resident_bytes_per_s: float = attrs.field(default=None)
    restores_chosen: int = 0
    recomputes_chosen: int = 0
    splits_chosen: int = 0
    overlaps_chosen: int = 0
    explorations: int = 0  # restores chosen to measure their bandwidth (counted in restores_chosen too)
    last: RestorePlan | None = None  # the last counted choice (its predicted arms are in the stats)
    resident_samples: int = 0
    # Seconds the recomputes chosen over an unmeasured restore may have forgone (RestorePlan.forgoes, summed;
    # carried across a restart until a restore is measured): an exploration is taken once it covers its cost.
    forgone_s: float = 0.0
    # Restores tried against their predicted cost since one last won on it (each doubles what the next try
    # waits for; carried across a restart)
    retries: int = 0
    # The same the other way round: seconds restores chosen on their cost may have forgone against a faster
    # recompute (RestorePlan.recompute_forgoes, summed), recomputes tried to time the prefill afresh, and the
    # tries since a recompute last won on its cost (each doubles the next one's wait; both sums carried)
    recompute_forgone_s: float = 0.0
    recompute_tries: int = 0
    recompute_retries: int = 0
    # The resident share of each restore chosen and not yet measured, oldest first (observe_restore)
    _chosen_resident: deque[float] = attrs.field(init=False, factory=lambda: deque(maxlen=16))
    # Decisions left while a chosen restore, not yet measured, is in flight (0: none; IN_FLIGHT_PLANS)
    _in_flight: int = attrs.field(init=False, default=0)
    _trying: bool = attrs.field(init=False, default=False)  # that restore a try: measured afresh, not averaged in
    # Decisions left while a recompute try's whole prefill is not yet timed (0: none; IN_FLIGHT_PLANS)
    _recompute_in_flight: int = attrs.field(init=False, default=0)

    @classmethod
    def for_choice(cls, choice: str, base: CostModel = DEFAULT, *, overlap: bool = True) -> RestoreAdvisor:
        """The advisor of a server's --restore-choice (measured, always, never, split, overlap) and
        --restore-overlap (weigh overlapped splits in the measured mode); a replay builds the same."""
        return cls(base=base, always=choice == "always", split=choice == "split", never=choice == "never",
                   overlap=choice == "overlap", explore=choice == "measured",
                   weigh_overlap=overlap and choice == "measured")

    def __attrs_post_init__(self) -> None:
        if self.restore_bytes_per_s is None:
            self.restore_bytes_per_s = self.base.restore_bytes_per_s
        if self.resident_bytes_per_s is None:
            self.resident_bytes_per_s = self.base.page_cache_bytes_per_s

    def observe_prefill(
        self, *, new_tokens: int, context: int, seconds: float, whole: bool = False, head: bool = False
    ) -> None:
        """A prefill chunk of `new_tokens` on a `context`-token prefix took `seconds`.

        `whole`: a whole prompt prefilled alone, to its first token, as served (every chunk and the
        engine's steps between them). Once one was timed, chunk timings no longer move the scale:
        they leave out what a served prefill pays beside its chunks' forward passes.
        `head`: an overlapped split's head, recomputed apart while its tail was read (`head_scale` only).
        """
        predicted = self.base.prefill_seconds(new_tokens, context)
        if new_tokens < 16 or predicted <= 0 or seconds <= 0:
            return  # too small to say anything about throughput
        ratio = seconds / predicted
        if head:
            self.head_scale = ratio if self.head_samples == 0 else _ewma(self.head_scale, ratio)
            self.head_samples += 1
            return
        if not whole and self.whole_prefill_samples:
            return
        first = self.prefill_samples == 0 or (whole and self.whole_prefill_samples == 0)
        if whole and self._recompute_in_flight > 0:  # a recompute try's timing: the prefill as it is now
            first, self._recompute_in_flight = True, 0
        self.prefill_scale = ratio if first else _ewma(self.prefill_scale, ratio)
        self.prefill_samples += 1
        self.whole_prefill_samples += int(whole)

    def observe_restore(self, *, nbytes: int, seconds: float, resident: float | None = None) -> None:
        """Reading and adopting `nbytes` of KV took `seconds` end to end.

        `resident`: the share of them that was in the page cache (default: the oldest restore chosen
        and not yet measured, as its plan saw it). A mostly resident restore measures the page cache's
        bandwidth (when there is one to calibrate), the others the disk's, net of their resident part.
        """
        if resident is None:
            resident = self._chosen_resident.popleft() if self._chosen_resident else 0.0
        self._in_flight, afresh, self._trying = 0, self._trying, False
        if nbytes < 1 << 16 or seconds <= 0:
            return
        fast = self.resident_bytes_per_s > 0
        if fast and resident >= 0.5:
            # net of its cold part at the disk's rate: charged whole, a restore 71% resident whose cold 29%
            # took nearly all its time set the page cache's rate to 23 MB/s (CPU, reads throttled to 8 MB/s),
            # and warm records then lost to recompute, so the figure was never corrected
            warm = int(nbytes * resident)
            took = seconds - (nbytes - warm) / self.restore_bytes_per_s
            if took <= 0:
                return
            rate = warm / took
            first = self.resident_samples == 0
            self.resident_bytes_per_s = rate if first else _ewma(self.resident_bytes_per_s, rate)
            self.resident_samples += 1
            return
        cold, took = nbytes, seconds
        if fast and resident > 0:
            cold = int(nbytes * (1 - resident))
            took = seconds - nbytes * resident / self.resident_bytes_per_s
            if took <= 0:
                return
        rate = cold / took
        first = self.restore_samples == 0 or afresh  # a try measures the disk as it is now
        self.restore_bytes_per_s = rate if first else _ewma(self.restore_bytes_per_s, rate)
        self.restore_samples += 1

    def forget_restore(self) -> None:
        """The oldest restore chosen and not yet measured was not made (an overlapped split's tail
        recomputed, or declined): its residency leaves the queue (`observe_restore` pairs each measurement
        with the oldest; a stale one filed a page-cache read as the disk's), and it is no longer in flight."""
        if self._chosen_resident:
            self._chosen_resident.popleft()
        self._in_flight, self._trying = 0, False

    def prefill_seconds(self, new_tokens: int, context: int) -> float:
        return self.prefill_scale * self.base.prefill_seconds(new_tokens, context)

    def head_seconds(self, new_tokens: int, context: int) -> float:
        """An overlapped split's head: `new_tokens` recomputed apart on a `context`-token prefix."""
        scale = self.head_scale if self.head_samples else self.prefill_scale
        return scale * self.base.prefill_seconds(new_tokens, context)

    def restore_seconds(self, nbytes: int, resident_nbytes: int = 0) -> float:
        fast = min(resident_nbytes, nbytes) if self.resident_bytes_per_s > 0 else 0
        # A page the page cache holds is never read slower than one from the disk: a lower figure is a
        # small probe's noise (H200 16:17: the probe's page-cache read 0.87 GB/s against its cold 1.04;
        # serving then read those resident records at 2.0 GB/s).
        resident_rate = max(self.resident_bytes_per_s, self.restore_bytes_per_s)
        return self.base.restore_fixed + (nbytes - fast) / self.restore_bytes_per_s + (
            fast / resident_rate if fast else 0.0
        )

    def should_restore(self, *, restore_bytes: int, cold_tokens: int, warm_tokens: int, prompt_tokens: int) -> bool:
        """Restore `cold_tokens` from SSD, or prefill on top of the `warm_tokens` RAM prefix?"""
        plan = self.plan(cuts=[RestoreCut(cold_tokens, restore_bytes)], warm_tokens=warm_tokens,
                         prompt_tokens=prompt_tokens)
        return plan.arm != RECOMPUTE

    def plan(
        self, *, cuts: Sequence[RestoreCut], warm_tokens: int, prompt_tokens: int, count: bool = True,
        tails: Sequence[RestoreCut] = (),
    ) -> RestorePlan:
        """Recompute on the `warm_tokens` prefix, restore the whole record (the last cut), or a
        shorter cut and prefill the rest, or (`tails`) recompute a head while its tail is read:
        the least predicted time (counted in the stats).

        `cuts` are the prefixes the record's layout can read alone, shortest first, the
        last one the whole usable record. Cuts no longer than the warm prefix are ignored.
        `tails` are the record's parts [start, tokens) the layout can read alone (`RestoreCut.start`);
        those starting within the warm prefix are ignored.
        `count` False: a look ahead (the prefetcher's), not a decision: the stats stay.
        """
        plan = self._plan(cuts, warm_tokens, prompt_tokens)
        if tails:
            plan = self._overlapped(plan, tails, warm_tokens, prompt_tokens)
        if count:
            self.last = plan
            self.explorations += int(plan.explore)
            self.forgone_s += plan.forgoes
            self._in_flight = max(0, self._in_flight - 1)
            self._recompute_in_flight = max(0, self._recompute_in_flight - 1)
            self.recompute_forgone_s += plan.recompute_forgoes
            if plan.recompute_try:
                # as a restore's try: spends what was forgone and doubles the next one's wait
                self.recompute_tries += 1
                self.recompute_forgone_s, self.recompute_retries = 0.0, self.recompute_retries + 1
                self._recompute_in_flight = IN_FLIGHT_PLANS
            elif plan.arm == RECOMPUTE and plan.restore_seconds < float("inf") and not self.never:
                # a recompute chosen on its cost over a restore it could have made: the scale holds
                self.recompute_forgone_s, self.recompute_retries = 0.0, 0
            if plan.arm != RECOMPUTE:
                self._in_flight, self._trying = IN_FLIGHT_PLANS, plan.explore
                # a try spends what was forgone, and doubles the next one's wait; a win on cost resets both
                self.forgone_s, self.retries = 0.0, self.retries + 1 if plan.explore else 0
            if plan.cut is not None and plan.cut.nbytes > 0:
                self._chosen_resident.append(min(plan.cut.resident_nbytes, plan.cut.nbytes) / plan.cut.nbytes)
            if plan.arm == RECOMPUTE:
                self.recomputes_chosen += 1
            elif plan.arm == RESTORE:
                self.restores_chosen += 1
            elif plan.arm == SPLIT:
                self.splits_chosen += 1
            else:
                self.overlaps_chosen += 1
        return plan

    def _overlapped(
        self, plan: RestorePlan, tails: Sequence[RestoreCut], warm_tokens: int, prompt_tokens: int
    ) -> RestorePlan:
        """`plan`, or an overlapped split where one is predicted faster than every arm (or forced)."""
        usable = [t for t in tails if warm_tokens < t.start < t.tokens]
        if not usable or self.never or self.always or self.split:
            return plan
        if not self.overlap and (not self.weigh_overlap or plan.explore or plan.recompute_try):
            return plan
        tail = min(usable, key=lambda t: self.overlap_seconds(t, warm_tokens, prompt_tokens))
        seconds = self.overlap_seconds(tail, warm_tokens, prompt_tokens)
        if not self.overlap and seconds >= min(plan.seconds, plan.recompute_seconds):
            return plan
        return RestorePlan(OVERLAP, tail, seconds, plan.recompute_seconds, plan.restore_seconds,
                           read_seconds=self._read_seconds(tail),
                           head_seconds=self.head_seconds(tail.start - warm_tokens, warm_tokens))

    def overlap_seconds(self, tail: RestoreCut, warm_tokens: int, prompt_tokens: int) -> float:
        """Recompute the head on the warm prefix while `tail` is read (the longer of the two), then
        prefill the rest of the prompt on both."""
        head = self.head_seconds(tail.start - warm_tokens, warm_tokens)
        return max(head, self._read_seconds(tail)) + self.prefill_seconds(prompt_tokens - tail.tokens, tail.tokens)

    def _read_seconds(self, cut: RestoreCut) -> float:
        """Read `cut`'s bytes and move them to the device (nothing prefilled)."""
        return self.restore_seconds(cut.nbytes, cut.resident_nbytes) + self.landed_seconds(cut.nbytes)

    def _plan(self, cuts: Sequence[RestoreCut], warm_tokens: int, prompt_tokens: int) -> RestorePlan:
        usable = sorted((c for c in cuts if c.tokens > warm_tokens), key=lambda c: c.tokens)
        recompute = self.prefill_seconds(prompt_tokens - warm_tokens, warm_tokens)
        if not usable:
            return RestorePlan(RECOMPUTE, None, recompute, recompute, float("inf"))
        costs = [self._cut_seconds(c, prompt_tokens) for c in usable]
        whole = usable[-1]
        if self.never:
            return RestorePlan(RECOMPUTE, None, recompute, recompute, costs[-1])
        if self.split and len(usable) > 1:
            # the cut nearest the middle of what the record adds over the warm prefix
            mid = (warm_tokens + whole.tokens) / 2
            i = min(range(len(usable) - 1), key=lambda j: abs(usable[j].tokens - mid))
        elif self.always or self.split:
            i = len(usable) - 1
        else:
            i = min(range(len(usable)), key=lambda j: (costs[j], -usable[j].tokens))
            if costs[i] >= recompute:
                if not self._explorable(whole, warm_tokens, prompt_tokens):
                    return RestorePlan(RECOMPUTE, None, recompute, recompute, costs[-1])
                if 0 < (costs[-1] - recompute) * 2**self.retries <= self.forgone_s:
                    return RestorePlan(RESTORE, whole, costs[-1], recompute, costs[-1], explore=True)
                read = self.restore_seconds(whole.nbytes, whole.resident_nbytes)
                faster = EXPLORE_RATIO if self.restore_samples == 0 else RETRY_RATIO
                hopeful = costs[-1] - read + read / faster  # the read that much faster
                return RestorePlan(RECOMPUTE, None, recompute, recompute, costs[-1],
                                   forgoes=max(0.0, recompute - hopeful))
        arm = RESTORE if i == len(usable) - 1 else SPLIT
        if self.always or self.split or not self._explorable(whole, warm_tokens, prompt_tokens, recompute=True):
            return RestorePlan(arm, usable[i], costs[i], recompute, costs[-1])
        if 0 < (recompute - costs[i]) * 2**self.recompute_retries <= self.recompute_forgone_s:
            return RestorePlan(RECOMPUTE, None, recompute, recompute, costs[-1], recompute_try=True)
        return RestorePlan(arm, usable[i], costs[i], recompute, costs[-1],
                           recompute_forgoes=max(0.0, costs[i] - recompute / RETRY_RATIO))

    def _explorable(self, whole: RestoreCut, warm_tokens: int, prompt_tokens: int, *, recompute: bool = False) -> bool:
        """Could restoring `whole` be tried to measure it (`_plan` says when), or with `recompute`, recomputing
        in its place? Not while such a try is not yet measured (for `IN_FLIGHT_PLANS` decisions: it may never
        be), and only where the restore brings at least half the prompt (never a few tokens over a long RAM
        hit; a recompute long enough to be timed whole)."""
        if not self.explore or (self._recompute_in_flight if recompute else self._in_flight) > 0:
            return False
        return 2 * (whole.tokens - warm_tokens) >= prompt_tokens

    def _cut_seconds(self, cut: RestoreCut, prompt_tokens: int) -> float:
        """Restore `cut` (its read, then its pages moved to the device), then prefill the rest on it."""
        return self._read_seconds(cut) + self.prefill_seconds(prompt_tokens - cut.tokens, cut.tokens)

    def landed_seconds(self, nbytes: int) -> float:
        """What a restored turn waits for beyond the read: the landed pages' move to the device. The
        adoption starts it without waiting (`kinds.adopt`: outside the measured restore), the first forward
        over them waits; it is the host tier's promotion (a bulk host-to-device move, the probe's `host`
        figure); 0 on unified memory, or where no host tier was probed. (H200 18:26 and 19:28: a restored
        turn's forward took 62-69 ms, 168-216 ms on a process's first restore, against 16-49 ms on a RAM
        hit; the probe's promotion rate puts 1.88 GB at 61 ms.)"""
        return self.base.host_seconds(nbytes)

    def calibration(self) -> dict[str, float]:
        """What this advisor measured on this machine (what a restarted server's advisor `resume`s)."""
        return {
            "prefill_scale": self.prefill_scale, "whole_prefill_samples": self.whole_prefill_samples,
            "restore_bytes_per_s": self.restore_bytes_per_s, "restore_samples": self.restore_samples,
            "page_cache_bytes_per_s": self.resident_bytes_per_s, "page_cache_samples": self.resident_samples,
            "forgone_s": self.forgone_s, "restore_retries": self.retries,
            "recompute_forgone_s": self.recompute_forgone_s, "recompute_retries": self.recompute_retries,
            "overlap_head_scale": self.head_scale, "overlap_head_samples": self.head_samples,
        }

    def resume(self, calibration: dict[str, float]) -> None:
        """Start from a previous process's measurements on this machine: served whole-prompt prefills and
        restores (only those: chunk timings and unmeasured guesses are not carried). What recomputes have
        forgone since the last try, and the tries since a restore last won on its cost, are carried too
        (a server restarted after each returning turn still tries a restore, as rarely as one never restarted)."""
        c = calibration
        if int(c.get("whole_prefill_samples", 0)) > 0 and float(c.get("prefill_scale", 0)) > 0:
            self.prefill_scale = float(c["prefill_scale"])
            self.whole_prefill_samples = int(c["whole_prefill_samples"])
            self.prefill_samples = max(self.prefill_samples, self.whole_prefill_samples)
        if int(c.get("restore_samples", 0)) > 0 and float(c.get("restore_bytes_per_s", 0)) > 0:
            self.restore_bytes_per_s = float(c["restore_bytes_per_s"])
            self.restore_samples = int(c["restore_samples"])
        if int(c.get("page_cache_samples", 0)) > 0 and float(c.get("page_cache_bytes_per_s", 0)) > 0:
            self.resident_bytes_per_s = float(c["page_cache_bytes_per_s"])
            self.resident_samples = int(c["page_cache_samples"])
        if int(c.get("overlap_head_samples", 0)) > 0 and float(c.get("overlap_head_scale", 0)) > 0:
            self.head_scale = float(c["overlap_head_scale"])
            self.head_samples = int(c["overlap_head_samples"])
        # the two ski-rental sums and their tries' doublings (either way round)
        for forgone_key, retries_key, forgone_attr, retries_attr in (
            ("forgone_s", "restore_retries", "forgone_s", "retries"),
            ("recompute_forgone_s", "recompute_retries", "recompute_forgone_s", "recompute_retries"),
        ):
            forgone = float(c.get(forgone_key, 0))
            if 0 < forgone < float("inf"):
                setattr(self, forgone_attr, forgone)
            retries = int(c.get(retries_key, 0))
            if 0 < retries <= 64:
                setattr(self, retries_attr, retries)

    def stats(self) -> dict[str, float]:
        return {
            "restores_chosen": self.restores_chosen,
            "recomputes_chosen": self.recomputes_chosen,
            "splits_chosen": self.splits_chosen,
            "overlaps_chosen": self.overlaps_chosen,
            "prefill_scale": round(self.prefill_scale, 4),
            "prefill_samples": self.prefill_samples,
            "whole_prefill_samples": self.whole_prefill_samples,
            "overlap_head_scale": round(self.head_scale, 4),
            "overlap_head_samples": self.head_samples,
            "restore_bytes_per_s": round(self.restore_bytes_per_s),
            "restore_samples": self.restore_samples,
            "page_cache_bytes_per_s": round(self.resident_bytes_per_s),
            "page_cache_samples": self.resident_samples,
            "explorations": self.explorations,
            "forgone_s": round(self.forgone_s, 6),
            "restore_retries": self.retries,
            "recompute_tries": self.recompute_tries,
            "recompute_forgone_s": round(self.recompute_forgone_s, 6),
            "recompute_retries": self.recompute_retries,
            # The last choice's predicted seconds: its arm, recomputing, restoring the whole record.
            **({} if self.last is None else {
                "last_predicted_s": round(self.last.seconds, 6),
                "last_recompute_s": round(self.last.recompute_seconds, 6),
                "last_restore_s": round(self.last.restore_seconds, 6) if self.last.restore_seconds < float("inf") else -1.0,
                "last_explored": int(self.last.explore),
                "last_recompute_try": int(self.last.recompute_try),
                "last_resident_bytes": self.last.cut.resident_nbytes if self.last.cut is not None else 0,
            }),
            # An overlapped split's two halves as predicted (its head recomputed, its tail read beside it)
            **({} if self.last is None or self.last.arm != OVERLAP else {
                "last_overlap_head_s": round(self.last.head_seconds, 6),
                "last_overlap_read_s": round(self.last.read_seconds, 6),
            }),
        }


def _ewma(old: float, new: float) -> float:
    return (1 - _WEIGHT) * old + _WEIGHT * new
