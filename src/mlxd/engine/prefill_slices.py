"""How many prompt tokens the prefilling rows process in the next step: long prefills in short slices.

mlx-lm's `BatchGenerator` runs, per `next()`, one decode step for the decoding
rows and one chunk of `prefill_step_size` tokens for every prefilling row,
right-padded to the longest chunk. A short prompt that arrives while a long
one is prefilling waits for the chunk in flight, then is padded to the long
row's chunk: behind a 6k-token prompt its first token came many chunks late.

Here each step's chunk is sized so it takes about `slice_s` (from the prefill
rate measured on chunks that ran alone), so a newcomer never waits long for
the chunk in flight; and on a step where newcomers join rows already in the
batch, the chunk is cut to the newcomers' remaining prompt, so they finish
their prefill in that step without padding while the long row moves on by
as much; while a row that has prefilled waits for its first token (the
next step or two), the others advance by one token a step.

A slice bounds a chunk's prefill *work*, not its fixed cost: a step also pays
a per-step overhead (the host's side of the forward pass, syncs) that no
chunk size removes. Sizing by the whole measured rate (tokens ÷ seconds)
shrank the chunk whenever that overhead approached the slice, and the next
measurement, dominated by it, shrank it again: on the H200 a 16k-token
prompt fell to 16-token chunks and took 58-69 s instead of ~1 s. So the
slicer fits each step's time as `fixed + per_token × n` over its recent
chunks of different sizes and sizes the next one as `slice ÷ per_token`
(before two sizes were measured, by the whole rate, which overestimates the
per-token cost and so errs small; the fit then grows it). Where that whole
rate would ask again for the one size measured, the next chunk tries twice it,
so the fit gets its second size: a first chunk slowed by a kernel compile once
gave a rate that asked for MIN_CHUNK, every later chunk was MIN_CHUNK, no
second size ever came, and a 16k-token prompt took 65 s on the H200
(2026-12-04 13:50). Not where twice would pass the step size: no fit asks for
a smaller chunk than the whole rate does, so there another size only spends a
chunk, on CUDA one of a shape the warm-up did not build (half the step was
tried there until 2026-12-07: each process's first long prompt took two
1,024-token chunks). One slow chunk
(a shape's first compile, a GC pause) must not shrink the next ones either:
the per-token cost is at most the fastest recent chunk's whole time per
token (its fixed cost included), so that bounds both the fitted slope and the
fallback, and the slope is the median of the pairwise slopes (Theil-Sen) of
chunks at least 1.5x apart in size, not least squares. Nor may a run of short
chunks (128-token turns: nearly all fixed cost) make the next long prompt go
in short chunks: the latest chunk of each power-of-two size class is kept
after the window moves on, and the chunk is the larger of what the recent
chunks ask for and what they ask for with those. On the H200
(sim_ttft-h200-20261204-155620.json, both runs) a RAM hit's first 127-token
chunk (150 ms) after a miss's 75 ms asked for 32-token chunks, and the next
1,024-token miss took 1.16 s in 32 steps instead of ~0.08 s; RAM hits went
in 16-token chunks (0.29-0.46 s instead of ~0.07 s), and each wave's first
misses after a round of 128-token turns took 0.25-0.9 s, in one run and not
the other. A short prompt
(a few slices) that joins while another row is part way through its prompt
is prefilled on its own, before it joins: in the batch it would be padded to
the long row's chunk and attend over its context. A long prompt that
joins an empty batch (a whole prefill step or more) is prefilled on its own
caches too, a slice a step (`alone`): stepped through mlx-lm's batch each
chunk cost more than the same chunk on the row's own caches (on an H100:
`benchmarks/gpu/probe_apart_vs_batch.py`, docs/benchmarks.md), and a
request that arrives meanwhile joins the batch at the next step, as it
would beside a batch prefill. Pure and deterministic given its inputs (the
engine core calls it).

A row prefilling alone takes its chunk cut to end on a multiple of the
chunk's size (`aligned`): on CUDA a chunk's attention runs a cuDNN graph
built per exact (queries, keys) shape, ~60-150 ms for each new one on the
H100 against a 17-31 ms chunk (benchmarks/gpu/probe_first_prefill.py,
2026-12-05 17:43). Chunks counted from wherever a prompt's cached prefix
ended (3 tokens of a chat template's header), or resized part way through a
prompt, had key lengths no earlier prompt had: the same 16k prompt took
271-1,077 ms to recompute on the server where the same model's warm plain
prefill takes ~200. Aligned, every chunk but a prompt's first and last has
a key length every other prompt had too; with its keys passed contiguous
(model/suffix_attention.py: the graph is keyed by their strides as well),
its whole shape (H100 18:36: a 16k prompt after a 3-token prefix 793 ms ->
217 ms, a warm prompt from 0 193).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import attrs

# Smallest chunk: below this a step's fixed costs outweigh its prefill work.
MIN_CHUNK = 16
# A short prompt joining while another row is part way through its prompt is prefilled on its own
# (the others wait that long) when it fits this many slices.
APART_SLICES = 4
# ... and always when it has at most this many new tokens (a question, a short chat turn).
APART_MIN = 64
# Chunks the per-token cost is fitted over (the most recent; the context grows as a prompt is prefilled).
FIT_SAMPLES = 8
# Two chunks' sizes must differ this much for their slope to count (127 vs 128 tokens: noise over one token).
PAIR_SPREAD = 1.5
# A chunk's time below this is no measurement (perf_counter's resolution is far finer than any step).
MIN_SECONDS = 1e-9


@attrs.define
class PrefillSlicer:
    """`chunk(...)`: tokens per prefilling row in the next step; `measured(...)` feeds it the prefill rate."""

    slice_s: float  # 0 = off: every chunk is the whole prefill step size
    rate: float = 0.0  # prompt tokens per second, the fastest recent chunk that ran alone (0 = not measured yet)
    _samples: collections.deque[tuple[int, float]] = attrs.field(
        init=False, factory=lambda: collections.deque(maxlen=FIT_SAMPLES)
    )
    # The latest chunk of each power-of-two size class (by bit length), kept after the window moves on.
    _by_class: dict[int, tuple[int, float]] = attrs.field(init=False, factory=dict)
    # The last fit: (step size, rate, slice, samples seen) -> its size; a prefilling step asks again each step.
    _fitted: tuple[tuple[int, float, float, int], int] | None = attrs.field(init=False, default=None)
    _seen: int = attrs.field(init=False, default=0)  # samples taken so far

    def measured(self, tokens: int, seconds: float) -> None:
        # (a timing no clock gives is ignored: below MIN_SECONDS a chunk's cost per token could be 0.0
        # and the slice divided by it; an infinite one, inf sizes)
        if tokens > 0 and MIN_SECONDS <= seconds < math.inf:
            self._samples.append((tokens, seconds))
            self._seen += 1
            self._by_class[tokens.bit_length()] = (tokens, seconds)
            self.rate = max(n / t for n, t in self._samples)

    def _sized(self, step_size: int) -> int:
        """The next chunk: by the recent chunks, or, larger, by them with the latest chunk of each size
        class they lack (a 1,023-token miss's chunk, measured before a run of 127-token turns: those alone
        are nearly all fixed cost and ask for 128-token chunks, 8 steps for the next miss where 1 does).
        Only a larger size is taken from the older chunks: one of them slowed by a compile must not pin
        the chunks small, and a size they suggest wrongly is measured afresh at once."""
        recent = list(self._samples)
        if not recent:  # a rate given, nothing measured
            return min(step_size, max(MIN_CHUNK, _power_of_two_below(int(self.slice_s * self.rate))))
        key = (step_size, self.rate, self.slice_s, self._seen)
        if self._fitted is not None and self._fitted[0] == key:  # nothing new measured: the same fit
            return self._fitted[1]
        size = self._size_from(recent, step_size)
        classes = {n.bit_length() for n, _ in recent}
        older = [x for c, x in self._by_class.items() if c not in classes]
        if older:
            size = max(size, self._size_from(recent + older, step_size))
        self._fitted = (key, size)
        return size

    def _size_from(self, samples: list[tuple[int, float]], step_size: int) -> int:
        """The chunk `samples` ask for: `slice_s` of the per-token cost (`seconds_per_token`); without
        a fitted slope, when that asks again for about the one size measured (every chunk within
        PAIR_SPREAD of it), twice it for the fit, unless twice would pass the step size."""
        slope = _slope(samples)
        size = min(step_size, max(MIN_CHUNK, _power_of_two_below(int(self.slice_s / seconds_per_token(samples, slope)))))
        # (not at the largest size the step allows: no fit asks for less than the whole rate does, and more is
        # not allowed, so another size would be a chunk spent for nothing; on CUDA a new attention graph the
        # warm-up did not build, which half the step size was: docs/benchmarks.md, H100 2026-12-07 07:15)
        if slope is None and size * 2 <= step_size and all(size < PAIR_SPREAD * n and n < PAIR_SPREAD * size
                                                            for n, _ in samples):
            size *= 2
        return size

    def apart(self, new_tokens: int, *, others_prefilling: bool) -> bool:
        """Whether a joining row's prompt is prefilled on its own, before it joins (it fits a few slices)."""
        if self.slice_s <= 0 or self.rate <= 0 or not others_prefilling or new_tokens <= 0:
            return False
        return new_tokens <= max(APART_MIN, self.rate * self.slice_s * APART_SLICES)

    def alone(self, new_tokens: int, step_size: int) -> bool:
        """Whether a prompt joining an empty batch is prefilled on its own caches a slice a step before it joins:
        with slices on, when it has a whole prefill step or more (where the batch's steps cost per chunk)."""
        return self.slice_s > 0 and new_tokens >= step_size > 0

    def chunk(self, step_size: int, *, newcomers: Sequence[int], shared: bool, awaiting: bool = False) -> int:
        """`newcomers`: prompt tokens left of rows joining this step; `shared`: other rows are in the batch;
        `awaiting`: a row has prefilled its prompt and waits for its first token (one or two steps)."""
        if self.slice_s <= 0:
            return step_size
        if shared and awaiting and not newcomers:
            return 1  # those steps stay as short as a decode step: the first token is not held up
        size = step_size if self.rate <= 0 else self._sized(step_size)
        if shared and newcomers:
            size = min(
                size, _power_of_two_above(max(newcomers))
            )  # newcomers finish their prompt in this step
        return min(step_size, max(MIN_CHUNK, size))


