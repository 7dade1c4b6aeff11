"""The verifying generation batch: drafts of every speculating row checked in one target forward.

mlx-lm's `GenerationBatch` feeds each row one token per step. This subclass
does the same when no row drafts (so a row that backs off costs nothing), and
otherwise feeds every row its pending token followed by its drafts (rows with
fewer drafts, or none, are padded), in one forward of shape (rows, 1 + most
drafts). Each row then samples position by position with its own sampler,
logits processors and random stream, exactly as plain decoding would, and
keeps the drafts up to the first one its sample disagrees with; the sample
there becomes its pending token. The KV of every rejected or padded position
is dropped per row: a common trim, then each row with more to drop is shifted
right by the rest and its left padding grows by as much (the batch cache's
own way to hold rows of different lengths). On CUDA the verifying forward's
attention reads each layer's whole KV buffer (it grows 256 positions at a
time) under a mask that hides what lies past the row's tokens
(`WholeBuffer`): a query of several positions goes to cuDNN, whose plan is
built once per exact key length, so keys cut at the row's length, new at every
step, built a plan at every verifying step. A step verifies only while the
engine's `SpeculationGate` finds verifying steps faster than plain ones on this
device at this batch size (kv/ngram.py). Tokens, logprobs and finishes come
out as one response per emitted token, in order, so stop tokens, logprobs and
checkpoints see every accepted token.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from mlxd.engine.speculative import Drafts
from mlxd.kv.ngram import draft_lengths

# Verifying forwards attend over the whole KV buffer (see the module docstring): on CUDA only, where
# the attention's plan is keyed by the key length; elsewhere the exact length costs nothing to change.
WHOLE_BUFFER = mx.cuda.is_available() if hasattr(mx, "cuda") else False


class SpeculativeBatch(GenerationBatch):
    """A `GenerationBatch` whose steps verify drafts (see the module docstring)."""

    drafts: Drafts
    k: int
    _next_tokens: Any
    _next_logprobs: Any
    _current_tokens: Any
    _current_logprobs: Any
    _host_next: tuple[Any, list[int]] | None = None  # `_next_tokens` and its values, when made on the host
    _alone_seen: float = 0.0  # the draft's seconds fed alone, as of the gate's last charge
    # The gate's probes in flight: uid -> (where its drafts start in the row's tokens, the drafts,
    # the batch's rows at the probe); `_probed`: the rows that probed last (their draft KV is warm).
    _probes: dict[int, tuple[int, list[int], int]]
    _probed: tuple[int, ...] = ()
    _width: int = 1  # positions each row fed at the last verifying step (1 + most drafts, padded on CUDA)

    @classmethod
    def build(cls, model: Any, fallback_sampler: Any, *, drafts: Drafts, k: int) -> SpeculativeBatch:
        batch = cls.empty(model, fallback_sampler)
        batch.drafts, batch.k, batch._probes = drafts, k, {}
        return batch

    def next(self) -> list[Any]:
        start = time.perf_counter()
        gate = self.drafts.gate
        gate.started(start, charged=self._charged())
        if not self.uids:
            return []
        rows = len(self.uids)
        kind = gate.decide(rows)
        proposals, pending = self._proposals() if kind == "verify" else ({}, [])
        probed = kind == "probe" and self._probe(gate.probe_rows)
        if proposals:
            responses = self._verify(proposals, pending)
        else:
            responses = super().next()
        self._judge_probes()
        gate.ran(rows=rows, verifying=bool(proposals), tokens=len(responses), start=start, probe=probed,
                 width=self._width if proposals else 1)
        if not self.uids:  # every row ended: the time until rows come again is no step's
            gate.idle(time.perf_counter(), charged=self._charged())
        return responses

    def _charged(self) -> float:
        """Seconds the draft model fed rows alone since the last call (the gate is charged with them)."""
        total = self.drafts.prefix.alone_s
        charged = total - self._alone_seen
        self._alone_seen = total
        return charged

    def _probe(self, n: int) -> bool:
        """A gate probe: up to `n` rows draft after the tokens the host holds (the last one as the
        pending token: nothing is read from the device), not verified; the rows that probed before
        first (their draft KV is warm). Whether any row drafted."""
        if self._probes:  # one at a time: the last one's drafts are still being compared
            return False
        order = [u for u in self._probed if u in self.uids] + [u for u in self.uids if u not in self._probed]
        rows = len(self.uids)
        for uid in order:
            if len(self._probes) >= n:
                break
            tokens = self.tokens[self.uids.index(uid)]
            drafts = self.drafts.probe(uid, tokens, min(self.k, self.drafts.gate.probe_drafts))
            if drafts:
                self._probes[uid] = (len(tokens), drafts, rows)
        self._probed = tuple(self._probes) or self._probed
        if not self._probes:  # no row can probe (constrained rows only): the batch verifies from the next step
            self.drafts.gate.unprobed(rows)
        return bool(self._probes)

    def _judge_probes(self) -> None:
        """Compare each probe's drafts with what its row emitted since; the gate hears how many would
        have been accepted once a draft differs or all are matched (a row that ended is dropped)."""
        for uid, (at, drafts, rows) in list(self._probes.items()):
            if uid not in self.uids:
                del self._probes[uid]
                continue
            emitted = self.tokens[self.uids.index(uid)][at : at + len(drafts)]
            accepted = 0
            while accepted < len(emitted) and emitted[accepted] == drafts[accepted]:
                accepted += 1
            if accepted < len(emitted) or accepted == len(drafts):
                del self._probes[uid]
                self.drafts.probed(rows, accepted)

    def _proposals(self) -> tuple[dict[int, list[int]], list[int]]:
        """Each drafting row's pending token and drafts, by batch index, and every row's pending token
        (read, one host sync, only if a row drafts)."""
        wanting = [i for i, uid in enumerate(self.uids) if self.drafts.wants(uid, self.tokens[i])]
        if not wanting:
            return {}, []
        limits = [min(self.k, self.max_tokens[i] - self._num_tokens[i] - 1) for i in wanting]
        if self.drafts.bounded and not self._can_pay(limits):
            return {}, []
        known = self._host_next
        if known is not None and known[0] is self._next_tokens:  # a verifying step's samples: on the host already
            pending = known[1]
        else:  # after a plain step: waits for its forward (mlx-lm's pipelined step left it in flight)
            pending = self._next_tokens.tolist()  # type: ignore[assignment]
            self.drafts.counters.pending_reads += 1
        asks = [(self.uids[i], self.tokens[i], pending[i], limit) for i, limit in zip(wanting, limits, strict=True)]
        drafted = self.drafts.propose(asks, rows=len(self.uids))
        return {i: [pending[i], *drafts] for i, drafts in zip(wanting, drafted, strict=True) if drafts}, pending

    def _can_pay(self, limits: list[int]) -> bool:
        """Whether the step's drafts could pay if every one were accepted (`SpeculationGate.can_pay`):
        the rows that want to draft, `limits` at most each, at every draft length the step could take."""
        rows = len(self.uids)
        lengths = draft_lengths(self.k) if self.drafts.lengths else [self.k]
        tries = [(verify_width(1 + n, self.k), rows + sum(min(n, max(limit, 0)) for limit in limits))
                 for n in lengths]
        return self.drafts.gate.can_pay(rows, tries)

    def _verify(self, proposals: dict[int, list[int]], pending: list[int]) -> list[Any]:
        n_rows = len(self.uids)
        fed = [proposals.get(i) or [pending[i]] for i in range(n_rows)]
        width = verify_width(max(len(f) for f in fed), self.k)
        self._width = width
        inputs = mx.array([f + [f[-1]] * (width - len(f)) for f in fed], dtype=self._next_tokens.dtype)
        self._current_tokens = self._next_tokens  # what a constrained row's matcher reads (gen_hook.step_inputs)
        self._current_logprobs = self._next_logprobs

        logits = self.model(inputs, cache=whole_buffers(self.prompt_cache))
        logits = self._processed(logits, fed)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

        samples, keys = self._sample(logprobs, fed)
        flat: list[int] = mx.concatenate(samples).tolist()  # type: ignore[assignment]  # the step's one sync
        sampled, at = [], 0
        for f in fed:
            sampled.append(flat[at : at + len(f)])
            at += len(f)

        kept: list[int] = []  # positions of each row's KV that stay (its pending token + accepted drafts)
        for i in range(n_rows):
            drafts = fed[i][1:]
            n = 0
            while n < len(drafts) and sampled[i][n] == drafts[n]:
                n += 1
            row_keys = keys[i]
            if row_keys is not None:
                self.samplers[i].key = row_keys[n]  # the stream as if only the kept samples were drawn
            if drafts:
                self.drafts.verified(self.uids[i], len(drafts), n)
            kept.append(n + 1)
        self.drafts.forward()
        self._drop_rejected([width - k for k in kept])

        emitted = [fed[i][:kept[i]] for i in range(n_rows)]
        emitted_logprobs = [
            [self._current_logprobs[i], *(logprobs[i, j] for j in range(kept[i] - 1))] for i in range(n_rows)
        ]
        for i in range(n_rows):
            self.tokens[i].extend(emitted[i])
            if self.logits_processors and self.logits_processors[i]:
                self._token_context[i].update_and_fetch(mx.array(emitted[i], dtype=mx.int32))
        following = [sampled[i][kept[i] - 1] for i in range(n_rows)]
        self._next_tokens = mx.array(following, dtype=self._next_tokens.dtype)
        self._host_next = (self._next_tokens, following)  # the next step's drafts need no read back
        self._next_logprobs = [logprobs[i, kept[i] - 1] for i in range(n_rows)]
        return self._responses(emitted, emitted_logprobs)

    def _processed(self, logits: mx.array, fed: list[list[int]]) -> mx.array:
        """Each row's logits processors at each position it fed, with the context plain decoding would give."""
        if not any(self.logits_processors):
            return logits
        rows = []
        for i, f in enumerate(fed):
            processors = self.logits_processors[i] or ()
            if not processors:
                rows.append(logits[i])
                continue
            before = self._token_context[i].tokens
            positions = []
            for j in range(logits.shape[1]):
                row_logits = logits[i, j][None]
                if j < len(f):
                    context = mx.concatenate([before, mx.array(f[: j + 1], dtype=mx.int32)])
                    for processor in processors:
                        row_logits = processor(context, row_logits)
                positions.append(row_logits)
            rows.append(mx.concatenate(positions, axis=0))
        return mx.stack(rows)

    def _sample(self, logprobs: mx.array, fed: list[list[int]]) -> tuple[list[mx.array], list[list[Any] | None]]:
        """Per row, one sample per fed position, drawn in order; a seeded sampler's key after each draw."""
        samplers = self.samplers or [None] * len(fed)
        shared = self.fallback_sampler(logprobs)  # (rows, width): the batch's greedy sampler
        samples: list[mx.array] = []
        keys: list[list[Any] | None] = []
        for i, sampler in enumerate(samplers):
            if sampler is None or sampler is self.fallback_sampler:
                samples.append(shared[i, : len(fed[i])])
                keys.append(None)
                continue
            row: list[mx.array] = []
            row_keys: list[Any] = []
            for j in range(len(fed[i])):
                row.append(sampler(logprobs[i, j][None]))
                row_keys.append(getattr(sampler, "key", None))
            samples.append(mx.concatenate(row))
            keys.append(row_keys if row_keys[0] is not None else None)
        return samples, keys

    def _drop_rejected(self, extra: list[int]) -> None:
        """Drop each row's last `extra[i]` positions from every layer's KV."""
        common = min(extra)
        rest = [e - common for e in extra]
        pads = self.prompt_cache[0].left_padding.tolist() if any(rest) else None
        for cache in self.prompt_cache:
            if common:
                cache.trim(common)
            if any(rest):
                _shift_right(cache, rest, pads)

    def _responses(self, emitted: list[list[int]], logprobs: list[list[mx.array]]) -> list[Any]:
        keep, responses = [], []
        for i in range(len(self.uids)):
            finish = None
            for j, token in enumerate(emitted[i]):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(token):
                    finish = "stop"
                if finish is None:
                    responses.append(self.Response(self.uids[i], token, logprobs[i][j], None, None, None))
                    continue
                cut = len(emitted[i]) - j - 1  # accepted tokens past the finishing one: never emitted
                caches = self.extract_cache(i)
                if cut:
                    del self.tokens[i][-cut:]
                    for c in caches:
                        c.trim(cut)
                responses.append(self.Response(self.uids[i], token, logprobs[i][j], finish, caches, self.tokens[i]))
                break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def verify_width(fed: int, k: int) -> int:
    """The width of a verifying forward whose longest row feeds `fed` positions (its pending token and
    drafts), under `--num-draft-tokens k`. On CUDA (`WHOLE_BUFFER`), 1 + the next draft length rows choose
    from (`draft_lengths`): a draft cut short (its grammar, `max_tokens`) is padded, so a buffer size meets
    at most log2(k) + 2 widths, whatever lengths the rows choose. Elsewhere exactly `fed` (a CPU pays for
    every padded position)."""
    if not WHOLE_BUFFER or fed <= 1:
        return fed
    return 1 + next((n for n in draft_lengths(k) if n >= fed - 1), fed - 1)


