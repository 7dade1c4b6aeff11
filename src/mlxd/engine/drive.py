"""Drive an `EngineCore` by hand: rows from their start to their end, outside the actors.

Tests and benchmarks that exercise the engine core alone (speculation,
adapters, images) step it themselves; `run_rows` is that loop, once. It runs
on the calling thread, which must be the thread that loaded the core.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from mlxd.engine.ops import RowStart, StepOps
from mlxd.runtime.kernel.messages import (
    GenerationFinished,
    GenerationRequest,
    PublishPrefix,
    TokenGenerated,
)


@attrs.define
class RowsRun:
    """What rows run to their end emitted, per request id, and when."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[float | None]]
    top_logprobs: dict[str, list[tuple[tuple[int, float], ...]]]
    reasons: dict[str, str]  # each row's finish reason
    notes: list[PublishPrefix]  # the checkpoints the rows published, in order
    first_token_s: dict[str, float]  # seconds from the first step to each row's first token
    all_started_s: float  # seconds to the step after which every row had a token
    decoded_after: int  # tokens emitted after that step
    seconds: float  # the whole run
    # Process CPU seconds (every thread: the engine's, MLX's, a GPU driver's) over the same span as
    # `decode_tok_s`: from the step after which every row had a token to the last.
    decode_cpu_s: float = 0.0

    def decode_tok_s(self) -> float:
        """Tokens per second of the rows together, once every row had its first token."""
        return self.decoded_after / (self.seconds - self.all_started_s)

    def decode_cpu_ms_per_token(self) -> float:
        """Process CPU milliseconds per token over the span of `decode_tok_s` (0 when none was emitted)."""
        return 1000 * self.decode_cpu_s / self.decoded_after if self.decoded_after else 0.0


def run_rows(core: Any, starts: Sequence[RowStart | GenerationRequest]) -> RowsRun:
    """Step `core` until every row of `starts` has finished; a rejected row raises RuntimeError."""
    rows = [s if isinstance(s, RowStart) else RowStart(request=s) for s in starts]
    ids = [r.request.request_id for r in rows]
    run = RowsRun(
        tokens={i: [] for i in ids}, logprobs={i: [] for i in ids}, top_logprobs={i: [] for i in ids},
        reasons={}, notes=[], first_token_s={}, all_started_s=0.0, decoded_after=0, seconds=0.0,
    )
    ops, began, all_started = StepOps(starts=tuple(rows)), time.perf_counter(), None
    cpu_started = 0.0
    while len(run.reasons) < len(rows):
        result = core.step(ops)
        ops = StepOps()
        if result.rejected:
            raise RuntimeError(f"rows rejected: {result.rejected}")
        run.notes += [n for n in result.notes if isinstance(n, PublishPrefix)]
        for emit in result.emits:
            event, rid = emit.event, emit.request_id
            if isinstance(event, TokenGenerated):
                run.tokens[rid].append(event.token)
                run.logprobs[rid].append(event.logprob)
                run.top_logprobs[rid].append(event.top_logprobs)
                run.first_token_s.setdefault(rid, time.perf_counter() - began)
                run.decoded_after += all_started is not None
            elif isinstance(event, GenerationFinished):
                run.reasons[rid] = event.reason
        if all_started is None and all(run.tokens.values()):
            all_started = time.perf_counter() - began
            cpu_started = time.process_time()
    run.seconds = time.perf_counter() - began
    run.decode_cpu_s = time.process_time() - cpu_started if all_started is not None else 0.0
    run.all_started_s = run.seconds if all_started is None else all_started
    return run
