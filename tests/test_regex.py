"""Regular expressions compiled to byte automata (``dpu_gateway/regex.py``), against Python's ``re`` on every
string of a small alphabet; JSON Schema's ``pattern``, ``format`` and lengths (``json_grammar``) against the
validators a client would use on what the model wrote; ``structured_outputs`` (vLLM) read into constraints."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import math
import random
import re
import uuid

import pytest

from dpu_gateway import regex
from dpu_gateway.errors import APIError
from dpu_gateway.grammar import ByteDFA, accepts, byte_dfa
from dpu_gateway.json_grammar import FORMATS, SchemaError, schema_pattern
from dpu_gateway.protocol import decode_chat
from dpu_gateway.structured import constraint_of, id_table, pattern_of
from shared.token_dfa import GrammarError

ALPHABET = "ab01-. \n_\"\\é"
PATTERNS = [
    r"a+b?", r"(ab|0)*1", r"[a-b]{2,3}", r"\d{2}-\d", r"^(yes|no)$", r"[^a]b", r"a{0}b", r"(?:a|b)+?0",
    r"a\.b", r"[\w-]+", r"a|", r"(a|b|)0{1,}", r"[a\-0]", r"\s?\S", r".{1,2}", r"\D\W", r"[^\d\s]+",
    r"(?P<x>a)(b)?", r"a(?#note)b", r"\x61\u0062\U00000030", r"[é\"]+", r"\\?a", r"\Aab\Z", r"(a{2})*",
    r"[.-]", r"a{1}{", r"a{x}", r"b*?a??", r"[\s\d]a",
]


def walk_all(dfa: ByteDFA, source: str, length: int = 4, json_mode: bool = False, alphabet: str = ALPHABET) -> None:
    """Every string of ``alphabet`` up to ``length``: accepted exactly when it matches under Python's Unicode
    and ASCII readings both (the ASCII one stands in for ECMAScript's ``\\d \\w``)."""
    for n in range(length + 1):
        for t in itertools.product(alphabet, repeat=n):
            s = "".join(t)
            text = json.dumps(s, ensure_ascii=False)[1:-1] if json_mode else s
            want = re.fullmatch(source, s) is not None and re.fullmatch(source, s, re.ASCII) is not None
            assert accepts(dfa, text.encode()) == want, (source, s)


@pytest.mark.parametrize("source", PATTERNS)
def test_every_short_string_matches_as_in_python(source: str) -> None:
    walk_all(byte_dfa(regex.pattern(source)), source)


@pytest.mark.parametrize(("ecmascript", "python"), [
    (r"(?<y>a)b", r"(?P<y>a)b"), (r"\u{30}\u{1F600}", r"0\U0001F600"), (r"\cJ\ca", r"\n\x01"),
])
def test_ecmascript_only_forms_match_their_python_spelling(ecmascript: str, python: str) -> None:
    dfa, ref = byte_dfa(regex.pattern(ecmascript)), byte_dfa(regex.pattern(python))
    assert dfa.trans.shape == ref.trans.shape and (dfa.trans == ref.trans).all() and (dfa.accept == ref.accept).all()


@pytest.mark.parametrize("source", [r"[a\"\\]+", r"\n?.", r"[^b]{2}", r"\\\\a"])
def test_json_mode_matches_the_value_inside_a_json_string(source: str) -> None:
    walk_all(byte_dfa(regex.pattern(source, json=True)), source, length=3, json_mode=True)


@pytest.mark.parametrize("source", [r"\W", r"\D", r"\S", r"[^\w]", r"[^\d\s]", r"[^\S]", r"[^\W\d]", r"\w\S?"])
def test_negated_shorthands_leave_out_what_either_dialect_counts_in(source: str) -> None:
    """Unicode digits, letters and spaces: an answer never has one where the pattern excludes it under a
    dialect; nor U+FEFF where ECMAScript's \\s would take it."""
    contested = "a1 _-é٣\u3000\x1c\xa0"
    dfa = byte_dfa(regex.pattern(source))
    walk_all(dfa, source, length=2, alphabet=contested)
    assert not accepts(dfa, "\ufeff".encode()) or not any(k in source for k in (r"\S", r"[^\d\s]"))


def test_control_characters_are_written_as_json_escapes() -> None:
    dfa = byte_dfa(regex.pattern(r"[\x00-\x1f]", json=True))
    for code in range(0x20):
        assert accepts(dfa, json.dumps(chr(code))[1:-1].encode()), code
    assert not accepts(dfa, b"\n") and not accepts(dfa, b" ")


def test_dot_and_negations_keep_to_both_dialects() -> None:
    """``.`` leaves out every line terminator, ``\\S`` every Unicode space, ``\\d`` / ``\\w`` are ASCII: an
    answer matches under Python's ``re`` (Unicode or ASCII) and under ECMAScript alike."""
    dot, non_space, digit = (byte_dfa(regex.pattern(p)) for p in (".", r"\S", r"\d"))
    for c in ("\n", "\r", "\u2028", "\u2029"):
        assert not accepts(dot, c.encode())
    for c in ("\u00a0", "\u3000", "\ufeff", "\u2003", " "):
        assert not accepts(non_space, c.encode())
    assert accepts(dot, "é".encode()) and accepts(dot, "\U0001f600".encode()) and accepts(non_space, "é".encode())
    assert not accepts(digit, "\u0663".encode()) and accepts(digit, b"7")


def test_utf8_ranges_cover_each_code_point_once() -> None:
    rng = random.Random(4)
    for _ in range(400):
        lo = rng.randrange(0x110000)
        hi = min(regex.MAX_CODE, lo + rng.choice([0, 1, 63, 64, 2048, 70000]))
        seqs = [s for a, b in regex.normalize([(lo, hi)]) for s in regex.utf8_ranges(a, b)]
        assert sum(math.prod(b - a + 1 for a, b in s) for s in seqs) == sum(
            1 for c in range(lo, hi + 1) if not regex.SURROGATES[0] <= c <= regex.SURROGATES[1])
        for c in rng.sample(range(lo, hi + 1), min(8, hi - lo + 1)):
            if regex.SURROGATES[0] <= c <= regex.SURROGATES[1]:
                continue
            code = chr(c).encode()
            assert sum(len(s) == len(code) and all(a <= x <= b for x, (a, b) in zip(code, s, strict=True))
                       for s in seqs) == 1


def test_long_and_wide_patterns() -> None:
    regex.parse("a" * regex.MAX_PATTERN)  # linear in the pattern's length (anchors checked in one pass)
    with pytest.raises(regex.RegexError, match="more than"):
        regex.parse("a" * (regex.MAX_PATTERN + 1))
    dfa = byte_dfa(regex.pattern("a{0,900}"))  # built in a loop, not 900 nested patterns
    assert accepts(dfa, b"a" * 900) and not accepts(dfa, b"a" * 901)
    regex.wide.cache_clear()
    regex.parse(r"[^\W\d]\S", sets=False)  # the gateway's check walks no code point (the worker does, once)
    assert regex.wide.cache_info().currsize == 0
    literal = byte_dfa(regex.pattern("a{\u0661}"))  # a non-ASCII digit: a literal brace in both dialects
    assert accepts(literal, "a{\u0661}".encode()) and re.fullmatch("a{\u0661}", "a{\u0661}")


@pytest.mark.parametrize(("source", "why"), [
    (r"(a", "missing ')'"), (r"a)", "unbalanced"), (r"(a)\1", "backreferences"), (r"a(?=b)", "lookahead"),
    (r"(?<!a)b", "lookbehind"), (r"\bword", "word boundaries"), (r"(?i)a", "inline flags"), (r"a**", "multiple"),
    (r"*a", "nothing to repeat"), (r"a{,3}", "{0,n}"), (r"[]a]", "write \\]"), (r"a^b", "start"), (r"a$b", "end"),
    (r"(^a)*", "start"), (r"\p{L}", "property"), (r"a*+", "possessive"), (r"(?>a)", "atomic"), (r"[z-a]", "range"),
    (r"\q", "bad escape"), (r"a{1001}", "above 1000"), (r"\x4", "bad escape"), ("(" * 65 + ")" * 65, "nested"),
    (r"[a", "unterminated"), (r"\ud800", "bad escape"), (r"a{,}", "{0,n}"), ("a{" + "9" * 5000 + "}", "above 1000"),
])
def test_what_is_not_compiled_is_refused_with_why(source: str, why: str) -> None:
    with pytest.raises(regex.RegexError) as info:
        regex.pattern(source)
    assert why in str(info.value) and repr(source) in str(info.value)


def sentences(dfa: ByteDFA, count: int, seed: int) -> list[str]:
    """Random texts the automaton accepts (a walk that keeps to states from which a sentence can end)."""
    live = dfa.accept.copy()
    while True:
        grown = live | ((dfa.trans >= 0) & live[dfa.trans.clip(0)]).any(axis=1)
        if (grown == live).all():
            break
        live = grown
    usable = (dfa.trans >= 0) & live[dfa.trans.clip(0)]
    moves_of = [[int(b) for b in row.nonzero()[0]] for row in usable]
    rng, out = random.Random(seed), []
    while len(out) < count:
        state, data = dfa.start, b""
        while not (dfa.accept[state] and rng.random() < 0.3) and len(data) < 400:
            moves = moves_of[state]
            if not moves:
                break
            b = rng.choice(moves)
            data, state = data + bytes((b,)), int(dfa.trans[state, b])
        if dfa.accept[state]:
            out.append(data.decode())
    return out


def _email(value: str) -> None:
    """RFC 5321's lengths and a dotted domain of labels of letters, digits and inner hyphens."""
    local, _, domain = value.partition("@")
    labels = domain.split(".")
    ok = 0 < len(local) <= 64 and len(domain) <= 253 and len(labels) >= 2 and not local.startswith(".") and \
        ".." not in local and all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x) for x in labels)
    if not ok:
        raise ValueError(value)


