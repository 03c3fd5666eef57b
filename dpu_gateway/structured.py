"""Structured output requests: ``response_format`` (OpenAI) and ``guided_json`` / ``guided_choice`` (vLLM)
to the grammar that constrains the answer, or a 400 naming what cannot be enforced."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dpu_gateway.errors import APIError
from dpu_gateway.grammar import Pat, alt, lit, seq, until, without
from dpu_gateway.json_grammar import any_object, schema_pattern
from dpu_gateway.protocol import _Common
from dpu_gateway.tools import FORMATS, parse_tools


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar to enforce: ``key`` names it and is all it takes to build it (JSON ``[kind, value]``, see
    ``pattern_of``; it travels to the compile worker), ``param`` is the request field it came from (errors
    name it)."""

    key: str
    param: str


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


def _key(kind: str, value: Any) -> str:
    """Members keep their order: a schema's property order is the output's."""
    return json.dumps([kind, value], separators=(",", ":"))


def pattern_of(key: str) -> Pat:
    """The pattern a constraint's ``key`` names (``json_object``, ``json_schema``, ``choice``, ``tool_call``, and
    ``after_reasoning``: free text up to a marker, then another constraint's pattern; see reasoning.py)."""
    kind, value = json.loads(key)
    if kind == "after_reasoning":
        end, inner = value
        # vLLM applies the grammar once the reasoning ended: the model may also end inside it
        return alt(without(end), seq(until(end), pattern_of(json.dumps(inner))))
    if kind == "json_object":
        return any_object()
    if kind == "json_schema":
        return schema_pattern(value)
    if kind == "choice":
        return alt(*(lit(c) for c in value))
    if kind == "tool_call":
        fmt, many, tools = value
        return FORMATS[fmt].pattern(parse_tools(tools), many)
    raise ValueError(f"unknown constraint kind {kind!r}")


def response_format(value: dict | None) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return Constraint(_key("json_object", None), "response_format")
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad("response_format.json_schema", "must be an object with a name (and a schema)")
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise _bad(f"response_format.json_schema.{sorted(unknown)[0]}", "unknown field")
        schema = spec.get("schema", {})
        return Constraint(_key("json_schema", schema), "response_format")
    raise _bad("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
               "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": ...}}")


def guided(req: _Common) -> Constraint | None:
    """vLLM's ``guided_json`` (a schema) and ``guided_choice`` (one of these strings)."""
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise _bad("guided_json", "must be a JSON Schema (an object, or its JSON text)") from None
        return Constraint(_key("json_schema", schema), "guided_json")
    if req.guided_choice is not None:
        choices = req.guided_choice
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise _bad("guided_choice", "must be a non-empty list of non-empty strings")
        return Constraint(_key("choice", choices), "guided_choice")
    return None


def constraint_of(req: _Common) -> Constraint | None:
    """The request's one output constraint (at most one of the fields may ask for one)."""
    found = [c for c in (response_format(req.response_format), guided(req)) if c is not None]
    if len(found) > 1:
        raise _bad(found[1].param, "only one of response_format, guided_json and guided_choice may be given")
    return found[0] if found else None
