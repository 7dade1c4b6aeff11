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
def test_on_the_cpu_the_rows_matchers_walk_on_a_worker_thread_during_the_forward_pass(cache, monkeypatch):
    monkeypatch.delenv("MLXD_MASK_DEVICE", raising=False)  # the CPU's own path
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


# --- MLXD_MASK_MODE: where a GPU step's masks are made (run on the CPU with MLXD_MASK_DEVICE=gpu) ---

class AheadBatch(Batch):
    """A Batch whose generator holds the next step's input tokens as an array evaluated asynchronously,
    as mlx-lm's does; `step` starts the step the engine core's way (`StepMasks.start`)."""

    def __init__(self, cache: GrammarCache, part: type[Constrained] = Constrained,
                 bodies: tuple[dict, ...] = BODIES) -> None:
        super().__init__(cache, part, bodies)
        self.next: mx.array | None = None
        self.changed = False  # the batch changed between the start and the step: a new array
        self.masks.pending = lambda: None if self.next is None else (list(self.fed), self.next)
        self.masks.current = self._current

    def _current(self) -> tuple[list[int], mx.array] | None:
        if self.next is None:
            return None
        return list(self.fed), mx.array(self.next) if self.changed else self.next

    def step(self, logits: mx.array) -> list[mx.array]:
        self.masks.start()
        out = []
        for i, (row, part) in enumerate(self.rows):
            out.append(part.mask(row, mx.array(self.context[i]), logits[i : i + 1]))
        return out

    def feed(self, tokens: list[int], *, evaluated: bool = True) -> None:
        super().feed(tokens)
        self.next = mx.array([self.fed[uid] for uid in sorted(self.fed)]) + 0  # a graph, as a sampler's output
        if evaluated:
            mx.async_eval(self.next)
        self.masks.prepare()  # the generator's step returned (mode "ahead-early" starts the next one's masks)


def walk(cache: GrammarCache, batch: Batch, bodies: tuple[dict, ...], steps: int = 12, **feed: bool) -> int:
    """Decode `steps` steps, checking each row's masked logits against its own matcher; the reads it took."""
    alone = [cache.matcher(constraint_from_request(body)) for body in bodies]
    rng = random.Random(1)
    reads = batch.reads
    for step in range(steps):
        logits = mx.random.normal((len(bodies), batch.size), key=mx.random.key(step))
        processed = batch.step(logits)
        chosen = []
        for i, (got, ref) in enumerate(zip(processed, alone, strict=True)):
            allowed = ref.allowed_mask()
            assert np.array_equal(np.array(got[0]), np.where(allowed, np.array(logits[i]), -np.inf)), (step, i)
            allowed[list(cache.vocab.eos_ids)] = False
            token = int(rng.choice(np.flatnonzero(allowed)))
            assert ref.consume(token)
            chosen.append(token)
        batch.feed(chosen, **feed) if isinstance(batch, AheadBatch) else batch.feed(chosen)
    for (_, part), ref in zip(batch.rows, alone, strict=True):
        assert part.walks and part.matcher.tokens == ref.tokens[:-1] and part.consumed == len(ref.tokens) - 1
    batch.masks.close()
    return batch.reads - reads


@pytest.mark.parametrize("launch", ["early", "ready"])
@pytest.mark.parametrize("evaluated", [True, False], ids=["tokens scheduled", "tokens not scheduled yet"])
@pytest.mark.parametrize("mode", ["engine", "ahead", "ahead-bool", "ahead-early", "ahead-steal"])
@pytest.mark.parametrize("bodies", [BODIES, BODIES[:1], BODIES[1:2]], ids=["three rows", "one regex row", "one json row"])
def test_every_mask_mode_on_the_gpu_path_masks_as_each_row_alone_would(cache, bodies, mode, evaluated, launch,
                                                                      monkeypatch):
    """Ahead, a batch that changed holds a new array of tokens not scheduled yet: the engine thread
    schedules it before the worker waits for it (another thread cannot evaluate it). MLXD_MASK_LAUNCH:
    the forward launched at the first mask, or (ready) only when the ahead masks are not made yet."""
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", mode)
    monkeypatch.setenv("MLXD_MASK_LAUNCH", launch)
    batch = AheadBatch(cache, bodies=bodies)
    reads = walk(cache, batch, bodies, evaluated=evaluated)
    assert not batch.masks._device_is_cpu()
    # engine: one read per step after the first; ahead: the worker reads the array itself (ahead-steal: the
    # engine thread reads it for a step whose job the worker had not started yet)
    if mode == "ahead-steal":
        assert reads <= 11
    else:
        assert reads == (11 if mode == "engine" else 0)