CHECKS = {
    "date": datetime.date.fromisoformat,
    "time": lambda v: datetime.time.fromisoformat(v) and v[-1] in "Z0123456789" and ("Z" in v or "+" in v or "-" in v),
    "date-time": lambda v: datetime.datetime.fromisoformat(v).tzinfo is not None,
    "uuid": uuid.UUID,
    "email": lambda v: _email(v),
    "ipv4": ipaddress.IPv4Address,
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_answer_of_a_format_passes_its_validator(fmt: str) -> None:
    dfa = byte_dfa(schema_pattern({"type": "string", "format": fmt}))
    for text in sentences(dfa, 200, seed=len(fmt)):
        CHECKS[fmt](json.loads(text))
    assert CHECKS.keys() == FORMATS.keys()


def test_string_keywords_in_a_schema() -> None:
    pattern = byte_dfa(schema_pattern({"type": ["string", "null"], "pattern": r"^[A-Z]{2}\d$"}))
    assert accepts(pattern, b'"AB1"') and accepts(pattern, b"null") and not accepts(pattern, b'"AB"')
    assert byte_dfa(schema_pattern({"type": "string", "maxLength": 256})).trans.shape[0] <= 2048  # the budget's
    lengths = byte_dfa(schema_pattern({"minLength": 2, "maxLength": 3}))  # no type: a string
    for value, ok in (("ab", True), ("a\u00e9\n", True), ("a", False), ("abcd", False), ('"\\', True)):
        assert accepts(lengths, json.dumps(value, ensure_ascii=False).encode()) is ok, value
    compact = byte_dfa(schema_pattern({"type": "object", "properties": {"a": {"type": "array"}}}, compact=True))
    assert accepts(compact, b'{"a":[1,{"b":2}]}') and not accepts(compact, b'{"a": []}')


def test_keywords_beside_a_branch_or_a_value_list_are_kept_or_refused() -> None:
    """A keyword beside ``anyOf`` / ``$ref`` / ``enum`` still applies: bounds take the tighter, types both
    allow; what cannot be combined is refused, never dropped."""
    def dfa(schema: dict) -> ByteDFA:
        return byte_dfa(schema_pattern(schema))
    tighter = dfa({"minimum": 5, "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}]})
    assert accepts(tighter, b"5") and not accepts(tighter, b"0") and not accepts(tighter, b"10")
    ref = dfa({"$ref": "#/$defs/N", "maximum": 3, "$defs": {"N": {"type": "integer", "minimum": 1}}})
    assert accepts(ref, b"3") and not accepts(ref, b"4") and not accepts(ref, b"0")
    typed = dfa({"type": "string", "enum": ["a", 1, None]})
    assert accepts(typed, b'"a"') and not accepts(typed, b"1") and not accepts(typed, b"null")
    nullable = dfa({"type": ["string", "null"], "format": "date"})
    assert accepts(nullable, b"null") and accepts(nullable, b'"2024-05-06"') and not accepts(nullable, b'"x"')
    for schema, keyword in (({"enum": [1, 50], "maximum": 10}, "maximum"),
                            ({"const": "abc", "pattern": "^x"}, "pattern"),
                            ({"pattern": "^b$", "anyOf": [{"type": "string", "pattern": "^a$"}]}, "pattern"),
                            ({"type": "string", "anyOf": [{"type": "integer"}]}, "type"),
                            ({"type": "string", "minLength": True}, "minLength")):
        with pytest.raises(SchemaError) as info:
            schema_pattern(schema)
        assert info.value.keyword == keyword, schema


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "string", "format": "hostname"}, "format"), ({"type": "integer", "format": "int32"}, "format"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": "(?=a)"}, "pattern"), ({"type": "string", "maxLength": 257}, "maxLength"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength"),
])
def test_string_keywords_not_enforced_are_refused_by_name(schema: dict, keyword: str) -> None:
    with pytest.raises(GrammarError) as info:  # a SchemaError, or the pattern's RegexError
        schema_pattern(schema)
    assert info.value.keyword == keyword


