"""MLXD_CARRY_ROWS (model/carry_rows.py): a row that ends while others decode stays in mlx-lm's generation batch,
its tokens discarded, for a step (`CARRY_STEPS`), or until the others end, rows join, or prompts wait; every row
decodes the same tokens as with mlx-lm's filter at every end, and a batch whose rows end a step apart is never
copied."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache
from tests.serving import rows_ending_apart, served_with_patch

from mlxd.model import carry_rows


@pytest.fixture
def carrying(request) -> Iterator[bool]:
    """Carrying on (True) or mlx-lm's filter at every end (False), restored after."""
    was = bool(carry_rows._ORIGINAL)
    carry_rows.uninstall()
    if request.param:
        carry_rows.install(force=True)
    yield request.param
    carry_rows.uninstall()
    if was:
        carry_rows.install(force=True)


class Filters:
    """Counts the batch KV caches' gathers (`BatchKVCache.filter`, one per layer per filter)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        inner = BatchKVCache.filter

        def counted(cache: Any, indices: Any) -> None:
            self.calls += 1
            inner(cache, indices)

        monkeypatch.setattr(BatchKVCache, "filter", counted)


def decode(model: Any, prompts: list[list[int]], limits: list[int], *, batch: int = 8,
           late: dict[int, tuple[list[int], int]] | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of each prompt under mlx-lm's BatchGenerator, and the generation batch's uids after every
    step; `late` inserts {step: (prompt, max_tokens)} after that step."""
    gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch)
    uids = gen.insert(prompts, max_tokens=limits)
    out: dict[int, list[int]] = {u: [] for u in uids}
    wanted = dict(zip(uids, limits, strict=True))
    rows: list[list[int]] = []
    try:
        for step in range(400):
            _, responses = gen.next()
            for r in responses:
                assert r.uid in out and len(out[r.uid]) < wanted[r.uid], "a carried row's token came out"
                out[r.uid].append(r.token)
            rows.append(list(gen._generation_batch.uids))
            if late and step in late:
                prompt, limit = late.pop(step)
                (uid,) = gen.insert([prompt], max_tokens=[limit])
                out[uid], wanted[uid] = [], limit
                uids.append(uid)
            if not late and all(len(out[u]) == wanted[u] for u in uids) and not gen._generation_batch.uids:
                break
    finally:
        gen.close()
    return [out[u] for u in uids], rows


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"row {i} " + "words and more words " * (2 + 3 * i)) for i in range(n)]


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("carrying", [True], indirect=True)
def test_a_row_that_ends_is_carried_for_its_steps(tiny_model, carrying, steps, monkeypatch):
    monkeypatch.setattr(carry_rows, "CARRY_STEPS", steps)
    model, tokenizer = tiny_model
    ours, rows = decode(model, prompts(tokenizer, 4), [3, 40, 40, 40])
    carry_rows.uninstall()
    theirs, plain_rows = decode(model, prompts(tokenizer, 4), [3, 40, 40, 40])
    assert ours == theirs and [len(t) for t in ours] == [3, 40, 40, 40]
    first = next(uids for uids in rows if uids)[0]
    joined = next(i for i, uids in enumerate(plain_rows) if uids)
    ended = next(i for i in range(joined, len(plain_rows)) if first not in plain_rows[i])  # mlx-lm filtered it
    assert all(first in uids for uids in rows[ended:ended + steps])  # carried
    assert first not in rows[ended + steps] and len(rows[ended + steps]) == 3  # then filtered out, a step late


@pytest.mark.parametrize("carrying", [True], indirect=True)
def test_rows_ending_a_step_apart_are_never_copied(tiny_model, carrying, monkeypatch):
    model, tokenizer = tiny_model
    filters = Filters(monkeypatch)
    ours, rows = decode(model, prompts(tokenizer, 4), [5, 6, 6, 6])
    assert [len(t) for t in ours] == [5, 6, 6, 6]
    assert rows[-2] == rows[-3] and len(rows[-2]) == 4 and rows[-1] == []  # all four to the end, then none
    carried = filters.calls  # (the prompt batch's own filters, as the rows move on to generation)
    carry_rows.uninstall()
    theirs, _ = decode(model, prompts(tokenizer, 4), [5, 6, 6, 6])
    assert ours == theirs
    assert filters.calls - carried == carried + len(model.layers)  # mlx-lm: one gather a layer when the first ends


