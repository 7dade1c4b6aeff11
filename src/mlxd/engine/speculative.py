"""Speculative decoding (`--speculative ngram`): the per-row part and what the verifying batch asks of it.

A row that speculates carries a `Speculation` part: a draft source (a
prompt-lookup index over its own tokens, kv/ngram.py, or a draft model with its
own KV, engine/draft.py, whose checkpoints go to the prompt cache beside the
target's: `DraftCheckpoints`) and a back-off. At a step, the verifying batch
(engine/spec_batch.py) asks `Drafts` which rows want to draft, hands each its
tokens and the pending one, and verifies every row's drafts in one target
forward; then it reports what was accepted. A constrained row's drafts are cut
at the first token its grammar refuses, and the refused ones are rolled back
from its matcher after verification. Rows without drafts decode in the same step.

No MLX here: importing this module loads nothing native.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mlxd.engine.features import Constrained, Ending, Feature
from mlxd.engine.ops import SpeculationStats
from mlxd.kv.media import is_media_id
from mlxd.kv.ngram import Backoff, DraftCounters, DraftLength, PromptLookup, SpeculationGate
from mlxd.runtime.logging import get_logger

if TYPE_CHECKING:
    from mlxd.engine.core import EngineCore, Row, StepOut

log = get_logger("mlxd.engine")


class DraftSource(Protocol):
    def propose(self, tokens: Sequence[int], pending: int, k: int) -> list[int]: ...


class CheckpointedSource(DraftSource, Protocol):
    """A draft source with KV of its own (engine/draft.py's ModelDrafts)."""

    computed: int  # prefix tokens its first step computed itself (0: all came from the cache, or not run yet)

    def checkpoint(self, tokens: Sequence[int] | None = None, *, complete: bool = False) -> tuple[list[Any], list[int]]: ...


@attrs.define
class DraftPrefixCounts:
    """A draft model's prefix at each row's first step: tokens taken from the cache, tokens computed."""

    reused: int = 0
    recomputed: int = 0
    # Seconds the draft spent feeding a row alone (its prefix at its first draft, a catch-up on steps
    # it sat out, the row's end): drafting's one-off work, which the engine's gate is charged with.
    alone_s: float = 0.0


def draft_namespace(namespace: str, tag: str) -> str:
    """Where a draft model's cache entries live: beside the target's namespace, one per draft model."""
    return f"{namespace}#draft-{tag}"


@attrs.define
class DraftCheckpoints:
    """A draft model's KV checkpoints, published when the target publishes its own (accepted tokens only).

    `boundary`: the target checkpoints the prompt boundary; the draft does too, after its first
    step (where it has computed the prompt), unless the whole prompt came from the cache.
    """

    source: CheckpointedSource
    namespace: str
    boundary: bool

    def token(self, row: Row, core: EngineCore, out: StepOut) -> None:
        if self.boundary and self.source.computed > 0:
            self.boundary = False
            prompt = row.start.request.prompt
            core.checkpoint(out, "boundary", lambda: self.source.checkpoint(prompt), self.namespace,
                            row.start.request.session)

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        """The row's end: the draft's KV over every token the target's final checkpoint holds (the
        draft first reads those it has not: emitted after its last proposal, or while it sat out)."""
        session = row.start.request.session
        if not ending.requested:
            if ending.caches is not None:
                tokens: Sequence[int] | None = ending.tokens
                core.checkpoint(out, "final", lambda: self.source.checkpoint(tokens, complete=True), self.namespace,
                                session)
        elif row.generated > 0:
            held = _row_tokens(core, row.uid)  # still in the generator (ended by ops: removed after)
            core.checkpoint(out, "final", lambda: self.source.checkpoint(held, complete=held is not None),
                            self.namespace, session)


def _row_tokens(core: EngineCore, uid: int) -> list[int] | None:
    """The tokens a decoding row's target KV holds (mlx-lm's generation batch), None if it is not decoding."""
    batch = getattr(core.generator, "_generation_batch", None)
    uids = getattr(batch, "uids", None)
    if batch is None or uids is None or uid not in uids:
        return None
    return list(batch.tokens[uids.index(uid)])


@attrs.define
class NgramDrafts:
    """`--speculative ngram`: drafts copied from where the row's last n-gram occurred before."""

    lookup: PromptLookup = attrs.Factory(PromptLookup)

    def propose(self, tokens: Sequence[int], pending: int, k: int) -> list[int]:
        self.lookup.observe(tokens)
        if len(self.lookup) == len(tokens):  # the pending token is indexed once (the next step's tokens hold it)
            self.lookup.append(pending)
        return self.lookup.propose(k)

    def may_propose(self, tokens: Sequence[int]) -> bool:
        """Whether a proposal after `tokens` and a pending token not read yet could find anything."""
        if len(self.lookup) > len(tokens):  # the pending token is indexed already (a step that did read it)
            return True
        self.lookup.observe(tokens)
        return self.lookup.may_propose_after()


@attrs.define
class Speculation(Feature):
    """A row that drafts up to `k` tokens a step from its source (n-grams or a draft model) and backs off;
    how many at a step, its `length` chooses (`Drafts.lengths`)."""

    k: int
    source: DraftSource = attrs.Factory(NgramDrafts)
    backoff: Backoff = attrs.Factory(Backoff)
    counters: DraftCounters = attrs.Factory(DraftCounters)
    checkpoints: DraftCheckpoints | None = None  # a draft model's KV in the prompt cache (with the target's)
    length: DraftLength = attrs.field(default=attrs.Factory(lambda self: DraftLength(self.k), takes_self=True))

    def propose(self, tokens: Sequence[int], pending: int, limit: int) -> list[int]:
        return self.drafted(self.source.propose(tokens, pending, min(self.k, limit)))

    def drafted(self, drafts: list[int]) -> list[int]:
        """What the source proposed, cut before an image span key; nothing found backs off."""
        for i, t in enumerate(drafts):  # an image's span keys (kv/media.py) are no vocabulary tokens
            if is_media_id(t):
                drafts = drafts[:i]
                break
        if not drafts:
            self.backoff.nothing_found()
        return drafts

    def verified(self, proposed: int, accepted: int) -> None:
        self.counters.add(proposed, accepted)
        self.backoff.verified(proposed, accepted)
        self.length.verified(proposed, accepted)

    def token(self, row: Row, token: int, core: EngineCore, out: StepOut) -> None:
        if self.checkpoints is not None:
            self.checkpoints.token(row, core, out)

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        if self.checkpoints is not None:
            self.checkpoints.leave(row, ending, core, out)


@attrs.define
class Drafts:
    """What the verifying batch asks of the rows, by generator uid; counts for the whole engine."""

    rows: Mapping[int, Row]
    counters: DraftCounters = attrs.Factory(DraftCounters)
    gate: SpeculationGate = attrs.Factory(SpeculationGate)
    off_reason: str | None = None  # set at load when the model's caches cannot roll back
    prefix: DraftPrefixCounts = attrs.Factory(DraftPrefixCounts)  # --draft-model: each row's first step
    # Each row's draft length chosen from what verifying costs (`DraftLength`); False: always `k` (as before
    # issue 23's adaptive lengths; MLXD_DRAFT_LENGTH=fixed).
    lengths: bool = True
    # Whether a verifying step first asks `SpeculationGate.can_pay` (n-gram, whose drafts cost nothing to make). Not
    # with a draft model: its forwards in the timed step vary with the host's load, and its price is checked at load
    # (`ceiling`) and its drafts by probes; a loaded CI host refused drafts accepted at 1.0 there.
    bounded: bool = True

    def stats(self) -> SpeculationStats:
        c = self.counters
        return SpeculationStats(
            active=self.off_reason is None, off_reason=self.off_reason, proposed=c.proposed, accepted=c.accepted,
            acceptance_rate=round(c.acceptance_rate, 4), tokens_per_forward=round(c.tokens_per_forward, 4),
            verify_steps=c.verify_steps, verified_rows=c.verified_rows, constrained_rows=c.constrained_rows,
            grammar_refused=c.grammar_refused,
            gate_pauses=self.gate.pauses, decode_steps=self.gate.steps, gate_withheld_steps=self.gate.withheld,
            draft_prefix_reused=self.prefix.reused, draft_prefix_recomputed=self.prefix.recomputed,
            draft_steps=c.draft_steps, draft_rows=c.draft_rows, gate_probes=c.probes,
            gate_probe_accepted=c.probe_accepted, gate_cannot_pay_steps=self.gate.cannot_pay,
            pending_reads=c.pending_reads,
        )

    def _part(self, uid: int) -> Speculation | None:
        row = self.rows.get(uid)
        if row is None:
            return None
        for part in row.features:
            if isinstance(part, Speculation):
                return part
        return None

    def wants(self, uid: int, tokens: Sequence[int] | None = None) -> bool:
        """Whether this row drafts at this step (no sync needed to know). With the row's `tokens`
        (on the host: those before the pending one), an n-gram row whose lookup cannot find anything
        whatever its pending token is backs off here, as its lookup would: the pending token is then
        not read from the device (after a plain step that read waits for the forward in flight)."""
        part = self._part(uid)
        if part is None or not part.backoff.ready():
            return False
        source = part.source
        if tokens is not None and isinstance(source, NgramDrafts) and not source.may_propose(tokens):
            part.backoff.nothing_found()
            return False
        return True

    def propose(self, asks: Sequence[tuple[int, Sequence[int], int, int]], *, rows: int = 0) -> list[list[int]]:
        """Each row's drafts, for `(uid, tokens, pending, limit)` each, in a step of `rows` rows (default:
        as many as asks): at most the step's draft length (`_lengths`) and `limit`. Rows drafting from
        the draft model propose together (one draft forward per draft position for all of them)."""
        from mlxd.engine.draft import ModelDrafts, propose_rows

        out: list[list[int]] = [[] for _ in asks]
        together: list[tuple[int, Speculation]] = []
        asks = self._lengths(asks, rows or len(asks)) if self.lengths else list(asks)
        for n, (uid, tokens, pending, limit) in enumerate(asks):
            part = self._part(uid)
            if part is None or limit <= 0:
                continue
            if isinstance(part.source, ModelDrafts):
                together.append((n, part))
            else:
                out[n] = part.propose(tokens, pending, limit)
        if together:
            self.counters.draft_steps += 1
            self.counters.draft_rows += len(together)
            jobs = [(p.source, asks[n][1], asks[n][2], min(p.k, asks[n][3])) for n, p in together]
            for (n, part), drafts in zip(together, propose_rows(jobs), strict=True):  # type: ignore[arg-type]
                out[n] = part.drafted(drafts)
        for n, (uid, tokens, pending, _) in enumerate(asks):
            grammar = self._grammar(uid)
            if grammar is not None and out[n]:  # a constrained row verifies only what its grammar allows
                admitted = grammar.admit(tokens, pending, out[n])
                self.counters.grammar_refused += len(out[n]) - len(admitted)
                out[n] = admitted
        return out

    def _lengths(self, asks: Sequence[tuple[int, Sequence[int], int, int]], rows: int
                 ) -> list[tuple[int, Sequence[int], int, int]]:
        """`asks` with each limit cut to the step's draft length: the longest any drafting row chooses
        (`DraftLength.choose`, at this batch size's step costs). The step's forward is as wide as its
        longest row anyway (shorter rows are padded), and a row that fed fewer positions than the width
        has more to drop after it, which moves the row in the batch's KV (`_shift_right`); so every row
        drafts that many (a row alone: its own choice)."""
        widths: dict[int, float | None] = {}  # the step's costs by width, found once for every row

        def cost(width: int) -> float | None:
            if width not in widths:
                widths[width] = self.gate.costs.seconds(rows, width)
            return widths[width]

        chosen = [part.length.choose(cost) for uid, *_ in asks if (part := self._part(uid)) is not None]
        if not chosen:
            return list(asks)
        step = max(chosen)
        return [(uid, tokens, pending, min(limit, step)) for uid, tokens, pending, limit in asks]

    def probe(self, uid: int, tokens: Sequence[int], k: int) -> list[int]:
        """A gate probe's drafts for a row (not verified): what its source proposes after `tokens`
        (the row's last token as the pending one: nothing read from the device). None for a row
        whose grammar checks its drafts (its matcher is not at those tokens), or that has no tokens."""
        part = self._part(uid)
        if part is None or len(tokens) < 2 or self._grammar(uid) is not None:
            return []
        self.counters.probes += 1
        return part.source.propose(tokens[:-1], tokens[-1], k)

    def probed(self, rows: int, accepted: int) -> None:
        """A probe's drafts were compared with what its row emitted: `accepted` matched."""
        self.counters.probe_accepted += accepted
        self.gate.probed(rows, accepted)

    def verified(self, uid: int, proposed: int, accepted: int) -> None:
        self.counters.add(proposed, accepted)
        part = self._part(uid)
        if part is not None:
            part.verified(proposed, accepted)
        grammar = self._grammar(uid)
        if grammar is not None:
            grammar.verified(accepted)

    def _grammar(self, uid: int) -> Constrained | None:
        row = self.rows.get(uid)
        if row is None:
            return None
        return next((p for p in row.features if isinstance(p, Constrained)), None)

    def forward(self) -> None:
        """One target forward verified drafts."""
        self.counters.verify_steps += 1


# A draft model's probe, at any batch of this many rows or more (batch 1 included): this many rows draft in
# a plain step, not verified, and their drafts are compared with what the rows then emit (kv/ngram.py's
# SpeculationGate.probe_rows): a failed probe pays one row's draft forward (and its prefill), no verifying
# forward, no token read.
DRAFT_PROBE_ROWS = 1


def engine_drafts(rows: Mapping[int, Row], *, draft_model: bool) -> Drafts:
    """The engine's `Drafts`: with a draft model its gate probes with `DRAFT_PROBE_ROWS` rows
    (`MLXD_DRAFT_PROBE_ROWS` instead; 0: the whole batch verifies at a probe, as with n-grams,
    whose drafts cost nothing to make). Rows choose their draft lengths (`DraftLength`) unless
    `MLXD_DRAFT_LENGTH=fixed` (every row drafts `--num-draft-tokens`)."""
    given = os.environ.get("MLXD_DRAFT_PROBE_ROWS")
    probe = (int(given) if given else DRAFT_PROBE_ROWS) if draft_model else 0
    length = os.environ.get("MLXD_DRAFT_LENGTH", "").strip().lower() or "adaptive"  # set but empty: the default
    if length not in ("adaptive", "fixed"):
        raise ValueError(f"MLXD_DRAFT_LENGTH={length!r}: adaptive or fixed")
    return Drafts(rows, gate=SpeculationGate(probe_rows=probe), lengths=length == "adaptive", bounded=not draft_model)


def draft_ceiling(k: int, cost: float) -> float:
    """The most a verifying step can gain over a plain one (tokens per second, as a ratio) with `k`
    drafts from a draft model whose forward costs `cost` target forwards: every draft accepted
    emits 1 + k tokens for the target's forward (a plain step's cost at least) and k draft forwards.
    At k = 4 a draft costing 0.89 of the target or more cannot gain 1.1x (the gate's bar) even at
    acceptance 1; the target as its own draft (cost 1) gains at most 1.0x."""
    return (1 + k) / (1 + k * max(cost, 0.0))


def speculation_off_reason(model: Any, config: Any) -> str | None:
    """Why this model cannot speculate (None: it can): every layer's KV must roll back per row."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if config.kv_bits is not None:
        return f"--kv-bits {config.kv_bits}: quantized KV is not rolled back per row yet"
    if config.distributed:  # the gate decides by each rank's own timing: ranks could disagree on a step's shape
        return "--distributed: every rank would have to take the same verify decisions (not done yet)"
    caches = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if kinds:
        return f"cache kinds {', '.join(kinds)} cannot drop rejected drafts per row (only KVCache can)"
    return None
