"""Constrained rows' masks made together for a step (engine/features.StepMasks), on real MLX logits
and llguidance matchers over the tiny model's tokenizer."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxd.engine.features import Constrained, StepMasks
from mlxd.structured import GrammarCache, constraint_from_request, load_vocabulary

PROMPT = 5
LIST = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 100}  # stays open for 12 steps
BODIES = ({"regex": "[a-z ]{0,60}"}, {"guided_json": LIST}, {"regex": "[0-9]{1,80}"})


@pytest.fixture(scope="module")
def cache(tiny_model_dir: Path) -> GrammarCache:
    return GrammarCache(load_vocabulary(tiny_model_dir))


class Batch:
    """Three constrained rows decoding together, their processors called the way mlx-lm calls them."""

    def __init__(self, cache: GrammarCache, part: type[Constrained] = Constrained,
                 bodies: tuple[dict, ...] = BODIES) -> None:
        self.fed: dict[int, int] = {}
        self.reads = 0
        self.masks = StepMasks(self._read, lambda: [(row.uid, part) for row, part in self.rows])
        self.rows = [(SimpleNamespace(uid=uid), part(cache.matcher(constraint_from_request(body)), PROMPT,
                                                           self.masks)) for uid, body in enumerate(bodies)]
        self.context: list[list[int]] = [[1] * PROMPT for _ in self.rows]
        self.size = cache.vocab.size

    def _read(self) -> dict[int, int]:
        self.reads += 1
        return dict(self.fed)

    def step(self, logits: mx.array) -> list[mx.array]:
        """Each row's processed logits for this step (the rows' contexts end with the token each feeds)."""
        self.masks.clear()
        out = []
        for i, (row, part) in enumerate(self.rows):
            processed = part.mask(row, mx.array(self.context[i]), logits[i : i + 1])
            out.append(processed)
        return out

    def feed(self, tokens: list[int]) -> None:
        for i, token in enumerate(tokens):
            self.context[i].append(token)
            self.fed[i] = token


@pytest.mark.parametrize("bodies", [BODIES, BODIES[:1], BODIES[1:2]], ids=["three rows", "one regex row", "one json row"])
def test_walking_rows_are_masked_together_as_each_alone_would_be(cache, bodies):
    batch = Batch(cache, bodies=bodies)
    alone = [cache.matcher(constraint_from_request(body)) for body in bodies]  # each row's reference walk
    rng = random.Random(1)
    for step in range(12):
        logits = mx.random.normal((len(bodies), batch.size), key=mx.random.key(step))
        reads = batch.reads
        processed = batch.step(logits)
        assert batch.reads == reads + (step > 0), "one read of the step's tokens for every walking row"
        chosen = []
        for i, (got, ref) in enumerate(zip(processed, alone, strict=True)):
            allowed = ref.allowed_mask()
            want = np.where(allowed, np.array(logits[i]), -np.inf)
            assert np.array_equal(np.array(got[0]), want)
            allowed[list(cache.vocab.eos_ids)] = False
            token = int(rng.choice(np.flatnonzero(allowed)))
            assert ref.consume(token)
            chosen.append(token)
        batch.feed(chosen)
    for (_, part), ref in zip(batch.rows, alone, strict=True):
        assert part.walks and part.matcher.tokens == ref.tokens[:-1]  # the last token is fed by the next step


def test_a_row_whose_step_is_not_the_batchs_catches_up_on_its_own(cache):
    batch = Batch(cache)
    logits = mx.zeros((len(BODIES), batch.size))
    batch.step(logits)  # first steps: each row on its own
    a, b = (cache.vocab.tokenizer.tokenize_str(s)[0] for s in "ab")
    one, two = (cache.vocab.tokenizer.tokenize_str(s)[0] for s in "12")
    batch.feed([a, cache.vocab.tokenizer.tokenize_str("[")[0], one])
    batch.context[0].insert(-1, b)  # row 0 holds one more token than the batch thinks (e.g. a resumed row)
    processed = batch.step(logits)
    row0 = batch.rows[0][1]
    assert row0.matcher.tokens == (b, a) and row0.consumed == 2
    ref = cache.matcher(constraint_from_request(BODIES[0]))
    assert ref.consume(b) and ref.consume(a)
    assert np.array_equal(np.isfinite(np.array(processed[0][0])), ref.allowed_mask())
    batch.feed([b, cache.vocab.tokenizer.tokenize_str('"')[0], two])
    batch.step(logits)
    assert row0.matcher.tokens == (b, a, b) and batch.rows[2][1].matcher.tokens == (one, two)


class ThreadNoted(Constrained):
    """Notes the thread each matcher takes its step's token on."""

    threads: list[str] = []

    def take(self, token: int) -> None:
        ThreadNoted.threads.append(threading.current_thread().name)
        super().take(token)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the worker thread is the CPU path")
def test_on_the_cpu_the_rows_matchers_walk_on_a_worker_thread_during_the_forward_pass(cache):
    batch = Batch(cache, ThreadNoted)
    logits = mx.zeros((len(BODIES), batch.size))
    batch.step(logits)  # first steps: each row alone, on the caller's thread
    ThreadNoted.threads.clear()
    batch.feed([cache.vocab.tokenizer.tokenize_str(s)[0] for s in ("a", "[", "1")])
    batch.step(logits)
    assert len(ThreadNoted.threads) == len(BODIES), "every walking row took its token in the batched step"
    assert all(name.startswith("mlxd-masks") for name in ThreadNoted.threads), ThreadNoted.threads
    assert threading.current_thread().name not in ThreadNoted.threads
    batch.masks.close()


def test_a_lone_walking_row_takes_its_token_on_the_callers_thread(cache):
    batch = Batch(cache, ThreadNoted, bodies=BODIES[:1])
    logits = mx.zeros((1, batch.size))
    batch.step(logits)  # its first step: alone
    ThreadNoted.threads.clear()
    batch.feed([cache.vocab.tokenizer.tokenize_str("a")[0]])
    reads = batch.reads
    batch.step(logits)
    assert batch.reads == reads + 1 and batch.rows[0][1].walks
    assert ThreadNoted.threads == [threading.current_thread().name]
    assert batch.masks._worker is None, "no worker thread for one row"


@pytest.mark.parametrize("vocab_size", [64, 1000, 8193])
def test_the_device_unpack_gives_numpys_bits(vocab_size):
    """A GPU step unpacks the rows' packed masks on the device: bit j of word i is token 32 * i + j, as numpy reads it."""
    words = (vocab_size + 31) // 32
    bits = np.random.default_rng(vocab_size).integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(np.bool_)
    got = StepMasks(dict, list)._unpacked(bits, vocab_size)
    assert got.dtype == mx.bool_ and np.array_equal(np.array(got), want)
