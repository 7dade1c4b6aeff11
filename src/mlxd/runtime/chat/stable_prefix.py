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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
