"""A constrained-decoding load: the same ``response_format`` in every request, and the answers checked.

``--response-format`` takes ``json_object``, ``json_schema:NAME`` (one of ``SCHEMAS``) or ``json_schema:PATH`` (a
file holding a JSON schema). The field goes into the streamed ``/v1/completions`` requests as they are: both
Blink and vLLM (0.26: its ``CompletionRequest`` takes ``response_format`` as chat does) enforce it on
completions, so the token-id prompts stay as they are. A constrained request is sent without ``ignore_eos``
(Blink refuses the pair: a complete answer ends with EOS), so it ends at the grammar's end (``stop``) or at the
workload's output length (``length``).

The check (``check_outputs``) is deliberately simple and needs nothing beyond the standard library: an answer
that finished with ``stop`` must parse as JSON, be an object, and (for a schema) hold its required top-level keys,
no key it does not allow, and values of the right top-level types and enums; an answer cut at ``length`` must at
least begin as an object. A system that ignores the constraint shows up as invalid outputs either way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "email": {"type": "string"}},
               "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object", "properties": {"id": {"type": "integer"},
                                               "items": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                                               "paid": {"type": "boolean"},
                                               "status": {"enum": ["open", "shipped", "closed"]}},
              "required": ["id", "items", "paid", "status"], "additionalProperties": False},
}
TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                      "boolean": (bool,), "array": (list,), "object": (dict,), "null": (type(None),)}
SAMPLE_CHARS = 200  # of the first invalid answer, kept in the record


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """One constraint: ``label`` names it in the records, ``body`` is the request's ``response_format``."""

    label: str
    body: dict[str, Any]

    @property
    def schema(self) -> dict[str, Any] | None:
        return self.body["json_schema"]["schema"] if self.body["type"] == "json_schema" else None


def parse_response_format(text: str) -> ResponseFormat:
    """``json_object``, ``json_schema:NAME`` (built in) or ``json_schema:PATH`` (a schema file)."""
    if text == "json_object":
        return ResponseFormat(text, {"type": "json_object"})
    kind, _, what = text.partition(":")
    if kind != "json_schema" or not what:
        raise ValueError(f"response format {text!r}: json_object, json_schema:NAME ({', '.join(SCHEMAS)}) or "
                         "json_schema:PATH")
    if what in SCHEMAS:
        name, schema = what, SCHEMAS[what]
    else:
        path = Path(what)
        try:
            schema = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"response format {text!r}: neither a built-in schema ({', '.join(SCHEMAS)}) nor a "
                             f"readable JSON schema file ({exc})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"response format {text!r}: the schema must be a JSON object")
        name = path.stem
    return ResponseFormat(f"json_schema:{name}", {"type": "json_schema",
                                                   "json_schema": {"name": name, "schema": schema}})


def _typed(value: Any, spec: Any) -> bool:
    """Whether ``value`` has the top-level type and enum value ``spec`` (a property's schema) asks for."""
    if not isinstance(spec, dict):
        return True
    if "enum" in spec and value not in spec["enum"]:
        return False
    if "const" in spec and value != spec["const"]:
        return False
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if isinstance(value, bool):  # JSON's true is no integer
        return "boolean" in kinds
    return any(isinstance(value, TYPES.get(k, ())) for k in kinds)


def answer_problem(text: str, schema: dict[str, Any] | None) -> str | None:
    """Why a finished answer breaks the constraint (None when it keeps it)."""
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(value, dict):
        return "not an object"
    if schema is None:
        return None
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        return f"missing {missing[0]!r}"
    if schema.get("additionalProperties") is False:
        extra = [k for k in value if k not in props]
        if extra:
            return f"unexpected {extra[0]!r}"
    wrong = [k for k, v in value.items() if k in props and not _typed(v, props[k])]
    return f"wrong type or value of {wrong[0]!r}" if wrong else None


def check_outputs(answers: Iterable[tuple[str, str]], fmt: ResponseFormat) -> dict[str, Any]:
    """``answers``: (finish_reason, text) of the completed measured requests. Counts by finish reason, the
    invalid ones among those that stopped (``invalid``) and among those cut at the length limit, the ones that
    do not even begin as an object (``length_not_object``), and the first invalid answer's start."""
    out: dict[str, Any] = {"stop": 0, "length": 0, "other": 0, "invalid": 0, "length_not_object": 0,
                           "first_problem": None, "sample": None}
    for finish, text in answers:
        problem = None
        if finish == "stop":
            out["stop"] += 1
            problem = answer_problem(text, fmt.schema)
            out["invalid"] += problem is not None
        elif finish == "length":
            out["length"] += 1
            problem = None if text.lstrip().startswith("{") else "length-cut answer does not begin as an object"
            out["length_not_object"] += problem is not None
        else:
            out["other"] += 1
        if problem is not None and out["first_problem"] is None:
            out["first_problem"], out["sample"] = problem, text[:SAMPLE_CHARS]
    return out
