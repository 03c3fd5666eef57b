"""Structured output requests: ``response_format`` (OpenAI), ``structured_outputs`` (vLLM) and vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` to the grammar that constrains the answer, or a 400
naming what cannot be enforced."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from dpu_gateway import regex
from dpu_gateway.errors import APIError
from dpu_gateway.grammar import Pat, alt, lit, seq, until, without
from dpu_gateway.json_grammar import any_object, schema_pattern
from dpu_gateway.protocol import _Common
from dpu_gateway.tools import FORMATS, parse_tools
from shared.token_dfa import GrammarError, TokenDFA


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar to enforce: ``key`` names it and is all it takes to build it (JSON ``[kind, value]``, see
    ``pattern_of``; it travels to the compile worker), ``param`` is the request field it came from (errors
    name it). ``on_tokens``: a mask over token ids from the first token, not a grammar of the answer's text (a
    reasoning parser does not defer it); ``ends_anywhere``: every state allows an end and bans no end token, so
    ``min_tokens`` and ``ignore_eos`` cannot leave a row without a token."""

    key: str
    param: str
    on_tokens: bool = False
    ends_anywhere: bool = False


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


def _key(kind: str, value: Any) -> str:
    """Members keep their order: a schema's property order is the output's."""
    return json.dumps([kind, value], separators=(",", ":"))


def pattern_of(key: str) -> Pat:
    """The pattern a constraint's ``key`` names (``json_object``, ``json_schema``, their ``_compact`` forms with no
    space after ``:`` and ``,``, ``regex``, ``choice``, ``tool_call``, and ``after_reasoning``: free text up to a
    marker, then another constraint's pattern; see reasoning.py)."""
    kind, value = json.loads(key)
    if kind == "after_reasoning":
        end, inner = value
        # vLLM applies the grammar once the reasoning ended: the model may also end inside it
        return alt(without(end), seq(until(end), pattern_of(json.dumps(inner))))
    if kind in ("json_object", "json_object_compact"):
        return any_object(ws=seq()) if kind.endswith("_compact") else any_object()
    if kind in ("json_schema", "json_schema_compact"):
        return schema_pattern(value, compact=kind.endswith("_compact"))
    if kind == "regex":
        return regex.pattern(value)
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


def _schema(value: Any, param: str, compact: bool = False) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, "must be a JSON Schema (an object, or its JSON text)") from None
    return Constraint(_key("json_schema_compact" if compact else "json_schema", value), param)


def _regex(value: Any, param: str) -> Constraint:
    if not isinstance(value, str):
        raise _bad(param, "must be a regular expression (a string)")
    try:
        regex.parse(value, sets=False)  # a syntax error or an unsupported construct is a 400 before any compile
    except regex.RegexError as exc:
        raise _bad(param, str(exc)) from None
    return Constraint(_key("regex", value), param)


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(param, "must be a non-empty list of non-empty strings")
    return Constraint(_key("choice", value), param)