BOUNDS = [
    ("integer", {"minimum": 0}), ("integer", {"minimum": -20, "maximum": 135}), ("integer", {"maximum": -7}),
    ("integer", {"exclusiveMinimum": 2.5, "exclusiveMaximum": 99}), ("integer", {"minimum": 1000, "maximum": 1000}),
    ("number", {"minimum": 0, "maximum": 1}), ("number", {"minimum": -3}), ("number", {"maximum": 0}),
    ("number", {"minimum": -120, "maximum": -5.0}), (None, {"minimum": 10}),
]


@pytest.mark.parametrize(("kind", "bounds"), BOUNDS)
def test_numbers_within_bounds_are_exactly_those_a_validator_takes(kind: str | None, bounds: dict) -> None:
    dfa = byte_dfa(schema_pattern({"type": kind, **bounds} if kind else bounds))

    def inside(value: float) -> bool:
        return all((key == "minimum" and value >= b) or (key == "maximum" and value <= b) or
                   (key == "exclusiveMinimum" and value > b) or (key == "exclusiveMaximum" and value < b)
                   for key, b in bounds.items())
    for whole in range(-1300, 1300):
        texts = [str(whole)] if kind == "integer" else [str(whole), f"{whole}.5", f"{whole}.0", f"{whole}.04"]
        for text in texts:
            value = float(text)
            # every accepted text is inside; every inside value is accepted in JSON's plain form
            assert accepts(dfa, text.encode()) == inside(value), (bounds, text)
    assert not accepts(dfa, b"1e2") and not accepts(dfa, b"01")


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum"), ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "integer", "maximum": 10**16}, "maximum"), ({"type": "integer", "minimum": 3, "maximum": 2}, "maximum"),
    ({"type": "integer", "minimum": True}, "minimum"), ({"type": "number", "multipleOf": 2}, "multipleOf"),
])
def test_bounds_not_enforced_are_refused_by_name(schema: dict, keyword: str) -> None:
    with pytest.raises(GrammarError) as info:
        schema_pattern(schema)
    assert info.value.keyword == keyword


