"""The paged RAM tier's pure half (seed §6): entries made of shared KV pages.

With `--ram-pages on` a RAM entry of an attention-only model is a list of
pages instead of one contiguous copy of its KV: a page holds one token span of
every layer, and is named by the SSD blocks' chained hash
(`mlxd.kv.blocks.chain_hash`), so two entries over the same prefix name the
same pages and hold them once. Spans are cut as the block store cuts them
(`choose_spans`): on the grid of `page_tokens`, reusing the partial page a
growing conversation's previous checkpoint ended with, and ending a new page
where it stops sharing with a page already held (`SharedStarts`), so an agent
prompt's tail past the last grid line is held once too.

`PageLedger` counts what the pages cost: each page once, whatever the number
of entries naming it; an entry that leaves frees only the pages no other
entry names. `PromptCache` keeps one (its byte cap, the memory budget and
`/stats` count pages once); the simulator models pages with `model_pages`.
The MLX half (cutting arrays into pages, lending from them) is
`mlxd.kv.page_pool`; nothing here imports MLX or trio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from mlxd.kv.blocks import BlockLedger, BlockRef, SharedStarts, choose_spans

PageRef = BlockRef  # a page an entry uses: name, token span [start, end), KV bytes


@attrs.define
class PageLedger:
    """Pages held by RAM entries: reference counts, unique bytes, and where new pages should end."""

    _refs: BlockLedger = attrs.Factory(BlockLedger)
    starts: SharedStarts = attrs.Factory(SharedStarts)  # the held pages' tokens, by the page they follow

    @property
    def bytes(self) -> int:
        """KV bytes of every page some entry names, each counted once."""
        return self._refs.bytes

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def add(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[PageRef]) -> int:
        """An entry of `tokens` names `pages`: the bytes that were not held before."""
        added = self._refs.add(pages)
        self.starts.add(tokens, pages)
        return added

    def remove(self, pages: Iterable[PageRef]) -> int:
        """An entry left: drop its references; the bytes freed (pages nothing names any more)."""
        pages = list(pages)
        sizes = {p.name: p.nbytes for p in pages}
        gone = self._refs.remove(pages)
        self.starts.discard(gone)
        return sum(sizes[name] for name in gone)

    def unique_bytes(self, pages: Iterable[PageRef]) -> int:
        """What removing an entry with these pages would free."""
        return self._refs.unique_bytes(pages)


def model_pages(
    tokens: Sequence[int] | np.ndarray,
    *,
    namespace: str,
    fingerprint: str,
    page_tokens: int,
    bytes_per_token: int,
    held: Callable[[str], bool],
    starts: SharedStarts | None = None,
) -> tuple[PageRef, ...]:
    """The pages an entry of `tokens` would use, with modeled sizes (the simulator's paged RAM tier).

    The same spans the engine cuts (`choose_spans`, `held` standing for the pages held now).
    """
    spans = choose_spans(
        tokens, namespace=namespace, fingerprint=fingerprint, exists=held, block_tokens=page_tokens, starts=starts
    )
    return tuple(PageRef(s.name, s.start, s.end, (s.end - s.start) * bytes_per_token) for s in spans)
