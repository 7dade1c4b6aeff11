"""Parse and validate OpenAI-style request bodies into mlxd requests.

Every problem becomes an `ApiError` with the status code and the OpenAI error
shape, so bad input never reaches the actors.
"""

from __future__ import annotations

from typing import Any

import attrs

from mlxd.runtime.kernel.messages import SamplingParams
from mlxd.structured.spec import (
    Constraint,
    ConstraintError,
    constraint_from_request,
    tool_call_constraint,
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_CHOICES = 16


@attrs.frozen
class ParsedRequest:
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    n: int = 1


@attrs.frozen
class ChatOptions:
    """What a chat request adds to the prompt and to how the reply is read."""

    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"  # "auto" or "none" (a forced call is `forced`, and reads as "auto")
    template_kwargs: dict[str, Any] = attrs.Factory(dict)
    forced: Constraint | None = None  # tool_choice "required" or a named function: the call's grammar


def _num(body: dict[str, Any], name: str, default: float | None, *, lo: float, hi: float) -> float | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field; null is unset, as for every other field (OpenAI's API takes null for them)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return tuple(stop)
    raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    try:
        pairs = tuple((int(k), float(v)) for k, v in bias.items())
    except (TypeError, ValueError):
        raise ApiError(400, "'logit_bias' keys must be token ids and values numbers", param="logit_bias") from None
    if any(not -100 <= v <= 100 for _, v in pairs):
        raise ApiError(400, "'logit_bias' values must be between -100 and 100", param="logit_bias")
    return pairs


def parse_common(
    body: Any, *, default_max_tokens: int, max_tokens_limit: int, chat: bool
) -> ParsedRequest:
    """The sampling/streaming fields shared by chat and text completions."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    n = _int(body, "n", 1, lo=1, hi=MAX_CHOICES)
    assert n is not None
    constraint = _constraint(body)
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, default_max_tokens, lo=1)
    assert max_tokens is not None
    if max_tokens > max_tokens_limit:
        raise ApiError(
            400,
            f"'{max_name}' is {max_tokens}, above this server's limit of {max_tokens_limit}",
            param=max_name,
        )
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage", False))
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, lo=0, hi=20) or 0
        if top and not logprobs:
            raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    else:
        top = _int(body, "logprobs", 0, lo=0, hi=20) or 0
        logprobs = body.get("logprobs") is not None
    seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - 1)
    sampling = SamplingParams(
        temperature=_num(body, "temperature", 1.0, lo=0.0, hi=2.0) or 0.0,
        top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0) or 1.0,
        top_k=_int(body, "top_k", 0, lo=0) or 0,
        min_p=_num(body, "min_p", 0.0, lo=0.0, hi=1.0) or 0.0,
        seed=None if seed is None else seed % 2**32,
        max_tokens=max_tokens,
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0) or 0.0,
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0) or 0.0,
        repetition_penalty=_num(body, "repetition_penalty", None, lo=0.0, hi=10.0),
        repetition_context_size=_int(body, "repetition_context_size", 20, lo=1, hi=2**31 - 1) or 20,
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        top_logprobs=top,
        constraint=constraint,
    )
    return ParsedRequest(sampling, _stop(body), stream, include_usage, model, n)


def _constraint(body: dict[str, Any]) -> Constraint | None:
    """Structured output asked for: `response_format`, `regex`, `grammar` or vLLM's `guided_*` fields."""
    try:
        return constraint_from_request(body)
    except ConstraintError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None


def _legacy_functions(body: dict[str, Any]) -> tuple[Any, Any]:
    """`tools` and `tool_choice` from the deprecated `functions` / `function_call`, or as given."""
    functions, call = body.get("functions"), body.get("function_call")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if functions is not None:
        if tools is not None:
            raise ApiError(400, "give 'tools' or the deprecated 'functions', not both", param="functions")
        if not isinstance(functions, list):
            raise ApiError(400, "'functions' must be a list", param="functions")
        tools = [{"type": "function", "function": fn} for fn in functions]
    if call is not None:
        if choice is not None:
            raise ApiError(400, "give 'tool_choice' or the deprecated 'function_call', not both",
                           param="function_call")
        if call in ("none", "auto"):
            choice = call
        elif isinstance(call, dict) and isinstance(call.get("name"), str):
            choice = {"type": "function", "function": {"name": call["name"]}}
        else:
            raise ApiError(400, "'function_call' must be 'none', 'auto' or {'name': ...}", param="function_call")
    return tools, choice


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def parse_chat_options(body: dict[str, Any]) -> ChatOptions:
    """`tools`, `tool_choice` (or `functions`, `function_call`), `chat_template_kwargs`, `reasoning_effort`."""
    tools, choice = _legacy_functions(body)
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be an object", param="tools")
    if choice is None:
        choice = "auto"
    parallel = _bool(body, "parallel_tool_calls", True)
    try:  # "required" or a named function: the reply is a call, by a grammar over the call format
        forced = tool_call_constraint(tools, choice, parallel_tool_calls=parallel)
    except ConstraintError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "conversation"} & kwargs.keys()
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:  # a template variable, as gpt-oss's and other templates read it
        if effort not in REASONING_EFFORTS:
            raise ApiError(400, f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}",
                           param="reasoning_effort")
        kwargs = {"reasoning_effort": effort, **kwargs}
    return ChatOptions(tuple(tools), "none" if choice == "none" else "auto", dict(kwargs), forced)


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role {m['role']!r} is not supported", param="messages")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # content parts: text, and images (kept as parts, docs/vision.md)
            texts, parts = [], []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    parts.append({"type": "image_url", "image_url": part.get("image_url")})
                    continue
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text and image_url parts are supported",
                                   param="messages")
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
            content = parts if len(parts) > len(texts) else "".join(texts)
        if not isinstance(content, str | list):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            message.update(_assistant_extras(m, i))
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    message[key] = m[key]
        out.append(message)
    return out


def _assistant_extras(m: dict[str, Any], i: int) -> dict[str, Any]:
    """An assistant turn's tool calls and reasoning, as the chat template reads them."""
    extras: dict[str, Any] = {}
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if isinstance(reasoning, str) and reasoning:
        extras["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls is None:
        return extras
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}] needs function.name", param="messages")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str | dict):
            raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string",
                           param="messages")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    if out:
        extras["tool_calls"] = out
    return extras


def parse_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return parse_prompt({"prompt": prompt[0]})
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