def constraint(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return constraint_of(decode_chat(json.dumps(body).encode()))


def test_structured_outputs_become_the_constraint_vllm_means() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    cases = [
        ({"json": schema}, b'{"n": 1}', b'{"n":1,}'),
        ({"json": json.dumps(schema), "disable_any_whitespace": True}, b'{"n":1}', b'{"n": 1}'),
        ({"regex": r"[a-c]{2}\d"}, b"ab7", b"ab"),
        ({"choice": ["yes", "no"]}, b"no", b"maybe"),
        ({"json_object": True, "disable_fallback": True, "disable_additional_properties": True}, b'{"x": [1]}', b"[]"),
    ]
    for fields, good, bad in cases:
        found = constraint(structured_outputs=fields)
        dfa = byte_dfa(pattern_of(found.key))
        assert found.param.startswith("structured_outputs.") and accepts(dfa, good) and not accepts(dfa, bad), fields
    assert constraint(structured_outputs={}) is None and constraint(structured_outputs={"json_object": False}) is None
    regex_old = constraint(guided_regex="x+")
    assert regex_old.param == "guided_regex" and accepts(byte_dfa(pattern_of(regex_old.key)), b"xx")


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"json_objects": True}}, "structured_outputs.json_objects"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
    ({"structured_outputs": ["a"]}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": False}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": False}}, "structured_outputs.choice"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs.regex"),
])
def test_structured_outputs_that_cannot_be_served_are_a_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        constraint(**fields)
    assert info.value.status == 400 and info.value.param == param, info.value


