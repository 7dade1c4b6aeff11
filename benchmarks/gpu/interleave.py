"""Decode levels with every server up at once, interleaved in short rounds (issue 28): the pure part.

A host that drifts by 10-20% over a minute (the H200 at 20:21 UTC: mlx_lm itself 688 -> 540 tok/s at 8 streams
between two repeats) hides a 1.0x goal when each server's decodes run one server after another. Here a round
visits every server at each level, runs a few seconds apart, and each server's ratio to the reference (mlx_lm)
is taken within the round; the goal is the median of those per-round ratios, with its IQR, beside a control:
the reference against itself (a second reference run in the same schedule).

Schedules of one level of one round (`slots`):
- interleaved: every server once and the control slot once, in the orders of a Williams design (a Latin
  square balanced for carry-over): over a cycle of rounds (n slots: n rounds, 2n where n is odd) each slot
  takes each position equally often AND follows every other slot equally often. A plain rotation keeps who
  follows whom fixed (mlx_lm~ after mlxd_host_ssd in every round at 21:07 UTC), so whatever one server leaves
  behind (an SSD write's tail, a cache insert after the last token) would always land on the same neighbour;
- bracket: ref, A, ref, B, ref, control, ref, the arms rotated each round: each arm (and the control) between
  two reference runs (a linear drift cancels), ratio to their mean.

No mlx, trio or HTTP here: unit-tested in tests/test_decode_interleave.py.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

CONTROL_SUFFIX = "~"  # the reference's control slot: "mlx_lm~" is mlx_lm again
SCHEDULES = ("interleaved", "bracket")


def control_of(ref: str) -> str:
    return ref + CONTROL_SUFFIX


def server_of(slot: str) -> str:
    """The server a slot runs on (the control slot is the reference's server)."""
    return slot.removesuffix(CONTROL_SUFFIX)


def slots(servers: Sequence[str], ref: str, r: int, mode: str) -> list[str]:
    """Round `r`'s runs of one level, in order (see the module's docstring)."""
    if ref not in servers:
        raise ValueError(f"the reference {ref!r} is not among the servers {list(servers)}")
    if mode == "interleaved":
        arms = [*servers, control_of(ref)]
        rows = williams(len(arms))
        return [arms[i] for i in rows[r % len(rows)]]
    if mode == "bracket":
        arms = [s for s in servers if s != ref] + [control_of(ref)]
        k = r % len(arms)
        return [x for arm in arms[k:] + arms[:k] for x in (ref, arm)] + [ref]
    raise ValueError(f"unknown schedule {mode!r}; choose from {SCHEDULES}")


def williams(n: int) -> list[list[int]]:
    """Orders of 0..n-1, one a round: each index in each position equally often and right after every other
    index equally often (a Williams design: n rows for even n, the n rows and their mirrors for odd n)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + k) % n for x in first] for k in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


@attrs.frozen
class Run:
    """One decode: round, level (streams), its position in the level's runs, the slot, tok/s (None: failed)."""

    round: int
    streams: int
    at: int
    slot: str
    tok_s: float | None


def _mean(xs: Iterable[float | None]) -> float | None:
    got = [x for x in xs if x is not None and x > 0]
    return sum(got) / len(got) if got else None


def round_ratios(runs: Sequence[Run], ref: str, mode: str) -> dict[int, dict[str, list[float | None]]]:
    """Per level, per slot (the reference's own excluded, its control included): the ratio in each round,
    in round order; None where the run or its reference failed. interleaved: ÷ the round's reference run;
    bracket: ÷ the mean of the reference runs right before and after."""
    out: dict[int, dict[str, list[float | None]]] = {}
    by_level_round: dict[tuple[int, int], list[Run]] = {}
    for run in runs:
        by_level_round.setdefault((run.streams, run.round), []).append(run)
    for (streams, _), group in sorted(by_level_round.items()):
        group = sorted(group, key=lambda x: x.at)
        level = out.setdefault(streams, {})
        for j, run in enumerate(group):
            if run.slot == ref:
                continue
            if mode == "interleaved":
                base = _mean(x.tok_s for x in group if x.slot == ref)
            elif mode == "bracket":
                near = [group[i] for i in (j - 1, j + 1) if 0 <= i < len(group) and group[i].slot == ref]
                base = _mean(x.tok_s for x in near)
            else:
                raise ValueError(f"unknown schedule {mode!r}; choose from {SCHEDULES}")
            value = run.tok_s / base if run.tok_s is not None and run.tok_s > 0 and base else None
            level.setdefault(run.slot, []).append(value)
    return out


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and interquartile range of per-round ratios (the failed ones left out), and the values."""
    got = [x for x in values if x is not None]
    if not got:
        return {"n": 0, "median": None, "iqr": None, "values": list(values)}
    q = statistics.quantiles(got, n=4, method="inclusive") if len(got) > 1 else [got[0]] * 3
    return {"n": len(got), "median": round(statistics.median(got), 4), "iqr": [round(q[0], 4), round(q[2], 4)],
            "values": [None if x is None else round(x, 4) for x in values]}


def summarize(runs: Sequence[Run], ref: str, mode: str) -> dict[str, Any]:
    """Per level: each slot's tok/s (median over rounds) and runs, each arm's ratio to the reference
    (median + IQR of the per-round ratios), the control's (what the reference differs from itself by here),
    and each arm's per-round ratio ÷ the control's of the same round."""
    ratios = round_ratios(runs, ref, mode)
    levels: dict[str, Any] = {}
    for streams in sorted({r.streams for r in runs}):
        mine = [r for r in runs if r.streams == streams]
        level: dict[str, Any] = {"rounds": len({r.round for r in mine}), "tok_s": {}, "ratio_to_" + ref: {}}
        for slot in dict.fromkeys(r.slot for r in mine):
            rates = [r.tok_s for r in mine if r.slot == slot and r.tok_s is not None]
            level["tok_s"][slot] = round(statistics.median(rates), 2) if rates else None
        per = ratios.get(streams, {})
        control = per.get(control_of(ref))
        for slot, values in per.items():
            entry = spread(values)
            if control is not None and slot != control_of(ref):
                entry["vs_control"] = spread([a / c if a is not None and c else None
                                              for a, c in zip(values, control, strict=False)])
            level["ratio_to_" + ref][slot] = entry
        levels[str(streams)] = level
    return {"schedule": mode, "reference": ref, "control": control_of(ref), "levels": levels}


def ratio_of(summary: dict[str, Any], streams: int | str, arm: str, other: str | None = None) -> float | None:
    """The median per-round ratio of `arm` to the reference at a level; with `other`, of `arm` to `other`
    (the median of arm ÷ other per round, both measured against the same reference)."""
    level = (summary.get("levels") or {}).get(str(streams)) or {}
    table = level.get("ratio_to_" + summary.get("reference", "")) or {}
    if other is None:
        return (table.get(arm) or {}).get("median")
    a, b = (table.get(arm) or {}).get("values") or [], (table.get(other) or {}).get("values") or []
    return spread([x / y if x is not None and y else None for x, y in zip(a, b, strict=False)])["median"]
