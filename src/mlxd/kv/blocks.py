"""Content-addressed blocks and checkpoint manifests (seed §5.11 C1): the pure part.

A checkpoint of `n` tokens is stored as

- *span blocks*: the token axis of every trimmable attention tensor ("kv" and
  "quant" caches whose tensors hold exactly the checkpoint's `n` tokens) cut
  into spans; one block holds one span of every such layer, in layer order;
- at most one *state block*: every other cache whole (recurrent "arrays"
  state, "rotating" windows), kept at the checkpoint's exact boundary;
- a *manifest*: the checkpoint's identity (tokens, namespace, model), its full
  cache descriptors, and the names of its blocks in order.

A block's name is its chained hash: sha256 of the store fingerprint, the
namespace, the parent block's name and the span's token ids. Attention KV at
a position depends only on the tokens up to it, so equal names mean equal
contents; two checkpoints that share a prefix share the blocks of it. This is
mlxd's one block chain: KV events (`mlxd.kv.kv_events`) name their logical
blocks with `grid_names` over the same function, as 63-bit ints taken from the
same digest (`event_hash`), so where the event block size equals the store's
span the two name the same blocks.

Spans end on multiples of `block_tokens` (a grid shared by every
conversation), except that a growing conversation reuses the partial block
its previous checkpoint ended with (`choose_spans` probes for it), so a
follow-up checkpoint writes only its new tokens; and a new block that starts
where a stored block starts, and shares only its first tokens with it, ends
where they stop matching (`SharedStarts`), so the part of a grid cell that
conversations share (an agent's system prompt past its last grid line) is
stored once, not once per conversation.

Nothing here does I/O (see `mlxd.kv.block_store`) or imports MLX.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

if TYPE_CHECKING:  # descriptors only; the simulator and the tier core use this module without MLX
    from mlxd.kv import file_format as ff

BLOCK_TOKENS = 256  # the smallest default span (tokens of every attention layer)
MAX_BLOCK_TOKENS = 4096
TARGET_BLOCK_BYTES = 16 << 20
ROOT = "0" * 32  # the parent of a chain's first block
_EVENT_MASK = (1 << 63) - 1  # non-negative in both signed and unsigned 64-bit decoders
_NAME_CHARS = frozenset("0123456789abcdef")
_SPANNED_KINDS = ("kv", "quant")  # token axis -2, trimmable
MIN_SHARED_CUT = 16  # a block is cut where it stops sharing only after this many shared tokens


def chain_hash(parent: str, tokens: Sequence[int] | np.ndarray, *, namespace: str, fingerprint: str) -> str:
    """The name of the block after `parent` that holds `tokens` (32 hex digits)."""
    h = hashlib.sha256(b"mlxd-block\0")
    h.update(fingerprint.encode() + b"\0" + namespace.encode() + b"\0" + parent.encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def event_hash(name: str) -> int:
    """A block name as the 64-bit int that KV events carry (vLLM's `block_hashes`): its first 63 bits."""
    return int(name[:16], 16) & _EVENT_MASK


def grid_names(tokens: Sequence[int] | np.ndarray, *, block_tokens: int, namespace: str, fingerprint: str) -> list[str]:
    """The chained names of every full `block_tokens` block of `tokens` (a partial last block has none).

    These are the names `choose_spans` gives the full grid cells of a
    checkpoint written from scratch with the same `block_tokens`.
    """
    out: list[str] = []
    parent = ROOT
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, tokens[start : start + block_tokens], namespace=namespace, fingerprint=fingerprint)
        out.append(parent)
    return out


