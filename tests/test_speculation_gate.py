"""The engine's speculation gate (kv/ngram.py) driven through whole benchmark-like runs on a fake clock.

Each run decodes a few rows to their end the way `SpeculativeBatch.next` drives the gate: `started`
at a step's start, `allow`, `ran`, and `idle` when the batch runs empty; then the batch waits (other
arms of a benchmark decode, no request comes) before the next run. Step costs model the two
devices the issue measures: on a GPU a forward of 1 + K positions costs about what a forward of 1
costs, and a plain step is pipelined (a plain step right after a verifying one returns at once, its
forward lands in the next step); on a CPU at batch 8 the wider forward costs nearly its width.
The gate's decisions are what is checked: where every draft is accepted and verifying is faster it
keeps drafting (the first gate version paused there on the H200: the wait between runs was counted
as a step), where no draft is accepted it backs off at once and stays off nearly every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs
import pytest

from mlxd.kv.ngram import SpeculationGate


@attrs.define
class Device:
    """Seconds of one step: a plain forward, a verifying forward of 1 + k positions, and the host's
    own work per step (sampling, the engine's bookkeeping)."""

    plain_s: float
    verify_s: float
    host_s: float = 0.0005


@attrs.define
class Tally:
    steps: int = 0
    verifying: int = 0
    tokens: int = 0
    seconds: float = 0.0


def count_step(tally: Tally, *, verifying: bool, tokens: int, seconds: float) -> None:
    tally.steps += 1
    tally.verifying += verifying
    tally.tokens += tokens
    tally.seconds += seconds


def end_run(gate: SpeculationGate, tally: Tally, now: float, carry: float, gap_s: float) -> float:
    """A run's last forward (`carry`), the batch running empty, then a wait no step caused: the next run's start."""
    now += carry
    tally.seconds += carry
    gate.idle(now)
    return now + gap_s


def drive(
    gate: SpeculationGate,
    device: Device,
    *,
    runs: int,
    tokens: int,
    rows: int,
    accepted: int,
    k: int = 4,
    gap_s: float = 4.0,
    first_step_s: float = 0.3,
    load: Callable[[int], float] = lambda step: 1.0,
) -> Tally:
    """`runs` runs of `rows` rows decoding `tokens` each; a verifying step keeps `accepted` of k
    drafts per row. The first step of each run also waits `first_step_s` (a prefill, a shape compiled).
    `load(step)`: how many times slower the host makes that step (other processes on its cores)."""
    now, tally = 0.0, Tally()
    for _ in range(runs):
        left, carry = tokens, first_step_s
        while left > 0:
            gate.started(now)
            start = now
            verifying = gate.allow(rows)
            if verifying:
                emitted = min(left, 1 + accepted)
                cost = carry + device.verify_s + device.host_s  # synchronous: waits for its own forward
                carry = 0.0
            else:
                # Pipelined: it launches its forward and waits for the one before it (none after a
                # verifying step, so it returns at once); the next step waits for this one's.
                emitted = 1
                cost, carry = carry + device.host_s, device.plain_s
            cost *= load(tally.steps)
            gate.ran(rows=rows, verifying=verifying, tokens=emitted * rows, start=start)
            now += cost
            left -= emitted
            count_step(tally, verifying=verifying, tokens=emitted * rows, seconds=cost)
        now = end_run(gate, tally, now, carry, gap_s)
    return tally


def plain_seconds(device: Device, *, runs: int, tokens: int, first_step_s: float = 0.3) -> float:
    return runs * (first_step_s + tokens * (device.plain_s + device.host_s))


H200_BATCH1 = Device(plain_s=0.0075, verify_s=0.0085)  # Qwen3-1.7B bf16: 5 positions cost ~1 forward
H200_BATCH8 = Device(plain_s=0.0080, verify_s=0.0110)
CPU_BATCH8 = Device(plain_s=0.030, verify_s=0.160)  # a CPU: the wider forward costs about its width


def test_every_draft_accepted_on_a_gpu_keeps_drafting_across_runs():
    """3 runs of 192 tokens (the H200 benchmark's n-gram repetitive arm): drafting is never paused
    by the gate; only its plain probes (a few steps per run) run without drafts."""
    for device, rows in ((H200_BATCH1, 1), (H200_BATCH8, 8)):
        gate = SpeculationGate()
        tally = drive(gate, device, runs=3, tokens=192, rows=rows, accepted=4)
        assert gate.pauses == 0, (rows, gate.rates(rows))
        assert (gate.steps, gate.withheld) == (tally.steps, tally.steps - tally.verifying), "the counts /stats shows"
        plain, verify = gate.rates(rows)
        assert verify > 3 * plain, (rows, plain, verify)
        assert tally.verifying >= 0.85 * tally.steps, (rows, tally)
        speedup = plain_seconds(device, runs=3, tokens=192) / tally.seconds
        assert speedup > 2.5, (rows, speedup)


def test_no_draft_accepted_backs_off_at_once_and_costs_almost_nothing():
    """Every draft rejected (an unrelated draft model, text that does not repeat): the gate pauses
    after its first two verifying steps, then for 16, 64, 256 steps; over 3 runs of 192 tokens the
    verifying steps are a few percent of all, and the time within 3% of plain decoding's on a GPU
    (6% on a CPU at batch 8, where each of those few verifying steps costs 5 plain ones)."""
    for device, rows, bound in ((H200_BATCH1, 1, 1.03), (H200_BATCH8, 8, 1.03), (CPU_BATCH8, 8, 1.06)):
        gate = SpeculationGate()
        tally = drive(gate, device, runs=3, tokens=192, rows=rows, accepted=0)
        assert gate.pauses >= 3, rows
        assert tally.verifying <= 0.03 * tally.steps, (rows, tally)
        assert tally.seconds <= bound * plain_seconds(device, runs=3, tokens=192), rows


def test_drafts_accepted_but_verifying_slower_pauses_and_stays_near_plain_speed():
    """A CPU at batch 8: 5 tokens a row per verifying step, but the wide forward costs 5.3 plain
    ones; the gate finds verifying slower than its measured plain rate and pauses, longer each time."""
    gate = SpeculationGate()
    tally = drive(gate, CPU_BATCH8, runs=3, tokens=192, rows=8, accepted=4)
    plain, verify = gate.rates(8)
    assert gate.pauses >= 2 and 0 < plain, (plain, verify)
    assert tally.verifying <= 0.10 * tally.steps, tally
    # What it cost against never drafting: the steps before each verdict (and the plain probes).
    assert tally.seconds <= 1.10 * plain_seconds(CPU_BATCH8, runs=3, tokens=192), tally


def test_half_the_drafts_accepted_on_a_gpu_at_batch_1_keeps_drafting():
    """2 of 4 drafts accepted: 3 tokens per verifying step at about one forward's cost still pays."""
    gate = SpeculationGate()
    tally = drive(gate, H200_BATCH1, runs=3, tokens=192, rows=1, accepted=2)
    assert gate.pauses == 0 and tally.verifying >= 0.8 * tally.steps, tally


def test_a_loaded_host_s_slow_spells_do_not_pause_drafting_that_pays():
    """A CPU shared with other work (the benchmark host: load 13 on 2 cores): every step is 4 times
    slower for 12 steps out of 40. Verifying pays 2x here; a plain rate measured in a quiet spell
    against verifying steps measured in a slow one looks like a loss. The gate measures plain
    again before it pauses, and keeps drafting."""
    device = Device(plain_s=0.030, verify_s=0.075)  # 5 tokens a row for 2.5 plain steps' time

    def bursts(step: int) -> float:
        return 4.0 if step % 40 >= 28 else 1.0

    gate = SpeculationGate()
    tally = drive(gate, device, runs=3, tokens=96, rows=8, accepted=4, load=bursts)
    assert gate.pauses == 0 and tally.verifying >= 0.8 * tally.steps, tally


def test_a_draft_model_barely_faster_in_its_timed_steps_pauses():
    """The target as its own draft on a GPU: 4 draft forwards and a verifying one emit 5 tokens in
    about the time of 5 plain steps (timed: 1.05x plain). The steps the gate does not time (the
    draft's catch-up after plain steps, its prefill of a row's prompt) are paid on top, so
    verifying must measure `min_speedup` (1.1x) faster to go on: here drafting pauses."""
    device = Device(plain_s=0.0075, verify_s=5 * 0.008 / 1.05 - 0.0005)
    gate = SpeculationGate()
    tally = drive(gate, device, runs=3, tokens=192, rows=1, accepted=4)
    assert gate.pauses >= 2 and tally.verifying <= 0.2 * tally.steps, tally


def test_a_draft_models_one_off_work_is_charged_to_verifying():
    """Verifying steps timed at 2x plain's rate, but each run's first verifying step also paid the
    draft's prefill of every row's prompt (reported as `charged`): spread over the tokens verifying
    emitted, it makes verifying the slower, so drafting pauses after it, in each run; the same steps
    without that work never pause. A charged step's own time is measured without it, and a pause
    clears the charge (what was paid is not held against the steps after it: they resume)."""

    def run(charged_s: float) -> tuple[SpeculationGate, Tally]:
        gate, tally, now, charged = SpeculationGate(), Tally(), 0.0, 0.0
        plain_s, verify_s = 0.010, 0.025  # 5 tokens a row for 2.5 plain steps' time: 2x
        for _ in range(3):
            left, first = 96, True
            while left > 0:
                gate.started(now, charged=charged)
                charged = 0.0
                verifying = gate.allow(8)
                emitted = min(left, 5) if verifying else 1
                cost = verify_s if verifying else plain_s
                if verifying and first:  # the draft prefills the rows' prompts inside this step
                    cost, charged, first = cost + charged_s, charged_s, False
                gate.ran(rows=8, verifying=verifying, tokens=emitted * 8, start=now)
                now += cost
                left -= emitted
                tally.steps += 1
                tally.verifying += verifying
            gate.idle(now, charged=charged)
            charged = 0.0
            now += 4.0
        return gate, tally

    free, free_tally = run(0.0)
    assert free.pauses == 0 and free_tally.verifying >= 0.8 * free_tally.steps, free_tally
    plain, verify = free.rates(8)
    assert verify == pytest.approx(2 * plain, rel=0.01)
    paid, paid_tally = run(2.0)  # 2 s of prefill against ~0.5 s of decoding per run
    # One 16-step pause per run, right after its charged stretch; verifying resumes after each.
    assert paid_tally.steps - paid_tally.verifying >= 3 * 16, paid_tally
    assert paid_tally.verifying >= 0.3 * paid_tally.steps, paid_tally
    assert paid.rates(8)[1] == pytest.approx(2 * paid.rates(8)[0], rel=0.01)  # after the pause: uncharged


def test_a_draft_that_cannot_pay_at_any_acceptance_never_verifies():
    """The ceiling from the draft's cost (engine/speculative.py's draft_ceiling): the target as its
    own draft at K = 4 gains at most 1.0x, so no step verifies, not even the first probe; a draft a
    tenth of the target's cost may (3.57x at best) and is probed as before."""
    from mlxd.engine.speculative import draft_ceiling

    assert draft_ceiling(4, 1.0) == pytest.approx(1.0) and draft_ceiling(4, 0.1) == pytest.approx(5 / 1.4)
    assert draft_ceiling(4, 0.9) < SpeculationGate().min_speedup < draft_ceiling(4, 0.85)
    dear, cheap = SpeculationGate(ceiling=draft_ceiling(4, 1.0)), SpeculationGate(ceiling=draft_ceiling(4, 0.1))
    assert not any(dear.allow(rows) for rows in (1, 8, 1, 8)) and dear.withheld == dear.steps == 4
    assert cheap.allow(1) and cheap.allow(8) and cheap.withheld == 0


@attrs.define
class DraftDevice:
    """A draft model's costs beside a `Device`'s: one draft forward (any rows: launch-bound on a GPU),
    and its prefill of a row's prompt at the row's first draft (rows together: one forward)."""

    target: Device
    draft_s: float = 0.0015
    prefill_s: float = 0.004


def drive_draft(gate: SpeculationGate, device: DraftDevice, *, runs: int, tokens: int, rows: int,
                accepted: int, k: int = 4) -> Tally:
    """`drive` with a draft model at the gate's `decide`: a verifying step also makes k draft forwards
    and prefills the rows that never drafted in this run; a probe step is a plain step in which one
    row drafts (the gate's `probe_drafts` draft forwards, its prefill the first time), whose drafts are compared with what it
    emits over the next steps (`probed`, one step later)."""
    now, tally, target = 0.0, Tally(), device.target
    for _ in range(runs):
        left, carry, fresh, judging = tokens, 0.3, rows, False
        while left > 0:
            gate.started(now)
            start = now
            kind = gate.decide(rows)
            if kind == "verify":
                emitted = min(left, 1 + accepted)
                cost = carry + target.verify_s + target.host_s + k * device.draft_s
                cost += device.prefill_s if fresh else 0.0
                carry, fresh = 0.0, 0
            else:
                emitted = 1
                cost, carry = carry + target.host_s, target.plain_s
                if judging:  # the probe's drafts against what its row emitted
                    gate.probed(rows, accepted)
                    judging = False
                elif kind == "probe":
                    cost += gate.probe_drafts * device.draft_s + (device.prefill_s if fresh == rows else 0.0)
                    fresh, judging = min(fresh, rows - 1), True
            gate.ran(rows=rows, verifying=kind == "verify", tokens=emitted * rows, start=start,
                     probe=kind == "probe")
            now += cost
            left -= emitted
            tally.steps += 1
            tally.verifying += kind == "verify"
            tally.tokens += emitted * rows
            tally.seconds += cost
        now += carry
        tally.seconds += carry
        gate.idle(now)
        now += 4.0
    return tally


H200_DRAFT8 = DraftDevice(Device(plain_s=0.0088, verify_s=0.0110))
# Batch 1 (the H200's draft = default at t = 4: 0.840x of off in 48-token rounds, 19:19): a verifying try
# waits for its own forward and the draft's K forwards; the draft's prefill of a 512-token prompt and
# the graph builds of new attention shapes (cuDNN) land in a row's first try.
H200_DRAFT1 = DraftDevice(Device(plain_s=0.0093, verify_s=0.0100), draft_s=0.0015, prefill_s=0.030)


def test_a_draft_probe_at_batch_8_drafts_one_row_unverified_and_costs_under_3_percent():
    """A small draft model whose drafts are never accepted, at batch 8 (the H200's draft = default at
    t = 4, 0.955x when every probe verified the whole batch): probes draft one token for one row in a
    plain step and compare it with what the row emits, so no step verifies, and over one fresh run of 96
    tokens (three probes' pauses: 16, 64) the time stays within 3% of plain decoding's; the same gate
    probing with the whole batch verifies and costs more."""
    one = SpeculationGate(probe_rows=1)
    tally = drive_draft(one, H200_DRAFT8, runs=1, tokens=96, rows=8, accepted=0)
    assert tally.verifying == 0 and one.pauses >= 2, tally
    assert one.withheld == one.steps == tally.steps
    assert tally.seconds <= 1.03 * plain_seconds(H200_DRAFT8.target, runs=1, tokens=96), tally
    every = SpeculationGate(probe_rows=0)
    whole = drive_draft(every, H200_DRAFT8, runs=1, tokens=96, rows=8, accepted=0)
    assert whole.verifying >= 4 and whole.seconds > tally.seconds, (whole, tally)
    three = drive_draft(one, H200_DRAFT8, runs=2, tokens=96, rows=8, accepted=0)
    assert three.verifying == 0 and one.pauses >= 3, three


def test_a_draft_probe_whose_drafts_would_be_accepted_lets_the_whole_batch_verify():
    """Every draft accepted: after `min_tries` probes the whole batch verifies (timed against plain
    steps as before) and keeps verifying; at batch 1 too (the probe's one draft forward in a plain
    step, not K of them, a read of the pending token and a wider forward)."""
    gate = SpeculationGate(probe_rows=1)
    tally = drive_draft(gate, H200_DRAFT8, runs=3, tokens=192, rows=8, accepted=4)
    assert gate.pauses == 0 and tally.verifying >= 0.8 * tally.steps, tally
    plain, verify = gate.rates(8)
    assert verify > 2 * plain, (plain, verify)  # 5 tokens a row for a verifying forward and 4 draft forwards
    assert SpeculationGate(probe_rows=1).decide(1) == "probe"
    assert SpeculationGate(probe_rows=1).decide(8) == "probe"
    assert SpeculationGate(probe_rows=0).decide(1) == "verify", "n-grams: no probe (their drafts cost nothing)"
    one = SpeculationGate(probe_rows=1)
    tally = drive_draft(one, H200_DRAFT1, runs=3, tokens=192, rows=1, accepted=4)
    assert one.pauses == 0 and tally.verifying >= 0.8 * tally.steps, tally


def test_one_chance_match_among_probes_does_not_open_the_whole_batch():
    """Sampled rows and an unrelated draft: now and then the draft's token is the one sampled. A
    probe hit between misses does not let the batch verify: `min_tries` misses pause it first;
    `min_tries` hits (however many misses in between, fewer than that) do."""
    gate = SpeculationGate(probe_rows=1)
    for accepted in (0, 1, 0):
        assert gate.decide(8) == "probe"
        gate.probed(8, accepted)
    assert gate.pauses == 1 and gate.decide(8) == "plain", "two misses: a pause, one hit or not"
    hits = SpeculationGate(probe_rows=1)
    for accepted in (1, 0, 1):
        hits.probed(8, accepted)
    assert hits.decide(8) == "verify" and hits.pauses == 0


def test_an_unrelated_draft_at_batch_1_after_an_accepted_one_tries_little_in_short_runs():
    """The H200's batch-1 benchmark (19:19): a draft whose drafts are all accepted (repetitive), then the
    same engine with drafts never accepted (t = 4, 0.840x of off), each a 24-token warm-up and 4 runs of
    48 tokens. As it was (no probe at batch 1, 2 tries after each pause, the tokens-per-row average
    carried over from the accepted rows) the second case verifies drafts in its runs; now a row at batch 1
    probes with one draft forward in a plain step, the rows after an idle batch are judged afresh and one
    failed try after a pause is a verdict: no verifying step, a few probes, within 3% of plain decoding.
    The accepted case still verifies nearly every step."""

    def case(gate: SpeculationGate, accepted: int) -> tuple[Tally, float]:
        drive_draft(gate, H200_DRAFT1, runs=1, tokens=24, rows=1, accepted=accepted)  # the warm-up
        tally = drive_draft(gate, H200_DRAFT1, runs=4, tokens=48, rows=1, accepted=accepted)
        plain = plain_seconds(H200_DRAFT1.target, runs=4, tokens=48, first_step_s=0.0)
        return tally, (tally.seconds - 4 * 0.3) / plain  # decode only, as the benchmark times it

    @attrs.define
    class Carried(SpeculationGate):  # as it was: an idle batch kept the tokens-per-row average
        def idle(self, now: float, *, charged: float = 0.0) -> None:
            self.started(now, charged=charged)
            self._last = None

    before = Carried(probe_rows=0, retries=2)
    now = SpeculationGate(probe_rows=1)
    results = {}
    for name, gate in (("before", before), ("now", now)):
        repetitive, _ = case(gate, 4)
        assert repetitive.verifying >= 0.8 * repetitive.steps, (name, repetitive)
        results[name] = case(gate, 0)
    (was, was_cost), (tally, cost) = results["before"], results["now"]
    assert was.verifying >= 2, was
    assert tally.verifying == 0, tally
    assert cost <= 1.03 and cost < was_cost, (cost, was_cost)


def test_after_a_pause_one_failed_try_pauses_again():
    """`min_tries` failed tries make the first verdict; after a pause one does (`retries`): a verifying
    step that emitted one token a row, or a probe whose draft the row did not emit."""
    for probe_rows in (0, 1):
        gate, t = SpeculationGate(probe_rows=probe_rows), 0.0
        pauses = []
        for _ in range(200):
            gate.started(t)
            kind = gate.decide(1)
            if kind == "probe":
                gate.probed(1, 0)
            gate.ran(rows=1, verifying=kind == "verify", tokens=1, start=t, probe=kind == "probe")
            t += 0.01
            pauses.append(gate.pauses)
        tries = [pauses.index(n) for n in (1, 2, 3)]
        assert tries[1] - tries[0] == 16 + 1 and tries[2] - tries[1] == 64 + 1, (probe_rows, tries)


def drive_acceptance(gate: SpeculationGate, p: float, seed: int, *, rounds: int, tokens: int = 48,
                     k: int = 4) -> Tally:
    """n-gram drafts at batch 1 on the H200's step costs (`verify_shapes.py`, 21:09: a plain forward 6.9 ms,
    one of 1 + k = 5 queries 12.2 ms), each drafted token accepted with chance `p` (seeded), a row's
    `Backoff` asked as `Drafts.wants` asks it (only at a step the gate lets verify), one new row a round
    (`benchmarks/spec_gate_model.py` drives the same with bursty acceptance and prints the table)."""
    from mlxd.kv.ngram import Backoff

    device, rng, now, tally = Device(plain_s=0.0069, verify_s=0.0122), random.Random(seed), 0.0, Tally()
    for _ in range(rounds):
        left, carry, backoff = tokens, 0.0, Backoff()
        while left > 0:
            gate.started(now)
            start = now
            verifying = gate.decide(1) == "verify" and backoff.ready()
            if verifying:
                limit = min(k, left - 1)
                accepted = 0
                while accepted < limit and rng.random() < p:
                    accepted += 1
                if limit > 0:
                    backoff.verified(limit, accepted)
                emitted, cost, carry = 1 + accepted, carry + device.verify_s + device.host_s, 0.0
            else:
                emitted, cost, carry = 1, carry + device.host_s, device.plain_s
            gate.ran(rows=1, verifying=verifying, tokens=emitted, start=start)
            now += cost
            left -= emitted
            count_step(tally, verifying=verifying, tokens=emitted, seconds=cost)
        now = end_run(gate, tally, now, carry, 1.0)
    return tally


def test_a_good_draft_is_not_given_up_by_one_unlucky_try_after_a_pause():
    """Drafts accepted at 0.7 a token (i.i.d.) in 40 rounds of 48 tokens, seeds 0-9: a verifying step keeps
    no draft 30% of the time, so with one failed try after a pause a verdict (4818c4c) the gate paused
    again often, each time 4 times longer: 29.3% of steps verified (1.24x of off in this model). Now, where
    verifying last measured faster than plain, two failed tries make the verdict (`paid_retries`), and a
    failed-try pause after a verifying step that gained is no longer than the last (`hold_after_hit`):
    37.0% (1.29x). Drafts never accepted: unchanged, 3 verifying steps in the first 48 tokens (2 tries,
    a 16-step pause, 1 try, a 64-step pause) and 0.6% of all steps (0.996x of off)."""

    def share(make: Callable[[], SpeculationGate], p: float) -> float:
        tallies = [drive_acceptance(make(), p, seed, rounds=40) for seed in range(10)]
        return sum(t.verifying for t in tallies) / sum(t.steps for t in tallies)

    def was() -> SpeculationGate:
        return SpeculationGate(paid_retries=1, hold_after_hit=False)

    assert share(SpeculationGate, 0.7) >= 0.35 > share(was, 0.7)
    for seed in range(10):
        first = drive_acceptance(SpeculationGate(), 0.0, seed, rounds=1)
        assert first.verifying <= 3, (seed, first)
    assert share(SpeculationGate, 0.0) <= 0.01


def drive_wanting(gate: SpeculationGate, *, rows: int, wanting: Callable[[random.Random], int], accepted: int,
                  verify_s: Callable[[int], float], plain_s: float, runs: int = 3, tokens: int = 192, k: int = 4,
                  can_pay: bool = True, seed: int = 0) -> Tally:
    """`runs` runs of `rows` rows, `wanting(rng)` of them wanting to draft k tokens at a step (their lookups
    found something), each verifying row keeping `accepted`; a verifying step of width w costs `verify_s(w)`.
    As `SpeculativeBatch._proposals` asks: the gate (`decide`), then, where rows want to draft, `can_pay`
    over the draft lengths 1, 2, 4 (unless `can_pay` is False: the engine before it). Plain steps are
    pipelined (a verifying step after one first waits for its forward)."""
    from mlxd.kv.ngram import draft_lengths

    rng, now, tally, host = random.Random(seed), 0.0, Tally(), 0.0005
    for _ in range(runs):
        left, carry = tokens, 0.0
        while left > 0:
            gate.started(now)
            start, n = now, wanting(rng)
            tries = [(1 + j, rows + n * j) for j in draft_lengths(k)]
            verifying = gate.decide(rows) == "verify" and n > 0 and (not can_pay or gate.can_pay(rows, tries))
            if verifying:
                emitted, cost, carry = 1 + accepted, carry + verify_s(1 + k) + host, 0.0
                tokens_out = rows + n * accepted
            else:
                emitted, cost, carry, tokens_out = 1, carry + host, plain_s, rows
            gate.ran(rows=rows, verifying=verifying, tokens=tokens_out, start=start, width=1 + k if verifying else 1)
            now += cost
            left -= emitted if n == rows else 1
            count_step(tally, verifying=verifying, tokens=tokens_out, seconds=cost)
        now = end_run(gate, tally, now, carry, 1.0)
    return tally


def test_a_verifying_step_that_could_not_pay_even_if_every_draft_were_accepted_is_not_tried():
    """A CPU at batch 8 (a verifying forward costs about its width in plain ones), text that does not
    repeat: now and then one row's lookup finds something (its drafts all rejected). One row of eight
    drafting 4 tokens emits at most 12 tokens for 5 plain steps' time: it cannot pay at any acceptance.
    The gate times its first tries (a try after a plain step, less the plain step's forward it waited
    for) and refuses such steps from then on (`can_pay`: no pending-token read, no wide forward); the
    gate alone (pauses after failed tries: 16, 64, 256 steps) tries again after each pause. On a GPU at
    batch 1 (5 positions cost about 1.8 plain steps) the same drafts could pay: nothing is refused."""
    cpu = {"rows": 8, "plain_s": 0.030, "verify_s": lambda w: 0.030 * w, "accepted": 0, "runs": 6}

    def one_in_eight(rng: random.Random) -> int:
        return 1 if rng.random() < 0.3 else 0

    alone = drive_wanting(SpeculationGate(), wanting=one_in_eight, can_pay=False, **cpu)  # type: ignore[arg-type]
    gate = SpeculationGate()
    bounded = drive_wanting(gate, wanting=one_in_eight, **cpu)  # type: ignore[arg-type]
    assert alone.verifying >= 6, alone
    assert bounded.verifying <= 3, "tries until two are timed (the first, before a plain step is, is not); none after"
    assert gate.cannot_pay > 0 and gate.withheld >= gate.cannot_pay and gate.costs.seconds(8, 5) == pytest.approx(0.15)
    assert bounded.seconds < alone.seconds
    # Every row drafting, every draft accepted, at batch 8 on the CPU: 40 tokens for 5 plain steps' time
    # against 8 for one: it could pay, so it is tried (the gate's clock judges it).
    gate = SpeculationGate()
    drive_wanting(gate, wanting=lambda rng: 8, **{**cpu, "accepted": 4})  # type: ignore[arg-type]
    assert gate.cannot_pay == 0
    # A GPU at batch 1, every draft accepted: never refused, verifying nearly every step.
    gate = SpeculationGate()
    gpu = drive_wanting(gate, rows=1, wanting=lambda rng: 1, accepted=4, plain_s=0.0069,
                        verify_s=lambda w: 0.0122, runs=3)
    assert gate.cannot_pay == 0 and gpu.verifying >= 0.8 * gpu.steps, gpu


def test_steps_refused_as_unable_to_pay_let_one_through_now_and_then_to_time_it_again():
    """A width timed at a bad moment (a loaded host: 10 plain steps' time) would refuse drafts that
    could pay for good: after `explore_every` refusals at a batch size one step verifies anyway; once
    enough such steps time the width afresh (the median of the last 5 at it), drafts are tried again."""
    gate = SpeculationGate(explore_every=8)
    for _ in range(3):
        gate.costs.record(4, 1, 0.010)
    for _ in range(5):
        gate.costs.record(4, 5, 0.100)
    tries = [(5, 4 + 4 * 4)]  # 4 rows drafting 4 each, all accepted: 20 tokens
    allowed = [gate.can_pay(4, tries) for _ in range(32)]
    assert allowed.count(True) == 4 and allowed[7] and allowed[15], allowed
    assert gate.cannot_pay == 28
    for _ in range(3):  # the width timed again on a quiet host: 2 plain steps' time
        gate.costs.record(4, 5, 0.020)
    assert gate.can_pay(4, tries)
    # Nothing timed at a batch size yet: a step may verify (it is how the costs get timed).
    assert gate.can_pay(2, [(5, 2)]) and SpeculationGate().can_pay(4, tries)


def test_a_width_s_first_slow_step_does_not_refuse_drafts_that_pay():
    """The H200 at batch 1 (2026-12-05): a width's first verifying forward compiles its kernels (half a
    second), its second takes about a plain step. By the median of the two (0.256 s) one row's four
    drafts, all accepted, could not beat 12 ms plain steps, and every n-gram step of a repetitive
    workload was refused. `can_pay` asks what a step could cost at best: the fastest recent one."""
    gate = SpeculationGate()
    for _ in range(3):
        gate.costs.record(1, 1, 0.012)
    gate.costs.record(1, 5, 0.500)  # first forward of width 5: compiles
    gate.costs.record(1, 5, 0.013)
    assert gate.costs.seconds(1, 5) == pytest.approx(0.2565)  # the median DraftLength chooses by
    assert gate.costs.seconds(1, 5, best=True) == pytest.approx(0.013)
    assert gate.can_pay(1, [(5, 5)]) and gate.cannot_pay == 0
    # What cannot pay at its best still cannot: every step at width 5 timed at 10 plain steps.
    for _ in range(5):
        gate.costs.record(1, 5, 0.120)
    assert not gate.can_pay(1, [(5, 5)]) and gate.cannot_pay == 1
