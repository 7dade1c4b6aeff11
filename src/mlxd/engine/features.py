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

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np

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
    # How many top logprobs its tokens carry (0: the chosen token's only; None: no logprobs; read per token)
    top_k: int | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        s = self.params
        self.top_k = s.top_logprobs if s.logprobs or s.top_logprobs != 0 else None

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

    def event(self, response: Any, read: LogprobRead | None = None) -> TokenGenerated:
        """The token event, with its logprobs when the request asked for them (`read`: already read)."""
        k = self.top_k
        if k is None:
            return TokenGenerated(response.token)
        chosen, top = read if read is not None else read_logprobs([(response, k)])[0]
        return TokenGenerated(response.token, chosen, top)


LogprobRead = tuple[float, tuple[tuple[int, float], ...]]  # the chosen token's logprob, the top (token, logprob)s


def read_logprobs(asks: list[tuple[Any, int]], stream: Any = None) -> list[LogprobRead]:
    """Each (response, top k)'s chosen-token logprob and top k (by logprob, highest first), in one evaluation.

    Built on `stream` (the core's side stream) rather than the generation stream: there mlx-lm has
    already queued the next step's forward (`async_eval`) and a read would wait for it to finish, so
    the host could not build the step after it meanwhile. The logprobs themselves are evaluated.
    """
    import mlx.core as mx

    with contextlib.nullcontext() if stream is None else mx.stream(stream):
        chosen, ids, values, ks = [], [], [], []
        for response, k in asks:
            lp = response.logprobs
            chosen.append(lp[response.token])
            k = min(k, lp.shape[-1]) if k > 0 else 0
            if k:
                idx = mx.argpartition(-lp, kth=k - 1)[:k]
                ids.append(idx)
                values.append(lp[idx])
            ks.append(k)
        together = [mx.stack(chosen), *([mx.concatenate(ids), mx.concatenate(values)] if ids else [])]
        mx.eval(together)
    # three reads of evaluated arrays, whatever the number of rows
    got: list[Any] = together[0].tolist()  # type: ignore[assignment]
    all_ids: list[Any] = together[1].tolist() if ids else []  # type: ignore[assignment]
    all_values: list[Any] = together[2].tolist() if ids else []  # type: ignore[assignment]
    reads: list[LogprobRead] = []
    at = 0
    for value, k in zip(got, ks, strict=True):
        pairs = sorted(zip(all_ids[at:at + k], all_values[at:at + k], strict=True), key=lambda p: -p[1])
        at += k
        reads.append((float(value), tuple((int(t), float(v)) for t, v in pairs)))
    return reads


@attrs.frozen
class StopTokens(Feature):
    """The model's end tokens and the request's stop token ids end the row as "stop".

    Stop *strings* are matched on text by whoever decodes it (the HTTP layer):
    it sends `StopGeneration`, and the core ends the row with the next step's `stops`.
    """

    ids: frozenset[int]

    def join(self, row: Row, joining: Joining) -> None:
        joining.stop_tokens |= self.ids


MASK_MODES = ("engine", "ahead", "ahead-bool", "ahead-early", "ahead-steal")
EARLY_MODES = ("ahead-early", "ahead-steal")  # the worker starts when the last step returns


def mask_mode() -> str:
    """`MLXD_MASK_MODE`: where a GPU step's masks are made (docs/structured-output.md, "Mask modes").

    "engine": on the engine thread once the forward pass is started; "ahead":
    a worker reads the step's input tokens, feeds the matchers and fills the packed masks
    while the engine thread builds the step's graph, joined at the first mask (the packed
    bits copied and unpacked on the device); "ahead-bool": the same, numpy unpacking the
    bits on the worker and one bool array copied (the H200's best of those three,
    docs/benchmarks.md, 2026-12-04 13:52); "ahead-early": ahead-bool, the worker started
    as soon as the last step's tokens are sampled (`StepMasks.prepare`, before the engine
    thread hands that step's tokens on) rather than when the next step starts: the default,
    ahead of ahead-bool in all four cells of the H200's 15:44-15:56 sweep, behind it in both
    batch-8 cells at 16:19 (a noisy host: docs/benchmarks.md); "ahead-steal": ahead-early, but
    when the engine thread reaches the join before the worker has started the job (not woken
    yet, or waiting for the GIL: a busy host's hand-off), the engine thread does the step's
    masks itself, the engine's way, and the worker drops the job. Read at every step (a
    benchmark switches it).
    """
    import os

    mode = os.environ.get("MLXD_MASK_MODE", "ahead-early")
    if mode not in MASK_MODES:
        raise ValueError(f"MLXD_MASK_MODE must be one of {', '.join(MASK_MODES)}, not {mode!r}")
    return mode


