"""JSON as byte patterns (``dpu_gateway/grammar.py``): any JSON value to a nesting depth, and JSON Schema.

What the constrained output looks like (``docs/API.md``): keys in the schema's order, one optional space
after ``:`` and ``,`` and nowhere else, exponents of at most 3 digits. A value of unconstrained type
("any JSON") nests at most ``ANY_DEPTH`` containers deep. Schema keywords that change what is valid and
are not implemented are refused (``SchemaError`` naming the keyword), never ignored.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dpu_gateway import regex
from dpu_gateway.grammar import Pat, alt, byteset, lit, opt, rep, seq, star
from shared.token_dfa import GrammarError

ANY_DEPTH = 3
MAX_ITEMS_BOUND = 16  # maxItems above this is refused (each allowed item is a copy of its pattern)


class SchemaError(GrammarError):
    """A schema this server cannot enforce; ``keyword`` names what it would have to ignore."""

    def __init__(self, message: str, keyword: str = "") -> None:
        super().__init__(message)
        self.keyword = keyword


WS = opt(lit(" "))
DIGIT = byteset(b"0123456789")
HEX = byteset(b"0123456789abcdefABCDEF")
_PLAIN = bytes(b for b in range(0x20, 0x80) if b not in (0x22, 0x5C))


def _span(lo: int, hi: int) -> Pat:
    return byteset(range(lo, hi + 1))


_TAIL = _span(0x80, 0xBF)
UTF8 = alt(  # a well-formed multi-byte UTF-8 sequence (RFC 3629): strings stay valid text
    seq(_span(0xC2, 0xDF), _TAIL), seq(lit(b"\xe0"), _span(0xA0, 0xBF), _TAIL),
    seq(byteset([*range(0xE1, 0xED), 0xEE, 0xEF]), _TAIL, _TAIL), seq(lit(b"\xed"), _span(0x80, 0x9F), _TAIL),
    seq(lit(b"\xf0"), _span(0x90, 0xBF), _TAIL, _TAIL), seq(_span(0xF1, 0xF3), _TAIL, _TAIL, _TAIL),
    seq(lit(b"\xf4"), _span(0x80, 0x8F), _TAIL, _TAIL))
CHAR = alt(byteset(_PLAIN), UTF8, seq(lit("\\"), alt(byteset(b'"\\/bfnrt'), seq(lit("u"), HEX, HEX, HEX, HEX))))
STRING = seq(lit('"'), star(CHAR), lit('"'))
INTEGER = seq(opt(lit("-")), alt(lit("0"), seq(byteset(b"123456789"), star(DIGIT))))
NUMBER = seq(INTEGER, opt(seq(lit("."), rep(DIGIT, 1, None))),
             opt(seq(byteset(b"eE"), opt(byteset(b"+-")), rep(DIGIT, 1, 3))))
BOOLEAN = alt(lit("true"), lit("false"))
NULL = lit("null")
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}


def encode(value: Any) -> str:
    """A JSON value as the constrained output writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def any_value(depth: int = ANY_DEPTH, ws: Pat = WS) -> Pat:
    if depth <= 0:
        return alt(STRING, NUMBER, BOOLEAN, NULL)
    return alt(STRING, NUMBER, BOOLEAN, NULL, any_object(depth - 1, ws), array(any_value(depth - 1, ws), ws=ws))


def any_object(depth: int = ANY_DEPTH - 1, ws: Pat = WS) -> Pat:
    return mapping(any_value(depth, ws), ws)


def mapping(value: Pat, ws: Pat = WS) -> Pat:
    member = seq(STRING, lit(":"), ws, value)
    return seq(lit("{"), opt(seq(member, star(seq(lit(","), ws, member)))), lit("}"))


