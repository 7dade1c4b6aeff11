"""Structured output: request fields to a constraint, and per-row token matchers (llguidance).

Pure and synchronous: no MLX and no trio here. `spec` reads OpenAI request
fields into a `Constraint`; `matcher` compiles it for a model's vocabulary and
walks one row through it, token by token.
"""

from mlxd.structured.matcher import (
    BatchMasks,
    CacheStats,
    CompiledGrammar,
    GrammarCache,
    Matcher,
    MatcherState,
    Vocabulary,
    bitmask_words,
    compile_grammar,
    load_vocabulary,
    vocabulary_from_json,
)
from mlxd.structured.spec import (
    JSON_OBJECT,
    Constraint,
    ConstraintError,
    constraint_from_request,
    tool_call_constraint,
    tool_call_grammar,
)

__all__ = [
    "JSON_OBJECT",
    "BatchMasks",
    "CacheStats",
    "CompiledGrammar",
    "Constraint",
    "ConstraintError",
    "GrammarCache",
    "Matcher",
    "MatcherState",
    "Vocabulary",
    "bitmask_words",
    "compile_grammar",
    "constraint_from_request",
    "load_vocabulary",
    "tool_call_constraint",
    "tool_call_grammar",
    "vocabulary_from_json",
]