def aligned(chunk: int, position: int, left: int) -> int:
    """The next chunk of a prompt at `position` with `left` tokens to prefill: `chunk` cut to end on a multiple
    of itself, so its key length (the context after it) is one every prompt chunked at this size has too;
    what is left when it fits in `chunk` (a prompt's last chunk ends where the prompt does, a new key length
    wherever it starts: cutting it would only add a step). Never 0 while tokens are left."""
    return left if left <= chunk else chunk - position % chunk


def prefill_step(model: Any, caches: list[Any], prompt: Sequence[int], at: int, until: int, step: int) -> int:
    """Prefill the next `aligned` chunk of `prompt[at:until]` on a row's own caches, outside the batch, and
    evaluate it (engine thread); the position after it."""
    import mlx.core as mx

    upto = at + aligned(step, at, until - at)
    model(mx.array([list(prompt[at:upto])]), cache=caches)
    mx.eval([c.state for c in caches])
    return upto


def seconds_per_token(samples: list[tuple[int, float]], slope: float | None) -> float:
    """A chunk's cost per prompt token less the step's fixed cost: `slope` (the fitted one), at most the
    fastest chunk's whole time per token (its fixed cost included, so no per-token cost is above it: a
    chunk slowed by a compile cannot raise it); without a slope, that bound itself (errs small)."""
    bound = min(t / n for n, t in samples)
    return bound if slope is None else min(slope, bound)


def _slope(samples: list[tuple[int, float]]) -> float | None:
    """The median of the pairwise slopes of chunks whose sizes differ by PAIR_SPREAD or more (Theil-Sen:
    one outlier moves it by one rank, not by its size); None without such a pair or with a non-positive
    median."""
    slopes = sorted((t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(samples)
                    for n2, t2 in samples[i + 1 :] if max(n1, n2) >= PAIR_SPREAD * min(n1, n2))
    if not slopes:
        return None
    mid = len(slopes) // 2
    slope = slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
    return slope if slope > 0 else None


# Chunks are powers of two: a few shapes for the kernels, and the same chunks for the same measured speed.
def _power_of_two_below(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _power_of_two_above(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