def array(item: Pat, lo: int = 0, hi: int | None = None, ws: Pat = WS) -> Pat:
    if hi == 0:
        return lit("[]")
    rest = rep(seq(lit(","), ws, item), max(lo - 1, 0), None if hi is None else hi - 1)
    body = seq(item, rest)
    return seq(lit("["), body if lo > 0 else opt(body), lit("]"))


def members(props: list[tuple[str, Pat, bool]], ws: Pat = WS) -> Pat:
    """An object with these (name, value, required) members, in this order, optional ones omissible."""

    def build(nfa: Any, cont: int) -> int:
        first = rest = lit("}")(nfa, cont)  # after no member yet / after one
        for name, value, required in reversed(props):
            member = seq(lit(encode(name)), lit(":"), ws, value)
            with_first, with_rest = member(nfa, rest), seq(lit(","), ws, member)(nfa, rest)
            first = with_first if required else nfa.fork([with_first, first])
            rest = with_rest if required else nfa.fork([with_rest, rest])
        return lit("{")(nfa, first)
    return build


# Keywords that only annotate (nothing about validity changes); any keyword not named here or handled below
# is refused.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "readOnly",
                         "writeOnly", "deprecated", "discriminator", "strict"})
STRING_KEYWORDS = ("pattern", "format", "minLength", "maxLength")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
HANDLED = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                     "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", *STRING_KEYWORDS,
                     *NUMBER_KEYWORDS})
# ``format`` values served, as regular expressions (dpu_gateway/regex.py) a string's value matches. Each is a
# part of what the format allows, so every answer passes a validator that checks formats: dates have days that
# exist in every year (February up to the 28th) of years 1000-9999, times and date-times carry an offset (RFC 3339).
_YEAR = r"[1-9][0-9]{3}"
_DAY = r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)" \
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMATS = {
    "date": rf"{_YEAR}-{_DAY}",
    "time": _TIME,
    "date-time": rf"{_YEAR}-{_DAY}T{_TIME}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    # a local part of at most 50 characters (RFC 5321: 64), a domain of at most 216 (253)
    "email": rf"[A-Za-z0-9_+-]{{1,16}}(?:\.[A-Za-z0-9_+-]{{1,16}}){{0,2}}@{_LABEL}(?:\.{_LABEL}){{0,2}}"
             r"\.[A-Za-z]{2,24}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}
MAX_LENGTH_BOUND = 256  # minLength / maxLength above this are refused (each allowed character is a copy)
# A string of bounded length takes the Basic Multilingual Plane less the controls but tab and newline: about 6
# automaton states a character where every code point (escaped controls, 4-byte UTF-8) takes 14, so that 256
# characters fit the token-state budget.
BOUNDED_CHARS = regex.normalize([(0x09, 0x0A), (0x20, 0xFFFF)])
MAX_REF_DEPTH = 8