def mask_threads() -> int | None:
    """`MLXD_MASK_THREADS`: the threads llguidance fills a step's masks on (unset: its default,
    80% of the cores). Read at every step, like `MLXD_MASK_MODE` (a benchmark switches it)."""
    import os

    value = os.environ.get("MLXD_MASK_THREADS", "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MLXD_MASK_THREADS must be a whole number of threads, at least 1, not {value!r}")
    return int(value)


def mask_cache() -> int:
    """`MLXD_MASK_CACHE`: how many device masks a step may reuse by their bits (unset: 64; 0: none, every
    mask copied every step). A grammar offers the same set of tokens step after step (inside a string,
    between items), and a kept mask costs the engine thread no unpack, copy or allocation. Read at every
    step, like `MLXD_MASK_MODE` (a benchmark switches it)."""
    import os

    value = os.environ.get("MLXD_MASK_CACHE", "")
    if not value:
        return 64
    if not value.isdigit():
        raise ValueError(f"MLXD_MASK_CACHE must be a whole number of masks (0: none), not {value!r}")
    return int(value)


MASK_LAUNCHES = ("early", "ready")


def mask_launch() -> str:
    """`MLXD_MASK_LAUNCH`: when a GPU step with constrained rows launches its forward pass. "early": at
    the first mask, before the masks are joined, so the device runs it while the matchers work; "ready"
    (the default since the H200's 18:20 paired run: ahead of "early" in 3 of 4 cells, engine-thread CPU
    per token 1.013 / 0.926 against 1.032 / 1.028 for JSON at batch 1 / 8): then only when an ahead job's
    masks are not made yet, else with the rest of the step at its one launch after sampling (one launch
    a step, as free decode has). Read at every step."""
    import os

    value = os.environ.get("MLXD_MASK_LAUNCH", "ready")
    if value not in MASK_LAUNCHES:
        raise ValueError(f"MLXD_MASK_LAUNCH must be one of {', '.join(MASK_LAUNCHES)}, not {value!r}")
    return value


def gil_switch_ms() -> float | None:
    """`MLXD_GIL_SWITCH_MS`: Python's GIL switch interval while an engine runs, in ms (unset: Python's own, 5).

    The engine thread holds the GIL while mlx-lm builds a step's graph; a thread waiting for it
    (the ahead mask worker, trio's) gets it only when the holder lets go or after this interval, so
    with 5 ms an ahead worker's whole job can land at the join (benchmarks/sim_gil_handoff.py).
    """
    import os

    value = os.environ.get("MLXD_GIL_SWITCH_MS", "")
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= 1000:
        raise ValueError(f"MLXD_GIL_SWITCH_MS must be a number of milliseconds in (0, 1000], not {value!r}")
    return ms


FINAL_PLANS = ("with-token", "after-token", "after-forward")