class WholeBuffer:
    """A `BatchKVCache` or `KVCache` as one forward of several positions sees it: attention over the
    whole buffer.

    The keys and values handed to attention are the buffer (it grows by the cache's 256-position
    step), not the slice up to the tokens held, and the mask hides every position past each new
    token (and, in a batch cache, before each row's start): the same attention, with key shapes
    that stay the same for 256 positions. Everything else is the cache's own.
    """

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        _reserve(self.cache, _held(self.cache), keys.shape[2])  # every layer's buffer the size the mask has
        self.cache.update_and_fetch(keys, values)
        return self.cache.keys, self.cache.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        if window_size is not None:
            raise ValueError("a whole-buffer view has no sliding window")
        c = self.cache
        held = _held(c)
        _reserve(c, held, N)  # the buffer's size after this forward's update, known now
        columns = mx.arange(c.keys.shape[2])
        mask = mx.arange(held, held + N)[:, None] >= columns
        if isinstance(c, BatchKVCache):
            return mask & (mx.expand_dims(c.left_padding, (1, 2, 3)) <= columns)
        return mask[None, None]  # (1, 1, N, buffer): the shape a batch cache's mask has


def whole_buffers(caches: list[Any]) -> list[Any]:
    """`caches` seen whole (`WholeBuffer`) where that is on and every one can be; else as they are."""
    if WHOLE_BUFFER and all(type(c) in (BatchKVCache, KVCache) and c.keys is not None for c in caches):
        return [WholeBuffer(c) for c in caches]
    return caches


