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

import time
import weakref
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
    # The rows' batch cache, kept from step to step (a weak reference to a `DraftBatch`: the rows'
    # slots keep it, so it goes with the last of them), and the draft's KV shapes per layer:
    # mutable state of the engine's MLX thread.
    batch: list[Any] = attrs.Factory(list)
    kv_shapes: list[Any] = attrs.Factory(list)

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


def forward_cost(draft: Any, target: Any) -> float:
    """What a draft forward costs next to a target forward, from their weights' bytes (a decode
    step reads every weight once: it is bound by memory on a GPU, by the same multiply-adds on a CPU)."""
    from mlx.utils import tree_flatten

    def nbytes(model: Any) -> int:
        return sum(int(a.nbytes) for _, a in tree_flatten(model.parameters()))

    whole = nbytes(target)
    return nbytes(draft) / whole if whole else 0.0


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
    # The most drafts a step asks for (--num-draft-tokens): a step's first draft forward feeds up to 1 + this
    # many new ids (the last step's accepted run) even when it drafts fewer (the row's chosen length), so a
    # shorter draft costs no forward alone on top; 0: the k asked.
    most: int = 0

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
        feed = self._catch_up(seq, 1 + max(k, self.most))  # a long prefix (a row's first step) fed alone first, timed (the gate)
        model = self.draft.model
        self._own()
        assert self.caches is not None
        caches = whole_buffers(self.caches) if len(feed) > 1 else self.caches  # CUDA: a plan per buffer size
        y = mx.argmax(model(mx.array([feed]), cache=caches)[:, -1, :], axis=-1)
        drafts = [y]
        for _ in range(k - 1):
            mx.eval(y)  # forward by forward: the next one's KV write then goes in place (propose_rows)
            y = mx.argmax(model(y[:, None], cache=self.caches)[:, -1, :], axis=-1)
            drafts.append(y)
        out: list[int] = mx.concatenate(drafts).tolist()  # type: ignore[assignment]
        self.held = seq + out[:-1]  # the last draft is not fed yet
        self.accepted = len(seq)  # the pending token is always emitted; the drafts are not verified yet
        return out

    def _catch_up(self, seq: list[int], most: int, *, feed: bool = True) -> list[int]:
        """Cut the caches back to what they share with `seq` (rejected drafts go) and feed the missing
        ids but the last `most` or fewer (at least the pending token's), which are returned; without
        `feed`, every missing id is returned (the draft batch feeds them: `propose_rows`)."""
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
        if len(ids) > most and feed:
            self._feed(ids[:-most], whole=True)
            keep, ids = keep + len(ids) - most, ids[-most:]
        self.held = seq[:keep]
        return ids

    def _feed(self, ids: list[int], *, whole: bool) -> list[int]:
        """Feed `ids` into the caches in prefill-step chunks: all of them (`whole`), or all but the
        last chunk of at most one step, which is returned (its logits are the caller's)."""
        import mlx.core as mx

        from mlxd.engine import spec_batch

        began = time.perf_counter()
        self._own()
        assert self.caches is not None
        step = self.draft.prefill_step
        while len(ids) > step or (whole and ids):
            chunk, ids = ids[:step], ids[step:]
            if spec_batch.WHOLE_BUFFER:  # CUDA: a bucket's width over the whole buffer (one plan per pair)
                pad = fed_width(len(chunk), step) - len(chunk)
                self.draft.model(mx.array([chunk + [chunk[-1]] * pad]), cache=spec_batch.whole_buffers(self.caches))
                for c in self.caches if pad else ():
                    c.trim(pad)  # the padding's KV (after every real id: none of them attended to it)
            else:
                self.draft.model(mx.array([chunk]), cache=self.caches)
            mx.eval([c.state for c in self.caches])
        self.prefix.alone_s += time.perf_counter() - began  # the engine's gate is charged with it
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
        if isinstance(self.caches[0], _Slot):  # the row's KV in the draft batch: its tokens copied out
            slot = self.caches[0]
            return slot.batch.copy_out(slot.i, n), self.held[:n]
        return kinds.lend(self.caches, n), self.held[:n]

    def _own(self) -> None:
        """Before a forward of the row's own: its KV out of the draft batch (its tokens copied)."""
        if self.caches and isinstance(self.caches[0], _Slot):
            slot = self.caches[0]
            self.caches = slot.batch.copy_out(slot.i, slot.offset)


