"""A cost model fitted to a recording's measured TTFTs (`mlxd simulate --fit-ttft-out`).

A recording (`mlxd serve --record-trace`) carries each request's measured
time to first token, its queue time, the tier that served it and how many
tokens that tier held. Misses and RAM hits are prefill: TTFT - queue =
prefill(new, cached), fitted as `fixed + a*n + b*(n*ctx + n*n/2)` (about
least absolute relative error: reweighted least squares); SSD hits add a
restore of the cached tokens' KV bytes, `restore_fixed + bytes / bandwidth`
fitted to what the SSD hits take beyond their prefill when their sizes differ
enough to tell the two apart (else `base`'s bandwidth and the median rest).
The prefill fit is then scaled so its median ratio (measured / predicted) is 1:
on a shared machine a few requests wait far longer than the rest, and the
median, not the mean, is what a p50 prediction needs. The spread itself is
kept: `service_ratios` (each request's measured / fitted time), and a replay
scales each request by one of its quantiles (sim/replay.py `_spread`), so its
p95 carries the recorded machine's tail. The ratios are also kept per tier
(`tier_ratios`, for a tier with at least `MIN_TIER_REQUESTS`): a RAM hit's
fixed costs (lend, insert) or a restore's are not a miss's, and one formula
fitted to all of them leaves each tier off by its own factor; that tier's
median ratio is the factor, and its spread is its own (a miss's few-percent
spread is not a RAM hit's).

Rows prefilling at once share the one engine (one MLX thread runs every
row's chunks in turn), so a request's TTFT past its queue time is its own
work only when it ran alone. Each request's own work is taken as its time
from admission to first token with every moment divided by the number of
requests then between admission and first token (processor sharing, what a
replay of a recorded server models with `--prefill-sharing on`); one
request at a time, it is TTFT - queue.

The first `warmup` requests (default 1) are left out: the first request after
a start pays one-off costs (kernel compilation, the allocator growing) that
are not the server's steady state.

Every term is fitted to medians (the prefill fit's scale, the restore's fixed
part, the admission time), and a tier's spread leaves out its far-out
outliers (Tukey's fence on the log ratios: above Q3 + `fence` x IQR, default
3, and above `floor` x the tier's median, default 2): a one-off (a shape's
first compile, a prefill cut into tiny chunks by a rate that compile skewed)
that came in the calibration run is no tail the next run will have. On the
H200 (15:54 run) it left out 5 of 63 RAM hits at 285-457 ms (the rest
53-97 ms); on the CPU at load 2-10 it leaves out 0-1 of 95-191 a tier (a
loaded machine's tail is continuous, not far out). The floor keeps a tight
tier's tail: where requests spread a few percent, Tukey's fence falls just
above them and would leave out the recurring 1.3-1.4x tail the p95 reads
(docs/benchmarks.md, H100 2026-12-06). `CostModel.outliers` counts them
per tier.

The model describes the recorded server and machine under the recorded load;
`mlxd simulate OTHER --cost-model FILE` then predicts another trace (or other
tier sizes) with it. Pure: no MLX, no trio.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from mlxd.kv.cost_model import CostModel
from mlxd.sim.trace import TraceRequest

_PREFILL_TIERS = ("none", "ram")
_IRLS_ROUNDS = 8
MIN_TIER_REQUESTS = 3  # fewer than this, a tier takes the pooled spread
OUTLIER_FENCE = 3.0  # a tier's spread leaves out ratios above Q3 + this x IQR of the log ratios (Tukey's far out)
OUTLIER_FLOOR = 2.0  # ... and above this x the tier's median ratio: a one-off costs several times a request's work
RESTORE_SIZE_SPREAD = 1.5  # SSD hits' largest / smallest restore for the bandwidth to be fitted, not the probe's
DEFAULT_WARMUP = 1
SOURCE = {"none": "miss", "ram": "ram", "ssd": "ssd", "host": "host"}  # recorded tier -> replay source


def fit_recording(reqs: Sequence[TraceRequest], base: CostModel, *, warmup: int = DEFAULT_WARMUP,
                  tier_warmup: int = 0, fence: float = OUTLIER_FENCE, floor: float = OUTLIER_FLOOR) -> CostModel:
    """`base` with its prefill and restore terms fitted to the requests' measured TTFTs.

    Decode, KV bytes per token and the host tier are kept from `base`. The first `warmup` requests
    (in recorded order) are left out, and the first `tier_warmup` of each tier (`tier_warmup_indices`);
    each tier's spread leaves out its far-out outliers (`far_out`, `fence` 0 = none, `floor` <= 1 = the fence alone).
    Raises ValueError when the recording has no measured prefill to fit.
    """
    if warmup < 0 or tier_warmup < 0:
        raise ValueError(f"warmup must be >= 0, not {min(warmup, tier_warmup)}")
    if fence < 0 or floor < 0:
        raise ValueError(f"the outlier fence and floor must be >= 0, not {min(fence, floor)}")
    timed = [r for r in sorted(reqs, key=lambda r: r.index) if r.ttft_s is not None]
    own = own_service(timed)
    first_use = tier_warmup_indices(timed, tier_warmup)
    measured = [r for r in timed[warmup:] if r.index not in first_use]
    rows = [(r.input_length - (r.cached_tokens or 0), r.cached_tokens or 0, own[r.index], SOURCE["none"]
             if (r.cache_tier or "none") == "none" else SOURCE["ram"])
            for r in measured if (r.cache_tier or "none") in _PREFILL_TIERS]
    rows = [(n, ctx, t, src) for n, ctx, t, src in rows if n > 0 and t > 0]
    if not rows:
        raise ValueError("no measured TTFT of a miss or a RAM hit to fit prefill to")
    fixed, a, b = _fit_prefill([(n, ctx, t) for n, ctx, t, _ in rows])
    model = attrs.evolve(base, model=f"fit:{base.model}", prefill_fixed=fixed, prefill_per_token=a,
                         prefill_per_pair=b)
    scale = _median_ratio([(t, model.prefill_seconds(n, ctx)) for n, ctx, t, _ in rows])
    model = attrs.evolve(model, prefill_fixed=fixed * scale, prefill_per_token=a * scale, prefill_per_pair=b * scale)
    ssd = [(r.input_length - r.cached_tokens, r.cached_tokens, own[r.index]) for r in measured
           if r.cache_tier == "ssd" and r.cached_tokens]
    if ssd:  # what the SSD hits take beyond their prefill: restore_fixed + bytes / bandwidth
        fixed, bandwidth = _fit_restore([(model.kv_bytes(ctx), t - model.prefill_seconds(n, ctx)) for n, ctx, t in ssd],
                                        base.restore_bytes_per_s)
        model = attrs.evolve(model, restore_fixed=fixed, restore_bytes_per_s=bandwidth)
    by_tier: dict[str, list[float]] = {}
    for n, ctx, t, src in rows:
        by_tier.setdefault(src, []).append(t / model.prefill_seconds(n, ctx))
    for n, ctx, t in ssd:
        by_tier.setdefault("ssd", []).append(t / (model.prefill_seconds(n, ctx)
                                                   + model.restore_seconds(model.kv_bytes(ctx))))
    kept = {src: far_out(ratios, fence, floor)[0] for src, ratios in by_tier.items()}
    outliers = {src: len(by_tier[src]) - len(ratios) for src, ratios in sorted(kept.items())
                if len(ratios) < len(by_tier[src])}
    pooled = sorted(x for ratios in kept.values() for x in ratios)
    return attrs.evolve(model, service_ratios=_rounded(pooled), tier_ratios={
        src: _rounded(sorted(ratios)) for src, ratios in sorted(kept.items()) if len(ratios) >= MIN_TIER_REQUESTS
    }, admission_s=admission_by_tier(timed, {r.index for r in measured}), outliers=outliers)


def far_out(ratios: Sequence[float], fence: float = OUTLIER_FENCE,
            floor: float = OUTLIER_FLOOR) -> tuple[list[float], list[float]]:
    """(kept, left out): the ratios above Q3 + `fence` x IQR of their logs (Tukey's far-out fence, on logs
    since a ratio is a factor) and above `floor` x their median are left out (`floor` <= 1: the fence alone);
    with fewer than 4 ratios, or `fence` 0, none are."""
    values = [float(x) for x in ratios]
    if fence <= 0 or len(values) < 4 or min(values) <= 0:
        return values, []
    logs = np.log(values)
    q1, q3 = np.percentile(logs, (25, 75))
    limit = max(q3 + fence * (q3 - q1), float(np.median(logs)) + np.log(max(floor, 1.0)))
    return [x for x, v in zip(values, logs, strict=True) if v <= limit], \
        [x for x, v in zip(values, logs, strict=True) if v > limit]


def admission_by_tier(reqs: Sequence[TraceRequest], keep: set[int]) -> dict[str, float]:
    """Per tier, the median recorded queue time of the requests in `keep` that arrived alone (no other
    request between its arrival and first token then): with every slot free that is no slot wait but the
    server's own work before the request starts, which its TTFT includes and the fitted service leaves out."""
    spans = [(r.t, r.t + r.ttft_s) for r in reqs if r.ttft_s is not None]
    by: dict[str, list[float]] = {}
    for r in reqs:
        if r.index not in keep or r.ttft_s is None or r.queued_s is None:
            continue
        others = sum(a <= r.t < b for a, b in spans) - 1  # itself: a <= t < t + ttft when ttft > 0
        if others <= 0:
            by.setdefault(SOURCE.get(r.cache_tier or "none", r.cache_tier or "miss"), []).append(r.queued_s)
    return {tier: round(float(np.median(v)), 6) for tier, v in sorted(by.items())}


