"""Per-row token matchers over llguidance, and a cache of compiled grammars.

A `Vocabulary` wraps the model's tokenizer once (llguidance's token trie, the
model's vocab size, its EOS ids). `GrammarCache` compiles each `Constraint`
once, keyed by `Constraint.key`, and keeps the most recently used in RAM; a
`Matcher` is one row's walk through a compiled grammar: the allowed-token mask
before each step, then the sampled token.

A compiled grammar is not persisted: llguidance cannot serialize one (its
lexer is built lazily as rows walk it), and a compile costs milliseconds. With
an SSD tier the engine keeps the list of recent constraints instead
(kv/grammar_list.py) and `warm`s them at the next start. All of it is synchronous and meant for one thread (the engine's).

A known llguidance quirk: it counts every added token (`<think>`,
`<tool_call>`, ...) as special, so a grammar literal that spells one out
(`"a<think>b"`) gets a mask offering only that token, which `consume` then
refuses. Grammars should name such tokens as `<think>`, as the tool-call
grammar does.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import llguidance as llg
import numpy as np

from mlxd.structured.spec import Constraint, ConstraintError, llguidance_grammar


@attrs.frozen
class Vocabulary:
    """The model's tokens as llguidance sees them; ids from the tokenizer's size up are never allowed."""

    tokenizer: llg.LLTokenizer = attrs.field(eq=False, repr=False)
    size: int  # the model's vocab (its logits' width), at least the tokenizer's
    eos_ids: tuple[int, ...]


def vocabulary_from_json(tokenizer_json: str, *, eos_ids: Sequence[int], size: int | None = None) -> Vocabulary:
    """A Vocabulary from a HF `tokenizer.json` text; `size` pads it to the model's vocab."""
    if not eos_ids:
        raise ValueError("eos_ids must name at least one token")
    tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=size, eos_token=list(eos_ids))
    return Vocabulary(tokenizer, tokenizer.vocab_size, tuple(eos_ids))