def final_plan() -> str:
    """`MLXD_FINAL_PLAN`: when a finished row's final checkpoint is taken. `after-forward` (the default; with any prompt
    cache, not with speculation): the row's copy of its KV is dispatched without waiting as its last token goes out
    (queued behind the forward mlx-lm dispatched before returning that token), and the checkpoint (its write plan
    with the SSD tier) is taken in the next step after that step's forward is dispatched, while the device computes
    it; the row's finish (its `GenerationFinished`) goes out with that step's tokens, its checkpoint in the same
    step's notes, so the cache owner has it before the reply ends. `with-token` (before 2026-12-06): in the step of
    its last token, before that step's tokens go out; the copy then waits for the whole forward in flight and every
    row's next token with it (issue 28: ~30 ms a step where rows end on the H100, 10.7-11.9 ms a copy).
    `after-token` (with the SSD tier): in a step of its own right after it, with no forward."""
    import os

    value = os.environ.get("MLXD_FINAL_PLAN", "") or "after-forward"
    if value not in FINAL_PLANS:
        raise ValueError(f"MLXD_FINAL_PLAN must be one of {', '.join(FINAL_PLANS)}, not {value!r}")
    return value


PLAN_STREAMS = ("side", "main")


def plan_stream() -> str:
    """`MLXD_PLAN_STREAM`: the stream a checkpoint evaluates its token slices on (its caches' `state`, and with the
    SSD tier its write plan's, `kinds.plan_snapshot`). `side` (the default): the engine's side stream, so the slices
    of KV already evaluated are ready at once; `main`: the generation stream, where they queue behind the forward
    the step dispatched and the engine thread waits for the whole forward before the step's events go out (issue
    28: a same-stream copy waited 10.7-11.9 ms on the H100, a side-stream one 2.6-2.9 ms). In serving the two have
    measured the same so far: `main` ÷ `side` 0.993 on an H100 (docs/benchmarks.md, H100 2026-12-06 09:01) and on
    the CPU."""
    import os

    value = os.environ.get("MLXD_PLAN_STREAM", "") or "side"
    if value not in PLAN_STREAMS:
        raise ValueError(f"MLXD_PLAN_STREAM must be one of {', '.join(PLAN_STREAMS)}, not {value!r}")
    return value


def plan_device() -> bool:
    """`MLXD_PLAN_DEVICE` (on by default; `runtime.config.env_switch` values): with the SSD tier on CUDA, a
    checkpoint's write plan hands the writer its arrays' device addresses (`runtime/device_pointers.py`), which the
    writer's staging copies by DMA, instead of host views whose first access converts the row's whole KV to managed
    memory with the GIL held (issue 28: 49.7 ms for an 8k-token row of the 1.7B shape on the H100, 120 ms beside a
    busy device; the addresses 1.6-2.7 ms, the DMA ~20 ms at 45-49 GB/s without the GIL). Off: the host views, as
    before. Nothing changes off CUDA."""
    from mlxd.runtime.config import env_switch

    return env_switch("MLXD_PLAN_DEVICE", default=True)


def first_token_early() -> bool:
    """`MLXD_FIRST_TOKEN_EARLY` (on by default; `runtime.config.env_switch` values): rows whose prompt ended in a
    step where no row of the batch was decoding (a row alone, or rows that started together) get their first token
    with that step. mlx-lm samples it in that step's forward and hands it out with the next step, after that step
    has built (and dispatched) the forward of the token after it; read in the step that sampled it, it goes out one
    step earlier (engine/gen_hook.py `first_tokens`). Off: with the next step, as mlx-lm hands it out."""
    from mlxd.runtime.config import env_switch

    return env_switch("MLXD_FIRST_TOKEN_EARLY", default=True)


# MLXD_JOIN_FIRST_EARLY: steps from one early read beside decoding rows to the next (a bound on its cost to them)
JOIN_EARLY_GAP = 4


def join_first_early() -> bool:
    """`MLXD_JOIN_FIRST_EARLY` (off by default; `runtime.config.env_switch` values; only with
    MLXD_FIRST_TOKEN_EARLY): rows whose prompt ended beside decoding rows get their first token with that step too,
    a step before mlx-lm hands it out. The read waits for the step's forwards, so the device idles while the next
    step is built, once per such step and at most once every `JOIN_EARLY_GAP` steps (a row joining within the gap
    gets mlx-lm's timing). Off: only rows that joined no decoding row (every row of the batch new) get it early."""
    from mlxd.runtime.config import env_switch

    return env_switch("MLXD_JOIN_FIRST_EARLY", default=False)