class SchemaCompiler:
    """One schema (with its ``$defs``) to a pattern; ``ws`` is what may follow ``:`` and ``,``."""

    def __init__(self, root: Any, ws: Pat = WS) -> None:
        self.root = root
        self.ws = ws
        self.refs: list[str] = []

    def pattern(self, schema: Any) -> Pat:
        if schema is True or schema == {}:
            return any_value(ws=self.ws)
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object or true, got {schema!r}")
        unknown = sorted(set(schema) - ANNOTATIONS - HANDLED)
        if unknown:
            raise SchemaError(f"JSON Schema keyword {unknown[0]!r} is not enforced by this server", unknown[0])
        if "$ref" in schema:
            return self._ref(schema["$ref"], _rest(schema, "$ref"))
        for key in ("anyOf", "oneOf"):  # oneOf is enforced as anyOf (exclusivity is not checked)
            if key in schema:
                return alt(*(self.pattern(merge(_rest(schema, key), _sub(s))) for s in _list(schema, key)))
        if "allOf" in schema:
            parts = _list(schema, "allOf")
            if len(parts) != 1:
                raise SchemaError("allOf with more than one schema is not enforced by this server", "allOf")
            return self.pattern(merge(_rest(schema, "allOf"), _sub(parts[0])))
        if "const" in schema or "enum" in schema:
            return self._values(schema)
        return self._typed(schema)

    def _values(self, schema: dict) -> Pat:
        """``enum`` / ``const``: the values (of the schema's type, where it has one); beside any other keyword
        that could exclude one of them, refused."""
        values = [schema["const"]] if "const" in schema else None
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError("enum must be a non-empty list", "enum")
            values = schema["enum"] if values is None else [v for v in schema["enum"] if encode(v) == encode(values[0])]
        other = sorted(set(schema) - ANNOTATIONS - {"const", "enum", "type", "$defs", "definitions"})
        if other:
            raise SchemaError(f"{other[0]} beside enum or const is not enforced by this server", other[0])
        if "type" in schema:
            kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            values = [v for v in values or [] if _json_type(v) & set(kinds)]
        if not values:
            raise SchemaError("no value of enum / const is allowed by the rest of the schema", "enum")
        return alt(*(lit(encode(v)) for v in values))

    def _typed(self, schema: dict) -> Pat:
        kinds = schema.get("type")
        if kinds is None:
            kinds = "object" if "properties" in schema else "array" if "items" in schema else \
                "string" if any(k in schema for k in STRING_KEYWORDS) else \
                "number" if any(k in schema for k in NUMBER_KEYWORDS) else None
        if kinds is None:
            return any_value(ws=self.ws)
        kinds = kinds if isinstance(kinds, list) else [kinds]
        return alt(*(self._one_type(schema, k) for k in kinds)) if len(kinds) > 1 else self._one_type(schema, kinds[0])

    def _one_type(self, schema: dict, kind: Any) -> Pat:
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind not in SCALARS:
            raise SchemaError(f"unknown JSON Schema type {kind!r}", "type")
        if "format" in schema and kind in ("integer", "number"):  # on null and boolean it asserts nothing
            raise SchemaError(f"format on a {kind} is not enforced by this server", "format")
        if kind in ("integer", "number") and any(k in schema for k in NUMBER_KEYWORDS):
            return regex.pattern(bounded(schema, kind == "integer"))
        return SCALARS[kind]

    def _string(self, schema: dict) -> Pat:
        given = [k for k in ("pattern", "format") if k in schema]
        lengths = [k for k in ("minLength", "maxLength") if k in schema]
        if len(given) + bool(lengths) > 1:
            raise SchemaError(f"{' and '.join(given + lengths)} together are not enforced by this server",
                              (given + lengths)[1])
        if "pattern" in schema:
            return seq(lit('"'), regex.pattern(schema["pattern"], json=True, keyword="pattern"), lit('"'))
        if "format" in schema:
            source = FORMATS.get(schema["format"]) if isinstance(schema["format"], str) else None
            if source is None:
                raise SchemaError(f"format {schema['format']!r} is not enforced by this server (served: "
                                  f"{', '.join(FORMATS)})", "format")
            return seq(lit('"'), regex.pattern(source, json=True), lit('"'))
        if lengths:
            lo, hi = schema.get("minLength", 0), schema.get("maxLength")
            if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
                raise SchemaError("minLength / maxLength must be integers with 0 <= minLength <= maxLength",
                                  lengths[-1])
            if max(lo, hi or 0) > MAX_LENGTH_BOUND:
                raise SchemaError(f"minLength / maxLength above {MAX_LENGTH_BOUND} are not enforced by this server",
                                  lengths[-1])
            return seq(lit('"'), rep(regex.set_pattern(BOUNDED_CHARS, json=True), lo, hi), lit('"'))
        return STRING

    def _object(self, schema: dict) -> Pat:
        props = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if props is None:
            if extra in (True, {}):
                return any_object(ws=self.ws)
            return mapping(self.pattern(extra), self.ws) if extra else lit("{}")
        if not isinstance(props, dict):
            raise SchemaError("properties must be an object", "properties")
        required = schema.get("required", [])
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"required property {missing[0]!r} has no schema in properties", "required")
        return members([(name, self.pattern(sub), name in required) for name, sub in props.items()], self.ws)

    def _array(self, schema: dict) -> Pat:
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
            raise SchemaError("minItems / maxItems must be integers with 0 <= minItems <= maxItems", "maxItems")
        if max(lo, hi or 0) > MAX_ITEMS_BOUND:
            raise SchemaError(f"minItems / maxItems above {MAX_ITEMS_BOUND} are not enforced by this server",
                              "maxItems")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise SchemaError("tuple-form items are not enforced by this server", "items")
        return array(self.pattern(items), lo, hi, self.ws)

    def _ref(self, ref: Any, siblings: dict) -> Pat:
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise SchemaError(f"only local references (#/$defs/NAME) are supported, got {ref!r}", "$ref")
        if self.refs.count(ref) >= 1 or len(self.refs) >= MAX_REF_DEPTH:
            raise SchemaError(f"recursive schemas ({ref}) are not enforced by this server", "$ref")
        section, name = ref[2:].split("/", 1)
        target = self.root.get(section, {}).get(name) if isinstance(self.root, dict) else None
        if target is None:
            raise SchemaError(f"reference {ref} names no definition", "$ref")
        self.refs.append(ref)
        try:  # keywords beside the reference apply with the target's
            return self.pattern(merge(siblings, _sub(target)) if siblings else target)
        finally:
            self.refs.pop()


