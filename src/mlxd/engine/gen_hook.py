"""The engine-thread half of generation checkpoints (MLX calls; see kv/gen_checkpoint.py).

- `SeededSampler`: a per-request sampler whose RNG state is a value (the key
  after n samples), so a resumed request continues the very same random stream.
- `snapshot_row`: a running row's caches, tokens and pending token, read from
  mlx-lm's `BatchGenerator` between two steps.
- `first_tokens`: the tokens rows' last prompt tokens sampled, read in the step
  that sampled them (mlx-lm hands them out with the next step).
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


class SeededSampler:
    """Temperature / top-p / min-p / top-k sampling from a split chain of one RNG key.

    Each call splits the key: the state after k samples is `key` after k
    splits, and `state()` returns it as two integers (None-free, JSON-able).
    """

    def __init__(self, sampling: Any, key: mx.array) -> None:
        self._top_p = sampling.top_p
        self._top_k = sampling.top_k
        self._min_p = sampling.min_p
        self._inv_temp = 1.0 / sampling.temperature
        self.key = key

    @classmethod
    def seeded(cls, sampling: Any) -> SeededSampler:
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
        return cls(sampling, mx.random.key(seed))

    @classmethod
    def restore(cls, sampling: Any, state: tuple[int, ...]) -> SeededSampler:
        return cls(sampling, mx.array(list(state), dtype=mx.uint32))

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self._top_p < 1.0:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._min_p > 0:
            logprobs = apply_min_p(logprobs, self._min_p)
        if self._top_k > 0:
            logprobs = apply_top_k(logprobs, self._top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self._inv_temp, key=sub)

    def state(self) -> tuple[int, ...]:
        values: list[int] = self.key.tolist()  # type: ignore[assignment]
        return tuple(int(v) for v in values)


@attrs.frozen(eq=False)
class RowSnapshot:
    """One decoding row at a token boundary: caches cover `tokens`; `pending` is sampled, not emitted."""

    caches: list[Any]
    tokens: list[int]
    pending: int


def snapshot_row(generator: Any, uid: int) -> RowSnapshot | None:
    """Read a decoding row out of mlx-lm's BatchGenerator (None if it is not decoding).

    mlx-lm 0.32 keeps the already-sampled next token of each row in its
    generation batch (`_next_tokens`); no public accessor exists, so this is
    the one place that reads it. `extract_cache` returns new arrays, so the
    row keeps decoding in place while the snapshot is written.
    """
    batch = generator._generation_batch
    if uid not in batch.uids or batch._next_tokens is None:
        return None
    i = batch.uids.index(uid)
    caches = batch.extract_cache(i)
    pending = int(batch._next_tokens[i].item())
    return RowSnapshot(caches, list(batch.tokens[i]), pending)


def first_tokens(generator: Any, uids: set[int], *, beside: bool = False) -> dict[int, Any]:
    """The first tokens of rows that entered the generation batch in the step just run, by uid, as mlx-lm's responses
    for them (token, logprobs; no finish reason: the caller checks its stops), read in one wait; a row that may
    generate only one token is left out (it gets it with the step that finishes it). Without `beside`, only where
    every row of the batch is one of them (none was decoding): else empty.

    mlx-lm's generation batch samples a row's first token in the step its prompt ends (`_next_tokens`, evaluated
    asynchronously) and hands it out with the next step, once that step has dispatched the following forward; this
    reads them now: a wait for this step's forwards (beside decoding rows, theirs too, queued first)."""
    batch = generator._generation_batch
    if batch._next_tokens is None or not uids or (not beside and not set(batch.uids) <= uids):
        return {}
    at = [(i, uid) for i, uid in enumerate(batch.uids) if uid in uids and batch.max_tokens[i] > 1]
    if not at:
        return {}
    values: list[Any] = batch._next_tokens.tolist()
    return {uid: type(batch).Response(uid, int(values[i]), batch._next_logprobs[i], None, None, None) for i, uid in at}


def step_inputs(generator: Any) -> dict[int, int]:
    """The token each decoding row feeds the step in progress, by uid, in one read for the batch.

    Called from a logits processor (inside `BatchGenerator.next()`), where mlx-lm's
    generation batch holds them as `_current_tokens`; one read costs one sync for
    every row instead of one per row.
    """
    batch = generator._generation_batch
    if batch._current_tokens is None:
        return {}
    values: list[Any] = batch._current_tokens.tolist()
    return {uid: int(t) for uid, t in zip(batch.uids, values, strict=True)}


def pending_inputs(generator: Any) -> tuple[list[int], Any] | None:
    """The uids of the decoding rows and the array of the tokens they feed the next step, not read.

    Called between steps: mlx-lm's generation batch holds them as `_next_tokens`, evaluated
    asynchronously by the last step (another thread may wait on it; a new array after the
    batch changed may not be evaluated yet, and reading it from another thread fails).
    """
    return _batch_array(generator, "_next_tokens")


def current_inputs(generator: Any) -> tuple[list[int], Any] | None:
    """The step in progress's rows and input tokens array, not read (from a logits processor)."""
    return _batch_array(generator, "_current_tokens")


def _batch_array(generator: Any, name: str) -> tuple[list[int], Any] | None:
    batch = getattr(generator, "_generation_batch", None)
    if batch is None or getattr(batch, name, None) is None or not batch.uids:
        return None
    return list(batch.uids), getattr(batch, name)