def trims_device_pool() -> bool:
    """`MLXD_POOL_TRIM` (on by default; `runtime.config.env_switch` values): with a memory budget on CUDA, an engine
    idle for `IDLE_TRIM_S` gives its GPU's memory pool back what it holds past what MLX uses and one buffer-cache
    share of the budget (engine/core.py `idle_trim`), a backstop. Off: the pool is left to CUDA."""
    from mlxd.runtime.config import env_switch

    return env_switch("MLXD_POOL_TRIM", default=True)


def plan_pack_bytes() -> int:
    """`MLXD_PLAN_PACK_MB`: a checkpoint's write plan of at most this many MB is written from one packed copy of its
    tensors (`kinds.plan_snapshot`): on CUDA one host conversion to managed memory instead of one per tensor (a
    finished row's final checkpoint has two per layer), and the RAM tier's arrays stay device memory. Unset, "" or
    0: off. An arm to measure (issue 28: eight rows ending in one step convert 448 arrays in their last step)."""
    import math
    import os

    value = os.environ.get("MLXD_PLAN_PACK_MB", "").strip() or "0"
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not (math.isfinite(mb) and mb >= 0):
        raise ValueError(f"MLXD_PLAN_PACK_MB must be a number of megabytes >= 0 (0: off), not {value!r}")
    return int(mb * (1 << 20))


def mask_device_is_cpu() -> bool:
    """The device the masks are made for: MLX's default, or a GPU's path on the CPU (`MLXD_MASK_DEVICE=gpu`)."""
    import os

    import mlx.core as mx

    if os.environ.get("MLXD_MASK_DEVICE") == "gpu":  # time the GPU path's host work on a CPU host
        return False
    return bool(mx.default_device() == mx.cpu)


@attrs.frozen
class AheadJob:
    """The masks a worker makes for the step about to run, before its graph is built (mode "ahead")."""

    uids: list[int]  # the batch's decoding rows when it was started
    tokens: Any  # the mx.array of their input tokens it reads
    future: Any  # -> (walking uids, their masks as one numpy array: packed or bool, the parts it fed) or None
    claim: Any = None  # mode "ahead-steal": a Lock; whichever thread takes it first makes the step's masks


def made_vocab(done: tuple[list[int], Any, list[Constrained]]) -> int:
    """The vocab size of an ahead job's masks."""
    return done[2][0].matcher.vocab_size


@attrs.frozen
class Filled:
    """A step's masks as filled on a worker, for the engine thread's kept device masks (`MLXD_MASK_CACHE`)."""

    keys: list[bytes]  # each row's packed bits: the key of its device mask
    unpacked: dict[int, np.ndarray]  # row -> its (vocab,) bool mask, for bits no kept mask had when filled