MAX_BOUND = 10**15  # bounds of larger magnitude are refused (the pattern grows with their digits)


def bounded(schema: dict, integer: bool) -> str:
    """A regular expression for the integers (or numbers) within the schema's bounds, written as JSON writes
    them (no exponent). Numbers take inclusive integral bounds only (``minimum: 0, maximum: 1``): the integer
    part then decides, and the top bound is reached only with a zero fraction."""
    lo = hi = None
    for key in NUMBER_KEYWORDS:
        if key not in schema:
            continue
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) <= MAX_BOUND:
            raise SchemaError(f"{key} must be a number of magnitude at most {MAX_BOUND}", key)
        if not integer and (key.startswith("exclusive") or not float(value).is_integer()):
            raise SchemaError(f"{key} {value!r} on a number is not enforced by this server (served: minimum and "
                              "maximum with integral values)", key)
        low = key.endswith("inimum")
        bound = (math.floor(value) + 1 if low else math.ceil(value) - 1) if key.startswith("exclusive") else \
            (math.ceil(value) if low else math.floor(value))
        if low:
            lo = bound if lo is None else max(lo, bound)
        else:
            hi = bound if hi is None else min(hi, bound)
    if lo is not None and hi is not None and lo > hi:
        raise SchemaError(f"no {'integer' if integer else 'number'} lies within the bounds", "maximum")
    parts = []
    if hi is None or hi >= 0:
        parts.append(_magnitudes(max(lo, 0) if lo is not None else 0, hi, integer))
    if lo is None or lo < 0:  # negative values, by magnitude
        parts.append("-" + _magnitudes(max(-hi, 1 if integer else 0) if hi is not None else (1 if integer else 0),
                                       None if lo is None else -lo, integer))
    return "|".join(parts)


def _magnitudes(a: int, b: int | None, integer: bool) -> str:
    """Values of magnitude ``a..b`` (None: unbounded), without sign: integers, or numbers whose integer part
    is below ``b`` with any fraction, or ``b`` with a zero one."""
    if integer:
        return _naturals(a, b)
    if b is None:
        return f"{_naturals(a, None)}(?:\\.[0-9]+)?"
    below = f"{_naturals(a, b - 1)}(?:\\.[0-9]+)?|" if a <= b - 1 else ""
    return f"(?:{below}{b}(?:\\.0+)?)"


