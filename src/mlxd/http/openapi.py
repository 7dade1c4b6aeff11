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
            "responses": {"200": _json_ok("the session was known: its references are gone"), **_errors(401, 404)},
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
            },
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "--api-key / MLXD_API_KEY"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "--admin-key / MLXD_ADMIN_KEY"},
            },
        },
    }


if __name__ == "__main__":
    print(json.dumps(openapi_document(), indent=2))