def guided(req: _Common) -> list[Constraint]:
    """vLLM's ``guided_json`` (a schema), ``guided_regex`` and ``guided_choice`` (one of these strings)."""
    found = []
    if req.guided_json is not None:
        found.append(_schema(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(_regex(req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(_choice(req.guided_choice, "guided_choice"))
    return found


# vLLM's StructuredOutputsParams: the constraints (one at most) and the options
_CONSTRAINTS = ("json", "regex", "choice", "json_object", "grammar", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "whitespace_pattern")


def structured_outputs(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs``: ``json`` (a schema or its text), ``regex``, ``choice`` or ``json_object``,
    with ``disable_any_whitespace`` (JSON with no space after ``:`` and ``,``). ``disable_additional_properties``
    and ``disable_fallback`` change nothing here (extra keys are never produced; there is no other backend to
    fall back to); ``grammar``, ``structural_tag`` and ``whitespace_pattern`` are refused."""
    if value is None:
        return None
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _bad(param, "must be an object (vLLM's StructuredOutputsParams)")
    unknown = sorted(set(value) - set(_CONSTRAINTS) - set(_OPTIONS))
    if unknown:
        raise _bad(f"{param}.{unknown[0]}", f"unknown field (known: {', '.join(_CONSTRAINTS + _OPTIONS)})")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(value.get(flag, False), bool):
            raise _bad(f"{param}.{flag}", "must be true or false")
    for name in ("grammar", "structural_tag", "whitespace_pattern"):
        if value.get(name) is not None:
            what = {"grammar": "context-free grammars are", "structural_tag": "structural tags are",
                    "whitespace_pattern": "a whitespace pattern is"}[name]
            raise APIError(400, f"{param}.{name}: {what} not supported by this server (served: json, regex, choice, "
                           "json_object)", param=f"{param}.{name}", code="unsupported_value")
    # only null is absent (as vLLM): a false regex or schema is a 400 below; json_object false asks for nothing
    given = [k for k in _CONSTRAINTS if value.get(k) is not None and (k != "json_object" or value[k] is not False)]
    compact = value.get("disable_any_whitespace", False)
    if len(given) > 1:
        raise _bad(f"{param}.{given[1]}", f"only one constraint may be given, got {' and '.join(given)}")
    if not given:
        if compact:
            raise _bad(f"{param}.disable_any_whitespace", "applies to a json or json_object constraint; none given")
        return None
    kind = given[0]
    if compact and kind not in ("json", "json_object"):
        raise _bad(f"{param}.disable_any_whitespace", f"applies to json and json_object, not to {kind}")
    if kind == "json":
        return _schema(value["json"], f"{param}.json", compact)
    if kind == "regex":
        return _regex(value["regex"], f"{param}.regex")
    if kind == "choice":
        return _choice(value["choice"], f"{param}.choice")
    if value["json_object"] is not True:
        raise _bad(f"{param}.json_object", "must be true or false")
    return Constraint(_key("json_object_compact" if compact else "json_object", None), f"{param}.json_object")


MAX_ALLOWED_IDS = 262_144


def allowed_ids(value: list | None) -> Constraint | None:
    """vLLM's ``allowed_token_ids``: only these tokens may be sampled, EOS and stop ids too (as vLLM, which masks
    every other id): a listed one is allowed by its bit, and the table never adds the end tokens."""
    if value is None:
        return None
    param = "allowed_token_ids"
    if not value or len(value) > MAX_ALLOWED_IDS or \
            not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad(param, f"must be a non-empty list of at most {MAX_ALLOWED_IDS} token ids (integers >= 0)")
    ids = sorted(set(value))
    return Constraint(_key("allowed_ids", ids), param, on_tokens=True)


MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 64
MAX_BAD_CHARS = 16_384  # of all the words: tokenized in the gateway, so bounded before that


def bad_words(value: list | None, encode: Callable[[str], list[int]] | None,
              ends: tuple[int, ...] = ()) -> Constraint | None:
    """vLLM's ``bad_words``: each word's token sequence (as the tokenizer writes it alone, and after a space when
    that is another sequence of the same length, as vLLM) never completed by the answer: its last token is
    masked wherever the answer so far ends with the rest. A word that an end token (``ends``: EOS, the request's
    stop ids) would complete is refused: an end is allowed wherever the answer may end."""
    if value is None or value == []:
        return None
    param = "bad_words"
    if len(value) > MAX_BAD_WORDS or not all(isinstance(w, str) and w.strip() for w in value) or \
            sum(len(w) for w in value) > MAX_BAD_CHARS:
        raise _bad(param, f"must be a list of at most {MAX_BAD_WORDS} non-blank strings, {MAX_BAD_CHARS} characters "
                   "in all")
    if encode is None:
        raise APIError(400, f"{param}: this endpoint cannot tokenize bad words", param=param, code="unsupported_value")
    found: list[list[int]] = []
    for word in value:
        alone = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        for ids in (alone, spaced if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone) else []):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise _bad(param, f"a bad word of more than {MAX_BAD_WORD_TOKENS} tokens: {word[:40]!r}")
            if ids and ids[-1] in ends:
                raise APIError(400, f"{param}: {word[:40]!r} ends with an end token (EOS or a stop id): an answer "
                               "may always end", param=param, code="unsupported_value")
            if ids and ids not in found:
                found.append(ids)
    return Constraint(_key("bad_words", found), param, on_tokens=True, ends_anywhere=True) if found else None


def id_table(key: str, vocab_size: int) -> TokenDFA | None:
    """The token table of an ``allowed_ids`` key (one state: the listed ids lead back to it; it never accepts, so
    an end token is sampled only when listed) or a ``bad_words`` key (``_bad_words_table``); None for a key
    whose grammar is a pattern."""
    kind, value = json.loads(key)
    if kind == "bad_words":
        return _bad_words_table(value, vocab_size)
    if kind != "allowed_ids":
        return None
    ids = value
    if ids[-1] >= vocab_size:
        raise GrammarError(f"token id {ids[-1]} is not below the vocabulary size {vocab_size}")
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[ids] = True
    return TokenDFA(0, vocab_size, np.packbits(allowed)[None, :], np.zeros(1, np.int32), np.zeros(2, np.int64),
                    np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, dtype=bool))


MAX_BAD_STATES = 256  # every state is a row of bits over the vocabulary (stored, and on the device): more is refused


def _bad_words_table(sequences: list[list[int]], vocab_size: int) -> TokenDFA:
    """An Aho-Corasick automaton over token ids: a state is the longest end of the answer that begins a bad
    sequence; its allowed tokens are all but those completing a bad sequence from it or from a shorter end
    (the states its failure links reach); every state accepts (an end is always allowed)."""
    if any(t >= vocab_size for s in sequences for t in s):
        raise GrammarError(f"a bad word's token is not below the vocabulary size {vocab_size}")
    node: dict[tuple[int, ...], int] = {(): 0}  # the proper prefixes of the sequences
    children: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {(): {}}
    own: dict[tuple[int, ...], set[int]] = {}  # the last tokens of the sequences that this prefix begins
    for seq_ in sequences:
        own.setdefault(tuple(seq_[:-1]), set()).add(seq_[-1])
        for k in range(1, len(seq_)):
            prefix = tuple(seq_[:k])
            if prefix not in node:
                if len(node) >= MAX_BAD_STATES:
                    raise GrammarError(f"bad_words need more than {MAX_BAD_STATES} automaton states")
                node[prefix] = len(node)
                children[prefix] = {}
                children[prefix[:-1]][prefix[-1]] = prefix
    fail: dict[tuple[int, ...], tuple[int, ...]] = {}
    banned: dict[tuple[int, ...], set[int]] = {}
    moves: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {}
    for p in sorted(node, key=len):  # shorter first: a failure link points to a shorter prefix
        f: tuple[int, ...] = ()
        if len(p) > 1:
            f = fail[p[:-1]]
            while f and p[-1] not in children[f]:
                f = fail[f]
            f = children[f].get(p[-1], ())
        fail[p] = f
        banned[p] = own.get(p, set()) | (banned[f] if p else set())
        moves[p] = {**(moves[f] if p else {}), **children[p]}
    S = len(node)
    bits = np.packbits(np.ones(vocab_size, dtype=bool))[None, :].repeat(S, axis=0)
    offsets, tokens, nexts = [0], [], []
    for p, i in node.items():  # in state order
        for t in banned[p]:
            bits[i, t >> 3] &= ~np.uint8(0x80 >> (t & 7))
        taken = sorted((t, node[q]) for t, q in moves[p].items() if t not in banned[p])
        tokens += [t for t, _ in taken]
        nexts += [q for _, q in taken]
        offsets.append(len(tokens))
    return TokenDFA(0, vocab_size, bits, np.zeros(S, np.int32), np.array(offsets, np.int64),
                    np.array(tokens, np.int32), np.array(nexts, np.int32), np.ones(S, dtype=bool))


def constraint_of(req: _Common, eos: tuple[int, ...] = (),
                  encode: Callable[[str], list[int]] | None = None) -> Constraint | None:
    """The request's one output constraint (at most one of the fields may ask for one); ``eos``: the served
    model's EOS ids and ``encode`` text to token ids without special tokens (``bad_words``)."""
    found = [c for c in (response_format(req.response_format), structured_outputs(req.structured_outputs),
                         *guided(req), allowed_ids(req.allowed_token_ids),
                         bad_words(req.bad_words, encode, (*eos, *(req.stop_token_ids or ()))))
             if c is not None]
    if len(found) > 1:
        raise _bad(found[1].param, f"only one output constraint may be given, got {found[0].param} and "
                   f"{found[1].param}")
    return found[0] if found else None