def tier_warmup_indices(reqs: Sequence[TraceRequest], n: int) -> set[int]:
    """The indices of each recorded tier's first `n` timed requests (in recorded order): a tier's first
    use in a process pays one-off costs (a shape's first compile, the first restore's thread and buffers)
    that its later requests do not. `mlxd simulate --ttft-warmup N` leaves the same requests out of its
    percentiles (the replay serves every request in the recorded tier)."""
    seen: dict[str, int] = {}
    out: set[int] = set()
    for r in sorted(reqs, key=lambda r: r.index):
        if r.ttft_s is None:
            continue
        tier = SOURCE.get(r.cache_tier or "none", r.cache_tier or "miss")
        seen[tier] = seen.get(tier, 0) + 1
        if seen[tier] <= n:
            out.add(r.index)
    return out


def _rounded(ratios: Sequence[float]) -> tuple[float, ...]:
    return tuple(round(x, 4) for x in ratios)


def own_service(reqs: Sequence[TraceRequest]) -> dict[int, float]:
    """Each measured request's own work from admission to first token (by index), shared time divided out.

    A request is served from `t + queued_s` to `t + ttft_s`; while k requests are in that stretch
    together, each progresses at 1/k of the engine. Requests without a TTFT are left out.
    """
    spans = {r.index: (r.t + (r.queued_s or 0.0), r.t + r.ttft_s) for r in reqs if r.ttft_s is not None}
    if not spans:
        return {}
    edges = np.unique(np.array([x for span in spans.values() for x in span], dtype=np.float64))
    starts = np.sort([a for a, _ in spans.values()])
    ends = np.sort([b for _, b in spans.values()])
    mids = (edges[:-1] + edges[1:]) / 2
    # requests in service in each stretch between consecutive edges
    rows = np.searchsorted(starts, mids, side="right") - np.searchsorted(ends, mids, side="right")
    own_rate = np.where(rows > 0, 1.0 / np.maximum(rows, 1), 0.0)
    cumulative = np.concatenate([[0.0], np.cumsum(np.diff(edges) * own_rate)])  # own work done by each edge
    return {i: max(float(np.interp(b, edges, cumulative) - np.interp(a, edges, cumulative)), 1e-6)
            for i, (a, b) in spans.items()}


