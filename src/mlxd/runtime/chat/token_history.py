"""Keep the exact token ids of generated replies, so the next turn reuses their KV.

A reply's generated ids are not always what the tokenizer makes of its text
(byte-level BPE merges differently across the reply's edges), so re-encoding
the conversation would diverge from the cached checkpoint right where the
reply starts, and the next turn would re-prefill it. When a chat's rendered
text contains a reply we generated, we splice in the original ids, and keep
the result only if it decodes to exactly the rendered text. KV is never
relabelled: a lookup still needs exact ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class GeneratedHistory:
    """A bounded map from reply text to the ids that produced it (most recent kept)."""

    def __init__(self, *, max_entries: int = 4096) -> None:
        self._ids: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._max = max_entries

    def record(self, text: str, ids: Sequence[int]) -> None:
        if not text:
            return
        self._ids[text] = tuple(ids)
        self._ids.move_to_end(text)
        while len(self._ids) > self._max:
            self._ids.popitem(last=False)

    def get(self, text: str) -> tuple[int, ...] | None:
        return self._ids.get(text)

    def __len__(self) -> int:
        return len(self._ids)


def realign(tokenizer: Any, text: str, current: tuple[int, ...], checkpoint: tuple[int, ...] | None) -> tuple[int, ...]:
    """Reuse a cached checkpoint's exact ids for the part of `text` they spell.

    `current` is the encoding so far (canonical, or already partly realigned) and
    `checkpoint` the token sequence of a cache entry that matches it. The new ids
    are the longest prefix of the checkpoint whose text is a prefix of `text`,
    followed by the encoding of the rest; `current` comes back unchanged unless
    that reuses more of the checkpoint and decodes to exactly `text`.
    """
    shared = _common_prefix(current, checkpoint) if checkpoint else 0
    if not checkpoint or len(checkpoint) <= shared or shared >= len(current):
        # (`current` spells all of `text`: a checkpoint it is a prefix of, e.g. this very prompt's
        # end-of-turn checkpoint, cannot spell more of it; its search decoded ~15 prefixes of 16k tokens)
        return current
    k = _longest_spelled_prefix(tokenizer, text, checkpoint)
    if k <= shared:
        return current
    spelled = tokenizer.decode(list(checkpoint[:k]))
    ids = tuple(checkpoint[:k]) + tuple(tokenizer.encode(text[len(spelled):], add_special_tokens=False))
    return ids if tokenizer.decode(list(ids)) == text else current


def best_realignment(
    tokenizer: Any, text: str, current: tuple[int, ...], checkpoints: Sequence[tuple[int, ...]]
) -> tuple[int, ...]:
    """The realignment that shares the longest token prefix with one of the checkpoints."""
    best, best_shared = current, max((_common_prefix(current, c) for c in checkpoints), default=0)
    for checkpoint in checkpoints:
        ids = realign(tokenizer, text, current, checkpoint)
        shared = _common_prefix(ids, checkpoint)
        if shared > best_shared:
            best, best_shared = ids, shared
    return best


def needs_realignment(current: Sequence[int], checkpoints: Sequence[tuple[int, ...]]) -> bool:
    """Whether `best_realignment` could change `current`: not when every checkpoint is a prefix of it
    (a next turn after its own reply) or extends it (the same prompt again, after its reply's checkpoint),
    which this tells with slice comparisons, no decode."""
    for c in checkpoints:
        shared = _common_prefix(current, c)
        if shared < len(c) and shared < len(current):
            return True
    return False


def _longest_spelled_prefix(tokenizer: Any, text: str, tokens: tuple[int, ...]) -> int:
    """The largest k such that decode(tokens[:k]) is a prefix of `text` (binary search)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(tokenizer.decode(list(tokens[:mid]))):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix, by slice comparisons (C loops: a 16k-token prompt
    took ~2 ms a call as a Python loop, several calls a turn)."""
    n = min(len(a), len(b))
    x, y = tuple(a[:n]), tuple(b[:n])
    if x == y:
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo], x[:hi] != y[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    encode: Callable[[str], tuple[int, ...]] | None = None,
    **template_kwargs: Any,
) -> tuple[str, tuple[int, ...]]:
    """The chat template's text (with the generation prompt) and its canonical ids.

    `template_kwargs` (e.g. `tools`, `enable_thinking`) go to the template as variables.
    `encode` (the runtime's `PieceEncoder.encode`) gives the same ids as the tokenizer.
    """
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    if encode is not None:
        return text, encode(text)
    return text, tuple(tokenizer.encode(text, add_special_tokens=False))


# Tokens before the first difference that are decoded again with it, so the comparison sees the same
# context on both sides (a decoder's leading-space rule, space clean-up, a character split across tokens).
DECODE_CONTEXT = 16


def encode_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    history: GeneratedHistory | Mapping[str, tuple[int, ...] | None],
    eos_ids: frozenset[int],
    rendered: tuple[str, tuple[int, ...]] | None = None,
    encode: Callable[[str], Sequence[int]] | None = None,
) -> tuple[tuple[int, ...], int]:
    """Render and tokenize a chat; returns (ids, number of reply tokens taken from history).

    `history` may be a snapshot of the replies' ids (reply text -> ids), taken on
    the event loop so that this can run on a worker thread. `encode` (the runtime's
    `PieceEncoder.encode`) tokenizes the text between replies as the tokenizer does,
    reusing the ids of what it has seen (the conversation so far, on a next turn).
    """
    if encode is None:
        def encode(piece: str) -> Sequence[int]:
            return tokenizer.encode(piece, add_special_tokens=False)  # type: ignore[no-any-return]
    text, plain = rendered if rendered is not None else render(tokenizer, messages)
    replies = [m["content"] for m in messages if m.get("role") == "assistant" and m.get("content")]
    looked_up = [(r, history.get(r)) for r in replies]
    known = [(r, ids) for r, ids in looked_up if ids is not None]
    if not known:
        return plain, 0
    ids: list[int] = []
    cursor = 0
    reused = 0
    for reply, gen in known:
        at = text.find(reply, cursor)
        if at < 0:
            continue
        ids += encode(text[cursor:at])
        body = [t for t in gen if t not in eos_ids]
        ids += body
        reused += len(body)
        cursor = at + len(reply)
        if gen and gen[-1] in eos_ids:
            eos_text = tokenizer.decode([gen[-1]])
            if text.startswith(eos_text, cursor):
                ids.append(gen[-1])
                reused += 1
                cursor += len(eos_text)
    ids += encode(text[cursor:])
    if not _same_text(tokenizer, ids, plain):
        return plain, 0  # an unsafe boundary: keep the canonical encoding
    return tuple(ids), reused


def _same_text(tokenizer: Any, ids: Sequence[int], plain: Sequence[int]) -> bool:
    """Whether `ids` decode to what `plain` decodes to, decoding only from a little before where they
    part (both decoded whole cost ~20-60 ms for 16k tokens; they share everything before the first reply)."""
    start = max(0, _common_prefix(ids, plain) - DECODE_CONTEXT)
    return bool(tokenizer.decode(list(ids[start:])) == tokenizer.decode(list(plain[start:])))