def test_bad_words_table_masks_exactly_the_completing_tokens() -> None:
    """The Aho-Corasick table against a brute force: at every step of random answers over a 12-token vocabulary
    a token is allowed exactly when appending it completes no bad sequence (overlapping, nested and one-token
    sequences included)."""
    rng = random.Random(7)
    for _ in range(150):
        seqs: list[list[int]] = []
        for _ in range(rng.randint(1, 5)):
            s = [rng.randrange(12) for _ in range(rng.randint(1, 4))]
            if s not in seqs:
                seqs.append(s)
        table = id_table(json.dumps(["bad_words", seqs]), 12)
        assert table is not None and table.accept.all()
        for _ in range(20):
            out: list[int] = []
            state = table.start
            for _ in range(10):
                allowed = table.allowed(state)
                for t in range(12):
                    completes = any(len(out) >= len(s) - 1 and out[len(out) - len(s) + 1:] == s[:-1] and t == s[-1]
                                    for s in seqs)
                    assert allowed[t] == (not completes), (seqs, out, t)
                choices = [t for t in range(12) if allowed[t]]
                if not choices:
                    break
                out.append(rng.choice(choices))
                state = table.advance(state, out[-1])


def test_allowed_ids_let_an_end_token_through_only_when_listed() -> None:
    """As vLLM: EOS and stop ids are masked like every unlisted id (the table never accepts)."""
    from gpu_engine.grammar_mask import allowed_tokens  # noqa: PLC0415

    table = id_table(constraint(allowed_token_ids=[5, 7, 2]).key, 12)
    assert table is not None and not table.accept.any()
    allowed = allowed_tokens(table, [5, 7], [2, 9], 12)  # EOS 2 listed, stop id 9 not
    assert allowed.nonzero()[0].tolist() == [2, 5, 7]
