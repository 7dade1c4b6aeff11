"""The paged RAM tier's pure half (seed §6): entries made of shared KV pages.

With `--ram-pages on` a RAM entry of an attention-only model is a list of
pages instead of one contiguous copy of its KV: a page holds one token span of
every layer, and is named by the SSD blocks' chained hash
(`mlxd.kv.blocks.chain_hash`), so two entries over the same prefix name the
same pages and hold them once. Spans are cut as the block store cuts them
(`choose_spans`): on the grid of `page_tokens`, reusing the partial page a
growing conversation's previous checkpoint ended with, and ending a new page
where it stops sharing with a page already held (`SharedStarts`), so an agent
prompt's tail past the last grid line is held once too. Such a cut page is
a view of the page it was cut from (no copy): it names that page's buffer,
and the ledger counts buffers, so the first conversation's longer page and
every later conversation's cut of it are one buffer.

`PageLedger` counts what the pages cost: each page once, whatever the number
of entries naming it; an entry that leaves frees only the pages no other
entry names. `PromptCache` keeps one (its byte cap, the memory budget and
`/stats` count pages once); the simulator models pages with `model_pages`.
The MLX half (cutting arrays into pages, lending from them) is
`mlxd.kv.page_pool`; nothing here imports MLX or trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from mlxd.kv.blocks import ROOT, BlockLedger, BlockRef, SharedStarts, choose_spans


@attrs.frozen
class PageRef:
    """A page an entry uses: its chained name, its token span [start, end), and the buffer it lives in.

    `buffer` names the page whose memory holds it ("" = its own) and `nbytes`
    is that buffer's KV bytes: a page cut from a longer page is a view of it.
    """

    name: str
    start: int
    end: int
    nbytes: int
    buffer: str = ""

    @property
    def holder(self) -> str:
        return self.buffer or self.name


class PageStarts(SharedStarts):
    """SharedStarts that can also name the held page a new page's tokens begin (a cut to view, not copy)."""

    def add_pages(self, tokens: Sequence[int] | np.ndarray, pages: Iterable[PageRef]) -> None:
        """Learn the pages of an entry of `tokens`."""
        self.add(tokens, _by_name(pages))

    def holder(self, parent: str, tokens: Sequence[int] | np.ndarray) -> str | None:
        """A known page after `parent` whose tokens start with all of `tokens` (None if none)."""
        want = np.asarray(tokens, dtype=np.int64)
        for name, have in self._after.get(parent, {}).items():
            if len(have) >= len(want) and np.array_equal(have[: len(want)], want):
                return name
        return None


@attrs.define
class PageLedger:
    """Pages held by RAM entries: references by name, bytes by buffer (each once), where new pages end."""

    _names: BlockLedger = attrs.Factory(BlockLedger)
    _buffers: BlockLedger = attrs.Factory(BlockLedger)
    _held: dict[str, PageRef] = attrs.Factory(dict)  # a held page by name (its buffer and the buffer's bytes)
    starts: PageStarts = attrs.Factory(PageStarts)  # the held pages' tokens, by the page they follow

    @property
    def bytes(self) -> int:
        """KV bytes of every buffer some entry's pages live in, each counted once."""
        return self._buffers.bytes

    @property
    def buffers(self) -> int:
        return len(self._buffers)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> PageRef | None:
        return self._held.get(name)

    def add(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[PageRef]) -> int:
        """An entry of `tokens` names `pages`: the bytes that were not held before."""
        self._names.add(_by_name(pages))
        for p in pages:
            self._held.setdefault(p.name, p)
        self.starts.add_pages(tokens, pages)
        return self._buffers.add(_by_buffer(pages))

    def remove(self, pages: Iterable[PageRef]) -> int:
        """An entry left: drop its references; the bytes freed (buffers no page names any more)."""
        pages = list(pages)
        gone = self._names.remove(_by_name(pages))
        for name in gone:
            del self._held[name]
        self.starts.discard(gone)
        sizes = {p.holder: p.nbytes for p in pages}
        return sum(sizes[name] for name in self._buffers.remove(_by_buffer(pages)))

    def unique_bytes(self, pages: Iterable[PageRef]) -> int:
        """What removing an entry with these pages would free."""
        return self._buffers.unique_bytes(_by_buffer(pages))


def _by_name(pages: Iterable[PageRef]) -> list[BlockRef]:
    return [BlockRef(p.name, p.start, p.end, 0) for p in pages]


def _by_buffer(pages: Iterable[PageRef]) -> list[BlockRef]:
    return [BlockRef(p.holder, p.start, p.end, p.nbytes) for p in pages]


def model_pages(
    tokens: Sequence[int] | np.ndarray,
    *,
    namespace: str,
    fingerprint: str,
    page_tokens: int,
    bytes_per_token: int,
    held: PageLedger,
) -> tuple[PageRef, ...]:
    """The pages an entry of `tokens` would use, with modeled sizes (the simulator's paged RAM tier).

    The same spans and views the engine makes (`choose_spans` over the pages `held` now).
    """
    spans = choose_spans(
        tokens, namespace=namespace, fingerprint=fingerprint, exists=held.__contains__, block_tokens=page_tokens,
        starts=held.starts,
    )
    out: list[PageRef] = []
    parent = ROOT
    for s in spans:
        found = held.get(s.name) if s.exists else None
        if found is None:
            cut = held.starts.holder(parent, tokens[s.start : s.end])
            source = held.get(cut) if cut is not None else None
            if source is not None:
                found = PageRef(s.name, s.start, s.end, source.nbytes, source.holder)
            else:
                found = PageRef(s.name, s.start, s.end, (s.end - s.start) * bytes_per_token)
        out.append(found)
        parent = s.name
    return tuple(out)