def test_ahead_the_matchers_take_their_tokens_on_the_worker_before_the_step(cache, monkeypatch):
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", "ahead")
    batch = AheadBatch(cache, ThreadNoted)
    logits = mx.zeros((len(BODIES), batch.size))
    batch.step(logits)  # first steps: each row alone
    ThreadNoted.threads.clear()
    batch.feed([cache.vocab.tokenizer.tokenize_str(s)[0] for s in ("a", "[", "1")])
    batch.masks.start()
    batch.masks._ahead.future.result()  # the worker is done before any processor runs
    assert len(ThreadNoted.threads) == len(BODIES) and all(n.startswith("mlxd-masks") for n in ThreadNoted.threads)
    assert [part.consumed for _, part in batch.rows] == [1, 1, 1]  # fed ahead of the step
    batch.masks.close()


def test_ahead_early_the_worker_starts_when_the_last_step_returns_and_the_next_step_keeps_it(cache, monkeypatch):
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", "ahead-early")
    batch = AheadBatch(cache, ThreadNoted)
    logits = mx.zeros((len(BODIES), batch.size))
    batch.step(logits)  # first steps: each row alone
    ThreadNoted.threads.clear()
    batch.feed([cache.vocab.tokenizer.tokenize_str(s)[0] for s in ("a", "[", "1")])  # the step returned
    job = batch.masks._ahead
    assert job is not None, "the worker started before the next step"
    job.future.result()
    assert len(ThreadNoted.threads) == len(BODIES) and all(n.startswith("mlxd-masks") for n in ThreadNoted.threads)
    batch.masks.start()  # the next step: the same rows and tokens
    assert batch.masks._ahead is job
    batch.masks.close()


@pytest.mark.parametrize("mode", ["ahead", "ahead-early", "ahead-steal"])
@pytest.mark.parametrize("case", ["batch changed", "no processor ran"])
def test_ahead_work_for_another_step_is_rolled_back_and_the_step_done_the_engines_way(cache, case, mode, monkeypatch):
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", mode)
    batch = AheadBatch(cache)
    if case == "batch changed":
        batch.changed = True
        assert walk(cache, batch, BODIES) == 11  # every step read its tokens itself
    else:
        logits = mx.zeros((len(BODIES), batch.size))
        batch.step(logits)
        batch.feed([cache.vocab.tokenizer.tokenize_str(s)[0] for s in ("a", "[", "1")])
        batch.masks.start()  # a step that only prefilled: no constrained processor ran
        batch.masks.start()
        batch.masks.clear()
        assert [part.consumed for _, part in batch.rows] == [0, 0, 0]  # its feeds undone
        assert [len(part.matcher.tokens) for _, part in batch.rows] == [0, 0, 0]
        batch.masks.close()


@pytest.mark.parametrize("kept", ["0", "1", "64"], ids=["none kept", "one kept", "64 kept"])
@pytest.mark.parametrize(("mode", "device"), [("ahead-early", "gpu"), ("ahead-steal", "gpu"), ("ahead-bool", "gpu"),
                                              ("engine", "gpu"), ("engine", "cpu")])
@pytest.mark.parametrize("bodies", [BODIES, BODIES[:1]], ids=["three rows", "one regex row"])
def test_kept_device_masks_mask_as_each_row_alone_would(cache, bodies, mode, device, kept, monkeypatch):
    """MLXD_MASK_CACHE: a step whose rows' bits match kept masks reuses them; with one kept, the worker's
    view of what is kept goes stale between rows (unpacked on the engine thread then); none: copied every step."""
    if device == "cpu" and mx.default_device() != mx.cpu:
        pytest.skip("the CPU path")
    monkeypatch.setenv("MLXD_MASK_DEVICE", device)
    monkeypatch.setenv("MLXD_MASK_MODE", mode)
    monkeypatch.setenv("MLXD_MASK_CACHE", kept)
    batch = AheadBatch(cache, bodies=bodies)
    walk(cache, batch, bodies, steps=16)
    assert len(batch.masks._kept) <= int(kept)


