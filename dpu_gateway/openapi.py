"""A hand-written OpenAPI 3.1 description of the gateway's endpoints (served at /openapi.json).

It names the one served model and, while an engine runs, that engine's limits (output tokens,
prompt length, token ids), so that a schema-valid request is one the server can serve.
"""

from __future__ import annotations

import dataclasses

from dpu_gateway.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, Limits


@dataclasses.dataclass(frozen=True, slots=True)
class DocLimits:
    """The engine's limits as JSON-schema keywords (empty while no engine runs)."""

    max_output: dict
    max_prompt: dict
    max_token_id: dict

    @classmethod
    def of(cls, limits: Limits | None, vocab_size: int) -> DocLimits:
        token_id = {"maximum": vocab_size - 1} if vocab_size else {}
        if limits is None:
            return cls({}, {}, token_id)
        return cls({"maximum": limits.max_output_tokens}, {"maxItems": limits.max_prompt_tokens}, token_id)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_responses(*codes: int) -> dict:
    text = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            413: "Body too large", 429: "Ring and wait queue full (see Retry-After)", 503: "Engine down"}
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


def _sampling(model: str, limits: DocLimits) -> dict:
    stop_text = {"type": "string", "maxLength": MAX_STOP_CHARS}
    return {
        "model": {"type": "string", "enum": [model]},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, **limits.max_output},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "n": {"type": "integer", "enum": [1]},
        "stream": {"type": "boolean"},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"oneOf": [stop_text, {"type": "array", "items": stop_text, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "seed": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**63 - 1},
        "user": {"type": ["string", "null"]},
        "top_k": {"type": ["integer", "null"], "minimum": -1},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "ignore_eos": {"type": "boolean"},
    }


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# Text parts only: image, audio and file parts and tool messages are refused (docs/API.md), and so is any
# property not listed (additionalProperties: false).
_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                                     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "null"}, _PARTS]},
    "name": {"type": ["string", "null"]}}}
_USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                           "completion_tokens": {"type": "integer"},
                                           "total_tokens": {"type": "integer"},
                                           "prompt_tokens_details": {"type": "object", "properties": {
                                               "cached_tokens": {"type": "integer"}}}}}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"],
               "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                              "created": {"type": "integer"}, "model": {"type": "string"},
                              "choices": {"type": "array", "items": {"type": "object"}}, "usage": _ref("Usage")}}
_MODEL_LIST = {"type": "object", "properties": {"object": {"const": "list"}, "data": {
    "type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}}}}}}


def _schemas(model: str, limits: DocLimits) -> dict:
    sampling = _sampling(model, limits)
    token_id = {"type": "integer", "minimum": 0, **limits.max_token_id}
    prompt = {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": token_id,
                                              **limits.max_prompt}]}
    return {
        "Error": _ERROR, "ChatMessage": _MESSAGE, "Usage": _USAGE, "Completion": _COMPLETION,
        "ModelList": _MODEL_LIST,
        "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
                                  "properties": {
            **sampling, "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, **limits.max_output},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20}}},
        "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
                              "properties": {
            **sampling, "prompt": prompt, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}},
    }


# OpenAPI 3.1 reads the schema of an event stream as that of each event.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (or an error object), and last `[DONE]`"},
    "event": {"type": "string"}}}


def _generate(summary: str, schema: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(schema)}}},
        "responses": {"200": {"description": "The completion (JSON), or SSE chunks when stream=true",
                              "content": {"application/json": {"schema": _ref("Completion")},
                                          "text/event-stream": {"schema": _SSE_EVENT}}},
                      **_error_responses(400, 401, 404, 413, 429, 503)}}}


def openapi_document(model: str, limits: DocLimits) -> dict:
    """The document; with ``limits``, the running engine's bounds are stated too."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "Blink OpenAI-compatible API", "version": "1", "description": f"Serving `{model}`."},
        "paths": {
            "/v1/models": {"get": {"summary": "List the served model", "security": [{"bearer": []}, {}],
                                   "responses": {"200": {"description": "Models", "content": {
                                       "application/json": {"schema": _ref("ModelList")}}},
                                       **_error_responses(401)}}},
            "/v1/completions": _generate("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generate("Chat completion", "ChatCompletionRequest"),
            "/health": {"get": {"summary": "200 while the engine beats", "responses": {
                "200": {"description": "Healthy"}, **_error_responses(503)}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "Text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": _schemas(model, limits),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
