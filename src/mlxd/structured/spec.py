"""Structured-output constraints read from OpenAI request fields.

A `Constraint` says what a reply must match: any JSON object, a JSON schema, a
regex, a grammar, or a forced tool call. Sources are checked here with
llguidance (no tokenizer needed), so a bad schema fails its request with a
message naming the field and the keyword before any row starts.

Fields read by `constraint_from_request` (at most one may be given):
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
  (the schema is enforced whatever `strict` says);
- `regex` / `guided_regex`: the whole reply fullmatches it (Rust `regex` syntax:
  no look-around or backreferences);
- `grammar` / `guided_grammar`: llguidance's Lark dialect (Lark's EBNF plus
  `%json {schema}`, `<special_token>` and regex terminals); a llama.cpp GBNF
  grammar (`root ::= ...`) is accepted and converted to it;
- `guided_json` (a schema, or its JSON text) and `guided_choice` (a list of
  strings), as vLLM names them.
`tool_call_constraint` builds the constraint of a forced tool call.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json_object", "json_schema", "regex", "grammar", "tool_call"]

# JSON on one line with ", " and ": " between items (as json.dumps writes it, and as
# Hermes/Qwen tool calls look): no free whitespace, so a model cannot pad forever with
# newlines. A schema's own "x-guidance" object overrides these.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_MESSAGE = 600


class ConstraintError(ValueError):
    """A request's constraint fields are invalid; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@attrs.frozen
class Constraint:
    """What one reply must match; `key` identifies its compiled grammar."""

    kind: Kind
    source: str  # canonical JSON for the JSON kinds; regex or Lark text; tool_call: its Lark grammar
    key: str = attrs.field(init=False)

    @key.default
    def _key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """Compact JSON that keeps key order (a schema's property order is its output's order)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


JSON_OBJECT = Constraint("json_object", canonical_json({"type": "object"}))


@functools.lru_cache(maxsize=256)
def llguidance_grammar(constraint: Constraint) -> str:
    """The grammar text llguidance compiles for `constraint`, converted once: the request's
    check (`problem`) and the engine's compile (`compile_grammar`) share it."""
    if constraint.kind in ("json_object", "json_schema"):
        return llg.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
    if constraint.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(constraint.source)
    return llg.LLMatcher.grammar_from_lark(constraint.source)


@functools.lru_cache(maxsize=512)
def problem(constraint: Constraint) -> str | None:
    """llguidance's error for `constraint` without a tokenizer, or None when it compiles."""
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(llguidance_grammar(constraint), None)
    if not is_error:
        return None
    text = messages[0].strip() if messages else "invalid"
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + " ..."


def checked(constraint: Constraint, where: str, param: str) -> Constraint:
    """`constraint`, or a ConstraintError naming `where` and llguidance's reason."""
    reason = problem(constraint)
    if reason is not None:
        raise ConstraintError(f"{where}: {reason}", param)
    return constraint


# ---- request fields ----

def constraint_from_request(body: Mapping[str, Any]) -> Constraint | None:
    """The constraint a chat/completions request asks for, or None for free text."""
    found = [(name, read(body[name], name)) for name, read in _READERS.items() if body.get(name) is not None]
    asked = [(name, c) for name, c in found if c is not None]
    if len(asked) > 1:
        names = ", ".join(f"'{name}'" for name, _ in asked)
        raise ConstraintError(f"give one way to constrain the output, not several ({names})", asked[1][0])
    return asked[0][1] if asked else None


def _response_format(value: Any, param: str) -> Constraint | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        return _json_schema_format(value.get("json_schema"), param)
    raise ConstraintError("'response_format' must be an object with 'type': 'text', 'json_object' or "
                          "'json_schema'", param)