@pytest.mark.parametrize("mode", ["ahead-early", "ahead-bool"])
@pytest.mark.parametrize("bodies", [BODIES, BODIES[:1]], ids=["three rows", "one regex row"])
def test_a_step_whose_masks_are_made_launches_once_and_masks_as_each_row_alone_would(cache, bodies, mode, monkeypatch):
    """MLXD_MASK_LAUNCH=ready: when the ahead job is done at the first mask, the forward pass is not
    launched there (the step's own launch takes it); when it is not, it is, as "early" always does."""
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", mode)
    monkeypatch.setenv("MLXD_MASK_LAUNCH", "ready")
    launches = [0, 0]  # at the first mask: [with the job done, with it not done]
    real = StepMasks._compute

    def compute(self, logits):
        if self._ahead is not None:
            launches[not self._ahead.future.done()] += 1
        return real(self, logits)

    monkeypatch.setattr(StepMasks, "_compute", compute)
    batch = AheadBatch(cache, bodies=bodies)
    walk(cache, batch, bodies)
    assert sum(launches) == 11  # every step after the first had an ahead job


@pytest.mark.parametrize("bodies", [BODIES, BODIES[:1]], ids=["three rows", "one regex row"])
def test_ahead_steal_the_engine_thread_makes_the_masks_of_a_job_the_worker_has_not_started(cache, bodies, monkeypatch):
    """The worker is busy (a busy host's late wake-up): the step's first mask claims the job, feeds the
    matchers on the engine thread and masks as each row alone would; the worker then drops the job."""
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", "ahead-steal")
    batch = AheadBatch(cache, ThreadNoted, bodies=bodies)
    alone = [cache.matcher(constraint_from_request(body)) for body in bodies]
    logits = mx.random.normal((len(bodies), batch.size), key=mx.random.key(0))
    batch.step(logits)  # first steps: each row alone
    first = [cache.vocab.tokenizer.tokenize_str(s)[0] for s in ("a", "[", "1")][: len(bodies)]
    for ref, token in zip(alone, first, strict=True):
        assert ref.consume(token)
    release = threading.Event()
    batch.masks._pool().submit(release.wait)  # the worker cannot start the next job
    ThreadNoted.threads.clear()
    batch.feed(first)  # the step returned: the job is queued behind the busy worker
    job = batch.masks._ahead
    assert job is not None and job.claim is not None
    processed = batch.step(logits)
    assert ThreadNoted.threads == [threading.current_thread().name] * len(bodies), "fed on the engine thread"
    for i, (got, ref) in enumerate(zip(processed, alone, strict=True)):
        assert np.array_equal(np.array(got[0]), np.where(ref.allowed_mask(), np.array(logits[i]), -np.inf))
    release.set()
    assert job.future.result() is None  # the worker dropped it: nothing fed twice
    assert [part.consumed for _, part in batch.rows] == [1] * len(bodies)
    assert [part.matcher.tokens for _, part in batch.rows] == [(t,) for t in first]
    batch.masks.close()


def test_a_mask_whose_bits_were_seen_is_the_kept_device_array(cache, monkeypatch):
    """The regex row offers the same tokens step after step: after its first batched step its mask is
    one device array, never unpacked or copied again."""
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", "ahead-early")
    unpacks: list[int] = []
    real = np.unpackbits

    def counted(*a, **k):
        unpacks.append(1)
        return real(*a, **k)

    monkeypatch.setattr(np, "unpackbits", counted)
    batch = AheadBatch(cache, bodies=BODIES[:1])
    a = cache.vocab.tokenizer.tokenize_str("a")[0]
    logits = mx.zeros((1, batch.size))
    masks = []
    for _ in range(6):
        batch.step(logits)
        masks.append(batch.masks._step[0] if batch.masks._step else None)
        batch.feed([a])
    assert masks[1] is not None and all(m is masks[1] for m in masks[2:])
    assert len(batch.masks._kept) == 1
    assert len(unpacks) == 2, "the row's first step (its own way) and the first batched step"
    batch.masks.close()


def test_an_unknown_mask_mode_is_refused_when_the_engine_builds_its_masks(monkeypatch):
    monkeypatch.setenv("MLXD_MASK_MODE", "sideways")
    with pytest.raises(ValueError, match="MLXD_MASK_MODE"):
        StepMasks(dict, list)
    monkeypatch.delenv("MLXD_MASK_MODE")
    monkeypatch.setenv("MLXD_MASK_THREADS", "0")
    with pytest.raises(ValueError, match="MLXD_MASK_THREADS"):
        StepMasks(dict, list)
    monkeypatch.delenv("MLXD_MASK_THREADS")
    monkeypatch.setenv("MLXD_MASK_CACHE", "-1")
    with pytest.raises(ValueError, match="MLXD_MASK_CACHE"):
        StepMasks(dict, list)
    monkeypatch.delenv("MLXD_MASK_CACHE")
    monkeypatch.setenv("MLXD_MASK_LAUNCH", "later")
    with pytest.raises(ValueError, match="MLXD_MASK_LAUNCH"):
        StepMasks(dict, list)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_fill_threads_change_no_mask(cache, threads, monkeypatch):
    """MLXD_MASK_THREADS sizes llguidance's pool for the batched fill; the masks are each row's own."""
    monkeypatch.setenv("MLXD_MASK_DEVICE", "gpu")
    monkeypatch.setenv("MLXD_MASK_MODE", "ahead-early")
    monkeypatch.setenv("MLXD_MASK_THREADS", threads)
    batch = AheadBatch(cache)
    assert walk(cache, batch, BODIES) == 0
    assert list(batch.masks._fillers) == [int(threads)]