@pytest.mark.parametrize("carrying", [True], indirect=True)
def test_carried_rows_leave_when_others_join_or_wait(tiny_model, carrying, monkeypatch):
    monkeypatch.setattr(carry_rows, "CARRY_STEPS", 8)  # (carried long enough to see them leave for these)
    model, tokenizer = tiny_model
    # a prompt arriving after the first row ended, with room in the batch: it joins, the carried row leaves first
    late_prompt = tokenizer.encode("a late row " + "more words " * 9)
    limits = [2, 30, 30, 30, 30]
    ours, rows = decode(model, prompts(tokenizer, 5), limits, late={3: (late_prompt, 6)})
    carry_rows.uninstall()
    theirs, _ = decode(model, prompts(tokenizer, 5), limits, late={3: (late_prompt, 6)})
    assert ours == theirs and [len(t) for t in ours] == [*limits, 6]
    first, joined = next(uids for uids in rows if uids)[0], max(max(uids) for uids in rows if uids)
    at = next(i for i, uids in enumerate(rows) if joined in uids)
    assert first in rows[at - 1] and first not in rows[at]
    # a full batch (4 rows): the prompt waits for room, and the carried row does not hold it
    carry_rows.install(force=True)
    limits = [2, 40, 40, 40]
    full, rows = decode(model, prompts(tokenizer, 4), limits, batch=4, late={3: (late_prompt, 6)})
    carry_rows.uninstall()
    plain, plain_rows = decode(model, prompts(tokenizer, 4), limits, batch=4, late={3: (late_prompt, 6)})
    assert full == plain and len(full[4]) == 6
    joined = max(max(uids) for uids in rows if uids)
    at = next(i for i, uids in enumerate(rows) if joined in uids)
    assert at == next(i for i, uids in enumerate(plain_rows) if joined in uids)  # no later than with mlx-lm's filter
    assert first in rows[at - 3] and first not in rows[at]  # (carried until the prompt was let in)


@pytest.mark.parametrize("carrying", [True], indirect=True)
def test_a_cancelled_row_leaves_no_carried_rows_behind(tiny_model, carrying, monkeypatch):
    monkeypatch.setattr(carry_rows, "CARRY_STEPS", 8)
    model, tokenizer = tiny_model
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    try:
        first, second = gen.insert(prompts(tokenizer, 2), max_tokens=[2, 50])
        for _ in range(5):
            gen.next()
        assert gen._generation_batch.uids == [first, second]  # the first ended, carried
        assert carry_rows.carried(gen._generation_batch) == {first}
        gen.remove([second])  # the one row going on is cancelled: nothing is left to decode
        assert gen._generation_batch.uids == [] and not carry_rows.carried(gen._generation_batch)
        assert gen.next() == ([], [])
    finally:
        gen.close()


def test_it_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv(carry_rows.ENV, raising=False)
    assert carry_rows.wanted()
    monkeypatch.setenv(carry_rows.ENV, "0")
    assert not carry_rows.wanted()


def test_served_rows_ending_in_different_steps_decode_the_same_carried(tiny_model_dir, monkeypatch):
    rows = rows_ending_apart(tiny_model_dir, [3, 7, 11, 12], spread=5)  # ends 4 steps apart, the last two 1
    plain = served_with_patch(carry_rows, monkeypatch, rows, False)
    ours = served_with_patch(carry_rows, monkeypatch, rows, True)
    carry_rows.uninstall()
    assert [len(r) for r in ours] == [3, 7, 11, 12]
    assert ours == plain