def _fit_restore(rows: Sequence[tuple[int, float]], base_bytes_per_s: float) -> tuple[float, float]:
    """(restore_fixed, restore_bytes_per_s) for SSD hits' (bytes, seconds beyond their prefill). With sizes
    that differ enough (the largest >= RESTORE_SIZE_SPREAD x the smallest, 3+ hits) both are fitted
    (least relative error, non-negative), as the server's restore costs; otherwise, or when the fit finds
    no per-byte cost, the bandwidth is `base_bytes_per_s` (the recorded probe's) and the fixed part the
    median of what is left."""
    sizes = [b for b, _ in rows]
    if len(rows) >= 3 and min(sizes) > 0 and max(sizes) >= RESTORE_SIZE_SPREAD * min(sizes):
        x = np.array([(1.0, float(b)) for b, _ in rows], dtype=np.float64)
        t = np.array([max(s, 1e-6) for _, s in rows], dtype=np.float64)
        w = 1.0 / t
        for _ in range(_IRLS_ROUNDS):
            coef = _nonnegative_fit(x, t, w)
            w = 1.0 / (t * np.maximum(np.abs(x @ np.array(coef) - t) / t, 0.02))
        fixed, per_byte = _nonnegative_fit(x, t, w)
        if per_byte > 0:
            return fixed, 1.0 / per_byte
    extra = [s - b / base_bytes_per_s for b, s in rows]
    return max(0.0, float(np.median(extra))), base_bytes_per_s


def _fit_prefill(rows: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(fixed, a, b) >= 0, least absolute relative error (approximately; non-negative subset fits)."""
    x = np.array([(1.0, n, n * ctx + n * n / 2.0) for n, ctx, _ in rows], dtype=np.float64)
    t = np.array([s for _, _, s in rows], dtype=np.float64)
    w = 1.0 / t
    for _ in range(_IRLS_ROUNDS):  # toward least absolute relative error: a slow outlier weighs little
        coef = _nonnegative_fit(x, t, w)
        w = 1.0 / (t * np.maximum(np.abs(x @ np.array(coef) - t) / t, 0.02))
    fixed, a, b = _nonnegative_fit(x, t, w)
    return fixed, a, b


def _nonnegative_fit(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, ...]:
    """Least squares of `x @ coef ~ t` weighted by `w`, every coefficient >= 0 (the best of the column subsets
    whose unconstrained fit is non-negative)."""
    import itertools

    rows, width = t.size, x.shape[1]
    best: tuple[float, list[float]] | None = None
    for size in range(width, 0, -1):
        for cols in itertools.combinations(range(width), size):
            if rows < size:
                continue
            coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], t * w, rcond=None)
            if (coef < 0).any():
                continue
            full = [0.0] * width
            for c, v in zip(cols, coef, strict=True):
                full[c] = float(v)
            err = float(np.sum(((x @ np.array(full)) - t) ** 2 * w**2))
            if best is None or err < best[0] - 1e-12:
                best = (err, full)
    if best is None:
        raise ValueError("no non-negative fit")
    return tuple(best[1])


def _median_ratio(pairs: Sequence[tuple[float, float]]) -> float:
    ratios = [m / p for m, p in pairs if p > 0]
    return float(np.median(ratios)) if ratios else 1.0
