# ruff: noqa: I001  (mlxd must be imported before mlx_lm: it preloads OpenBLAS)
"""Would persisting compiled grammars to the SSD tier save a restart real time?

llguidance (the matcher) has no way to serialize a compiled grammar: `LLMatcher`,
`LLTokenizer` and `LLInterpreter` have no serialize/pickle, and the only text form is
the grammar it compiles from. So the most a file could hold is that text (the
schema converted to llguidance's grammar). This measures, per vocabulary and per
large realistic constraint, each part of a cold start against a cached one:

- `convert`: request schema -> grammar text (the part a file could skip);
- `compile`: `LLMatcher(tokenizer, grammar)` (what a serialized matcher would skip);
- `first mask` of the compiled grammar, and a `cached` start (`deep_copy` + first
  mask, what `GrammarCache` gives every later row);
- a walk of 200 allowed tokens (mask + consume) from a fresh compile against one
  from a copy of a matcher that walked it before (llguidance builds its lexer
  lazily while rows walk; does a copy keep that work?).

    python benchmarks/bench_grammar_compile.py [--reps 5] [--large]

`--large` adds a 32k byte-level BPE trained as bench_matchers.py does (a minute or
two). Results go to benchmarks/results/grammar_compile-*.json.
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance as llg
import numpy as np

from mlxd.model import ensure_model
from mlxd.structured.matcher import Matcher, Vocabulary, compile_grammar, load_vocabulary, vocabulary_from_json
from mlxd.structured.spec import Constraint, ConstraintError, constraint_from_request, llguidance_grammar, tool_call_constraint

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def tool_with_30_properties(tag: str) -> dict[str, Any]:
    """A function whose parameters have 30 properties: enums, bounded numbers, patterns, arrays, nested objects."""
    props: dict[str, Any] = {}
    for i in range(30):
        kind = i % 6
        if kind == 0:
            props[f"mode_{i}_{tag}"] = {"enum": [f"option_{j}" for j in range(12)]}
        elif kind == 1:
            props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        elif kind == 2:
            props[f"code_{i}"] = {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}
        elif kind == 3:
            props[f"labels_{i}"] = {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8}
        elif kind == 4:
            props[f"where_{i}"] = {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 40}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False}},
                "required": ["city"], "additionalProperties": False}
        else:
            props[f"note_{i}"] = {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]}
    params = {"type": "object", "properties": props, "required": list(props)[:20], "additionalProperties": False}
    return {"type": "function", "function": {"name": f"update_record_{tag}", "parameters": params}}


def _array(tag: str) -> dict[str, Any]:
    return {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 100000, "title": tag}


def _enum(tag: str, count: int) -> dict[str, Any]:
    return {"enum": [f"{tag}-value-{i:06d}" for i in range(count)]}


# Each case's constraint from a tag that makes every rep's source new (a cold compile, not a lookup).
CASES: dict[str, Callable[[str], Constraint | None]] = {
    "tool_30_props (forced call)": lambda tag: tool_call_constraint([tool_with_30_properties(tag)], "required"),
    "schema_30_props": lambda tag: constraint_from_request(
        {"guided_json": tool_with_30_properties(tag)["function"]["parameters"]}),
    "array_100k_items (bench)": lambda tag: constraint_from_request({"guided_json": _array(tag)}),
    "enum_10k_values": lambda tag: constraint_from_request({"guided_json": _enum(tag, 10_000)}),
    "enum_100k_values": lambda tag: constraint_from_request({"guided_json": _enum(tag, 100_000)}),
}


def build(name: str, tag: str) -> Constraint:
    constraint = CASES[name](tag)
    assert constraint is not None
    return constraint


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def walk_tokens(row: Matcher, steps: int, seed: int) -> list[int]:
    """A fixed walk: random allowed non-EOS tokens."""
    rng = random.Random(seed)
    eos = set(row._grammar.vocab.eos_ids)
    out: list[int] = []
    for _ in range(steps):
        allowed = [t for t in np.flatnonzero(row.allowed_mask()).tolist() if t not in eos]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert row.consume(token)
        out.append(token)
    return out


def replay(row: Matcher, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    for token in tokens:
        row.allowed_bitmask()
        assert row.consume(token)
    return time.perf_counter() - t0


def measure(vocab: Vocabulary, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in CASES:
        try:
            build(name, "probe")
        except ConstraintError as exc:  # recorded: llguidance refuses the case itself
            out[name] = {"error": exc.message}
            print(f"  {name}: refused: {exc.message}", flush=True)
            continue
        rows: dict[str, list[float]] = {k: [] for k in ("convert_ms", "compile_ms", "first_mask_ms", "cached_ms",
                                                        "walk_fresh_ms", "walk_copy_ms")}
        for r in range(reps):
            # convert: the request's fields -> a Constraint (checked by llguidance) -> grammar text
            t_read, constraint = timed(lambda n=name, r=r: build(n, f"r{r}x{random.random():.6f}"))
            t_text, _ = timed(lambda c=constraint: llguidance_grammar(c))
            t_compile, compiled = timed(lambda c=constraint: compile_grammar(c, vocab))
            t_first, row = timed(lambda g=compiled: _first(g.matcher()))
            t_cached, _ = timed(lambda g=compiled: _first(g.matcher()))
            tokens = walk_tokens(compiled.matcher(), 200, seed=r)
            fresh = compile_grammar(constraint, vocab).matcher()
            t_walk_fresh = replay(fresh, tokens)
            t_walk_copy = replay(compiled.matcher(), tokens)  # the template walked these tokens once already
            rows["convert_ms"].append(1e3 * (t_read + t_text))
            rows["compile_ms"].append(1e3 * t_compile)
            rows["first_mask_ms"].append(1e3 * t_first)
            rows["cached_ms"].append(1e3 * t_cached)
            rows["walk_fresh_ms"].append(1e3 * t_walk_fresh)
            rows["walk_copy_ms"].append(1e3 * t_walk_copy)
            del row
        cell = {k: round(statistics.median(v), 3) for k, v in rows.items()}
        cell["grammar_chars"] = len(llguidance_grammar(build(name, "size")))
        cell["reps"] = {k: [round(x, 3) for x in v] for k, v in rows.items()}
        out[name] = cell
        print(f"  {name}: convert {cell['convert_ms']} ms, compile {cell['compile_ms']} ms, first mask "
              f"{cell['first_mask_ms']} ms, cached start {cell['cached_ms']} ms; 200-token walk fresh "
              f"{cell['walk_fresh_ms']} ms / from a walked copy {cell['walk_copy_ms']} ms", flush=True)
    return out


def _first(row: Matcher) -> Matcher:
    row.allowed_bitmask()
    return row


def serialization_api() -> dict[str, list[str]]:
    """What llguidance's classes offer that could save or load a compiled form."""
    words = ("serial", "pickle", "dump", "load", "save", "bytes", "state", "reduce", "to_json", "from_json")
    found = {}
    for cls in (llg.LLMatcher, llg.LLTokenizer, llg.LLInterpreter, llg.LLExecutor):
        found[cls.__name__] = [m for m in dir(cls) if any(w in m.lower() for w in words) and not m.startswith("__")]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--preset", default="default")
    parser.add_argument("--large", action="store_true", help="also a 32k BPE (trained here, as bench_matchers.py)")
    args = parser.parse_args()
    result: dict[str, Any] = {"llguidance": llg.__version__, "host": platform.node(), "reps": args.reps,
                              "serialization_api": serialization_api(), "vocabs": {}}
    try:
        pickle_error = None
        import pickle

        pickle.dumps(compile_grammar(constraint_from_request({"regex": "a+"}), _vocab_of(args.preset)[1])._start)
    except Exception as exc:  # noqa: BLE001 - recorded: why a compiled matcher cannot be saved
        pickle_error = f"{type(exc).__name__}: {exc}"
    result["pickle_compiled_matcher"] = pickle_error or "pickled"
    print(f"llguidance {llg.__version__}; serialization API: {result['serialization_api']}; "
          f"pickle of a compiled matcher: {result['pickle_compiled_matcher']}")
    vocabs = [_vocab_of(args.preset)]
    if args.large:
        vocabs.append(_large_vocab())
    for (label, setup_ms), vocab in [(v[0], v[1]) for v in vocabs]:
        print(f"{label} ({vocab.size} tokens; tokenizer setup {setup_ms:.1f} ms):", flush=True)
        result["vocabs"][label] = {"size": vocab.size, "tokenizer_setup_ms": round(setup_ms, 2),
                                   "cases": measure(vocab, args.reps)}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"grammar_compile-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(path)
    return 0


def _vocab_of(preset: str) -> tuple[tuple[str, float], Vocabulary]:
    model = ensure_model(preset)
    t, vocab = timed(lambda: load_vocabulary(model))
    return (f"preset {preset}", 1e3 * t), vocab


def _large_vocab() -> tuple[tuple[str, float], Vocabulary]:
    sys.path.insert(0, str(HERE))
    from bench_matchers import EOS, train_large

    text = train_large(32_000).to_str()
    t, vocab = timed(lambda: vocabulary_from_json(text, eos_ids=[EOS]))
    return ("32k BPE", 1e3 * t), vocab


if __name__ == "__main__":
    sys.exit(main())
