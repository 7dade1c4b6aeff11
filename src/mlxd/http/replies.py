"""Read a chat reply's text as content, reasoning and tool calls.

mlx-lm does the reading: its `TextStateMachine` (built by
`make_text_state_machine` from the tokenizer's markers) strips `<think>` and
`<tool_call>` markers as text streams in, and the tokenizer's tool parser (for
our built-in model, `json_tools`) turns a call's text into a name and
arguments. A call that does not parse stays in the content, markers and all:
malformed model output is shown, never a 500.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
from mlx_lm.generate import TextStateMachine, make_text_state_machine


@attrs.frozen
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def initial_state(tokenizer: Any, prompt: Sequence[int]) -> str:
    """"reasoning" when the prompt leaves a `<think>` block open (as mlx-lm's server decides)."""
    state = "normal"
    if tokenizer.has_thinking:
        start, end = getattr(tokenizer, "_think_start_tokens", None), getattr(tokenizer, "_think_end_tokens", None)
        if start and end:  # on the event loop, for every request: a C search (mlx-lm's is a Python loop, twice)
            ids = list(prompt)
            opened = rfind(ids, start) > rfind(ids, end)
        else:
            opened = tokenizer.rfind_think_start(list(prompt)) > tokenizer.rfind_think_end(list(prompt))
        state = "reasoning" if opened else state
    return getattr(tokenizer, "response_initial_state", None) or state


def rfind(tokens: list[int], sequence: Sequence[int]) -> int:
    """Where `sequence` last starts in `tokens` (-1 if nowhere), as mlx-lm's `_find(reverse=True)`."""
    seq = list(sequence)
    n, k = len(tokens), len(seq)
    if k == 0 or k > n:
        return -1
    backwards = tokens[::-1]
    at = 0
    while True:
        try:
            at = backwards.index(seq[0], at)
        except ValueError:
            return -1
        i = n - 1 - at
        if i + k <= n and tokens[i:i + k] == seq:
            return i
        at += 1


class ReplyReader:
    """Feed text deltas; get content, reasoning and finished tool calls back."""

    def __init__(
        self, tokenizer: Any, *, tools: Sequence[dict[str, Any]] = (), parse_tools: bool, initial: str = "normal"
    ) -> None:
        self._tokenizer = tokenizer
        self._tools = list(tools)
        self._parse_tools = parse_tools and tokenizer.has_tool_calling
        if self._parse_tools:
            machine = make_text_state_machine(tokenizer)
        elif tokenizer.has_thinking:
            machine = TextStateMachine({
                "normal": [(tokenizer.think_start, "reasoning")],
                "reasoning": [(tokenizer.think_end, "normal")],
            })
        else:
            machine = TextStateMachine()
        self._state = machine.make_state(initial)
        self._prev = initial
        self._tool_text = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ReplyDelta:
        if not text:
            return ReplyDelta()
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self) -> ReplyDelta:
        """Release held-back text; an unterminated call is parsed if it can be."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        delta = self._collect([(state, rest)])
        if self._prev == "tool" and self._tool_text:
            more = self._end_call(closed=False)  # cut (e.g. by max_tokens) before its end marker
            delta = ReplyDelta(delta.content + more.content, delta.reasoning, delta.tool_calls + more.tool_calls)
        return delta

    def _collect(self, segments: list[tuple[str | None, str]]) -> ReplyDelta:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for state, text in segments:
            if state == "tool":
                self._tool_text += text
            else:
                if self._prev == "tool":
                    done = self._end_call()
                    content.append(done.content)
                    calls.extend(done.tool_calls)
                if state == "reasoning":
                    reasoning.append(text)
                elif state is not None:
                    content.append(text)
            self._prev = state or self._prev
        return ReplyDelta("".join(content), "".join(reasoning), tuple(calls))

    def _end_call(self, *, closed: bool = True) -> ReplyDelta:
        text, self._tool_text = self._tool_text, ""
        calls = self._parse(text)
        if calls is None:  # shown as the model wrote it (an unclosed call without an end marker)
            end = (self._tokenizer.tool_call_end or "") if closed else ""
            return ReplyDelta(content=f"{self._tokenizer.tool_call_start}{text}{end}")
        for call in calls:
            call["index"] = len(self.calls)
            self.calls.append(call)
        return ReplyDelta(tool_calls=tuple(calls))

    def _parse(self, text: str) -> list[dict[str, Any]] | None:
        try:
            parsed = self._tokenizer.tool_parser(text, self._tools)
        except Exception:  # any parser failure means "not a call"
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in items):
            return None
        out = []
        for p in items:
            args = p.get("arguments", {})
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            out.append({
                "id": str(p.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                "type": "function",
                "function": {"name": p["name"], "arguments": args},
            })
        return out
