"""The speculation gate's decisions on a synthetic acceptance process, on the H200's step costs (issue 23).

No model, no GPU: the engine's own `SpeculationGate` (kv/ngram.py) and a row's `Backoff` are driven the way
`SpeculativeBatch.next` drives them, at batch 1 with n-gram drafts (no probe: drafts cost nothing), on a
fake clock whose step costs are the H200's (`verify_shapes.py`, 21:09: a plain forward 6.9 ms, a forward of
1 + K = 5 queries 12.2 ms, 0.5 ms of host work a step; a plain step is pipelined, a verifying one waits for
its own forward and for the plain forward before it). Each drafted token is accepted with probability p,
i.i.d. (`iid`), or by spans as edits make them (`edit`: spans of about 40 tokens the draft knows, p = 0.95,
between spans of about 12 it does not, p = 0.05; `churn`: 12 and 12, p = 0.9 / 0.1). A run is the H200
benchmark's `spec1` arm: `--rounds` rounds of `--tokens` tokens at batch 1, the gate's state carried across
rounds as in one engine (the batch runs empty between them).

Prints, for each gate variant and workload, decode tokens/s over off (never drafting), the share of steps
that verified, and the acceptance rate /stats would show (accepted / proposed), averaged over `--seeds` seeds:

    PYTHONPATH=src python benchmarks/spec_gate_model.py [--seeds 40] [--json benchmarks/results/...json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable

import attrs

from mlxd.kv.ngram import Backoff, SpeculationGate, draft_lengths

PLAIN_S, VERIFY_S, HOST_S, K = 0.0069, 0.0122, 0.0005, 4
DRAFT_S = 0.0015  # one forward of a small draft model at batch 1 on the H200 (test_speculation_gate's figure)

# A target forward over the whole KV buffer at batch 1, by queries (verify_shapes.py, H200, 21:09, median ms):
# 1 query is a plain decode step; 5 a K = 4 verify; 17 and 64 a draft's catch-ups. 2-4 queries were not
# measured: taken as 5's (the same kernel; the step from 1 to 2+ queries is the kernel change).
H200_VERIFY = ((1, 0.0069), (2, 0.0122), (5, 0.0122), (17, 0.0111), (64, 0.0103))


def cost_curve(points: tuple[tuple[int, float], ...], slope_s: float = 0.0) -> Callable[[int], float]:
    """Seconds of a target forward of `q` queries: linear between the measured points, flat past the
    last; `slope_s` adds that much per query past 5 (a cost that grows with the width, e.g. a CPU's)."""

    def cost(q: int) -> float:
        if q <= points[0][0]:
            base = points[0][1]
        elif q >= points[-1][0]:
            base = points[-1][1]
        else:
            for (q0, c0), (q1, c1) in zip(points, points[1:], strict=False):
                if q0 <= q <= q1:
                    base = c0 + (c1 - c0) * (q - q0) / (q1 - q0)
                    break
        return base + slope_s * max(0, q - 5)

    return cost


FLAT = cost_curve(H200_VERIFY)


class Length:
    """A row's draft length: `next()` before a try, `verified(proposed, accepted)` after it."""

    def next(self) -> int:
        raise NotImplementedError

    def verified(self, proposed: int, accepted: int) -> None:
        pass


@attrs.define
class Fixed(Length):
    k: int = K

    def next(self) -> int:
        return self.k


@attrs.define
class Steps(Length):
    """Grow by `up` after a fully accepted draft, shrink by `down` after a rejection, within [1, most]
    (transformers' assisted generation's "heuristic" schedule is up 2, down 1)."""

    most: int = 16
    k: int = K
    up: int = 2
    down: int = 1

    def next(self) -> int:
        return self.k

    def verified(self, proposed: int, accepted: int) -> None:
        if accepted >= proposed:
            if proposed >= self.k:  # a try cut short (max_tokens) says nothing about a longer one
                self.k = min(self.most, self.k + self.up)
        else:
            self.k = max(1, self.k - self.down)


@attrs.define
class Doubling(Length):
    """Double after a fully accepted draft; after a rejection, what was accepted plus one."""

    most: int = 16
    k: int = K

    def next(self) -> int:
        return self.k

    def verified(self, proposed: int, accepted: int) -> None:
        if accepted >= proposed:
            if proposed >= self.k:
                self.k = min(self.most, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)


@attrs.define
class Priced(Length):
    """The length with the most tokens per second (`next`): per-token acceptance `a` estimated from the
    row's tries (accepted drafts over accepted + rejections, decayed by `decay` a try, a prior of one each),
    expected tokens (1 - a^(k+1)) / (1 - a) over the try's cost, `verify(1 + k) + k * draft_s`."""

    verify: Callable[[int], float]
    draft_s: float = 0.0
    most: int = 16
    decay: float = 0.8
    hits: float = 1.0
    misses: float = 1.0

    def next(self) -> int:
        """As the engine's `DraftLength.choose` (kv/ngram.py): the longest of 1, 2, 4 ... `most` within 10%
        of the best rate, `most` at a row's first try, with the model's own costs (the engine times its
        steps instead)."""
        if self.hits == 1.0 and self.misses == 1.0:  # not verified yet
            return self.most
        a = self.hits / (self.hits + self.misses)
        rates = [(k, sum(a ** i for i in range(k + 1)) / (self.verify(1 + k) + k * self.draft_s + HOST_S))
                 for k in draft_lengths(self.most)]
        best = max(rate for _, rate in rates)
        return max(k for k, rate in rates if rate * 1.1 >= best)

    def verified(self, proposed: int, accepted: int) -> None:
        self.hits = self.decay * self.hits + accepted
        self.misses = self.decay * self.misses + (accepted < proposed)


@attrs.define
class Result:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    verifying: int = 0
    proposed: int = 0
    accepted: int = 0
    lengths: int = 0  # draft lengths asked for, summed over tries (÷ tries: the mean length)
    tries: int = 0


Acceptance = Callable[[int], float]  # a token position -> the chance its draft is accepted


def iid(p: float) -> Callable[[random.Random, int], Acceptance]:
    return lambda rng, n: (lambda pos: p)


def spans(good: float, bad: float, p_good: float, p_bad: float) -> Callable[[random.Random, int], Acceptance]:
    """Alternating spans of geometric lengths (means `good`, `bad` tokens), starting in either."""

    def make(rng: random.Random, n: int) -> Acceptance:
        chances, state = [], rng.random() < good / (good + bad)
        while len(chances) < n + K + 1:  # positions past the round's last token are never read
            mean = good if state else bad
            length = 1 + int(rng.expovariate(1 / mean))
            chances += [p_good if state else p_bad] * length
            state = not state
        return lambda pos: chances[pos]

    return make


def run(gate: SpeculationGate, workload: Callable[[random.Random, int], Acceptance], rng: random.Random, *,
        rounds: int, tokens: int, gap_s: float = 1.0, length: Callable[[], Length] = Fixed,
        verify: Callable[[int], float] = FLAT, draft_s: float = 0.0) -> Result:
    """`draft_s` > 0: a draft model, each draft token one draft forward of that cost, and the gate probes
    (`probe_rows` = 1: a plain step plus one draft forward, compared with the token the row emits)."""
    res, now = Result(), 0.0
    for _ in range(rounds):
        chance = workload(rng, tokens)
        backoff = Backoff()  # a new row each round
        lengths = length()
        pos, carry = 0, 0.0
        while pos < tokens:
            gate.started(now)
            start = now
            kind = gate.decide(1)
            verifying = kind == "verify" and backoff.ready()
            probe = kind == "probe"
            if verifying:
                k = lengths.next()
                limit = min(k, tokens - pos - 1)
                accepted = 0
                while accepted < limit and rng.random() < chance(pos + 1 + accepted):
                    accepted += 1
                if limit > 0:
                    backoff.verified(limit, accepted)
                    lengths.verified(limit, accepted)
                    res.proposed += limit
                    res.accepted += accepted
                    res.lengths += k
                    res.tries += 1
                emitted = 1 + accepted
                # waits for the plain forward in flight, and its own (1 + limit queries), after the drafts
                cost, carry = carry + verify(1 + max(limit, 1)) + limit * draft_s + HOST_S, 0.0
            else:
                emitted = 1
                cost, carry = carry + HOST_S + (draft_s if probe else 0.0), PLAIN_S  # pipelined
            if probe:  # the row's draft of its next token, compared with the token it emits
                gate.probed(1, int(rng.random() < chance(pos + 1)))
            gate.ran(rows=1, verifying=verifying, tokens=emitted, start=start, probe=probe)
            now += cost
            pos += emitted
            res.steps += 1
            res.verifying += verifying
            res.tokens += emitted
            res.seconds += cost
        now += carry
        res.seconds += carry
        gate.idle(now)
        now += gap_s
    return res


VARIANTS: dict[str, Callable[[], SpeculationGate]] = {
    "retries=1 (4818c4c)": lambda: SpeculationGate(paid_retries=1, hold_after_hit=False),
    "retries=2 if paid": lambda: SpeculationGate(paid_retries=2, hold_after_hit=False),
    "no growth after a hit": lambda: SpeculationGate(paid_retries=1, hold_after_hit=True),
    "both": lambda: SpeculationGate(paid_retries=2, hold_after_hit=True),
    "retries=2 (before)": lambda: SpeculationGate(retries=2, paid_retries=2, hold_after_hit=False),
}

WORKLOADS: dict[str, Callable[[random.Random, int], Acceptance]] = {
    **{f"iid p={p}": iid(p) for p in (0.0, 0.3, 0.5, 0.7, 0.9)},
    "edit 40/12 .95/.05": spans(40, 12, 0.95, 0.05),
    "churn 12/12 .9/.1": spans(12, 12, 0.9, 0.1),
}


LENGTHS: dict[str, Callable[[Callable[[int], float], float], Callable[[], Length]]] = {
    "fixed 4": lambda v, d: (lambda: Fixed(4)),
    "fixed 8": lambda v, d: (lambda: Fixed(8)),
    "fixed 16": lambda v, d: (lambda: Fixed(16)),
    "+2/-1 to 16": lambda v, d: (lambda: Steps(16)),
    "x2/a+1 to 16": lambda v, d: (lambda: Doubling(16)),
    "priced to 16": lambda v, d: (lambda: Priced(v, d, 16)),
}

COSTS: dict[str, tuple[Callable[[int], float], float]] = {  # verify cost by queries, a draft token's cost
    "n-gram, H200 (flat)": (FLAT, 0.0),
    "draft model 1.5 ms, H200 (flat)": (FLAT, DRAFT_S),
    "n-gram, +0.25 ms a query past 5": (cost_curve(H200_VERIFY, 0.00025), 0.0),
}


def lengths_table(args: argparse.Namespace) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    plain = args.tokens * (PLAIN_S + HOST_S)
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for cname, (verify, draft_s) in COSTS.items():
        print(f"\n{cname}: verify ms by queries 2/5/9/17/64 = "
              + "/".join(f"{verify(q) * 1e3:.1f}" for q in (2, 5, 9, 17, 64))
              + (f", a draft forward {draft_s * 1e3:.1f} ms (the gate probes)" if draft_s else ""))
        print("ratio vs off (verifying share of steps, /stats acceptance, mean draft length)")
        print(f"{'workload':22}" + "".join(f"{v:>27}" for v in LENGTHS))
        out[cname] = {}
        for wname, workload in WORKLOADS.items():
            row = {}
            for lname, make in LENGTHS.items():
                ratios, shares, acc, mean_k = [], [], [], []
                for seed in range(args.seeds):
                    gate = SpeculationGate(probe_rows=1 if draft_s else 0)
                    res = run(gate, workload, random.Random(seed), rounds=args.rounds, tokens=args.tokens,
                              length=make(verify, draft_s), verify=verify, draft_s=draft_s)
                    ratios.append(args.rounds * plain / res.seconds)
                    shares.append(res.verifying / res.steps)
                    acc.append(res.accepted / res.proposed if res.proposed else 0.0)
                    mean_k.append(res.lengths / res.tries if res.tries else 0.0)
                row[lname] = {"ratio": statistics.mean(ratios), "ratio_min": min(ratios),
                              "verifying": statistics.mean(shares), "acceptance": statistics.mean(acc),
                              "mean_k": statistics.mean(mean_k)}
            out[cname][wname] = row
            print(f"{wname:22}" + "".join(
                f"{c['ratio']:>7.3f} ({c['verifying']:4.0%}, {c['acceptance']:.2f}, {c['mean_k']:4.1f})"
                for c in row.values()))
        print("every step verifying (no gate, no back-off), fixed k: " + ", ".join(
            f"p={p}: " + "/".join(
                f"{sum(p ** i for i in range(k + 1)) / ((verify(1 + k) + k * draft_s + HOST_S) / (PLAIN_S + HOST_S)):.2f}"
                for k in (4, 8, 16)) for p in (0.5, 0.7, 0.9, 1.0)) + " (k = 4/8/16)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", choices=("lengths", "gates"), default="lengths",
                    help="lengths: fixed vs adaptive draft lengths; gates: the gate's variants at K = 4")
    args = ap.parse_args()
    if args.table == "lengths":
        lengths = lengths_table(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"costs": {"plain_s": PLAIN_S, "host_s": HOST_S, "verify_s_by_queries": H200_VERIFY,
                                     "draft_s": DRAFT_S}, "args": vars(args), "lengths": lengths}, f, indent=1)
        return
    plain = args.tokens * (PLAIN_S + HOST_S)  # a round never drafting
    table: dict[str, dict[str, dict[str, float]]] = {}
    print(f"H200 costs: plain {PLAIN_S * 1e3:.1f} ms, verify (K={K}) {VERIFY_S * 1e3:.1f} ms, host {HOST_S * 1e3:.1f} ms;"
          f" batch 1, {args.rounds} rounds x {args.tokens} tokens, {args.seeds} seeds")
    print("ratio vs off (verifying share of steps, acceptance rate)")
    print(f"{'workload':22}" + "".join(f"{v:>24}" for v in VARIANTS))
    for wname, workload in WORKLOADS.items():
        row = {}
        for vname, make in VARIANTS.items():
            ratios, shares, acc = [], [], []
            for seed in range(args.seeds):
                res = run(make(), workload, random.Random(seed), rounds=args.rounds, tokens=args.tokens)
                ratios.append(args.rounds * plain / res.seconds)
                shares.append(res.verifying / res.steps)
                acc.append(res.accepted / res.proposed if res.proposed else 0.0)
            row[vname] = {"ratio": statistics.mean(ratios), "ratio_min": min(ratios),
                          "verifying": statistics.mean(shares), "acceptance": statistics.mean(acc)}
        table[wname] = row
        print(f"{wname:22}" + "".join(
            f"{c['ratio']:>9.3f} ({c['verifying']:4.0%}, {c['acceptance']:.2f})" for c in row.values()))
    # The bound: every step verifying (no gate), the same costs.
    print("every step verifying (no gate, no back-off): "
          + ", ".join(f"p={p}: {(1 + sum(p ** i for i in range(1, K + 1))) / ((VERIFY_S + HOST_S) / (PLAIN_S + HOST_S)):.2f}x"
                      for p in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": {"plain_s": PLAIN_S, "verify_s": VERIFY_S, "host_s": HOST_S, "k": K},
                       "args": vars(args), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
