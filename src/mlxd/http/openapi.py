"""The OpenAPI 3.0 description of mlxd's HTTP API (served at GET /openapi.json).

Request schemas say what the server accepts; anything else gets a 4xx with
the OpenAI error shape. `max_tokens` carries the server's own limit.
`docs/openapi.json` is this document for the default limit, regenerated with
`python -m mlxd.http.openapi > docs/openapi.json`.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_MAX_TOKENS_LIMIT = 8192

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}

_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["chat.completion", "text_completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"$ref": "#/components/schemas/Usage"},
    },
}

_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}

_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCall"},
                       "description": "an assistant turn's calls, as the server returned them"},
        "tool_call_id": {"type": "string"},
        "reasoning_content": {"type": "string", "nullable": True},
        "content": {
            "nullable": True,
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                    },
                },
            ],
        },
    },
}


def _sampling(max_tokens_limit: int) -> dict[str, Any]:
    """The fields shared by chat and text completions."""
    number = {"type": "number"}
    return {
        "model": {"type": "string", "description": "the served model name, 'default' / 'default_model', or an --adapter NAME (that LoRA adapter)"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens_limit, "nullable": True},
        "temperature": {**number, "minimum": 0, "maximum": 2, "nullable": True},
        "top_p": {**number, "minimum": 0, "maximum": 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": 0, "nullable": True},
        "min_p": {**number, "minimum": 0, "maximum": 1, "nullable": True,
                  "description": "keep tokens at least this fraction of the likeliest one's probability"},
        "seed": {"type": "integer", "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": 16, "nullable": True,
              "description": "choices; they share one prefill, choice i samples with seed + i"},
        "presence_penalty": {**number, "minimum": -2, "maximum": 2, "nullable": True},
        "frequency_penalty": {**number, "minimum": -2, "maximum": 2, "nullable": True},
        "repetition_penalty": {**number, "minimum": 0, "maximum": 10, "nullable": True},
        "repetition_context_size": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1, "nullable": True,
                                    "description": "recent tokens the repetition penalty looks at (default 20)"},
        "logit_bias": {
            "type": "object",
            "nullable": True,
            "description": "token id -> bias",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        "stop": {
            "nullable": True,
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}],
        },
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object",
            "nullable": True,
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "response_format": {
            "type": "object",
            "nullable": True,
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                   "strict": {"type": "boolean", "nullable": True}},
                },
            },
            "description": "json_object and json_schema are enforced while decoding (docs/structured-output.md)",
        },
        "regex": {"type": "string", "nullable": True,
                  "description": "the whole reply matches this regex (Rust regex syntax); alias guided_regex"},
        "grammar": {"type": "string", "nullable": True,
                    "description": "the reply follows this Lark grammar (llguidance's dialect; GBNF is accepted); "
                    "alias guided_grammar"},
        "guided_json": {"nullable": True, "oneOf": [{"type": "object"}, {"type": "string"}],
                        "description": "a JSON schema the reply follows (vLLM's name)"},
        "guided_choice": {"type": "array", "nullable": True, "items": {"type": "string"},
                          "description": "the reply is exactly one of these strings (vLLM's name)"},
    }


def _chat_request(max_tokens_limit: int) -> dict[str, Any]:
    props = _sampling(max_tokens_limit)
    props.update({
        "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/Message"}},
        "max_completion_tokens": props["max_tokens"],
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
        "tools": {"type": "array", "nullable": True, "items": {"$ref": "#/components/schemas/Tool"},
                  "description": "rendered into the prompt by the chat template"},
        "tool_choice": {
            "nullable": True,
            "oneOf": [
                {"type": "string", "enum": ["auto", "none", "required"]},
                {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"type": "string", "enum": ["function"]},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}},
            ],
            "description": "'none' keeps the model from opening a call; 'required' or a named function "
            "forces a call whose arguments follow the tool's schema",
        },
        "parallel_tool_calls": {"type": "boolean", "nullable": True,
                                "description": "with a forced call: one call (false) or one or more (true)"},
        "chat_template_kwargs": {"type": "object", "nullable": True,
                                 "description": "extra template variables, e.g. {'enable_thinking': false}"},
        "functions": {"type": "array", "nullable": True, "items": {"type": "object"},
                      "description": "deprecated: read as tools of type function (not with tools)"},
        "function_call": {
            "nullable": True,
            "oneOf": [
                {"type": "string", "enum": ["auto", "none"]},
                {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
            ],
            "description": "deprecated: read as tool_choice (not with tool_choice)",
        },
        "reasoning_effort": {"type": "string", "nullable": True,
                             "enum": ["none", "minimal", "low", "medium", "high", "xhigh"],
                             "description": "passed to the chat template as the variable reasoning_effort"},
    })
    return {
        "type": "object",
        "required": ["messages"],
        "properties": props,
        "description": "fields not listed here are ignored",
    }


def _completion_request(max_tokens_limit: int) -> dict[str, Any]:
    props = _sampling(max_tokens_limit)
    props.update({
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            ],
            "description": "one prompt: text or token ids (ids must be in the vocabulary)",
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20, "nullable": True},
        "echo": {"type": "boolean", "enum": [False]},
    })
    return {"type": "object", "required": ["prompt"], "properties": props}


def _errors(*codes: int) -> dict[str, Any]:
    why = {
        400: "invalid request", 401: "missing or wrong bearer token", 403: "admin routes disabled",
        404: "unknown model or route", 413: "request body too large", 503: "overloaded or shutting down",
    }
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": why[c], "content": content} for c in codes}


def _generation(request: str, summary: str) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}}}
    ok = {
        "description": "the completion (JSON), or server-sent events when 'stream' is true",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
            # One server-sent event: `data` is a JSON chunk, an error, or "[DONE]".
            "text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}},
        },
    }
    return {
        "post": {
            "summary": summary,
            "security": [{"apiKey": []}, {}],
            "requestBody": body,
            "responses": {"200": ok, **_errors(400, 401, 404, 413, 503)},
        }
    }


def _json_ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema or {"type": "object"}}}}


def _paths(max_tokens_limit: int) -> dict[str, Any]:
    model_card = {"type": "object", "required": ["id", "object"], "properties": {"id": {"type": "string"}}}
    name = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/v1/chat/completions": _generation("ChatRequest", "Chat completion (OpenAI-compatible)"),
        "/v1/completions": _generation("CompletionRequest", "Text completion (OpenAI-compatible)"),
        "/v1/models": {"get": {"summary": "The served model", "responses": {
            "200": _json_ok("a list with the one served model"), **_errors(401)}}},
        "/v1/models/{model}": {"get": {"summary": "One model card", "parameters": [name], "responses": {
            "200": _json_ok("the model card", model_card), **_errors(401, 404)}}},
        "/health": {"get": {"summary": "Liveness (no token needed)", "security": [], "responses": {
            "200": _json_ok("serving"), "503": _json_ok("draining for shutdown")}}},
        "/stats": {"get": {"summary": "Runtime, scheduler and cache counters", "responses": {
            "200": _json_ok("counters"), **_errors(401)}}},
        "/openapi.json": {"get": {"summary": "This document (no token needed)", "security": [], "responses": {
            "200": _json_ok("the OpenAPI document")}}},
        "/v1/sessions/{session_id}": {"delete": {
            "summary": "Drop a session's cache references (X-Session-Id); its cached state stays",
            "parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json_ok("the session was known: its references are gone"),
                          **_errors(400, 401, 404)},
        }},
        "/admin/cache/flush": {"post": {
            "summary": "Make every RAM checkpoint durable on SSD (needs the admin key when one is set)",
            "security": [{"adminKey": []}, {}],
            "responses": {
                "200": _json_ok("durable: the evidence"),
                "503": _json_ok("not durable: the reason"),
                **_errors(400, 401, 403),
            },
        }},
        "/v1/loads": {"get": {"summary": "Load and cache counters for a router (vLLM's /v1/loads shape)",
                              "responses": {"200": _json_ok("the load report"), **_errors(401)}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "the exposition text", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(401)}}},
        "/": {"get": {"summary": "The status page (polls /stats)", "responses": {
            "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}},
            **_errors(401)}}},
        **_agent_paths(),
    }


# --- the agent protocols (Anthropic Messages, OpenAI Responses) and session transfer -----------

_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
    "description": "Anthropic's error shape (every error of /v1/messages except 401 from the API key check)",
}

_CACHE_CONTROL = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "enum": ["ephemeral"]},
                   "ttl": {"type": "string", "enum": ["5m", "1h"]}},
    "description": "a breakpoint: the prefix up to this block is pinned for the TTL (docs/agent-protocols.md)",
}

_ANTHROPIC_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "image", "tool_use", "tool_result", "thinking"]},
        "text": {"type": "string"},
        "thinking": {"type": "string"},
        "id": {"type": "string", "description": "tool_use: the call's id"},
        "name": {"type": "string", "description": "tool_use: the tool"},
        "input": {"type": "object", "description": "tool_use: the call's arguments"},
        "tool_use_id": {"type": "string", "description": "tool_result: the call it answers"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}],
                    "description": "tool_result: text or text blocks"},
        "is_error": {"type": "boolean"},
        "source": {"type": "object", "description": "image: {type: base64, media_type, data} or {type: url, url}"},
        "cache_control": {"$ref": "#/components/schemas/CacheControl"},
    },
}

_CACHE_KNOBS = {
    "prompt_cache_key": {"type": "string", "nullable": True,
                         "description": "a session key: the conversation's checkpoints are kept under it"},
    "prompt_cache_retention": {"type": "string", "nullable": True, "enum": ["in_memory", "24h"],
                               "description": "retention class of the session's checkpoints"},
}


def _messages_request(max_tokens_limit: int) -> dict[str, Any]:
    text_or_blocks = {"oneOf": [{"type": "string"},
                                {"type": "array", "items": {"$ref": "#/components/schemas/AnthropicBlock"}}]}
    return {
        "type": "object",
        "required": ["messages", "max_tokens"],
        "properties": {
            "model": {"type": "string", "description": "the served model name or an --adapter NAME"},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens_limit},
            "system": text_or_blocks,
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role", "content"],
                "properties": {"role": {"type": "string", "enum": ["user", "assistant"]},
                               "content": text_or_blocks},
                "description": "a final assistant turn of text is a prefill: the reply continues it"}},
            "tools": {"type": "array", "items": {
                "type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                               "input_schema": {"type": "object"}, "type": {"type": "string", "enum": ["custom"]},
                               "cache_control": {"$ref": "#/components/schemas/CacheControl"}}}},
            "tool_choice": {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                "disable_parallel_tool_use": {"type": "boolean"}}},
            "thinking": {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
                "budget_tokens": {"type": "integer"}},
                "description": "passed to the chat template as enable_thinking"},
            "stop_sequences": {"type": "array", "items": {"type": "string"}},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stream": {"type": "boolean", "description": "Anthropic's server-sent events"},
            "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}},
                         "description": "user_id names the cache session when prompt_cache_key is absent"},
            "cache_control": {"$ref": "#/components/schemas/CacheControl"},
            **_CACHE_KNOBS,
        },
        "description": "Anthropic Messages; fields not listed here are ignored",
    }


_MESSAGE_REPLY = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["assistant"]},
        "model": {"type": "string"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "thinking", "tool_use"]}}}},
        "stop_reason": {"type": "string", "nullable": True,
                        "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": "string", "nullable": True},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
            "input_tokens": {"type": "integer", "description": "prompt tokens not read from the cache"},
            "cache_read_input_tokens": {"type": "integer", "description": "prompt tokens read from the cache"},
            "cache_creation_input_tokens": {"type": "integer"},
            "output_tokens": {"type": "integer"}}},
    },
}


def _responses_request(max_tokens_limit: int) -> dict[str, Any]:
    item = {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["message", "function_call", "function_call_output", "reasoning"]},
            "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "string"},
            "output": {"type": "string"},
        },
    }
    return {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"type": "string", "description": "the served model name or an --adapter NAME"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": item}]},
            "instructions": {"type": "string", "nullable": True},
            "previous_response_id": {"type": "string", "nullable": True,
                                     "description": "continue a stored response (kept on the SSD tier)"},
            "store": {"type": "boolean", "description": "keep the response for previous_response_id (default true)"},
            "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens_limit, "nullable": True},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
            "stream": {"type": "boolean"},
            "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"}, "parameters": {"type": "object"},
                "strict": {"type": "boolean"}}}},
            "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                                      {"type": "object", "required": ["type", "name"], "properties": {
                                          "type": {"type": "string", "enum": ["function"]},
                                          "name": {"type": "string"}}}]},
            "parallel_tool_calls": {"type": "boolean"},
            "reasoning": {"type": "object", "nullable": True, "properties": {"effort": {"type": "string"}},
                          "description": "effort is passed to the chat template as reasoning_effort"},
            "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"],
                     "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]}}}}},
            "metadata": {"type": "object", "nullable": True},
            "user": {"type": "string", "nullable": True},
            **_CACHE_KNOBS,
        },
        "description": "OpenAI Responses; fields not listed here are ignored ('background' and 'conversation' "
        "are refused)",
    }


_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["response"]},
        "created_at": {"type": "integer"},
        "status": {"type": "string", "enum": ["completed", "incomplete", "in_progress"]},
        "model": {"type": "string"},
        "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["message", "function_call", "reasoning"]}}}},
        "previous_response_id": {"type": "string", "nullable": True},
        "usage": {"type": "object", "nullable": True, "properties": {
            "input_tokens": {"type": "integer"},
            "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
            "output_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"}}},
    },
}


def _agent_paths() -> dict[str, Any]:
    body = lambda ref: {"required": True, "content": {"application/json": {  # noqa: E731
        "schema": {"$ref": f"#/components/schemas/{ref}"}}}}
    anthropic_error = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}
    anthropic_errors = {str(c): {"description": why, "content": anthropic_error} for c, why in (
        (400, "invalid request"), (404, "unknown model"), (413, "request body too large"),
        (503, "overloaded or shutting down"))}
    event = {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}
    rid = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    sid = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}
    model = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "the base model (default) or an --adapter NAME: the cache namespace"}
    admin: list[dict[str, list[str]]] = [{"adminKey": []}, {}]
    return {
        "/v1/messages": {"post": {
            "summary": "Anthropic Messages (cache_control breakpoints pin prefixes)",
            "security": [{"apiKey": []}, {}], "requestBody": body("MessagesRequest"),
            "responses": {"200": {"description": "the message (JSON), or Anthropic's events when 'stream' is true",
                                  "content": {"application/json": {
                                      "schema": {"$ref": "#/components/schemas/MessageReply"}},
                                      "text/event-stream": event}},
                          **anthropic_errors, **_errors(401)}}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "The prompt tokens a Messages request renders to (max_tokens not needed)",
            "security": [{"apiKey": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["messages"], "properties": {
                    "model": {"type": "string"}, "system": {}, "messages": {"type": "array", "minItems": 1},
                    "tools": {"type": "array"}}}}}},
            "responses": {"200": _json_ok("the count", {"type": "object", "required": ["input_tokens"],
                                                        "properties": {"input_tokens": {"type": "integer"}}}),
                          **{c: r for c, r in anthropic_errors.items() if c != "503"}, **_errors(401)}}},
        "/v1/responses": {"post": {
            "summary": "OpenAI Responses (previous_response_id continues a stored response)",
            "security": [{"apiKey": []}, {}], "requestBody": body("ResponsesRequest"),
            "responses": {"200": {"description": "the response (JSON), or Responses events when 'stream' is true",
                                  "content": {"application/json": {
                                      "schema": {"$ref": "#/components/schemas/Response"}},
                                      "text/event-stream": event}},
                          **_errors(400, 401, 404, 413, 503)}}},
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response", "parameters": [rid], "responses": {
                "200": _json_ok("the response", {"$ref": "#/components/schemas/Response"}), **_errors(401, 404)}},
            "delete": {"summary": "Delete a stored response", "parameters": [rid], "responses": {
                "200": _json_ok("deleted", {"type": "object", "required": ["id", "object", "deleted"], "properties": {
                    "id": {"type": "string"}, "object": {"type": "string", "enum": ["response.deleted"]},
                    "deleted": {"type": "boolean"}}}), **_errors(401, 404)}},
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            "summary": "The input items of a stored response, paged",
            "parameters": [rid,
                           {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
                           {"name": "after", "in": "query", "schema": {"type": "string"}},
                           {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                       "maximum": 100}}],
            "responses": {"200": _json_ok("a page of items", {"type": "object", "required": ["object", "data"],
                                                              "properties": {"object": {"type": "string"},
                                                                             "data": {"type": "array"},
                                                                             "has_more": {"type": "boolean"}}}),
                          **_errors(400, 401, 404)}}},
        "/admin/sessions/{session_id}/export": {"get": {
            "summary": "A session's KV checkpoint as a verified .mlxkv file (needs the admin key when one is set)",
            "security": admin, "parameters": [sid, model],
            "responses": {"200": {"description": "the file", "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}}, **_errors(400, 401, 403, 404)}}},
        "/admin/sessions/{session_id}/import": {"post": {
            "summary": "Adopt an exported .mlxkv file as the session's checkpoint (every CRC checked)",
            "security": admin, "parameters": [sid],
            "requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": _json_ok("adopted", {"type": "object", "required": ["id", "object", "tokens"],
                                                      "properties": {"id": {"type": "string"},
                                                                     "object": {"type": "string"},
                                                                     "tokens": {"type": "integer"},
                                                                     "nbytes": {"type": "integer"},
                                                                     "ram": {"type": "boolean"},
                                                                     "ssd": {"type": "boolean"}}}),
                          **_errors(400, 401, 403, 404, 413)}}},
    }


def openapi_document(*, max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT) -> dict[str, Any]:
    """The API description, with `max_tokens` bounded by this server's limit."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "mlxd",
            "version": "0.1.0",
            "description": "OpenAI-compatible LLM serving on MLX with a durable tiered prompt cache. "
            "Every error is {'error': {'message', 'type', 'param', 'code'}}.",
        },
        "paths": _paths(max_tokens_limit),
        "components": {
            "schemas": {
                "Error": _ERROR,
                "Usage": _USAGE,
                "Completion": _COMPLETION,
                "Message": _MESSAGE,
                "Tool": _TOOL,
                "ToolCall": _TOOL_CALL,
                "ChatRequest": _chat_request(max_tokens_limit),
                "CompletionRequest": _completion_request(max_tokens_limit),
                "AnthropicError": _ANTHROPIC_ERROR,
                "CacheControl": _CACHE_CONTROL,
                "AnthropicBlock": _ANTHROPIC_BLOCK,
                "MessagesRequest": _messages_request(max_tokens_limit),
                "MessageReply": _MESSAGE_REPLY,
                "ResponsesRequest": _responses_request(max_tokens_limit),
                "Response": _RESPONSE,
            },
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "--api-key / MLXD_API_KEY"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "--admin-key / MLXD_ADMIN_KEY"},
            },
        },
    }


if __name__ == "__main__":
    print(json.dumps(openapi_document(), indent=2))