def load_vocabulary(model_dir: Path, *, eos_ids: Sequence[int] | None = None) -> Vocabulary:
    """A model directory's Vocabulary: tokenizer.json, config.json's vocab_size, and the
    EOS ids of generation_config.json (else config.json) unless given."""
    config = _read_json(model_dir / "config.json")
    if eos_ids is None:
        eos = _read_json(model_dir / "generation_config.json").get("eos_token_id", config.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
    text = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    return vocabulary_from_json(text, eos_ids=eos_ids, size=config.get("vocab_size"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


@attrs.frozen
class CompiledGrammar:
    """A constraint compiled for one vocabulary: new rows are copies of its start state."""

    constraint: Constraint
    vocab: Vocabulary
    _start: llg.LLMatcher = attrs.field(eq=False, repr=False)

    def matcher(self) -> Matcher:
        return Matcher(self, self._start.deep_copy())

    def restore(self, state: MatcherState) -> Matcher:
        """A matcher in `state`, rebuilt by replaying its tokens (a few µs each)."""
        if state.key != self.constraint.key:
            raise ValueError("state is from another constraint")
        row = self.matcher()
        for token in state.tokens:
            if not row.consume(token):
                raise ValueError(f"state does not replay: token {token} refused after {len(row.tokens)}")
        return row


def compile_grammar(constraint: Constraint, vocab: Vocabulary) -> CompiledGrammar:
    """Compile `constraint` for `vocab`; a tokenizer-specific problem raises ConstraintError."""
    start = llg.LLMatcher(vocab.tokenizer, llguidance_grammar(constraint), log_level=0)
    if start.is_error():
        raise ConstraintError(f"{constraint.kind}: {start.get_error().strip()[:600]}", None)
    return CompiledGrammar(constraint, vocab, start)


@attrs.frozen
class CacheStats:
    entries: int
    hits: int
    misses: int
    warmed: int = 0  # compiled at start from the saved list (kv/grammar_list.py), before any request


@attrs.define
class GrammarCache:
    """Compiled grammars by Constraint.key, the least recently used dropped past `capacity`."""

    vocab: Vocabulary
    capacity: int = attrs.field(default=256, kw_only=True)
    _entries: OrderedDict[str, CompiledGrammar] = attrs.field(init=False, factory=OrderedDict)
    _hits: int = attrs.field(init=False, default=0)
    _misses: int = attrs.field(init=False, default=0)
    _warmed: int = attrs.field(init=False, default=0)

    def compiled(self, constraint: Constraint) -> CompiledGrammar:
        found = self._entries.get(constraint.key)
        if found is not None:
            self._hits += 1
            self._entries.move_to_end(constraint.key)
            return found
        self._misses += 1
        return self._add(constraint)

    def warm(self, constraint: Constraint) -> bool:
        """Compile `constraint` ahead of its requests (neither a hit nor a miss); False when it is
        already here or does not compile for this vocabulary."""
        if constraint.key in self._entries:
            return False
        try:
            self._add(constraint)
        except Exception:  # a saved source this llguidance refuses: skipped, as a request would be refused
            return False
        self._warmed += 1
        return True

    def touch(self, constraint: Constraint) -> None:
        """Mark `constraint` the most recently used, if it is here (neither a hit nor a miss)."""
        if constraint.key in self._entries:
            self._entries.move_to_end(constraint.key)

    def recent(self) -> list[Constraint]:
        """The constraints compiled here, the most recently used last."""
        return [c.constraint for c in self._entries.values()]

    def _add(self, constraint: Constraint) -> CompiledGrammar:
        compiled = compile_grammar(constraint, self.vocab)
        self._entries[constraint.key] = compiled
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return compiled

    def matcher(self, constraint: Constraint) -> Matcher:
        """A new row's matcher at the grammar's start."""
        return self.compiled(constraint).matcher()

    def restore(self, constraint: Constraint, state: MatcherState) -> Matcher:
        """A resumed row's matcher, identical to the one that produced `state`."""
        return self.compiled(constraint).restore(state)

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self._hits, self._misses, self._warmed)


@attrs.frozen
class MatcherState:
    """Enough to rebuild a matcher: its constraint's key and the tokens it consumed."""

    key: str
    tokens: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "tokens": list(self.tokens)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MatcherState:
        return cls(str(data["key"]), tuple(int(t) for t in data["tokens"]))


@attrs.define
class Matcher:
    """One row's position in its grammar.

    Each step: `allowed_mask()` (or `allowed_bitmask()`), sample, `consume(token)`.
    EOS ids are allowed exactly when the output so far is complete (`accepting`);
    `done` means nothing but EOS can follow.
    """

    _grammar: CompiledGrammar
    _ll: llg.LLMatcher
    _tokens: list[int] = attrs.field(factory=list)

    @property
    def constraint(self) -> Constraint:
        return self._grammar.constraint

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def vocab_size(self) -> int:
        return self._grammar.vocab.size

    def allowed_bitmask(self) -> np.ndarray:
        """int32 words, (vocab.size + 31) // 32 of them: bit j of word i allows token 32 * i + j."""
        return np.frombuffer(self._ll.compute_bitmask(), dtype=np.int32)

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write `allowed_bitmask()` into `out` (a C-contiguous int32 row, e.g. of a batch array)."""
        if out.dtype != np.int32 or out.ndim != 1 or not out.flags["C_CONTIGUOUS"]:
            raise ValueError("out must be a C-contiguous 1-D int32 array")
        words = bitmask_words(self._grammar.vocab.size)
        if out.size != words:
            raise ValueError(f"out has {out.size} words, the vocab needs {words}")
        self._ll.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def allowed_mask(self) -> np.ndarray:
        """bool array of the model's vocab size: True where a token may come next."""
        bits = np.unpackbits(self.allowed_bitmask().view(np.uint8), bitorder="little")
        return bits[: self._grammar.vocab.size].view(np.bool_)

    def consume(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it."""
        if token in self._grammar.vocab.eos_ids:
            # llguidance's validate/try_consume never take EOS: it is allowed when the output is complete
            if not (self.accepting and not self._ll.is_error()):
                return False
            if not self._ll.consume_token(token):
                raise RuntimeError(f"llguidance allowed EOS {token} but refused it: {self._ll.get_error()[:300]}")
        elif not (0 <= token < self._grammar.vocab.size and self._ll.try_consume_tokens([token]) == 1):
            return False  # one call checks and takes it (a refused token changes nothing)
        self._tokens.append(token)
        return True

    def consume_all(self, tokens: Iterable[int]) -> int:
        """Consume tokens in order until one is refused; how many were taken."""
        taken = 0
        for token in tokens:
            if not self.consume(token):
                break
            taken += 1
        return taken

    @property
    def accepting(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return bool(self._ll.is_accepting())

    @property
    def done(self) -> bool:
        """Nothing but EOS can follow (or EOS was consumed): the row may stop here."""
        return bool(self._ll.is_stopped())

    def rollback(self, count: int) -> None:
        """Forget the last `count` tokens (a refused draft, a trimmed stop string)."""
        if not 0 <= count <= len(self._tokens) or not self._ll.rollback(count):
            raise ValueError(f"cannot roll back {count} of {len(self._tokens)} tokens")
        del self._tokens[len(self._tokens) - count :]

    def state(self) -> MatcherState:
        return MatcherState(self._grammar.constraint.key, tuple(self._tokens))

    def fork(self) -> Matcher:
        """An independent copy at the same position (a few µs)."""
        return Matcher(self._grammar, self._ll.deep_copy(), list(self._tokens))


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's packed mask: bit j of word i allows token 32 * i + j."""
    return (vocab_size + 31) // 32


@attrs.define
class BatchMasks:
    """Many rows' packed masks filled in one call, on llguidance's own threads (the GIL released).

    Each row of `out` is one matcher's `allowed_bitmask()`; a single row is filled
    in place without the thread pool's hand-off. `threads` sizes llguidance's pool
    (None: its default, 80% of the cores up to 32; its idle threads spin a while after
    each fill, so a small pool costs the host less CPU).
    """

    threads: int | None = None
    _executor: llg.LLExecutor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")
        self._executor = llg.LLExecutor(self.threads)

    def fill(self, rows: Sequence[Matcher], out: np.ndarray) -> None:
        """Write row i's mask into `out[i]` (a C-contiguous int32 array of at least len(rows) rows)."""
        if out.dtype != np.int32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"] or out.shape[0] < len(rows):
            raise ValueError(f"out must be a C-contiguous int32 array of at least {len(rows)} rows")
        if len(rows) == 1:
            rows[0].fill_bitmask(out[0])
            return
        for row in rows:
            if bitmask_words(row._grammar.vocab.size) != out.shape[1]:
                raise ValueError(f"out rows have {out.shape[1]} words, a row's vocab needs another count")
        pairs = [(row._ll, i) for i, row in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, out.shape[1] * 4, out.shape[0])
