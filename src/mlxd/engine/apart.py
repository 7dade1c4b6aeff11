"""A lone long prompt prefilled on its own caches, one chunk a step, before it joins the batch.

A prompt of a whole prefill step or more that joins an empty batch (`PrefillSlicer.alone`) does not go
through mlx-lm's batch for its prompt: each of the batch's steps costs more per chunk than the same chunk
run on the row's own caches (`benchmarks/gpu/probe_apart_vs_batch.py`). The engine core keeps one
`PendingApart` and, once per step, runs its next chunk (`advance`: the slicer's size for a row prefilling
alone, aligned as the batch path aligns a lone row's chunks). A request that arrives meanwhile joins the
batch (a short one prefilled apart at once, as beside a row prefilling in the batch) and decodes beside the
remaining chunks; no chunk runs in a step where a row of the batch joined or waits for its first token, as the
slicer keeps such steps short in the batch. A cancel drops it between two chunks. After its last chunk
the core admits it to the batch from its last token, as a short prompt prefilled apart is admitted. What it
carries is what that admission needs, gathered when it joined.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs

from mlxd.engine.ops import RowStart
from mlxd.engine.prefill_slices import prefill_step

if TYPE_CHECKING:
    from mlxd.engine.features import Sampling


@attrs.define
class PendingApart:
    """The prompt prefilling apart: its start, where its next chunk starts, and its admission's inputs."""

    start: RowStart
    sampling: Sampling  # built (and checked) when it joined
    caches: list[Any]
    at: int  # the position its next chunk starts from
    usable: int  # cached tokens it started on
    tier: str
    recomputed: int  # of them, tokens an overlapped split recomputed
    stages: list[tuple[str, float]]  # joined, an overlap's stages, lent
    began: float  # perf_counter when its prefill began
    shared: bool = False  # a chunk ran while rows were in the batch: its whole prefill was not timed alone

    @property
    def request_id(self) -> str:
        return self.start.request.request_id

    @property
    def end(self) -> int:
        """Where its prefill ends: its last token goes through the batch, for its first token."""
        return len(self.start.request.prompt) - 1

    @property
    def done(self) -> bool:
        return self.at >= self.end

    def advance(self, model: Any, size: int, *, alone: bool) -> tuple[int, float]:
        """Prefill its next chunk of about `size` tokens and evaluate it (engine thread); the chunk's tokens and
        seconds. `alone`: no row is in the batch (else the chunk's time is not its own)."""
        self.shared = self.shared or not alone
        t0 = time.perf_counter()
        upto = prefill_step(model, self.caches, self.start.request.prompt, self.at, self.end, size)
        chunk, self.at = upto - self.at, upto
        return chunk, time.perf_counter() - t0