def _naturals(a: int, b: int | None) -> str:
    """The integers ``a..b`` (None: unbounded; ``0 <= a``) without leading zeros."""
    parts = []
    width = len(str(a))
    for n in range(width, width + 1 if b is None else len(str(b)) + 1):
        lo, hi = max(a, 10 ** (n - 1) if n > 1 else 0), min(10**n - 1, 10**n - 1 if b is None else b)
        if lo <= hi:
            parts.append(_digits(str(lo), str(hi)))
    if b is None:
        parts.append(f"[1-9][0-9]{{{width},}}")
    return "(?:" + "|".join(parts) + ")"


def _digits(x: str, y: str) -> str:
    """Digit strings of one width from ``x`` to ``y`` (leading zeros allowed past the first position)."""
    if not x:
        return ""
    if x[0] == y[0]:
        return x[0] + _digits(x[1:], y[1:])
    rest = len(x) - 1
    low_full, high_full = x[1:] == "0" * rest, y[1:] == "9" * rest
    first, last = x[0] if low_full else chr(ord(x[0]) + 1), y[0] if high_full else chr(ord(y[0]) - 1)
    parts = [] if low_full else [x[0] + _digits(x[1:], "9" * rest)]
    if first <= last:
        parts.append(f"[{first}-{last}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if not high_full:
        parts.append(y[0] + _digits("0" * rest, y[1:]))
    return "(?:" + "|".join(parts) + ")"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_type(value: Any) -> set[str]:
    """The JSON Schema types ``value`` is an instance of."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    return {float: {"number"}, str: {"string"}, list: {"array"}, dict: {"object"}}.get(type(value), set())


_TIGHTER = {"minimum": max, "exclusiveMinimum": max, "minLength": max, "minItems": max,
            "maximum": min, "exclusiveMaximum": min, "maxLength": min, "maxItems": min}


def merge(outer: dict, inner: dict) -> dict:
    """One schema for an instance both must validate: a keyword set on one side is kept, bounds set on both
    take the tighter, ``type`` the types both allow, ``required`` both lists; any other keyword set on both
    sides with different values is refused (a branch's value must not replace the outer one)."""
    out = dict(inner)
    for key, value in outer.items():
        if key not in out or out[key] == value:
            out[key] = value
        elif key in _TIGHTER and all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, out[key])):
            out[key] = _TIGHTER[key](value, out[key])
        elif key == "type":
            out[key] = _both_types(value, out[key])
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = list(dict.fromkeys([*out[key], *value]))
        else:
            raise SchemaError(f"{key} given both beside and inside anyOf / oneOf / allOf / $ref with different "
                              "values is not enforced by this server", key)
    return out


def _both_types(a: Any, b: Any) -> list:
    a, b = (t if isinstance(t, list) else [t] for t in (a, b))
    both = [t for t in a if t in b or t == "integer" and "number" in b]
    both += [t for t in b if t == "integer" and "number" in a and t not in both]
    if not both:
        raise SchemaError(f"no value is of type {a} and of type {b}", "type")
    return both


def _list(schema: dict, key: str) -> list:
    value = schema[key]
    if not isinstance(value, list) or not value:
        raise SchemaError(f"{key} must be a non-empty list of schemas", key)
    return value


def _rest(schema: dict, key: str) -> dict:
    return {k: v for k, v in schema.items() if k != key and k not in ANNOTATIONS and k not in ("$defs", "definitions")}


def _sub(s: Any) -> dict:
    if s is True:
        return {}
    if not isinstance(s, dict):
        raise SchemaError(f"a schema must be an object or true, got {s!r}")
    return s


def schema_pattern(schema: Any, compact: bool = False) -> Pat:
    """``compact``: no space after ``:`` and ``,`` (vLLM's ``disable_any_whitespace``)."""
    return SchemaCompiler(schema, seq() if compact else WS).pattern(schema)
