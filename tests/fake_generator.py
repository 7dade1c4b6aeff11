"""Test helper: a scripted stand-in for mlx-lm's `BatchGenerator`, to drive `EngineCore` without a model.

It keeps mlx-lm's timing and its response objects (they are mlx-lm's own
dataclasses): a row's prompt, less its last token, is prefilled in chunks of
`prefill_step_size`, one prompt response per step, the last chunk with
`end_of_segment`; the next step moves it to decoding (`end_of_prompt`) and
feeds its last prompt token; from the step after, one token per step. Every
token fed goes into real mlx-lm `KVCache`s that store the token id itself as
its key and value, so `tokens_in` reads back which tokens any cache holds.
The next token is a function of the row's tokens (`count_up` by default);
rows finish with "stop" on a stop sequence (mlx-lm's own matcher) or
"length" at their max tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.models.cache import KVCache

VOCAB = 64
LAYERS = 2


def count_up(tokens: Sequence[int]) -> int:
    """The default script: each token is one more than the last (modulo the vocabulary)."""
    return (tokens[-1] + 1) % VOCAB


def encode(tokens: Sequence[int]) -> mx.array:
    """Keys (and values) of `tokens`: shape (1 batch, 1 head, n, 2), each position holding its token id."""
    ids = mx.array(list(tokens), dtype=mx.float32)
    return mx.broadcast_to(ids[None, None, :, None], (1, 1, len(tokens), 2))


def feed(caches: Sequence[KVCache], tokens: Sequence[int]) -> None:
    kv = encode(tokens)
    for c in caches:
        c.update_and_fetch(kv, kv)


def prefix_caches(tokens: Sequence[int]) -> list[KVCache]:
    """Real caches holding exactly `tokens` (a RAM entry's payload)."""
    caches = [KVCache() for _ in range(LAYERS)]
    feed(caches, tokens)
    mx.eval([c.state for c in caches])
    return caches


def tokens_in(caches: Sequence[KVCache]) -> list[int]:
    """The token ids caches written by this module hold (every layer must agree)."""
    held = [[int(t) for t in c.keys[0, 0, : c.offset, 0].tolist()] if c.keys is not None else [] for c in caches]
    assert all(h == held[0] for h in held), held
    return held[0]


def copy_caches(caches: Sequence[KVCache]) -> list[KVCache]:
    """New cache objects over new arrays (slices), as mlx-lm's `extract_cache` returns."""
    out = []
    for c in caches:
        e = KVCache()
        if c.keys is not None:
            e.keys, e.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            e.offset = c.offset
        out.append(e)
    return out


@attrs.frozen
class Inserted:
    """What the core handed `insert` for one row (for assertions)."""

    uid: int
    prompt: tuple[int, ...]
    max_tokens: int
    cached: tuple[int, ...]  # the tokens the given caches held (() for fresh caches)
    all_tokens: tuple[int, ...]
    stop_sequences: StopSequences
    sampler: Any
    processors: list[Any]


@attrs.define
class FakeRow:
    uid: int
    unfed: list[int]  # prompt tokens not prefilled yet (the last one is fed when decoding starts)
    total: int  # prompt tokens inserted
    max_tokens: int
    caches: list[KVCache]
    tokens: list[int]  # every token the caches hold
    matcher: Any
    decoding: bool = False
    emitted: int = 0
    pending: int | None = None  # sampled, not yet emitted (mlx-lm's `_next_tokens`)

    @property
    def done(self) -> int:
        return self.total - len(self.unfed)


class DecodingView:
    """The part of mlx-lm's `GenerationBatch` that `gen_hook.snapshot_row` reads."""

    def __init__(self, rows: list[FakeRow]) -> None:
        self.uids = [r.uid for r in rows]
        self.tokens = [r.tokens for r in rows]
        self._next_tokens = mx.array([r.pending for r in rows]) if rows else None
        self._rows = rows

    def extract_cache(self, i: int) -> list[KVCache]:
        return copy_caches(self._rows[i].caches)


class FakeGenerator:
    """mlx-lm's `BatchGenerator` interface (insert, next, remove, extract_cache, close), scripted."""

    def __init__(self, *, prefill_step_size: int = 4, script: Callable[[Sequence[int]], int] = count_up) -> None:
        self.prefill_step_size = prefill_step_size
        self.script = script
        self.rows: dict[int, FakeRow] = {}
        self.inserted: list[Inserted] = []
        self.closed = 0
        self._uid = 0

    def insert(self, prompts, max_tokens=None, caches=None, all_tokens=None, samplers=None,
               logits_processors=None, stop_sequences=None) -> list[int]:
        n = len(prompts)
        caches = caches or [None] * n
        all_tokens = all_tokens or [[] for _ in prompts]
        samplers = samplers or [None] * n
        logits_processors = logits_processors or [[] for _ in prompts]
        stop_sequences = stop_sequences or [StopSequences()] * n
        max_tokens = max_tokens or [128] * n
        uids = []
        for prompt, m, c, history, sampler, processors, stops in zip(
            prompts, max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences, strict=True
        ):
            if not prompt:  # as mlx-lm refuses them
                raise ValueError("empty prompt")
            if m <= 0:
                raise ValueError("max_tokens must be > 0")
            uid, self._uid = self._uid, self._uid + 1
            row_caches = c if c is not None else [KVCache() for _ in range(LAYERS)]
            cached = tuple(tokens_in(row_caches))
            self.inserted.append(Inserted(uid, tuple(prompt), m, cached, tuple(history), stops, sampler, processors))
            self.rows[uid] = FakeRow(uid, list(prompt), len(prompt), m, row_caches, list(history), stops.matcher())
            uids.append(uid)
        return uids

    def next(self) -> tuple[list[Any], list[Any]]:
        gen = [self._decode(r) for r in list(self.rows.values()) if r.decoding]
        prompt = []
        for r in [r for r in self.rows.values() if not r.decoding and len(r.unfed) == 1]:
            # Prefilled in an earlier step: decoding starts (and the row decodes after those before it).
            self._feed(r, r.unfed)
            r.unfed, r.decoding, r.pending = [], True, self.script(r.tokens)
            self.rows[r.uid] = self.rows.pop(r.uid)
            prompt.append(PromptProcessingBatch.Response(r.uid, (r.total, r.total), True, True))
        for r in [r for r in self.rows.values() if not r.decoding]:
            chunk = r.unfed[:-1][: self.prefill_step_size]  # the last prompt token waits for decoding
            r.unfed = r.unfed[len(chunk):]
            self._feed(r, chunk)
            prompt.append(PromptProcessingBatch.Response(r.uid, (r.done, r.total), len(r.unfed) == 1, False))
        return prompt, gen

    def _decode(self, r: FakeRow) -> Any:
        token = r.pending
        assert token is not None
        self._feed(r, [token])
        r.emitted += 1
        r.pending = self.script(r.tokens)
        finish = "length" if r.emitted >= r.max_tokens else None
        if r.matcher.advance(token):
            finish = "stop"
        logits = mx.where(mx.arange(VOCAB) == token, 4.0, 0.0)
        logprobs = logits - mx.logsumexp(logits)
        if finish is None:
            return GenerationBatch.Response(r.uid, token, logprobs, None, None, None)
        del self.rows[r.uid]
        return GenerationBatch.Response(r.uid, token, logprobs, finish, copy_caches(r.caches), list(r.tokens))

    def _feed(self, r: FakeRow, tokens: list[int]) -> None:
        feed(r.caches, tokens)
        r.tokens += tokens

    def remove(self, uids: Sequence[int]) -> None:
        for uid in uids:
            self.rows.pop(uid, None)

    def extract_cache(self, uids: Sequence[int]) -> dict[int, tuple[list[KVCache], list[int]]]:
        rows = [self.rows[uid] for uid in uids if uid in self.rows]
        return {r.uid: (copy_caches(r.caches), list(r.tokens)) for r in rows}

    @property
    def _generation_batch(self) -> DecodingView:
        return DecodingView([r for r in self.rows.values() if r.decoding])

    def close(self) -> None:
        """Drop every row: `EngineCore.over` hands this same object back as the fresh generator of a reset."""
        self.closed += 1
        self.rows.clear()