def fed_width(n: int, most: int) -> int:
    """The width a catch-up of `n` ids is fed at on CUDA (padded after its last id): 16 at least, then
    powers of two to 128, then multiples of 128, at most `most` (the prefill step) and never under `n`.
    A draft's catch-up (its prefix at a row's first draft, the tokens of steps it sat out) has a new
    length nearly every time, and CUDA's attention builds a plan per exact shape (model/suffix_attention.py):
    in buckets, a handful of widths over the whole buffer's 256-position sizes makes every plan."""
    width = 16 if n <= 16 else 1 << (n - 1).bit_length() if n <= 128 else -(-n // 128) * 128
    return max(n, min(width, most))


@attrs.define
class CopyCounter:
    """KV bytes the draft batch copied (rows gathered into a new batch, a row copied into its slot,
    a row's KV copied out of the batch): what a step costs beyond its forwards, growing with the context."""

    bytes: int = 0
    builds: int = 0  # batches built (every row gathered)
    adopted: int = 0  # rows copied into a slot of the batch kept from the step before
    copied_out: int = 0  # rows whose KV left the batch (a forward of their own, a checkpoint)


COPIED = CopyCounter()  # the process's figures (benchmarks/bench_verify_step.py reads them)


def propose_rows(asks: Sequence[tuple[ModelDrafts, Sequence[int], int, int]]) -> list[list[int]]:
    """Drafts for several rows of one draft model, `(row, tokens, pending, k)` each: one draft
    forward per draft position for all of them, over the draft model's `DraftBatch`.

    Each row cuts its KV back to what it shares with its tokens (rejected drafts go: a row of the
    batch only lowers its length) and catches up on what it misses beyond `1 + k` tokens (a row's
    first step, or one that sat out) in its slot, the rows' catch-ups together in prefill-step
    chunks (`DraftBatch.catch_up`: a probe after a pause feeds every row's prefix in a few forwards,
    not one row after another); then the rows feed their new ids (right-padded
    to the longest) in one forward, each at its own positions, and K − 1 single-token forwards
    follow. The batch stays from step to step: a step writes the new positions only, so its cost
    does not grow with the context. The rows' caches after the step are their slots in the batch.
    """
    import mlx.core as mx

    if not asks:
        return []
    if len(asks) == 1:
        row, tokens, pending, k = asks[0]
        return [row.propose(tokens, pending, k)]
    draft = asks[0][0].draft
    if any(a[0].draft is not draft for a in asks):
        raise ValueError("rows of different draft models cannot propose together")
    k = max(a[3] for a in asks)
    reach = max(k, *(a[0].most for a in asks))  # new ids a row feeds in the first forward (ModelDrafts.most)
    seqs = [[*tokens, pending] for _, tokens, pending, _ in asks]
    feeds = [row._catch_up(seq, 1 + reach, feed=False) for (row, *_), seq in zip(asks, seqs, strict=True)]
    rows = [a[0] for a in asks]
    batch = DraftBatch.for_rows(draft, rows)
    slots = [batch.slot_of(row) for row in rows]
    longer = [f[: max(0, len(f) - 1 - reach)] for f in feeds]  # catch-ups (a row's prefix, steps it sat out)
    if any(longer):
        batch.catch_up(slots, longer, rows[0].prefix)
        feeds = [f[len(c):] for f, c in zip(feeds, longer, strict=True)]
        for (row, *_), seq, f in zip(asks, seqs, feeds, strict=True):
            row.held = seq[: len(seq) - len(f)]
    width = max(len(f) for f in feeds)
    inputs = [[0] * width for _ in range(batch.size)]  # a slot no row asks for feeds padding, kept nowhere
    fed = [0] * batch.size
    for slot, f in zip(slots, feeds, strict=True):
        inputs[slot] = f + [f[-1]] * (width - len(f))
        fed[slot] = len(f)
    logits = batch.forward(mx.array(inputs), fed)
    last = logits[mx.arange(batch.size), mx.array([max(n, 1) - 1 for n in fed])]
    y = mx.argmax(last, axis=-1)
    drafts = [y]
    for _ in range(k - 1):
        # Evaluated forward by forward: a forward's attention still reading the KV buffer when the
        # next one writes into it would make that write copy the whole buffer (MLX writes in place
        # only into an array nothing else holds), at every draft position.
        mx.eval(y)
        y = mx.argmax(batch.forward(y[:, None], [1 if n else 0 for n in fed])[:, -1, :], axis=-1)
        drafts.append(y)
    out: list[list[int]] = mx.stack(drafts, axis=1).tolist()  # type: ignore[assignment]
    proposals = []
    for (row, _, _, row_k), seq, slot in zip(asks, seqs, slots, strict=True):
        row.caches = batch.slots(slot)
        row.held = seq + out[slot][:-1]  # the last draft is not fed
        row.accepted = len(seq)
        proposals.append(out[slot][:row_k])
    return proposals


@attrs.define(eq=False)
class _Lengths:
    """Tokens each slot holds, per layer (a row trims every layer's slot)."""

    per_layer: list[list[int]]


class DraftBatch:
    """The draft model's batch cache, kept from step to step: one slot per row, each row's KV
    left-aligned in its slot (positions 0 .. its length), rows of different lengths side by side.

    A forward writes each row's new ids at its own positions (one scatter per layer) and its
    attention mask hides each row's positions past its own; a row's rejected drafts go by lowering
    its length. Nothing is copied from step to step while the same rows draft: a row that does not
    draft at a step keeps its slot (its positions are not advanced), a row whose KV changed outside
    the batch (its own catch-up forward, a cache lent at its start) is copied into its slot (its
    tokens only), and the batch is built afresh (every row copied) only for a row it has no slot
    for, or when fewer than half its slots draft.
    """

    step = 256

    def __init__(self, draft: DraftModel, rows: Sequence[ModelDrafts]) -> None:
        import mlx.core as mx

        self.draft = draft
        self.refs = [weakref.ref(r) for r in rows]
        self.size = len(rows)
        shapes = _kv_shapes(draft)
        self.lengths = _Lengths([[0] * self.size for _ in shapes])
        sizes = [r.caches[0].offset if r.caches else 0 for r in rows]
        room = -(-(max(sizes) + self.step) // self.step) * self.step
        self.keys = [mx.zeros((self.size, h, room, dk), dtype) for h, dk, _, dtype in shapes]
        self.values = [mx.zeros((self.size, h, room, dv), dtype) for h, _, dv, dtype in shapes]
        COPIED.builds += 1
        for i, r in enumerate(rows):
            self._adopt(i, r)
        self._pos: Any = None
        self._offsets: Any = None
        self._fed: list[int] = []

    @classmethod
    def for_rows(cls, draft: DraftModel, rows: Sequence[ModelDrafts]) -> DraftBatch:
        """The draft's batch kept from the step before when it has a slot for every row (a new row takes
        the slot of a row that ended; rows whose KV changed since are copied into theirs) and at least
        half its slots draft, else a new one over `rows`."""
        batch = draft.batch[0]() if draft.batch else None  # a weak reference: the rows' slots keep it
        if batch is not None and 2 * len(rows) >= batch.size:
            live = {id(r): i for i, ref in enumerate(batch.refs) if (r := ref()) is not None}
            free = [i for i, ref in enumerate(batch.refs) if ref() is None]
            new = [r for r in rows if id(r) not in live]
            if len(new) <= len(free):
                for i, r in zip(free, new, strict=False):
                    batch.refs[i] = weakref.ref(r)
                    live[id(r)] = i
                for r in rows:
                    batch._adopt(live[id(r)], r)
                return batch
        batch = cls(draft, rows)
        draft.batch[:] = [weakref.ref(batch)]
        return batch

    def slot_of(self, row: ModelDrafts) -> int:
        return next(i for i, ref in enumerate(self.refs) if ref() is row)

    def slots(self, i: int) -> list[Any]:
        """Slot `i` as a row's caches (one `_Slot` per layer). The batch holds no reference to them
        (nor to its rows): it lives while a row's caches are its slots."""
        return [_Slot(self, layer, i) for layer in range(len(self.keys))]

    def _holds(self, caches: list[Any] | None, i: int) -> bool:
        return caches is not None and len(caches) > 0 and isinstance(caches[0], _Slot) \
            and caches[0].batch is self and caches[0].i == i

    def _adopt(self, i: int, row: ModelDrafts) -> None:
        """Copy `row`'s KV (its tokens only: its own caches, or its slot in an earlier batch) into
        slot `i`, and make the slot its caches; nothing to do when they already are."""
        caches = row.caches
        if self._holds(caches, i):
            return
        n = caches[0].offset if caches else 0
        if n and caches:
            self._reserve(n)
            for layer, c in enumerate(caches):
                self.keys[layer][i : i + 1, :, :n] = c.keys[..., :n, :]
                self.values[layer][i : i + 1, :, :n] = c.values[..., :n, :]
                COPIED.bytes += c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes
            COPIED.adopted += 1
        for lengths in self.lengths.per_layer:
            lengths[i] = n
        row.caches = self.slots(i)

    def _reserve(self, need: int) -> None:
        import mlx.core as mx

        room = self.keys[0].shape[2]
        if need <= room:
            return
        grow = -(-(need - room) // self.step) * self.step
        for layer in range(len(self.keys)):
            k, v = self.keys[layer], self.values[layer]
            self.keys[layer] = mx.concatenate([k, mx.zeros((*k.shape[:2], grow, k.shape[3]), k.dtype)], axis=2)
            self.values[layer] = mx.concatenate([v, mx.zeros((*v.shape[:2], grow, v.shape[3]), v.dtype)], axis=2)

    def forward(self, inputs: Any, fed: list[int]) -> Any:
        """The draft's logits for `inputs` (one row of ids per slot); slot i keeps its first `fed[i]`."""
        import mlx.core as mx

        lengths = self.lengths.per_layer[0]
        width = inputs.shape[1]
        self._reserve(max(lengths) + width)
        self._pos = mx.array(lengths)[:, None] + mx.arange(width)[None]  # (slots, width): where ids go
        self._offsets = mx.array(lengths)
        self._fed = fed
        logits = self.draft.model(inputs, cache=[_LayerView(self, layer) for layer in range(len(self.keys))])
        for per_layer in self.lengths.per_layer:
            for i, n in enumerate(fed):
                per_layer[i] += n
        return logits

    def catch_up(self, slots: Sequence[int], ids: Sequence[list[int]], prefix: DraftPrefixCounts) -> None:
        """Feed each row its `ids` (those it misses before its last 1 + K: its prefix at its first
        draft, the tokens of steps it sat out) into its slot, the rows together in prefill-step chunks
        (one forward per chunk for all of them, not one per row); timed as drafting's one-off work."""
        import mlx.core as mx

        began = time.perf_counter()
        left = [list(x) for x in ids]
        from mlxd.engine import spec_batch

        while any(left):
            width = min(self.draft.prefill_step, max(len(x) for x in left))
            if spec_batch.WHOLE_BUFFER:  # CUDA: a bucket's width (fed_width), padded past each row's ids
                width = fed_width(width, self.draft.prefill_step)
            inputs = [[0] * width for _ in range(self.size)]
            fed = [0] * self.size
            for n, slot in enumerate(slots):
                part, left[n] = left[n][:width], left[n][width:]
                if part:
                    inputs[slot] = part + [part[-1]] * (width - len(part))
                    fed[slot] = len(part)
            self.forward(mx.array(inputs), fed)  # the logits are not used: only the KV is evaluated
            mx.eval(self.keys, self.values)
        prefix.alone_s += time.perf_counter() - began  # the engine's gate is charged with it

    def copy_out(self, i: int, n: int) -> list[Any]:
        """Slot `i`'s first `n` tokens as `KVCache`s of their own (evaluated: nothing refers to the batch after)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        out = []
        for layer in range(len(self.keys)):
            c = KVCache()
            c.keys = mx.contiguous(self.keys[layer][i : i + 1, :, :n])
            c.values = mx.contiguous(self.values[layer][i : i + 1, :, :n])
            c.offset = n
            COPIED.bytes += c.keys.nbytes + c.values.nbytes
            out.append(c)
        mx.eval([x for c in out for x in (c.keys, c.values)])
        COPIED.copied_out += 1
        return out


class _LayerView:
    """One layer of a `DraftBatch` as the model's cache during a forward."""

    __slots__ = ("batch", "layer")

    def __init__(self, batch: DraftBatch, layer: int) -> None:
        self.batch, self.layer = batch, layer

    @property
    def offset(self) -> Any:  # each slot's position of its first new id (rope)
        return self.batch._offsets

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        b, layer = self.batch, self.layer
        pos = b._pos[:, None, :, None]
        b.keys[layer] = mx.put_along_axis(b.keys[layer], mx.broadcast_to(pos, keys.shape), keys, axis=2)
        b.values[layer] = mx.put_along_axis(b.values[layer], mx.broadcast_to(pos, values.shape), values, axis=2)
        end = self._columns(keys.shape[2])
        return b.keys[layer][..., :end, :], b.values[layer][..., :end, :]

    def _columns(self, width: int) -> int:
        """Key columns attention reads: to the longest slot's last new id, or (CUDA: one attention plan
        per buffer size, spec_batch.WHOLE_BUFFER) the whole buffer."""
        from mlxd.engine import spec_batch

        b = self.batch
        return b.keys[self.layer].shape[2] if spec_batch.WHOLE_BUFFER else max(b.lengths.per_layer[0]) + width

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> Any:
        import mlx.core as mx

        if window_size is not None:
            raise ValueError("the draft batch has no sliding window")
        columns = mx.arange(self._columns(N))
        mask = self.batch._pos[:, :, None] >= columns  # (slots, N, columns): each slot's own positions
        return mask[:, None]


class _Slot:
    """One row's layer in a `DraftBatch`: what the row's caches offer (its length, its KV as views,
    trimming); a forward of the row's own copies it out of the batch first (`ModelDrafts._own`)."""

    __slots__ = ("batch", "layer", "i")

    def __init__(self, batch: DraftBatch, layer: int, i: int) -> None:
        self.batch, self.layer, self.i = batch, layer, i

    @property
    def offset(self) -> int:
        return self.batch.lengths.per_layer[self.layer][self.i]

    @property
    def keys(self) -> Any:
        return self.batch.keys[self.layer][self.i : self.i + 1, :, : self.offset]

    @property
    def values(self) -> Any:
        return self.batch.values[self.layer][self.i : self.i + 1, :, : self.offset]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        lengths = self.batch.lengths.per_layer[self.layer]
        n = min(n, lengths[self.i])
        lengths[self.i] -= n
        return n


def _kv_shapes(draft: DraftModel) -> list[tuple[int, int, int, Any]]:
    """Per layer: (kv heads, key dim, value dim, dtype) of the draft's KV, from one token's forward (once)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if not draft.kv_shapes:
        caches = make_prompt_cache(draft.model)
        draft.model(mx.array([[0]]), cache=caches)
        draft.kv_shapes[:] = [(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype) for c in caches]
    return draft.kv_shapes


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