def _json_schema_format(spec: Any, param: str) -> Constraint:
    """`response_format.json_schema`: its `schema` (absent means any JSON object)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ConstraintError(f"'{where}' must be an object with a 'name' and a 'schema'", param)
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
        raise ConstraintError(f"'{where}.name' must be 1-64 letters, digits, '_' or '-'", param)
    if not isinstance(spec.get("strict", False), bool | None):
        raise ConstraintError(f"'{where}.strict' must be a boolean", param)
    schema = spec.get("schema")
    if schema is None:
        return JSON_OBJECT
    return _schema(schema, f"{where}.schema", param)


def _schema(schema: Any, where: str, param: str) -> Constraint:
    if not isinstance(schema, dict):
        raise ConstraintError(f"'{where}' must be a JSON schema object", param)
    try:
        source = canonical_json(schema)
    except ValueError as exc:  # NaN or infinity in the schema
        raise ConstraintError(f"'{where}': {exc}", param) from None
    return checked(Constraint("json_schema", source), where, param)


def _guided_json(value: Any, param: str) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConstraintError(f"'{param}' is not valid JSON: {exc}", param) from None
    return _schema(value, param, param)


def _regex(value: Any, param: str) -> Constraint:
    if not isinstance(value, str) or not value:
        raise ConstraintError(f"'{param}' must be a non-empty string", param)
    return checked(Constraint("regex", value), param, param)


def _grammar(value: Any, param: str) -> Constraint:
    if not isinstance(value, str) or not value.strip():
        raise ConstraintError(f"'{param}' must be a non-empty grammar string", param)
    try:
        lark = any_to_lark(value)  # GBNF to Lark; Lark passes through unchanged
    except Exception as exc:  # the converter raises its own error types
        raise ConstraintError(f"'{param}': not a Lark or GBNF grammar: {exc}", param) from None
    return checked(Constraint("grammar", lark), param, param)


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        raise ConstraintError(f"'{param}' must be a non-empty list of non-empty strings", param)
    lark = "start: " + " | ".join(json.dumps(s) for s in value)
    return checked(Constraint("grammar", lark), param, param)


_READERS: dict[str, Callable[[Any, str], Constraint | None]] = {
    "response_format": _response_format,
    "regex": _regex,
    "guided_regex": _regex,
    "grammar": _grammar,
    "guided_grammar": _grammar,
    "guided_json": _guided_json,
    "guided_choice": _choice,
}


# ---- forced tool calls ----

def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, *, parallel_tool_calls: bool = True
) -> Constraint | None:
    """The grammar of a forced call when `tool_choice` is "required" or names a function.

    The reply is `<tool_call>\\n{"name": "<fn>", "arguments": {...}}\\n</tool_call>`,
    once, or one or more times back to back when `parallel_tool_calls`;
    the arguments follow that function's `parameters` schema. None for
    "auto", "none" or no `tool_choice`: nothing is forced.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    functions = _functions(tools or ())
    if tool_choice == "required":
        chosen = list(functions)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        chosen = [_named(functions, tool_choice["function"].get("name"))]
    else:
        raise ConstraintError("'tool_choice' must be 'auto', 'none', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not chosen:
        raise ConstraintError("tool_choice 'required' needs at least one tool in 'tools'", "tool_choice")
    grammar = Constraint("tool_call", tool_call_grammar({n: functions[n] for n in chosen}, parallel=parallel_tool_calls))
    if problem(grammar) is None:  # one check covers every function's schema (the grammar embeds them)
        return grammar
    for name in chosen:  # which function's parameters are at fault, and the keyword
        checked(Constraint("json_schema", canonical_json(functions[name])),
                f"tools[{list(functions).index(name)}].function.parameters", "tools")
    return checked(grammar, "tools", "tools")


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each function's name and its parameters schema (absent: no arguments)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ConstraintError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[fn["name"]] = params
    return out


def _named(functions: Mapping[str, Any], name: Any) -> str:
    if name not in functions:
        raise ConstraintError(f"tool_choice names function {name!r}, which is not in 'tools'", "tool_choice")
    return str(name)


def tool_call_grammar(functions: Mapping[str, dict[str, Any]], *, parallel: bool) -> str:
    """Lark text for Hermes/Qwen tool calls to `functions` (name -> parameters schema).

    The markers are referenced as tokens (`<tool_call>`), so the tokenizer must
    have them as single tokens, as Qwen-family tokenizers do. Calls are not
    separated: text between them would reach the client as content.
    """
    lines = [
        f"start: {'call+' if parallel else 'call'}",
        f'call: {TOOL_CALL_START} "\\n" body "\\n" {TOOL_CALL_END}',
        "body: " + " | ".join(f"fn_{i}" for i in range(len(functions))),
    ]
    for i, (name, params) in enumerate(functions.items()):
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }
        lines.append(f"fn_{i}: %json {canonical_json(call)}")
    return "\n".join(lines) + "\n"