def _held(cache: Any) -> int:
    return cache._idx if isinstance(cache, BatchKVCache) else cache.offset


def _reserve(cache: Any, held: int, n: int) -> None:
    """Grow the buffer for `n` new positions (`update_and_fetch` then keeps it) to a multiple of the cache's
    step: a buffer copied at a row's exact length (a checkpoint lent back, a draft's KV out of its batch) would
    otherwise grow to that length + 256, a size of its own (on CUDA, attention plans of their own)."""
    step = cache.step
    if held + n <= cache.keys.shape[2]:
        return
    b, heads, _, dk = cache.keys.shape
    dv = cache.values.shape[3]
    grow = -(-(held + n) // step) * step - held
    if cache.keys.shape[2] != held:  # past `held` nothing is kept (a buffer copied at a length, then trimmed)
        cache.keys, cache.values = cache.keys[..., :held, :], cache.values[..., :held, :]
    cache.keys = mx.concatenate([cache.keys, mx.zeros((b, heads, grow, dk), cache.keys.dtype)], axis=2)
    cache.values = mx.concatenate([cache.values, mx.zeros((b, heads, grow, dv), cache.values.dtype)], axis=2)


def _shift_right(cache: Any, shifts: list[int], pads: list[int] | None = None) -> None:
    """Drop each row's last `shifts[i]` positions: move the row right by that much, under more left padding.

    With `pads` (the rows' left padding, read once for every layer), row by row: each row that moves
    has its held span copied out (evaluated, so that nothing else holds the buffer) and written back
    one place over, in place; rows that keep their end are not touched. Without, one roll of every
    row's every held position."""
    if not isinstance(cache, BatchKVCache):
        raise TypeError(f"speculation rolls back BatchKVCache only, not {type(cache).__name__}")
    by = mx.array(shifts)
    end = cache._idx
    if pads is None:
        cache.keys[..., :end, :] = dynamic_roll(cache.keys[..., :end, :], by[:, None], axis=2)
        cache.values[..., :end, :] = dynamic_roll(cache.values[..., :end, :], by[:, None], axis=2)
    else:
        moved = [(i, s, pads[i], mx.contiguous(cache.keys[i : i + 1, :, pads[i] : end - s]),
                  mx.contiguous(cache.values[i : i + 1, :, pads[i] : end - s])) for i, s in enumerate(shifts) if s]
        mx.eval([x for m in moved for x in m[3:]])
        for i, s, lo, keys, values in moved:
            cache.keys[i : i + 1, :, lo + s : end] = keys
            cache.values[i : i + 1, :, lo + s : end] = values
    cache.left_padding = cache.left_padding + by
    cache.offset = cache.offset - by
