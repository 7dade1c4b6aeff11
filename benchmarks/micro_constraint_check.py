# ruff: noqa: I001  (mlxd must be imported before mlx: it preloads OpenBLAS)
"""A cold constraint's host work before its first mask, the request's check and the engine's compile, old flow vs new.

Old (before aa0d071): a forced tool call checked each function's schema, then the
whole call grammar, and every check and the engine's compile converted the grammar
text again. New: `tool_call_constraint` checks the call grammar once (the functions'
schemas only when that fails) and `llguidance_grammar` is converted once per
constraint. Arms alternate in one process, each rep's schema new (a cold grammar).
Reported per case, medians: the check's and the compile + first mask's CPU time
(this thread's) and their wall time together.

    PYTHONPATH=src python benchmarks/micro_constraint_check.py [--reps 11] [--preset default]
"""

from __future__ import annotations

import mlxd  # noqa: F401  (preloads OpenBLAS before mlx)

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance as llg

from mlxd.model import ensure_model
from mlxd.structured import compile_grammar, constraint_from_request, load_vocabulary, spec, tool_call_constraint
from mlxd.structured.spec import Constraint, canonical_json, tool_call_grammar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grammar_compile import tool_with_30_properties  # noqa: E402
from bench_structured import _nested  # noqa: E402

CASES: dict[str, Callable[[str], Any]] = {
    "forced call, 30-property tool": lambda tag: [tool_with_30_properties(tag)],
    "json_schema, 30-property tool's parameters": lambda tag: tool_with_30_properties(tag)["function"]["parameters"],
    "json_schema, nested order": _nested,
}


def old_check(forced: bool, value: Any) -> Constraint:
    text = spec.llguidance_grammar.__wrapped__  # no cache: each use converts again

    def problem(c: Constraint) -> None:
        llg.LLMatcher.validate_grammar_with_warnings(text(c), None)

    if forced:
        fn = value[0]["function"]
        problem(Constraint("json_schema", canonical_json(fn["parameters"])))
        c = Constraint("tool_call", tool_call_grammar({fn["name"]: fn["parameters"]}, parallel=True))
    else:
        c = Constraint("json_schema", canonical_json(value))
    problem(c)
    return c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--preset", default="default")
    args = parser.parse_args()
    vocab = load_vocabulary(ensure_model(args.preset))
    text = spec.llguidance_grammar.__wrapped__

    def old_compile(c: Constraint) -> None:
        llg.LLMatcher(vocab.tokenizer, text(c), log_level=0).compute_bitmask()

    def new_compile(c: Constraint) -> None:
        compile_grammar(c, vocab).matcher().allowed_bitmask()

    def new_check(forced: bool, value: Any) -> Constraint:
        c = tool_call_constraint(value, "required") if forced else constraint_from_request({"guided_json": value})
        assert c is not None
        return c

    flows = {"old": (old_check, old_compile), "new": (new_check, new_compile)}
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(args.reps):
        for name, make in CASES.items():
            for arm in ("old", "new") if r % 2 == 0 else ("new", "old"):
                check, compile_ = flows[arm]
                value = make(f"{arm}{r}x{time.perf_counter_ns()}")
                w0, c0 = time.perf_counter(), time.thread_time()
                constraint = check(name.startswith("forced"), value)
                c1 = time.thread_time()
                compile_(constraint)
                w2, c2 = time.perf_counter(), time.thread_time()
                cell = times.setdefault((name, arm), {"check_cpu_ms": [], "compile_cpu_ms": [], "wall_ms": []})
                cell["check_cpu_ms"].append(1e3 * (c1 - c0))
                cell["compile_cpu_ms"].append(1e3 * (c2 - c1))
                cell["wall_ms"].append(1e3 * (w2 - w0))
    for (name, arm), cell in times.items():
        print(f"{name:45s} {arm}: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in cell.items()))


if __name__ == "__main__":
    main()