def state_hash(tokens: Sequence[int], *, namespace: str, fingerprint: str) -> str:
    """The name of the state block of a checkpoint after exactly `tokens`."""
    h = hashlib.sha256(b"mlxd-state\0")
    h.update(fingerprint.encode() + b"\0" + namespace.encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def span_for(kv_bytes_per_token: int, *, target_bytes: int = TARGET_BLOCK_BYTES) -> int:
    """The default span: the smallest power of two >= 256 tokens whose block holds >= `target_bytes`.

    Each block is a file, and a restore pays a first-read latency per file,
    which small files cannot amortize (docs/benchmarks.md), so blocks are
    sized by bytes. The span must stay fixed for a store
    directory (names depend on it); the model fixes bytes per token there.
    """
    span = BLOCK_TOKENS
    while span < MAX_BLOCK_TOKENS and span * max(1, kv_bytes_per_token) < target_bytes:
        span *= 2
    return span


def is_block_name(name: str) -> bool:
    return len(name) == 32 and set(name) <= _NAME_CHARS


@attrs.frozen
class BlockRef:
    """One block a manifest uses: a span [start, end) of tokens, or the state (start = end = n)."""

    name: str
    start: int
    end: int
    nbytes: int  # KV bytes it holds (what the SSD cap counts: headers and padding excluded)
    file_bytes: int = 0  # the block file's size (0 in the simulator)
    state: bool = False


@attrs.frozen
class Manifest:
    """A checkpoint as blocks: identity, full cache descriptors, block names in order.

    `caches` are the descriptors of the whole checkpoint (as a whole file's
    header has them, with zero offsets and checksums: each block file carries
    its own). Span blocks come first in token order, then the state block.
    """

    meta: ff.SnapshotMeta
    caches: tuple[ff.CacheDesc, ...]
    blocks: tuple[BlockRef, ...]
    block_tokens: int = BLOCK_TOKENS

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.meta.tokens

    @property
    def namespace(self) -> str:
        return self.meta.namespace

    @property
    def trimmable(self) -> bool:
        return all(c.trimmable for c in self.caches)

    @property
    def nbytes(self) -> int:
        """KV bytes of every block it uses (shared or not): the checkpoint's payload."""
        return sum(b.nbytes for b in self.blocks)

    @property
    def spans(self) -> tuple[BlockRef, ...]:
        return tuple(b for b in self.blocks if not b.state)

    @property
    def state(self) -> BlockRef | None:
        return next((b for b in self.blocks if b.state), None)

    @property
    def chain(self) -> tuple[tuple[str, int, int], ...]:
        """(block name, first token, end token) of every span block: the hash chain to publish."""
        return chain(self.blocks)


def leading(manifest: Manifest, tokens: int) -> Manifest | None:
    """The checkpoint of the manifest's first `tokens` tokens (a block boundary), read from its
    leading span blocks alone; None when the layout cannot (a state block, or no boundary there).

    Attention KV at a position depends only on the tokens before it, so the first
    blocks of a checkpoint are exactly the checkpoint of their tokens.
    """
    n = len(manifest.tokens)
    if manifest.state is not None or not 0 < tokens < n:
        return None
    head = tuple(b for b in manifest.spans if b.end <= tokens)
    if not head or head[-1].end != tokens or any(not spanned(c, n) for c in leaves(manifest.caches)):
        return None

    def cut(c: ff.CacheDesc) -> ff.CacheDesc:
        if c.kind == "list":
            return attrs.evolve(c, children=tuple(cut(x) for x in c.children))
        shorter = tuple(None if t is None else _span_tensor(t, tokens) for t in c.tensors)
        return attrs.evolve(c, offset=tokens, tensors=shorter)

    meta = attrs.evolve(manifest.meta, tokens=manifest.tokens[:tokens])
    return attrs.evolve(manifest, meta=meta, caches=tuple(cut(c) for c in manifest.caches), blocks=head)


def trailing(manifest: Manifest, start: int, end: int = 0) -> Manifest | None:
    """The KV of the manifest's tokens [start, end) (block boundaries; `end` 0: its last token), read from
    those span blocks alone, as a manifest of its own whose token axis starts at `start`: its tokens are
    those tokens, its blocks shifted to start at 0, its caches' tensors and offsets that many tokens long.
    None when the layout cannot (a state block, or no boundary there).

    What an overlapped split reads (kv/restore_decision.py): the KV of a position depends only on the
    tokens before it, so these rows are what recomputing them after the tokens before `start` gives.
    """
    n = len(manifest.tokens)
    end = end or n
    if manifest.state is not None or not 0 < start < end <= n:
        return None
    part = tuple(b for b in manifest.spans if start <= b.start and b.end <= end)
    if not part or part[0].start != start or part[-1].end != end or any(not spanned(c, n) for c in leaves(manifest.caches)):
        return None
    length = end - start

    def cut(c: ff.CacheDesc) -> ff.CacheDesc:
        if c.kind == "list":
            return attrs.evolve(c, children=tuple(cut(x) for x in c.children))
        shorter = tuple(None if t is None else _span_tensor(t, length) for t in c.tensors)
        return attrs.evolve(c, offset=length, tensors=shorter)

    meta = attrs.evolve(manifest.meta, tokens=manifest.tokens[start:end])
    blocks = tuple(attrs.evolve(b, start=b.start - start, end=b.end - start) for b in part)
    return attrs.evolve(manifest, meta=meta, caches=tuple(cut(c) for c in manifest.caches), blocks=blocks)


def chain(blocks: Iterable[BlockRef]) -> tuple[tuple[str, int, int], ...]:
    """The hash chain of a checkpoint's blocks (e.g. `SsdRecord.blocks`): names for KV events."""
    return tuple((b.name, b.start, b.end) for b in blocks if not b.state)


# ------------------------------------------------------------- splitting


def spanned(c: ff.CacheDesc, n_tokens: int) -> bool:
    """Is this cache's state cut into token spans (else it goes whole into the state block)?"""
    if c.kind not in _SPANNED_KINDS or c.offset != n_tokens or n_tokens == 0:
        return False
    present = [t for t in c.tensors if t is not None]
    return bool(present) and all(len(t.shape) >= 2 and t.shape[-2] == n_tokens for t in present)


def leaves(caches: Sequence[ff.CacheDesc]) -> Iterator[ff.CacheDesc]:
    """Every cache that holds tensors, in file order (lists are walked, not yielded)."""
    for c in caches:
        if c.kind == "list":
            yield from leaves(c.children)
        else:
            yield c


def span_descs(caches: Sequence[ff.CacheDesc], n_tokens: int, start: int, end: int) -> tuple[ff.CacheDesc, ...]:
    """The descriptors of the span block [start, end): every spanned leaf cut to its span."""
    out = []
    for c in leaves(caches):
        if not spanned(c, n_tokens):
            continue
        tensors = tuple(None if t is None else _span_tensor(t, end - start) for t in c.tensors)
        out.append(attrs.evolve(c, offset=end - start, tensors=tensors))
    return tuple(out)


def state_descs(caches: Sequence[ff.CacheDesc], n_tokens: int) -> tuple[ff.CacheDesc, ...]:
    """The descriptors of the state block: every leaf that is not spanned, whole."""
    return tuple(_blank(c) for c in leaves(caches) if not spanned(c, n_tokens))


def _span_tensor(t: ff.TensorDesc, n: int) -> ff.TensorDesc:
    shape = (*t.shape[:-2], n, t.shape[-1])
    per_token = t.nbytes // t.shape[-2]
    return attrs.evolve(t, shape=shape, nbytes=per_token * n, offset=0, crc32="0" * 8)


def _blank(c: ff.CacheDesc) -> ff.CacheDesc:
    """A descriptor without file offsets or checksums (what a manifest and a layout compare)."""
    tensors = tuple(None if t is None else attrs.evolve(t, offset=0, crc32="0" * 8) for t in c.tensors)
    return attrs.evolve(c, tensors=tensors, children=tuple(_blank(x) for x in c.children))


def blank(caches: Sequence[ff.CacheDesc]) -> tuple[ff.CacheDesc, ...]:
    return tuple(_blank(c) for c in caches)


@attrs.frozen
class Span:
    """A span block of a checkpoint being written: reused as it is on disk, or new."""

    name: str
    start: int
    end: int
    exists: bool


def choose_spans(
    tokens: Sequence[int] | np.ndarray,
    *,
    namespace: str,
    fingerprint: str,
    exists: Callable[[str], bool],
    block_tokens: int = BLOCK_TOKENS,
    starts: SharedStarts | None = None,
) -> list[Span]:
    """Cut `tokens` into span blocks, reusing the blocks `exists` says are stored.

    Walking from the first token: where the chain so far is stored, take the
    longest stored block that starts here and ends at or before the next grid
    line (a full grid cell, or the partial block an earlier checkpoint of this
    conversation ended with); otherwise a new block up to the grid line, or,
    when a stored block after the same parent begins with >= MIN_SHARED_CUT of
    those tokens and not all of them (`starts`), a new block of just the
    shared ones: the next conversation over that prefix reuses it. Once a
    block is new no later one can exist (its parent's name is new), so the
    probing stops there.

    With `starts`, the ends probed are the grid line and those of the blocks
    it knows after the same parent (one `exists` call each, not one per
    token); without it, every end down from the grid line.
    """
    toks = np.asarray(tokens, dtype="<i8")  # sliced per probe: one conversion, not one per probe
    n = len(toks)
    spans: list[Span] = []
    parent, pos, chain_stored = ROOT, 0, True
    while pos < n:
        grid = min(n, (pos // block_tokens + 1) * block_tokens)
        found = None
        if chain_stored:
            ends = range(grid, pos, -1) if starts is None else starts.ends(parent, toks[pos:grid], pos)
            for end in ends:
                name = chain_hash(parent, toks[pos:end], namespace=namespace, fingerprint=fingerprint)
                if exists(name):
                    found = Span(name, pos, end, True)
                    break
        if found is None:
            end = grid
            if chain_stored and starts is not None:
                common = starts.shared(parent, toks[pos:grid])
                if MIN_SHARED_CUT <= common < grid - pos:
                    end = pos + common
            chain_stored = False
            name = chain_hash(parent, toks[pos:end], namespace=namespace, fingerprint=fingerprint)
            found = Span(name, pos, end, False)
        spans.append(found)
        parent, pos = found.name, found.end
    return spans


def check_chain(manifest: Manifest) -> str | None:
    """Why a manifest's blocks do not name its tokens (None when they do)."""
    tokens, meta = manifest.tokens, manifest.meta
    parent, pos = ROOT, 0
    for b in manifest.spans:
        if b.start != pos or b.end <= b.start:
            return "span blocks do not tile the tokens"
        want = chain_hash(parent, tokens[b.start : b.end], namespace=meta.namespace, fingerprint=meta.config_fingerprint)
        if b.name != want:
            return f"block {b.name} does not name tokens [{b.start}, {b.end})"
        parent, pos = b.name, b.end
    has_spans = any(spanned(c, len(tokens)) for c in leaves(manifest.caches))
    if has_spans and pos != len(tokens):
        return "span blocks do not cover every token"
    if not has_spans and manifest.spans:
        return "span blocks without spanned caches"
    state = manifest.state
    needs_state = bool(state_descs(manifest.caches, len(tokens)))
    if needs_state != (state is not None):
        return "state block missing or unexpected"
    if state is not None and state.name != state_hash(
        tokens, namespace=meta.namespace, fingerprint=meta.config_fingerprint
    ):
        return "state block does not name the checkpoint"
    return None


# ---------------------------------------------------- shared block lifetime


@attrs.define
class BlockLedger:
    """Reference counts of committed blocks, and the bytes of the unique ones (what the SSD cap counts).

    Every indexed manifest adds one reference to each block it names; a
    block whose count drops to zero is garbage (its file may be collected).
    """

    _refs: dict[str, int] = attrs.field(factory=dict)
    _sizes: dict[str, int] = attrs.field(factory=dict)
    bytes: int = 0

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def refs(self, name: str) -> int:
        return self._refs.get(name, 0)

    def add(self, blocks: Iterable[BlockRef]) -> int:
        """Reference a manifest's blocks; returns the bytes that were not counted before."""
        added = 0
        for b in blocks:
            n = self._refs.get(b.name, 0)
            if n == 0:
                self._sizes[b.name] = b.nbytes
                added += b.nbytes
            self._refs[b.name] = n + 1
        self.bytes += added
        return added

    def remove(self, blocks: Iterable[BlockRef]) -> list[str]:
        """Drop a manifest's references; returns the blocks nothing references any more."""
        garbage = []
        for b in blocks:
            n = self._refs.get(b.name, 0)
            if n <= 1:
                if n == 1:
                    del self._refs[b.name]
                    self.bytes -= self._sizes.pop(b.name)
                    garbage.append(b.name)
                continue
            self._refs[b.name] = n - 1
        return garbage

    def new_bytes(self, blocks: Iterable[BlockRef]) -> int:
        """Bytes a manifest would add (its blocks not referenced yet, each counted once)."""
        seen: set[str] = set()
        total = 0
        for b in blocks:
            if b.name not in self._refs and b.name not in seen:
                seen.add(b.name)
                total += b.nbytes
        return total

    def unique_bytes(self, blocks: Iterable[BlockRef]) -> int:
        """Bytes that removing a manifest would free (its blocks referenced only by it)."""
        return sum(b.nbytes for b in {b.name: b for b in blocks}.values() if self._refs.get(b.name, 0) == 1)


@attrs.define
class SharedStarts:
    """The tokens of stored span blocks, by the block they follow: where a new block should end.

    `choose_spans` asks it, for a block about to be written, how many of its
    tokens a stored block after the same parent starts with; cutting the new
    block there lets the next checkpoint over the same prefix reuse the
    shared part. A hint only: a block it does not know (another process's,
    one collected since) costs sharing, never correctness.
    """

    _after: dict[str, dict[str, np.ndarray]] = attrs.field(factory=dict)
    _parent: dict[str, str] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self._parent)

    def add(self, tokens: Sequence[int] | np.ndarray, blocks: Iterable[BlockRef]) -> None:
        """Learn the span blocks of a stored checkpoint of `tokens`."""
        parent = ROOT
        for b in blocks:
            if b.state:
                continue
            if b.name not in self._parent:
                self._after.setdefault(parent, {})[b.name] = np.asarray(tokens[b.start : b.end], dtype=np.int64)
                self._parent[b.name] = parent
            parent = b.name

    def discard(self, names: Iterable[str]) -> None:
        """Forget blocks that are gone (collected)."""
        for name in names:
            parent = self._parent.pop(name, None)
            if parent is None:
                continue
            siblings = self._after[parent]
            del siblings[name]
            if not siblings:
                del self._after[parent]

    def shared(self, parent: str, tokens: Sequence[int] | np.ndarray) -> int:
        """The most leading `tokens` that a known block after `parent` starts with."""
        siblings = self._after.get(parent)
        if not siblings:
            return 0
        want = np.asarray(tokens, dtype=np.int64)
        best = 0
        for have in siblings.values():
            m = min(len(have), len(want))
            differ = np.flatnonzero(have[:m] != want[:m])
            best = max(best, int(differ[0]) if len(differ) else m)
        return best

    def ends(self, parent: str, tokens: Sequence[int] | np.ndarray, pos: int) -> list[int]:
        """Where a stored block starting at `pos` after `parent` may end, longest first: the end of
        `tokens` (the grid line) and every known block there that holds a prefix of them."""
        want = np.asarray(tokens, dtype=np.int64)
        out = {pos + len(want)}
        for have in self._after.get(parent, {}).values():
            if len(have) <= len(want) and np.array_equal(have, want[: len(have)]):
                out.add(pos + len(have))
        return sorted(out, reverse=True)


def unreferenced(stored: Iterable[str], manifests: Iterable[Iterable[str]]) -> set[str]:
    """GC planning: the stored block names that no manifest names."""
    live: set[str] = set()
    for names in manifests:
        live.update(names)
    return set(stored) - live


def model_blocks(
    tokens: Sequence[int],
    *,
    namespace: str,
    fingerprint: str,
    stored: Callable[[str], bool],
    bytes_per_token: int,
    state_bytes: int = 0,
    block_tokens: int = BLOCK_TOKENS,
    starts: SharedStarts | None = None,
) -> tuple[BlockRef, ...]:
    """The blocks a checkpoint of `tokens` would use, with modeled sizes (the simulator's store).

    Same spans as the block store writes (`choose_spans`, `stored` standing
    for the files on disk); a span block is `bytes_per_token` per token, the
    state block (when `state_bytes`) is `state_bytes`. Page padding and block
    headers are left out.
    """
    spans = choose_spans(
        tokens, namespace=namespace, fingerprint=fingerprint, exists=stored, block_tokens=block_tokens, starts=starts
    )
    refs = [BlockRef(s.name, s.start, s.end, (s.end - s.start) * bytes_per_token) for s in spans]
    if state_bytes:
        n = len(tokens)
        name = state_hash(tokens, namespace=namespace, fingerprint=fingerprint)
        refs.append(BlockRef(name, n, n, state_bytes, state=True))
    return tuple(refs)
