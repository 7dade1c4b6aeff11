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

from mlxd.kv.ngram import Backoff, SpeculationGate

PLAIN_S, VERIFY_S, HOST_S, K = 0.0069, 0.0122, 0.0005, 4


@attrs.define
class Result:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    verifying: int = 0
    proposed: int = 0
    accepted: int = 0


Acceptance = Callable[[int], float]  # a token position -> the chance its draft is accepted


def iid(p: float) -> Callable[[random.Random, int], Acceptance]:
    return lambda rng, n: (lambda pos: p)


def spans(good: float, bad: float, p_good: float, p_bad: float) -> Callable[[random.Random, int], Acceptance]:
    """Alternating spans of geometric lengths (means `good`, `bad` tokens), starting in either."""

    def make(rng: random.Random, n: int) -> Acceptance:
        chances, state = [], rng.random() < good / (good + bad)
        while len(chances) < n + K + 1:
            mean = good if state else bad
            length = 1 + int(rng.expovariate(1 / mean))
            chances += [p_good if state else p_bad] * length
            state = not state
        return lambda pos: chances[pos]

    return make


def run(gate: SpeculationGate, workload: Callable[[random.Random, int], Acceptance], rng: random.Random, *,
        rounds: int, tokens: int, gap_s: float = 1.0) -> Result:
    res, now = Result(), 0.0
    for _ in range(rounds):
        chance = workload(rng, tokens)
        backoff = Backoff()  # a new row each round
        pos, carry = 0, 0.0
        while pos < tokens:
            gate.started(now)
            start = now
            verifying = gate.decide(1) == "verify" and backoff.ready()
            if verifying:
                limit = min(K, tokens - pos - 1)
                accepted = 0
                while accepted < limit and rng.random() < chance(pos + 1 + accepted):
                    accepted += 1
                if limit > 0:
                    backoff.verified(limit, accepted)
                    res.proposed += limit
                    res.accepted += accepted
                emitted = 1 + accepted
                cost, carry = carry + VERIFY_S + HOST_S, 0.0  # waits for the plain forward in flight, and its own
            else:
                emitted = 1
                cost, carry = carry + HOST_S, PLAIN_S  # pipelined: its forward lands in the next step
            gate.ran(rows=1, verifying=verifying, tokens=emitted, start=start)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
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
