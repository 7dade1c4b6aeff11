"""How much of a rendered chat prompt the next turn's rendering keeps: where to checkpoint it.

Some chat templates rewrite the end of the previous prompt when the conversation
goes on: DeepSeek-R1's opens the generation prompt with `<think>` (the next turn
renders the reply without it) and closes a run of tool results only after the
last one. A trimmable cache reuses the common prefix anyway; an untrimmable one
(sliding window, recurrent state) can only resume from a checkpoint that ends
before the rewrite, and its checkpoints all end at the prompt or past it.

So the prompt is rendered again followed by probe continuations (a reply then a
user turn; a tool call then its result) and the stable prefix is the shortest
common token prefix between the prompt and those renderings. The engine then
cuts its prefill there and publishes a checkpoint (`checkpoint_at`).

`ProbedPrefixes` remembers the stable prefix of conversations already probed, so
a conversation sent again (a retry, Anthropic's count_tokens then the request,
a client's parallel samples) skips the probe renders.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

# Below this many tokens a checkpoint saves too little to pay for its copy.
MIN_CUT_TOKENS = 16

_REPLY = "Done."
_QUESTION = "And next?"
_RESULT = "ok"


def probes(tools: Sequence[dict[str, Any]] = ()) -> tuple[list[dict[str, Any]], ...]:
    """Continuations a conversation may take: a reply then a user turn; a tool call then its result."""
    fn = next((t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)),
              None)
    name = str(fn.get("name") or "probe") if fn is not None else "probe"
    call = {"id": "call_probe", "type": "function", "function": {"name": name, "arguments": "{}"}}
    return (
        [{"role": "assistant", "content": _REPLY}, {"role": "user", "content": _QUESTION}],
        [{"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_probe", "content": _RESULT}],
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stable_prefix(
    render: Callable[[list[dict[str, Any]]], Sequence[int]],
    messages: Sequence[dict[str, Any]],
    prompt: Sequence[int],
    *,
    tools: Sequence[dict[str, Any]] = (),
) -> int:
    """The tokens of `prompt` (the rendering of `messages`) that every probe continuation's rendering keeps.

    `render(messages)` gives a conversation's canonical ids, as `prompt` was made. A probe the
    template refuses to render (e.g. it knows no tool calls) is skipped; with none rendered, the
    whole prompt counts as stable.
    """
    stable = len(prompt)
    for probe in probes(tools):
        try:
            ids = render([*messages, *probe])
        except Exception:  # a template that refuses this continuation: no evidence either way
            continue
        stable = min(stable, common_prefix(prompt, ids))
    return stable


def cut_for(stable: int, plain: Sequence[int], ids: Sequence[int]) -> int | None:
    """Where in `ids` (the prompt served: `plain`, the canonical ids, with replies realigned to their
    generated ids) to checkpoint for a stable prefix of `plain`; None where no cut is worth it.

    Realignment changes replies in the history, not the tail: the cut keeps its distance from the
    end when `ids` ends with the same tail as `plain`.
    """
    tail = len(plain) - stable
    if tail <= 1:  # the prompt-boundary checkpoint (all but the last token) covers it
        return None
    cut = len(ids) - tail
    if cut < MIN_CUT_TOKENS or tuple(ids[cut:]) != tuple(plain[stable:]):
        return None
    return cut


@attrs.frozen
class ProbeStats:
    """`ProbedPrefixes` counters: conversations whose stable prefix was remembered, or probed."""

    hits: int
    misses: int
    entries: int

    def as_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": self.entries}


def template_identity(tokenizer: Any) -> str:
    """A digest of the tokenizer's chat template (a string, or named templates), as `ProbedPrefixes` keys it."""
    template = getattr(tokenizer, "chat_template", None)
    doc = json.dumps(template, sort_keys=True, default=str)
    return hashlib.blake2b(doc.encode(), digest_size=16).hexdigest()


class ProbedPrefixes:
    """The stable prefixes of conversations already probed: a bounded LRU, thread-safe.

    Keyed by the template's identity and the canonical JSON of the messages and the template's
    variables (tools, template kwargs). Safe if ever stale: a remembered prefix only places a
    checkpoint (`cut_for` still checks the tail against the fresh rendering), never a prompt token.
    """

    def __init__(self, template: str, *, max_entries: int = 4096) -> None:
        self._template = template
        self._max_entries = max_entries
        self._stable: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def key(self, messages: Sequence[dict[str, Any]], variables: Mapping[str, Any]) -> bytes | None:
        """The digest of a conversation as the template sees it; None where it is not plain JSON."""
        try:
            doc = json.dumps([self._template, list(messages), dict(variables)], sort_keys=True,
                             ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError):  # not plain JSON: no key that surely tells two apart
            return None
        return hashlib.blake2b(doc.encode(), digest_size=20).digest()

    def stable(
        self,
        render: Callable[[list[dict[str, Any]]], Sequence[int]],
        messages: Sequence[dict[str, Any]],
        prompt: Sequence[int],
        *,
        variables: Mapping[str, Any],
    ) -> int:
        """`stable_prefix(render, messages, prompt, tools=variables['tools'])`, remembered by conversation."""
        key = self.key(messages, variables)
        with self._lock:
            known = self._stable.get(key) if key is not None else None
            if known is not None and known <= len(prompt):
                self._stable.move_to_end(key)  # type: ignore[arg-type]
                self._hits += 1
                return known
            self._misses += 1
        stable = stable_prefix(render, messages, prompt, tools=variables.get("tools") or ())
        if key is not None:
            with self._lock:
                self._stable[key] = stable
                self._stable.move_to_end(key)
                while len(self._stable) > self._max_entries:
                    self._stable.popitem(last=False)
        return stable

    def clear(self) -> None:
        """Forget every conversation (benchmarks time the probes with it)."""
        with self._lock:
            self._stable.clear()

    def stats(self) -> ProbeStats:
        with self._lock:
            return ProbeStats(hits=self._hits, misses=self._misses, entries=len(self._stable))
