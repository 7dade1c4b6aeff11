"""A row that ends while others decode stays in mlx-lm's generation batch for a step (`MLXD_CARRY_ROWS`).

When a row of mlx-lm's generation batch ends, `GenerationBatch.next` filters the batch at once: every
layer's keys and values of every row that goes on are gathered into new arrays, before the next forward.
At long contexts that is the batch's whole KV cache copied, and the step after such an end is the slowest
of its run, more so where the copy's buffers are new. Rows admitted together but started a step apart (a lone row's
first token early, the others a step later) end a step apart, so every such batch pays the copy for one
step of decoding left. A dense batch that keeps a finished row pays for reading its keys and values once
more per step instead (docs/benchmarks.md, "a row that ends carried one step").

Here a row that ends inside a step is carried: its response goes out as mlx-lm makes it (its finish, its
caches extracted), then it stays in the batch, its tokens discarded, with no stop sequence, no token limit
and no logits processors, for `CARRY_STEPS` steps (in row-steps: the carried rows' steps add up), then it
is filtered out as mlx-lm would have, one step late. If the rows that go on end meanwhile the emptied
batch is cleared, with no copy at all. It leaves at once where rows join (mlx-lm concatenates the batch
then: the carried rows are not copied along) or prompts wait for room (the carried rows count against
mlx-lm's `completion_batch_size`). Carried longer, the cost grows with each step and the copy comes
anyway; how long pays depends on the device (on the CPU a carried row's step is a large part of a
copy, as measured there), so one step: at most one row-step more than mlx-lm
where the others go on, the whole copy saved where they end next. Speculative batches
(`engine/spec_batch.py`) filter as before.

`install()` patches mlx-lm's `GenerationBatch` and `BatchGenerator._next` once per process when wanted;
`MLXD_CARRY_ROWS=0` keeps mlx-lm's filter at every end.
"""

from __future__ import annotations

import sys
from typing import Any

ENV = "MLXD_CARRY_ROWS"
CARRY_STEPS = 1  # steps a carried row stays, on average over the rows carried at once

_ORIGINAL: dict[str, Any] = {}


class _NeverStops:
    """A carried row's stop-sequence matcher: its tokens are discarded, so nothing ends it again."""

    def advance(self, token: int) -> bool:
        return False


_NEVER = _NeverStops()


def wanted() -> bool:
    """Whether it is on: unset or "" (the default), "1", "on" or "true"; "0", "off" or "false" turn it off.
    Another value is a ValueError (`runtime.config.env_switch`)."""
    from mlxd.runtime.config import env_switch

    return env_switch(ENV, default=True)


def carried(batch: Any) -> frozenset[int]:
    """The uids of the rows a generation batch carries (ended, still in it)."""
    return frozenset(getattr(batch, "_mlxd_carried", ()))


def drop(batch: Any) -> None:
    """Filter a batch's carried rows out now (one gather of the rows that go on; none carried: nothing)."""
    gone = getattr(batch, "_mlxd_carried", None)
    if not gone:
        return
    keep = [i for i, uid in enumerate(batch.uids) if uid not in gone]
    _ORIGINAL["filter"](batch, keep)
    _forget(batch)


def _forget(batch: Any) -> None:
    batch._mlxd_carried = set()
    batch._mlxd_steps = 0


def _carry(batch: Any, ended: list[int]) -> None:
    """Keep the rows at `ended` in the batch with nothing left to end them or to shape their logits."""
    gone: set[int] = batch.__dict__.setdefault("_mlxd_carried", set())
    batch.__dict__.setdefault("_mlxd_steps", 0)
    for i in ended:
        gone.add(batch.uids[i])
        batch.max_tokens[i] = sys.maxsize
        batch._matchers[i] = _NEVER
        if batch.logits_processors:
            batch.logits_processors[i] = []


def _due(batch: Any) -> bool:
    """Whether the carried rows have had their steps (`CARRY_STEPS` each, added up over them)."""
    gone = getattr(batch, "_mlxd_carried", ())
    return bool(gone) and batch._mlxd_steps >= CARRY_STEPS * len(gone)


def install(*, force: bool = False) -> bool:
    """Patch mlx-lm once per process when asked for (`force`: regardless of the environment, for tests and
    benches); returns whether it is patched."""
    from mlx_lm.generate import BatchGenerator, GenerationBatch

    if _ORIGINAL:
        return True
    if not force and not wanted():
        return False
    original_next, original_filter = GenerationBatch.next, GenerationBatch.filter
    original_extend, original_generator_next = GenerationBatch.extend, BatchGenerator._next

    def next_carrying(self: Any) -> Any:
        before = frozenset(getattr(self, "_mlxd_carried", ()))
        self._mlxd_stepping = True
        try:
            responses = original_next(self)
        finally:
            self._mlxd_stepping = False
        if before:  # the carried rows' tokens: nobody's
            responses = [r for r in responses if r.uid not in before]
            self._mlxd_steps += len(before & set(self.uids))  # (set with the first carried row, `_carry`)
            if _due(self):
                drop(self)
        return responses

    def filter_carrying(self: Any, keep: list[int]) -> None:
        gone = getattr(self, "_mlxd_carried", None) or set()
        if all(self.uids[i] in gone for i in keep):  # only carried rows would stay: all out, no copy
            keep = []
        elif getattr(self, "_mlxd_stepping", False):  # rows ended in this step, others go on: carried
            kept = set(keep)
            _carry(self, [i for i in range(len(self.uids)) if i not in kept])
            return
        original_filter(self, keep)
        if gone:
            self._mlxd_carried = {uid for uid in self.uids if uid in gone}
            if not self._mlxd_carried:
                _forget(self)

    def extend_carrying(self: Any, batch: Any) -> None:
        drop(self)  # (mlx-lm copies the batch to concatenate it: the carried rows are not copied along)
        original_extend(self, batch)

    def generator_next(self: Any) -> Any:
        batch = self._generation_batch
        if getattr(batch, "_mlxd_carried", None) and self._unprocessed_sequences:
            # prompts wait: the carried rows must not take the room mlx-lm admits them to
            admits = min(self.prefill_batch_size - len(self._prompt_batch), len(self._unprocessed_sequences))
            if self.completion_batch_size - len(batch) < admits:
                drop(batch)
        return original_generator_next(self)

    GenerationBatch.next = next_carrying
    GenerationBatch.filter = filter_carrying
    GenerationBatch.extend = extend_carrying
    BatchGenerator._next = generator_next
    _ORIGINAL.update(next=original_next, filter=original_filter, extend=original_extend,
                     generator_next=original_generator_next)
    return True


def uninstall() -> None:
    from mlx_lm.generate import BatchGenerator, GenerationBatch

    if _ORIGINAL:
        GenerationBatch.next = _ORIGINAL["next"]
        GenerationBatch.filter = _ORIGINAL["filter"]
        GenerationBatch.extend = _ORIGINAL["extend"]
        BatchGenerator._next = _ORIGINAL["generator_next"]
        _ORIGINAL.clear()