@attrs.define
class StepMasks:
    """The token masks of the step in progress for every constrained row that walks, made together.

    The first walking row's logits processor does it for all of them: it reads the tokens
    the rows feed this step (one read for the batch), feeds each matcher its token, fills
    one packed bitmask for the rows (one llguidance call, on its threads) and makes one
    device copy of the rows' masks; each row's processor then applies its own row.
    On the CPU `mx.async_eval` runs most of the forward pass before it returns (MLX caps
    the tasks in flight), so the matchers' work, numpy's unpack of the bits included, runs
    on a worker thread meanwhile and one bool array is copied; on a GPU the forward pass is
    started first and the work follows on this thread while it runs, the packed bits copied
    and unpacked on the device.
    A single walking row is done as the per-row path did it, on this thread after the
    forward pass is started, its mask unpacked by numpy and copied as a bool array: a
    hand-off, the packed copy and the unpack ops cost a one-row step more than they save.

    With `MLXD_MASK_MODE=ahead` on a GPU (`start`, called before the generator's step) a
    worker waits for the step's input tokens, feeds the matchers and fills and unpacks the
    masks while the engine thread builds the forward pass; the first mask joins it and
    copies one bool array. When the step turns out to be another (its batch changed, its
    tokens not evaluated yet), the worker's feeds are rolled back and the step is done the
    engine's way.
    """

    read: Callable[[], dict[int, int]]  # the step's input token of every decoding row, by uid
    rows: Callable[[], Sequence[tuple[int, Constrained]]]  # the batch's constrained rows, by uid
    pending: Callable[[], tuple[list[int], Any] | None] = lambda: None  # the next step's rows and input tokens, unread
    current: Callable[[], tuple[list[int], Any] | None] = lambda: None  # the step in progress's, unread
    _fillers: dict[int | None, Any] = attrs.Factory(dict)  # structured.BatchMasks by MLXD_MASK_THREADS, built when needed
    _worker: ThreadPoolExecutor | None = None
    _bits: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 0), dtype=np.int32))  # reused step to step
    _shifts: Any = None  # mx.arange(32): a word's bits
    _step: dict[int, Any] | None = None  # this step's masks: uid -> (1, vocab) bool
    _kept: OrderedDict[bytes, Any] = attrs.Factory(OrderedDict)  # device masks by packed bits, last used last
    _kept_vocab: int = 0  # the vocab size of the kept masks
    _neg: dict[Any, Any] = attrs.Factory(dict)  # -inf as a device scalar, by logits dtype
    _ahead: AheadJob | None = None
    _on_cpu: bool | None = None  # the masks are made for the CPU (set by the first step)

    def __attrs_post_init__(self) -> None:
        mask_mode()  # a bad MLXD_MASK_* setting fails the engine's start, not its first step
        mask_threads()
        mask_cache()
        mask_launch()

    def neg_inf(self, dtype: Any) -> Any:
        """-inf in `dtype`, made once (the masked-out logits' value)."""
        neg = self._neg.get(dtype)
        if neg is None:
            import mlx.core as mx

            neg = self._neg[dtype] = mx.array(-mx.inf, dtype=dtype)
        return neg

    def clear(self) -> None:
        """A new generator step starts: nothing is computed for it yet."""
        self._drop_ahead()
        self._step = None

    def start(self) -> None:
        """A new generator step starts; in an ahead mode on a GPU a worker starts on its masks,
        or goes on with the one `prepare` started when the step's rows and tokens are still those.
        A batch without constrained rows has no masks to make: no setting read, no tokens looked at."""
        self._step = None
        if not self.rows():
            self._drop_ahead()
            return
        job = self._ahead
        if job is not None:
            pending = self.pending()
            if pending is not None and pending[1] is job.tokens and pending[0] == job.uids:
                return
            self._drop_ahead()
        self._begin(mask_mode())

    def prepare(self) -> None:
        """The generator's step returned (its sampled tokens scheduled): in mode "ahead-early" on a
        GPU the worker starts on the next step's masks now, while the engine thread hands this
        step's tokens on; the next `start` keeps it when the batch did not change in between."""
        if not self.rows():
            return
        mode = mask_mode()
        if mode in EARLY_MODES and self._ahead is None and not self._device_is_cpu():
            self._begin(mode)

    def _begin(self, mode: str) -> None:
        """An ahead mode: hand the next step's walking rows to the worker."""
        if mode == "engine" or self._device_is_cpu():
            return
        pending = self.pending()
        if pending is None:
            return
        uids, tokens = pending
        parts = [(uid, part) for uid, part in self.rows() if part.walks and not part.drafted]
        if parts:
            import mlx.core as mx

            # The worker waits on its own copy, scheduled here: no other thread waits on that array
            # (MLX arrays are not thread-safe), and another thread cannot evaluate an unscheduled one.
            mine = tokens * 1
            mx.async_eval(mine)
            claim = threading.Lock() if mode == "ahead-steal" else None
            work = self._pool().submit(self._ahead_work, uids, mine, parts, mode != "ahead", claim)
            self._ahead = AheadJob(uids, tokens, work, claim)

    def mask(self, uid: int, logits: Any) -> Any:
        """Row `uid`'s mask for this step, after its matcher took the token it feeds (None: not batched)."""
        if self._step is None:
            self._step = self._compute(logits)
        return self._step.get(uid)

    def close(self) -> None:
        self._drop_ahead()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _device_is_cpu(self) -> bool:
        if self._on_cpu is None:
            self._on_cpu = mask_device_is_cpu()
        return self._on_cpu

    def _pool(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxd-masks")
        return self._worker

    def _drop_ahead(self) -> None:
        """An ahead job this step did not use: wait for it and undo its feeds."""
        job, self._ahead = self._ahead, None
        if job is None:
            return
        if job.claim is not None:
            job.claim.acquire(blocking=False)  # not started yet: the worker will feed nothing
        done = job.future.result()
        if done is not None:
            for part in done[2]:
                part.matcher.rollback(1)
                part.consumed -= 1

    def _compute(self, logits: Any) -> dict[int, Any]:
        import mlx.core as mx

        on_cpu = self._device_is_cpu()
        # The forward pass is launched now to run while the matchers work, unless (MLXD_MASK_LAUNCH=ready)
        # an ahead job has its masks already: then the step's one launch, after sampling, takes it all.
        late = self._ahead is not None and self._ahead.future.done() and mask_launch() == "ready"
        if not on_cpu and not late:
            mx.async_eval(logits)
        if self._ahead is not None:
            made = self._joined()
            if made is not None:
                return made
        if not on_cpu and late:  # the job was for another step: the forward runs while this one works
            mx.async_eval(logits)
        tokens = self.read()
        walking = [(uid, part, tokens[uid]) for uid, part in self.rows() if part.walks and not part.drafted
                   and uid in tokens]
        if not walking:
            return {}
        vocab_size = walking[0][1].matcher.vocab_size
        bits = self._buffer(len(walking), vocab_size)
        if len(walking) == 1:  # one row: no hand-off, no unpack graph (the per-row path's cost)
            if on_cpu:
                mx.async_eval(logits)
            return self._alone(walking[0], bits)
        if on_cpu:  # fed, filled and unpacked by numpy on the worker while async_eval runs the forward pass
            if mask_cache() > 0:
                keyed = self._pool().submit(self._walk_keyed, walking, bits, vocab_size)
                mx.async_eval(logits)  # releases the GIL while it runs the forward pass
                kept = self._device_masks(keyed.result(), vocab_size)
                return {uid: kept[i] for i, (uid, _, _) in enumerate(walking)}
            job = self._pool().submit(self._walk_unpacked, walking, bits, vocab_size)
            mx.async_eval(logits)
            allowed = mx.array(job.result())  # one copy of every row's bool mask
        else:  # the device unpacks: its ops are cheap there, and the copy stays packed
            self._walk(walking, bits)
            allowed = self._unpacked(bits[: len(walking)], vocab_size)
        return {uid: allowed[i : i + 1] for i, (uid, _, _) in enumerate(walking)}

    def _joined(self) -> dict[int, Any] | None:
        """The ahead job's masks when it made them for this step (else its feeds undone, None)."""
        import mlx.core as mx

        job = self._ahead
        assert job is not None
        now = self.current()
        if now is None or now[1] is not job.tokens or now[0] != job.uids:
            self._drop_ahead()
            return None
        self._ahead = None
        if job.claim is not None and job.claim.acquire(blocking=False):
            return None  # the worker has not started it: this thread makes the step's masks (the caller)
        done = self._wait(job)
        if done is None:
            return None
        uids, made, _ = done
        if isinstance(made, Filled):  # each row's kept device mask, or one copied for it
            kept = self._device_masks(made, made_vocab(done))
            return {uid: kept[i] for i, uid in enumerate(uids)}
        if made.dtype == np.bool_:
            masks = mx.array(made)  # one copy of every row's bool mask
        else:
            masks = self._unpacked(made, made_vocab(done))
        if len(uids) == 1:
            return {uids[0]: masks}
        return {uid: masks[i : i + 1] for i, uid in enumerate(uids)}

    @staticmethod
    def _wait(job: AheadJob) -> Any:
        """The engine thread waits for the ahead job (timed apart by benchmarks/prof_structured_host.py)."""
        return job.future.result()

    @staticmethod
    def _read_ahead(tokens: Any) -> list[int]:
        """On the worker: the step's input tokens, once the last step's sampling is done (scheduled by `start`)."""
        values: list[int] = tokens.tolist()
        return values

    def _ahead_work(self, uids: list[int], tokens: Any, parts: list[tuple[int, Constrained]], unpack: bool,
                    claim: Any = None) -> Any:
        """On the worker: wait for the tokens, feed the walking rows' matchers, fill (and unpack) their masks
        (None when the engine thread claimed the job first: "ahead-steal")."""
        values = self._read_ahead(tokens)
        if claim is not None and not claim.acquire(blocking=False):
            return None
        by_uid = dict(zip(uids, values, strict=True))
        walking = [(uid, part, int(by_uid[uid])) for uid, part in parts if uid in by_uid]
        if not walking:
            return None
        vocab_size = walking[0][1].matcher.vocab_size
        bits = self._buffer(len(walking), vocab_size)
        if not unpack:
            made: Any = self._walked(walking, bits)
        else:
            made = self._walk_keyed(walking, bits, vocab_size) if mask_cache() > 0 else self._walk_unpacked(walking, bits, vocab_size)
        return [uid for uid, _, _ in walking], made, [part for _, part, _ in walking]

    def _walked(self, walking: list[tuple[int, Constrained, int]], bits: np.ndarray) -> np.ndarray:
        self._walk(walking, bits)
        return bits[: len(walking)]

    def _alone(self, walking: tuple[int, Constrained, int], bits: np.ndarray) -> dict[int, Any]:
        """One walking row: its matcher fed and its mask filled on this thread, unpacked by numpy."""
        import mlx.core as mx

        uid, part, token = walking
        part.take(token)
        part.matcher.fill_bitmask(bits[0])
        if mask_cache() > 0:
            return {uid: self._device_masks(Filled([bits[0].tobytes()], {}), part.matcher.vocab_size)[0]}
        allowed: np.ndarray = np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: part.matcher.vocab_size].view(np.bool_)
        return {uid: mx.array(allowed)}

    def _walk(self, walking: list[tuple[int, Constrained, int]], bits: np.ndarray) -> None:
        from mlxd.structured.matcher import BatchMasks

        for _, part, token in walking:
            part.take(token)
        threads = mask_threads()
        filler = self._fillers.get(threads)
        if filler is None:
            filler = self._fillers[threads] = BatchMasks(threads)
        filler.fill([part.matcher for _, part, _ in walking], bits)

    def _buffer(self, rows: int, vocab_size: int) -> np.ndarray:
        from mlxd.structured.matcher import bitmask_words

        words = bitmask_words(vocab_size)
        if self._bits.shape[0] < rows or self._bits.shape[1] != words:
            self._bits = np.zeros((max(rows, self._bits.shape[0]), words), dtype=np.int32)
        return self._bits

    def _walk_keyed(self, walking: list[tuple[int, Constrained, int]], bits: np.ndarray, vocab_size: int) -> Filled:
        """Fed and filled; each row's bits as its key, unpacked only where no kept mask has those bits."""
        self._walk(walking, bits)
        keys = [bits[i].tobytes() for i in range(len(walking))]
        new = [i for i, key in enumerate(keys) if key not in self._kept]
        if not new:
            return Filled(keys, {})
        rows: np.ndarray = bits[new].view(np.uint8)
        unpacked: np.ndarray = np.unpackbits(rows, axis=1, count=vocab_size, bitorder="little").view(np.bool_)
        return Filled(keys, dict(zip(new, unpacked, strict=True)))

    def _device_masks(self, filled: Filled, vocab_size: int) -> list[Any]:
        """On the engine thread: each row's (1, vocab) bool mask on the device, the one kept for the same
        bits when there is one (no unpack, no copy), else copied and kept (the least recently used dropped)."""
        import mlx.core as mx

        kept, limit = self._kept, mask_cache()
        if vocab_size != self._kept_vocab:
            kept.clear()
            self._kept_vocab = vocab_size
        masks = []
        for i, key in enumerate(filled.keys):
            mask = kept.get(key)
            if mask is not None:
                kept.move_to_end(key)
            else:
                row = filled.unpacked.get(i)
                if row is None:  # not unpacked on the worker (its bits were kept then) or on this thread
                    row = np.unpackbits(np.frombuffer(key, dtype=np.uint8), count=vocab_size, bitorder="little").view(np.bool_)
                mask = kept[key] = mx.array(row[None])
                while len(kept) > limit:
                    kept.popitem(last=False)
            masks.append(mask)
        return masks

    def _walk_unpacked(self, walking: list[tuple[int, Constrained, int]], bits: np.ndarray, vocab_size: int) -> np.ndarray:
        self._walk(walking, bits)
        rows: np.ndarray = bits[: len(walking)].view(np.uint8)
        unpacked: np.ndarray = np.unpackbits(rows, axis=1, count=vocab_size, bitorder="little").view(np.bool_)
        return unpacked

    def _unpacked(self, bits: np.ndarray, vocab_size: int) -> Any:
        import mlx.core as mx

        if self._shifts is None:
            self._shifts = mx.arange(32, dtype=mx.int32)
        packed = mx.array(bits)  # one copy of every row's packed mask (the buffer is reused next step)
        return ((packed[:, :, None] >> self._shifts) & 1).reshape(len(bits), -1)[:, :vocab_size].astype(mx.bool_)


