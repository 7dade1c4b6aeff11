"""An overlapped split's engine half: recompute a row's head while its tail is read, then append the tail.

The restore advisor chose (kv/restore_decision.py OVERLAP) to recompute the prompt's tokens before a
block boundary while the prefetcher reads the record's KV from there on into the request's `TailSlot`.
When the row joins, on the engine thread, `recompute_then_append` prefills the head apart on the warm
prefix's caches, in whole steps; waits for a tail not back yet (`tail_wait_s`; never for one whose read
has no memory yet: its landing would be a job queued on this very thread); goes on recomputing if
it is still out, looking for it again after each step; and appends what landed through each layer's
`update_and_fetch` (`kinds.extend`) from wherever the recompute got to. The engine core decides whether
to try (an empty batch), and turns the outcome into notes (a prefill timing, a restore timing or a
restore not taken, the prefix published as a restore's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from mlxd.engine.prefill_slices import prefill_step
from mlxd.kv.file_format import LoadedSnapshot
from mlxd.runtime import device_memory
from mlxd.runtime.kernel.messages import TailRestore

WAIT_SLACK = 1.5  # a late tail is waited for until this times its predicted read (`tail_wait_s`)


@attrs.frozen
class Overlapped:
    """What became of an overlapped split's row: its caches up to `at`, the head's recompute time, and
    the tail that was appended (None: recomputed instead, late or its read failed)."""

    caches: list[Any]
    at: int  # the prompt position the row goes on from
    recomputed_to: int  # where the recompute stopped (the tail's start, or past it when the tail was late)
    head_s: float
    appended: LoadedSnapshot | None = None
    append_s: float = 0.0  # the appended tail's adoption (added to its read for the restore's timing)
    placed: bool = True  # the tail's read had its memory when the head was done (else it was not waited for)
    # When (time.monotonic()) the head was done and the wait for the tail ended: the row's stages
    # ("overlap_head", "overlap_wait"; scheduler.first_token_split's split of its "lend")
    stamps: tuple[tuple[str, float], ...] = ()


def tail_wait_s(tail: TailRestore, head_s: float, head_tokens: int, left_tokens: int) -> float:
    """How long to wait for a tail not back when its head is done: as long as recomputing it would take at
    the head's own rate, as in ski rental (never more than twice the better choice), and no longer than
    `WAIT_SLACK` times its predicted read, counted from when it was asked (a prediction gone wrong then
    costs little more than the recompute)."""
    wait = head_s / max(1, head_tokens) * left_tokens
    if tail.expect_s > 0:
        wait = min(wait, max(0.0, WAIT_SLACK * tail.expect_s - (time.monotonic() - tail.asked_at)))
    return wait


def recompute_then_append(
    model: Any, caches: list[Any], prompt: Sequence[int], usable: int, tail: TailRestore, *, step: int,
    wait_s: float | None = None,
) -> Overlapped:
    """Prefill `prompt[usable:tail.start]` on `caches` (the warm prefix's, or fresh ones), then append the
    tail's KV up to `tail.usable` once it has landed; `wait_s` pins the wait for a late tail."""
    import mlx.core as mx

    from mlxd.kv import kinds

    at, end = usable, tail.usable
    began = time.perf_counter()
    while at < tail.start:
        at = prefill_step(model, caches, prompt, at, tail.start, step)
    head_s = time.perf_counter() - began
    head_at = time.monotonic()
    placed = tail.slot.placed
    if not tail.slot.landed and placed:  # unplaced, its landing may be a job queued behind this one
        tail.slot.wait(tail_wait_s(tail, head_s, at - usable, end - at) if wait_s is None else wait_s)
    stamps = (("overlap_head", head_at), ("overlap_wait", time.monotonic()))
    while at < end and not tail.slot.landed:
        at = prefill_step(model, caches, prompt, at, end, step)
    loaded = tail.slot.loaded if tail.slot.landed and at < end else None
    if loaded is None:
        return Overlapped(caches, at, at, head_s, placed=placed, stamps=stamps)
    t0 = time.perf_counter()
    read = kinds.adopt(loaded, landed=device_memory.to_device)
    if not kinds.extend(caches, read, skip=at - tail.start, upto=end - tail.start):
        return Overlapped(caches, at, at, head_s, placed=placed, stamps=stamps)
    mx.eval([c.state for c in caches])
    return Overlapped(caches, end, at, head_s, loaded, time.perf_counter() - t0, stamps=stamps)
