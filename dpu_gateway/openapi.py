"""A hand-written OpenAPI 3.1 description of the gateway's endpoints (served at /openapi.json)."""

from __future__ import annotations


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_responses(*codes: int) -> dict:
    text = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            413: "Body too large", 429: "Ring and wait queue full (see Retry-After)", 503: "Engine down"}
    return {str(c): {"description": text[c], "content": {"application/json": {"schema": _ref("Error")}}}
            for c in codes}


_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "enum": [1]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                       {"type": "null"}]},
    "seed": {"type": ["integer", "null"]},
    "user": {"type": ["string", "null"]},
    "top_k": {"type": ["integer", "null"], "minimum": -1},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "ignore_eos": {"type": "boolean"},
}

_SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    "ChatMessage": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}}},
    "ChatCompletionRequest": {"type": "object", "required": ["model", "messages"], "properties": {
        **_SAMPLING, "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": ["integer", "null"], "minimum": 0,
                                                          "maximum": 20}}},
    "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
        **_SAMPLING, "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                                "items": {"type": "integer", "minimum": 0}}]},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}},
    "Usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                               "completion_tokens": {"type": "integer"},
                                               "total_tokens": {"type": "integer"}}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                   "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                  "created": {"type": "integer"}, "model": {"type": "string"},
                                  "choices": {"type": "array", "items": {"type": "object"}},
                                  "usage": _ref("Usage")}},
    "ModelList": {"type": "object", "properties": {"object": {"const": "list"}, "data": {
        "type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}}}}}},
}


def _generate(summary: str, schema: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(schema)}}},
        "responses": {"200": {"description": "The completion (JSON), or SSE chunks when stream=true",
                              "content": {"application/json": {"schema": _ref("Completion")},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_error_responses(400, 401, 404, 413, 429, 503)}}}


def openapi_document(model: str) -> dict:
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
        "components": {"schemas": _SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
