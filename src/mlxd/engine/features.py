"""Per-row features: the small parts a row carries, called by the core at fixed points of a step.

A feature never adds a branch to the loop. The core calls, for every part a row
carries:

- `join(row, joining)` before the row enters the batch: add a sampler, logits
  processors (penalties today; token masks for structured output next), stop
  tokens;
- `segment(row, core, out)` when a prefill chunk of its prompt ends;
- `token(row, token, core, out)` after each token it generates that does not end it;
- `leave(row, ending, core, out)` when it leaves the batch, by a finish reason,
  a client's stop string ("stop") or a cancel ("cancelled").

Today's features: `Sampling` (every row: sampler, penalties, logprobs),
`StopTokens` (every row), `Constrained` (structured output: a token mask from
the request's grammar), `PromptCheckpoints` (with the prompt cache: the
prompt-boundary and final checkpoints) and `GenerationCheckpoints`
(`--generation-checkpoint N`: resumable in-flight generations).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mlxd.runtime.kernel.messages import (
    CheckpointGeneration,
    GenerationAbandoned,
    GenerationCompleted,
    SamplingParams,
    TokenGenerated,
)
from mlxd.runtime.logging import get_logger

if TYPE_CHECKING:
    from mlxd.engine.core import EngineCore, Row, StepOut
    from mlxd.structured.matcher import Matcher

log = get_logger("mlxd.engine")


@attrs.define
class Joining:
    """What a row brings to the batch, filled in by its features before the generator sees it."""

    sampler: Any = None  # None: the batch's shared greedy sampler
    processors: list[Any] = attrs.Factory(list)  # mlx-lm logits processors, applied in order
    stop_tokens: set[int] = attrs.Factory(set)


@attrs.frozen
class Ending:
    """Why a row leaves, and what the generator handed back with a natural finish."""

    reason: str  # a finish reason ("stop", "length"), or "cancelled"
    requested: bool = False  # ended by ops (a client's stop string or a cancel), not by the generator
    caches: Any = None  # the row's caches on a natural finish (mlx-lm's `prompt_cache`)
    tokens: tuple[int, ...] = ()  # every token those caches hold


class RowFeature(Protocol):
    def join(self, row: Row, joining: Joining) -> None: ...
    def segment(self, row: Row, core: EngineCore, out: StepOut) -> None: ...
    def token(self, row: Row, token: int, core: EngineCore, out: StepOut) -> None: ...
    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None: ...


class Feature:
    """A feature that does nothing at any point; subclasses override the points they use."""

    def join(self, row: Row, joining: Joining) -> None:
        pass

    def segment(self, row: Row, core: EngineCore, out: StepOut) -> None:
        pass

    def token(self, row: Row, token: int, core: EngineCore, out: StepOut) -> None:
        pass

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        pass


@attrs.define
class Sampling(Feature):
    """Temperature sampling with its own RNG (a value: checkpoints save it), penalties, logprobs."""

    params: SamplingParams
    sampler: Any = None  # gen_hook.SeededSampler, or None for greedy

    @classmethod
    def of(cls, params: SamplingParams, rng_state: tuple[int, ...] | None = None) -> Sampling:
        if params.temperature <= 0:
            return cls(params)
        from mlxd.engine.gen_hook import SeededSampler

        if rng_state is not None:  # a resumed generation continues its random stream
            return cls(params, SeededSampler.restore(params, rng_state))
        return cls(params, SeededSampler.seeded(params))

    def join(self, row: Row, joining: Joining) -> None:
        from mlx_lm.sample_utils import make_logits_processors

        s = self.params
        joining.sampler = self.sampler
        joining.processors += make_logits_processors(
            logit_bias=dict(s.logit_bias) or None,
            repetition_penalty=s.repetition_penalty,
            repetition_context_size=s.repetition_context_size,
            presence_penalty=s.presence_penalty or None,
            frequency_penalty=s.frequency_penalty or None,
        )

    def rng_state(self) -> tuple[int, ...] | None:
        return self.sampler.state() if self.sampler is not None else None

    def event(self, response: Any) -> TokenGenerated:
        """The token event, with its logprobs when the request asked for them."""
        import mlx.core as mx

        s = self.params
        if not s.logprobs and s.top_logprobs == 0:
            return TokenGenerated(response.token)
        lp = response.logprobs
        chosen = float(lp[response.token].item())
        top: tuple[tuple[int, float], ...] = ()
        if s.top_logprobs > 0:
            k = min(s.top_logprobs, lp.shape[-1])
            idx = mx.argpartition(-lp, kth=k - 1)[:k]
            ids: list[Any] = idx.tolist()  # type: ignore[assignment]
            vals: list[Any] = lp[idx].tolist()  # type: ignore[assignment]
            pairs = sorted(zip(ids, vals, strict=True), key=lambda p: -p[1])
            top = tuple((int(t), float(v)) for t, v in pairs)
        return TokenGenerated(response.token, chosen, top)


@attrs.frozen
class StopTokens(Feature):
    """The model's end tokens and the request's stop token ids end the row as "stop".

    Stop *strings* are matched on text by whoever decodes it (the HTTP layer):
    it sends `StopGeneration`, and the core ends the row with the next step's `stops`.
    """

    ids: frozenset[int]

    def join(self, row: Row, joining: Joining) -> None:
        joining.stop_tokens |= self.ids


@attrs.define
class StepInputs:
    """The tokens the decoding rows feed the step in progress, read once per step for all of them."""

    read: Any  # () -> {uid: token} (gen_hook.step_inputs over the core's generator)
    _tokens: dict[int, int] | None = None

    def clear(self) -> None:
        """A new generator step starts: its inputs are not read yet."""
        self._tokens = None

    def token(self, uid: int) -> int:
        if self._tokens is None:
            self._tokens = self.read()
        return self._tokens[uid]


@attrs.define
class Constrained(Feature):
    """Structured output: before each sampled token, every token the grammar refuses is masked out.

    The matcher follows the row's own tokens: at each step it consumes the token the
    row feeds that step (read once for the whole batch: `StepInputs`), or, at a resumed
    row's first step, every token the checkpoint holds, so a resume needs no saved
    state. End tokens are allowed only where the grammar is complete.
    """

    matcher: Matcher
    prompt_tokens: int  # the row's prompt: what the processor's context holds before generation
    inputs: StepInputs
    consumed: int = 0
    drafted: int = 0  # --speculative: drafts being verified this step (masked position by position)

    def join(self, row: Row, joining: Joining) -> None:
        joining.processors.append(lambda tokens, logits: self.mask(row, tokens, logits))

    def admit(self, tokens: Any, pending: int, drafts: list[int]) -> list[int]:
        """--speculative: the drafts up to the first one the grammar refuses after the pending token.

        Only when the matcher has caught up with the row (not at a resumed row's first step).
        The step then masks each position with the matcher after the tokens before it, and
        `verified` rolls the refused drafts back.
        """
        if len(tokens) - self.prompt_tokens != self.consumed or not drafts:
            return []
        probe = self.matcher.fork()
        admitted = probe.consume_all([pending, *drafts]) - 1
        self.drafted = max(admitted, 0)
        return drafts[: self.drafted]

    def verified(self, accepted: int) -> None:
        """The step kept `accepted` of this row's drafts: forget the rest."""
        rejected, self.drafted = self.drafted - accepted, 0
        if rejected > 0:
            self.matcher.rollback(rejected)
            self.consumed -= rejected

    def mask(self, row: Row, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        # Start this step's forward pass before waiting for the last token: the matcher's
        # CPU work below then overlaps with it.
        mx.async_eval(logits)
        generated = int(tokens.shape[0]) - self.prompt_tokens
        if generated == self.consumed + 1 and not self.drafted:
            self._consume([self.inputs.token(row.uid)])
        elif generated > self.consumed:  # a resumed row's first step: replay what it holds
            self._consume(tokens[self.prompt_tokens + self.consumed:].tolist())
        allowed = mx.array(self.matcher.allowed_mask())
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if not self.matcher.consume(int(t)):
                raise RuntimeError(f"token {t} broke the row's {self.matcher.constraint.kind} constraint")
        self.consumed += len(tokens)


@attrs.define
class PromptCheckpoints(Feature):
    """With the prompt cache: a checkpoint where the prompt ends and one where the row ends."""

    at_boundary: bool  # a prompt-boundary checkpoint is worth taking (enough new prompt tokens)
    cuts: int = 0  # prefill segments before the boundary's that end at a pinned breakpoint prefix

    def segment(self, row: Row, core: EngineCore, out: StepOut) -> None:
        if self.cuts > 0:  # a pinned breakpoint's prefix: keep a checkpoint that ends exactly there
            self.cuts -= 1
            req = row.start.request
            core.checkpoint(out, "boundary", lambda: core.extract(row.uid), req.namespace, req.session)
        elif self.at_boundary:
            self.at_boundary = False
            req = row.start.request
            core.checkpoint(out, "boundary", lambda: core.extract(row.uid), req.namespace, req.session)

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        req = row.start.request
        if not ending.requested:
            if ending.caches is not None:
                core.checkpoint(out, "final", lambda: (ending.caches, list(ending.tokens)), req.namespace, req.session)
        elif row.generated > 0:
            # Ended early (a stop string, a disconnect): every token the KV holds, a few of which
            # may lie past where a stop string cut the text; a later lookup lends only what it shares.
            core.checkpoint(out, "final", lambda: core.extract(row.uid), req.namespace, req.session)


@attrs.define
class GenerationCheckpoints(Feature):
    """`--generation-checkpoint N` (seed §5.7): every N tokens a resumable snapshot for the SSD.

    A finished row drops its checkpoint; a cancelled one leaves it for a retry to resume.
    """

    key: str
    every: int

    def token(self, row: Row, token: int, core: EngineCore, out: StepOut) -> None:
        if self.every <= 0 or row.generated % self.every:
            return
        t0 = time.perf_counter()
        try:
            out.notes.append(self._snapshot(row, core))
        except Exception:  # a checkpoint is an optimization: never fail the generation for it
            log.exception("engine.generation_checkpoint_failed")
        core.counters.checkpoint_s += time.perf_counter() - t0  # engine-thread time taken from decode

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        end = GenerationAbandoned if ending.reason == "cancelled" else GenerationCompleted
        out.notes.append(end(self.key, row.start.request.request_id))

    def _snapshot(self, row: Row, core: EngineCore) -> CheckpointGeneration:
        from mlxd.engine.gen_hook import snapshot_row
        from mlxd.kv import kinds
        from mlxd.kv.gen_checkpoint import GenerationRecord

        req = row.start.request
        snap = snapshot_row(core.generator, row.uid)
        if snap is None:
            raise RuntimeError("row is not decoding")
        record = GenerationRecord(
            key=self.key, prompt_tokens=len(req.prompt), emitted=snap.tokens[len(req.prompt):],
            pending=snap.pending, rng_key=row.sampling.rng_state(),
        )
        meta = attrs.evolve(core.store_identity.meta(snap.tokens, req.namespace), generation=record.as_doc())
        plan = kinds.plan_snapshot(snap.caches, meta=meta)
        return CheckpointGeneration(self.key, req.request_id, plan, len(record.emitted))