MIXED = ({"regex": "[a-z ]{0,400}"}, {"guided_json": LIST}, None, {"regex": "[0-9 ]{1,400}"})


async def decode_mixed(model_dir: Path, speculative: str) -> list[list[int]]:
    """Three constrained greedy rows and a free one, decoded together; each row's tokens."""
    import trio

    from mlxd import RuntimeConfig, SamplingParams, open_runtime

    config = RuntimeConfig(model=str(model_dir), max_batch=4, device_probe="off", speculative=speculative)
    out: list[list[int]] = [[] for _ in MIXED]
    async with open_runtime(config) as rt:
        no_eos = tuple((t, -100.0) for t in sorted(rt.info.eos_token_ids))
        prompt = rt.encode("Write words and numbers. " * 3)

        async def row(i: int) -> None:
            body = MIXED[i]
            s = SamplingParams(max_tokens=40, logit_bias=no_eos,
                               constraint=constraint_from_request(body) if body else None)
            async with rt.submit(rt.request(prompt, sampling=s)) as stream:
                out[i] = await stream.tokens()

        async with trio.open_nursery() as nursery:
            for i in range(len(MIXED)):
                nursery.start_soon(row, i)
    return out


@pytest.mark.parametrize("speculative", ["off", "ngram"])
async def test_every_mask_mode_decodes_a_mixed_greedy_batch_as_the_cpu_path_does(tiny_model_dir, monkeypatch, speculative):
    """The GPU path's modes (forced on the CPU) give the same greedy tokens as the CPU path, speculating or not,
    with kept device masks or without."""
    runs = {}
    for mode, device, kept, launch in [
        ("engine", "cpu", "0", "early"), ("engine", "cpu", "64", "early"), ("engine", "gpu", "64", "early"),
        ("ahead", "gpu", "64", "early"), ("ahead-bool", "gpu", "64", "early"), ("ahead-early", "gpu", "0", "early"),
        ("ahead-early", "gpu", "64", "early"), ("ahead-early", "gpu", "64", "ready"), ("ahead-steal", "gpu", "64", "early"),
    ]:
        monkeypatch.setenv("MLXD_MASK_MODE", mode)
        monkeypatch.setenv("MLXD_MASK_DEVICE", device)
        monkeypatch.setenv("MLXD_MASK_CACHE", kept)  # 0: every mask copied every step (before kept masks)
        monkeypatch.setenv("MLXD_MASK_LAUNCH", launch)
        runs[mode, device, kept, launch] = await decode_mixed(tiny_model_dir, speculative)
    reference = runs["engine", "cpu", "0", "early"]
    assert all(len(tokens) == 40 for tokens in reference)
    for key, tokens in runs.items():
        assert tokens == reference, key


async def test_the_engine_sets_the_gil_switch_interval_while_it_runs(tiny_model_dir, monkeypatch):
    """MLXD_GIL_SWITCH_MS: how soon a thread waiting for the GIL (the ahead mask worker) gets it; restored at close."""
    import sys

    from mlxd import RuntimeConfig, SamplingParams, open_runtime

    before = sys.getswitchinterval()
    monkeypatch.setenv("MLXD_GIL_SWITCH_MS", "0.5")
    async with open_runtime(RuntimeConfig(model=str(tiny_model_dir), device_probe="off")) as rt:
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        async with rt.submit(rt.request(rt.encode("Hello"), sampling=SamplingParams(max_tokens=3))) as stream:
            assert len(await stream.tokens()) == 3
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("value", ["0", "-1", "fast", "2000"])
def test_a_bad_gil_switch_interval_is_refused(value, monkeypatch):
    from mlxd.engine.features import gil_switch_ms

    monkeypatch.setenv("MLXD_GIL_SWITCH_MS", value)
    with pytest.raises(ValueError, match="MLXD_GIL_SWITCH_MS"):
        gil_switch_ms()
