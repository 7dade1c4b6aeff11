"""`--draft-model DIR`: a small model proposes each row's drafts (greedy), with its own KV per row.

The draft model is loaded beside the target at `EngineCore.load()` and must
share its tokenizer (the same vocabulary, id for id: checked, and refused with
a message otherwise). Each speculating row keeps a `ModelDrafts`: the draft's
own caches and the tokens they hold. At a step it cuts those caches back to
what they share with the row (rejected drafts go), feeds what is missing and
then K greedy tokens, chained lazily and evaluated once. Runs on the engine's
MLX thread only.

The draft's KV follows the target's prefix cache: its checkpoints are cache
entries of their own namespace (`draft_namespace`: the target's namespace plus
the draft's identity), published when the target publishes its own (the
prompt boundary, the row's end) and cut to accepted tokens, so the RAM tier,
SSD spill and restore, flush and restarts carry them like any entry. A row
starts from the draft's longest cached prefix (`start`), which may be shorter
than the target's: the draft then prefills only the rest at its first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from mlxd.engine.ops import ModelRefused
from mlxd.engine.speculative import DraftPrefixCounts


@attrs.frozen(eq=False)
class DraftModel:
    """The loaded draft model (shared by every row's `ModelDrafts`)."""

    path: Path
    model: Any
    prefill_step: int = 512
    tag: str = ""  # the draft's content identity (short): its cache entries' namespace suffix
    # A vision target's image placeholder id: the draft (no vision tower) reads an image's span as
    # that placeholder, repeated (kv/media.py's `model_tokens`); None for a text-only target.
    placeholder: int | None = None

    def ids(self, tokens: Sequence[int]) -> list[int]:
        """The ids the draft reads for `tokens` (key tokens: an image's media ids become the placeholder)."""
        from mlxd.kv.media import MEDIA_BASE, model_tokens

        if self.placeholder is None:
            if any(t >= MEDIA_BASE for t in tokens):
                raise ValueError("an image span reached a draft model with no placeholder id")
            return list(tokens)
        return model_tokens(tokens, self.placeholder)


def load_draft(path: str, target_tokenizer: Any, *, prefill_step: int, placeholder: int | None = None) -> DraftModel:
    """Load `--draft-model`, refusing one whose tokenizer or caches cannot serve as a draft.

    `placeholder`: a vision target's image placeholder id (what the draft reads in an image's span)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlxd.engine.loading import cast_float_weights
    from mlxd.model.detok import load_model
    from mlxd.model.identity import model_identity

    where = Path(path).expanduser()
    if not (where / "config.json").exists():
        raise ModelRefused(f"--draft-model {path}: no config.json there (a local model directory is needed)")
    model, tokenizer = load_model(where)
    mismatch = tokenizer_mismatch(target_tokenizer, tokenizer)
    if mismatch is not None:
        raise ModelRefused(f"--draft-model {path}: its tokenizer is not the model's ({mismatch}); "
                           "a draft must use the same token ids")
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache})
    if kinds:
        raise ModelRefused(f"--draft-model {path}: its caches ({', '.join(kinds)}) cannot drop rejected drafts")
    if mx.default_device() == mx.cpu:
        cast_float_weights(model, mx.float32)
    return DraftModel(where, model, prefill_step, tag=model_identity(where)[:16], placeholder=placeholder)


def tokenizer_mismatch(target: Any, draft: Any) -> str | None:
    """Why two tokenizers differ in the ids they give (None: the same vocabulary and end tokens)."""
    a, b = _vocab(target), _vocab(draft)
    if len(a) != len(b):
        return f"{len(b)} tokens, the model has {len(a)}"
    differ = [t for t in a if b.get(t) != a[t]]
    if differ:
        return f"{len(differ)} tokens have other ids, e.g. {differ[0]!r}"
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        return f"end tokens {sorted(draft.eos_token_ids)}, the model's are {sorted(target.eos_token_ids)}"
    return None


def _vocab(tokenizer: Any) -> dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return dict(inner.get_vocab())


@attrs.define
class ModelDrafts:
    """One row's drafts from the draft model: its caches, the tokens they hold, its prefix counts."""

    draft: DraftModel
    prefix: DraftPrefixCounts = attrs.Factory(DraftPrefixCounts)  # shared by the engine's rows
    caches: list[Any] | None = None
    held: list[int] = attrs.Factory(list)
    accepted: int = 0  # leading tokens of `held` that the row is known to hold (the rest are unverified drafts)
    first_step: bool = True
    computed: int = 0  # prefix tokens the first step computed (not from the cache)
    # The row's prefix: the tokens its draft's cache lookup was made with (the prompt, or a resumed
    # generation's prompt and emitted tokens); 0: all the row holds at its first step.
    prefix_tokens: int = 0

    def start(self, caches: list[Any] | None, tokens: Sequence[int]) -> None:
        """Begin from a cached prefix of the draft's KV (lent caches holding exactly `tokens`)."""
        if caches is not None and tokens:
            self.caches, self.held = caches, list(tokens)
            self.accepted = len(tokens)

    def propose(self, tokens: Sequence[int], pending: int, k: int) -> list[int]:
        import mlx.core as mx

        from mlxd.engine.spec_batch import whole_buffers

        if k <= 0:
            return []
        seq = [*tokens, pending]
        feed = self._catch_up(seq, self.draft.prefill_step)  # a long prefix (a row's first step) in chunks
        model = self.draft.model
        assert self.caches is not None
        caches = whole_buffers(self.caches) if len(feed) > 1 else self.caches  # CUDA: a plan per buffer size
        y = mx.argmax(model(mx.array([feed]), cache=caches)[:, -1, :], axis=-1)
        drafts = [y]
        for _ in range(k - 1):
            y = mx.argmax(model(y[:, None], cache=self.caches)[:, -1, :], axis=-1)
            drafts.append(y)
        out: list[int] = mx.concatenate(drafts).tolist()  # type: ignore[assignment]
        self.held = seq + out[:-1]  # the last draft is not fed yet
        self.accepted = len(seq)  # the pending token is always emitted; the drafts are not verified yet
        return out

    def _catch_up(self, seq: list[int], most: int) -> list[int]:
        """Cut the caches back to what they share with `seq` (rejected drafts go) and feed the missing
        ids but the last `most` or fewer (at least the pending token's), which are returned."""
        from mlx_lm.models.cache import make_prompt_cache

        if self.caches is None:
            self.caches = make_prompt_cache(self.draft.model)
        keep = _shared(self.held, seq)
        keep = min(keep, len(seq) - 1)  # at least the pending token is fed: its logits give the first draft
        if self.first_step:  # the row's prefix: how much came from the cache, how much the draft computes
            self.first_step = False  # (a first step the gate or back-off delayed reads later tokens too: not counted)
            prefix = min(self.prefix_tokens or len(seq) - 1, len(seq) - 1)
            self.computed = max(0, prefix - keep)
            self.prefix.reused += min(keep, prefix)
            self.prefix.recomputed += self.computed
        if keep < len(self.held):
            for c in self.caches:
                c.trim(len(self.held) - keep)
        ids = self.draft.ids(seq[keep:])
        if len(ids) > most:
            self._feed(ids[:-most], whole=True)
            keep, ids = keep + len(ids) - most, ids[-most:]
        self.held = seq[:keep]
        return ids

    def _feed(self, ids: list[int], *, whole: bool) -> list[int]:
        """Feed `ids` into the caches in prefill-step chunks: all of them (`whole`), or all but the
        last chunk of at most one step, which is returned (its logits are the caller's)."""
        import mlx.core as mx

        assert self.caches is not None
        step = self.draft.prefill_step
        while len(ids) > step or (whole and ids):
            chunk, ids = ids[:step], ids[step:]
            self.draft.model(mx.array([chunk]), cache=self.caches)
            mx.eval([c.state for c in self.caches])
        return ids

    def checkpoint(self, tokens: Sequence[int] | None = None, *, complete: bool = False) -> tuple[list[Any], list[int]]:
        """The draft's KV (new array objects) over accepted tokens: those it shares with `tokens`
        (the row's), or without them the ones known accepted at the last step. Empty: nothing held.

        `complete` (the row's end: its caches are not needed after): the row's tokens the draft
        has not read yet (those emitted after its last proposal, and steps it sat out) are run
        through it first, so the checkpoint holds every one of `tokens`."""
        from mlxd.kv import kinds

        n = self.accepted if tokens is None else min(_shared(self.held, tokens), len(self.held))
        if self.caches is None or n <= 0 or self.first_step:  # never ran: it holds only what the cache lent it
            return [], []
        if complete and tokens is not None and len(tokens) > n:
            for c in self.caches:  # unverified drafts go, then the missing accepted tokens are read
                c.trim(len(self.held) - n)
            self._feed(self.draft.ids(tokens[n:]), whole=True)
            self.held, self.accepted = list(tokens), len(tokens)
            n = len(tokens)
        return kinds.lend(self.caches, n), self.held[:n]


def propose_rows(asks: Sequence[tuple[ModelDrafts, Sequence[int], int, int]]) -> list[list[int]]:
    """Drafts for several rows of one draft model, `(row, tokens, pending, k)` each: one draft
    forward per draft position for all of them, over a batch cache built from the rows' own KV.

    Each row first catches up alone on what it misses beyond `1 + k` tokens (a row's first step,
    or one that sat out); then every row feeds the same number of ids, ending with its pending
    token: a row with fewer new ids feeds again the ids just before them (its caches cut back by
    as many), so the rows' positions line up with no gap (the batch cache's left padding covers
    only a row too short to have them). The rows' caches after the step are views of the batch's.
    """
    import mlx.core as mx

    from mlxd.engine.spec_batch import whole_buffers

    if not asks:
        return []
    if len(asks) == 1:
        row, tokens, pending, k = asks[0]
        return [row.propose(tokens, pending, k)]
    draft = asks[0][0].draft
    if any(a[0].draft is not draft for a in asks):
        raise ValueError("rows of different draft models cannot propose together")
    k = max(a[3] for a in asks)
    seqs = [[*tokens, pending] for _, tokens, pending, _ in asks]
    feeds = [row._catch_up(seq, 1 + k) for (row, *_), seq in zip(asks, seqs, strict=True)]
    width = max(len(f) for f in feeds)
    pads: list[int] = []
    for (row, *_), f in zip(asks, feeds, strict=True):
        back = min(width - len(f), len(row.held))  # ids fed again so that every row feeds `width`
        if back:
            assert row.caches is not None
            for c in row.caches:
                c.trim(back)
            f[:0] = draft.ids(row.held[-back:])
            del row.held[-back:]
        pads.append(width - len(f))
    caches, starts = _batch_caches([row.caches for row, *_ in asks], pads, room=width + k)  # type: ignore[misc]
    inputs = mx.array([[0] * p + f for p, f in zip(pads, feeds, strict=True)])
    model = draft.model
    fed = whole_buffers(caches) if inputs.shape[1] > 1 else caches  # CUDA: a plan per buffer size
    y = mx.argmax(model(inputs, cache=fed)[:, -1, :], axis=-1)
    drafts = [y]
    for _ in range(k - 1):
        y = mx.argmax(model(y[:, None], cache=caches)[:, -1, :], axis=-1)
        drafts.append(y)
    out: list[list[int]] = mx.stack(drafts, axis=1).tolist()  # type: ignore[assignment]
    proposals = []
    for i, ((row, _, _, row_k), seq) in enumerate(zip(asks, seqs, strict=True)):
        row.caches = [_row_view(c, i, starts[i]) for c in caches]
        row.held = seq + out[i][:-1]  # the last draft is not fed
        row.accepted = len(seq)
        proposals.append(out[i][:row_k])
    return proposals


def _batch_caches(rows: list[list[Any]], pads: list[int], *, room: int) -> tuple[list[Any], list[int]]:
    """One `BatchKVCache` per layer holding every row's KV, right-aligned (a row's `pads` more
    positions are padding past its start), with room for `room` more positions; and where each
    row starts (its left padding)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    lengths = [r[0].offset for r in rows]
    end = max(lengths)
    left = [end - n + p for n, p in zip(lengths, pads, strict=True)]
    size = -(-(end + room) // BatchKVCache.step) * BatchKVCache.step
    out = []
    for layer in range(len(rows[0])):
        cache = BatchKVCache(left)
        cache.offset = mx.array([n - p for n, p in zip(lengths, pads, strict=True)])
        held = [r[layer] for r in rows if r[layer].offset > 0]
        if held:
            _, heads, _, dk = held[0].keys.shape
            dv, dtype = held[0].values.shape[3], held[0].keys.dtype
            keys = mx.zeros((len(rows), heads, size, dk), dtype)
            values = mx.zeros((len(rows), heads, size, dv), dtype)
            for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
                if n:
                    keys[i : i + 1, :, end - n : end] = r[layer].keys[..., :n, :]
                    values[i : i + 1, :, end - n : end] = r[layer].values[..., :n, :]
            cache.keys, cache.values, cache._idx = keys, values, end
        out.append(cache)
    return out, left


def _row_view(cache: Any, i: int, start: int) -> Any:
    """Row `i` of a batch cache (its KV from `start`) as a `KVCache` over a view of its arrays."""
    from mlx_lm.models.cache import KVCache

    row = KVCache()
    row.keys = cache.keys[i : i + 1, :, start : cache._idx]
    row.values = cache.values[i : i + 1, :, start : cache._idx]
    row.offset = cache._idx - start
    return row


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
