"""Parse and validate OpenAI-style request bodies into mlxd requests.

Every problem becomes an `ApiError` with the status code and the OpenAI error
shape, so bad input never reaches the actors.
"""

from __future__ import annotations

from typing import Any

import attrs

from mlxd.runtime.messages import SamplingParams


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


@attrs.frozen
class ParsedRequest:
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None


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
    n = _int(body, "n", 1, lo=1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, default_max_tokens, lo=1)
    assert max_tokens is not None
    if max_tokens > max_tokens_limit:
        raise ApiError(
            400,
            f"'{max_name}' is {max_tokens}, above this server's limit of {max_tokens_limit}",
            param=max_name,
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage", False))
    if chat:
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
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
        seed=None if seed is None else seed % 2**32,
        max_tokens=max_tokens,
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0) or 0.0,
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0) or 0.0,
        repetition_penalty=_num(body, "repetition_penalty", None, lo=0.0, hi=10.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        top_logprobs=top,
    )
    return ParsedRequest(sampling, _stop(body), stream, include_usage, model)


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
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


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