@attrs.define
class Constrained(Feature):
    """Structured output: before each sampled token, every token the grammar refuses is masked out.

    The matcher follows the row's own tokens: at each step it takes the token the row
    feeds that step, with every other walking row's (`StepMasks`), or, at a row's first
    step, a resumed row's included, every token the checkpoint holds (so a resume needs
    no saved state), as it does for drafts being verified, position by position. End
    tokens are allowed only where the grammar is complete.
    """

    matcher: Matcher
    prompt_tokens: int  # the row's prompt: what the processor's context holds before generation
    masks: StepMasks
    consumed: int = 0
    drafted: int = 0  # --speculative: drafts being verified this step (masked position by position)
    walks: bool = False  # caught up with its row after its last step: the next one's mask is made in the batch

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

    def take(self, token: int) -> None:
        """The token the row feeds this step (`StepMasks`, for every walking row at once)."""
        self._consume([token])

    def mask(self, row: Row, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        generated = int(tokens.shape[0]) - self.prompt_tokens
        if self.walks and not self.drafted:
            allowed = self.masks.mask(row.uid, logits)
            if allowed is not None:
                if generated == self.consumed:
                    return mx.where(allowed, logits, self.masks.neg_inf(logits.dtype))
                self.matcher.rollback(1)  # not the step the batch took it for: the row's own way below
                self.consumed -= 1
        # Start this step's forward pass before waiting for the last token: the matcher's
        # CPU work below then overlaps with it.
        mx.async_eval(logits)
        if generated > self.consumed:  # a first step, a resumed row's, a draft: what the row holds
            self._consume(tokens[self.prompt_tokens + self.consumed:].tolist())
        self.walks = True
        allowed = mx.array(self.matcher.allowed_mask())
        return mx.where(allowed, logits, self.masks.neg_inf(logits.dtype))

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
            row.stamp("checkpoint")
            core.checkpoint(out, "boundary", lambda: core.extract(row.uid), req.namespace, req.session,
                            before_first_token=None if req.prompt_shared else row)
            row.stamp("checkpointed")

    def leave(self, row: Row, ending: Ending, core: EngineCore, out: StepOut) -> None:
        core.publish_deferred(out, lambda r: r is row)  # its boundary checkpoint first, if still deferred
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
        plan = core.plan(snap.caches, meta, staged=True)  # (the checkpointer stages a plan of device addresses)
        return CheckpointGeneration(self.key, req.request_id, plan, len(record.emitted))
