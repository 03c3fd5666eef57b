"""Structured output: JSON and JSON Schema grammars, their token DFA, the engine's mask, and
``response_format`` / ``structured_outputs`` / ``guided_*`` end to end (the official ``openai`` client against
``blink serve`` with the real CPU engine and the embedded model)."""

from __future__ import annotations

import datetime
import json
import random
import re
from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch
from helpers.e2e import FRANCE, start_real_stack, sync_client
from helpers.stack import MODEL, Stack, stop_stack

from dpu_gateway.grammar import Vocab, accepts, byte_dfa, token_dfa
from dpu_gateway.json_grammar import SchemaError, any_object, schema_pattern
from gpu_engine.grammar_mask import allowed_tokens
from gpu_engine.sampling import SamplingSpec, sample
from shared import token_dfa as store
from shared.token_dfa import TokenDFA

PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]}},
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}}}


@pytest.mark.parametrize(("text", "ok"), [
    (b"{}", True), (b'{"a": 1, "b": [true, null, -2.5e3], "c": {"d": "x\\n\\u00e9"}}', True),
    (b'{"a":1}', True), (b"[1]", False), (b'{"a": 01}', False), (b'{"a" 1}', False), (b'{"a": "x}', False),
    (b'{"a": {"b": {"c": {"d": 1}}}}', False),  # deeper than ANY_DEPTH
])
def test_json_object_grammar(text: bytes, ok: bool) -> None:
    assert accepts(byte_dfa(any_object()), text) is ok


@pytest.mark.parametrize(("text", "ok"), [
    (b'{"name": "Bo", "age": 3}', True), (b'{"name": "Bo", "age": 3, "pet": {"kind": "cat"}}', True),
    (b'{"name": "Bo", "age": 3, "pet": null}', True), (b'{"age": 3, "name": "Bo"}', False),  # schema order
    (b'{"name": "Bo"}', False), (b'{"name": "Bo", "age": 3.5}', False),
    (b'{"name": "Bo", "age": 3, "pet": {"kind": "cow"}}', False), (b'{"name": "Bo", "age": 3, "x": 1}', False),
])
def test_json_schema_grammar(text: bytes, ok: bool) -> None:
    assert accepts(byte_dfa(schema_pattern(PERSON)), text) is ok


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "string", "format": "uri"}, "format"), ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"$ref": "#/$defs/N", "$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}},
     "$ref"),
])
def test_schema_keywords_that_cannot_be_enforced_are_refused_by_name(schema: dict, keyword: str) -> None:
    with pytest.raises(SchemaError) as info:
        schema_pattern(schema)
    assert info.value.keyword == keyword


def small_vocab() -> list[bytes | None]:
    texts: list[bytes | None] = [bytes([b]) for b in range(256)]
    texts += [b'{"', b'": ', b'name', b'age', b', "', b'"}', b'}', b'12', b' "', b'ab"', None]  # None: special
    return texts


def test_token_dfa_walks_agree_with_the_byte_grammar_and_survive_the_store(tmp_path, monkeypatch) -> None:
    texts = small_vocab()
    dfa = byte_dfa(schema_pattern(PERSON))
    tok = token_dfa(dfa, Vocab.of(texts, len(texts)))
    rng = random.Random(5)
    for _ in range(200):
        ids = [rng.randrange(len(texts) - 1) for _ in range(rng.randrange(1, 6))]
        prefix_ok = any(accepts(dfa, b"".join(texts[i] or b"" for i in ids) + rest) for rest in (b"", b'"}'))
        state = tok.walk(ids)
        assert (state >= 0) or not prefix_ok
    assert not tok.allowed(tok.start)[len(texts) - 1]  # a special token never matches
    monkeypatch.setattr(store, "SHM_DIR", tmp_path)
    monkeypatch.setattr("shared.token_dfa.SHM_DIR", tmp_path)
    store.store("ring", 7, tok)
    back = store.load("ring", 7)
    assert isinstance(back, TokenDFA) and np.array_equal(back.bits, tok.bits) and back.walk([0x7B]) == tok.walk([0x7B])


def test_sampling_under_the_mask_always_spells_a_sentence() -> None:
    """Random logits, the engine's sampler: the output is always valid JSON of the schema once it ends."""
    texts = small_vocab()
    eos = len(texts) - 1
    tok = token_dfa(byte_dfa(schema_pattern(PERSON)), Vocab.of(texts, len(texts)))
    gen = torch.Generator().manual_seed(3)
    spec = SamplingSpec(temperature=1.0, seed=11, eos_ids=frozenset({eos}), grammar=tok)
    for run in range(5):
        out: list[int] = []
        while not out or out[-1] != eos:
            logits = torch.randn(1, len(texts), generator=gen) * 3
            res = sample(logits, [spec], torch.tensor([len(out)]), torch.tensor([run * 1000 + len(out)]),
                         [([], out)])
            out.append(int(res.tokens[0]))
            assert len(out) < 400
        text = b"".join(texts[i] or b"" for i in out[:-1])
        assert json.loads(text)["age"] is not None and accepts(byte_dfa(schema_pattern(PERSON)), text)
    allowed = allowed_tokens(tok, [], [eos], len(texts))
    assert allowed[ord("{")] and not allowed[eos] and not allowed[ord("[")]


def test_the_grammar_id_travels_in_the_slot_and_the_engine_refuses_a_missing_one(tmp_path, monkeypatch) -> None:
    from gpu_engine.grammar_mask import GrammarCache
    from shared.messages import Sampling
    from shared.slots import SlotRequest

    rec = SlotRequest(1, np.array([1], np.int32), Sampling(4, grammar_id=2**64 - 5)).sampling_record()
    assert int(rec["grammar_id"][0]) == 2**64 - 5
    monkeypatch.setattr("shared.token_dfa.SHM_DIR", tmp_path)
    assert GrammarCache("ring", 300).get(12345) is None  # the slot then fails with BAD_PARAMS


# ----------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_real_stack(tmp_path_factory.mktemp("response_format"))
    yield stack
    stop_stack(stack)


def chat(stack: Stack, **kw) -> openai.types.chat.ChatCompletion:
    kw.setdefault("max_tokens", 64)
    kw.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    return sync_client(stack).chat.completions.create(model=MODEL, temperature=0, **kw)


def test_json_object_answers_a_json_object(real: Stack) -> None:
    ask = [{"role": "user", "content": "Give me a JSON object describing a cat with name and age."}]
    out = chat(real, response_format={"type": "json_object"}, messages=ask, max_tokens=128)
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_json_schema_answers_match_the_schema(real: Stack) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for stream in (False, True):
        if stream:
            chunks = sync_client(real).chat.completions.create(
                model=MODEL, temperature=0, max_tokens=64, response_format=fmt, stream=True,
                messages=[{"role": "user", "content": "Describe a person as JSON."}])
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = chat(real, response_format=fmt).choices[0].message.content
        value = json.loads(text)
        assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_guided_choice_on_completions(real: Stack) -> None:
    out = sync_client(real).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                               temperature=1.0, seed=3, n=3,
                                               extra_body={"guided_choice": ["Lyon", "Nice", "Paris"]})
    assert all(c.text in ("Lyon", "Nice", "Paris") and c.finish_reason == "stop" for c in out.choices)


def test_structured_outputs_as_vllm_clients_send_them(real: Stack) -> None:
    """vLLM's ``structured_outputs`` (what its 0.12+ clients send in place of ``guided_*``): a regex, a schema
    with a date and no white space, a choice; and ``guided_regex`` on completions."""
    client = sync_client(real)
    out = chat(real, messages=FRANCE, max_tokens=40,  # room for the longest answer a byte a token
               extra_body={"structured_outputs": {"regex": r"(The capital is )?[A-Z][a-z]{2,8}\."}})
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(r"(The capital is )?[A-Z][a-z]{2,8}\.", text), text
    schema = {"type": "object", "properties": {"born": {"type": "string", "format": "date"},
                                               "kind": {"enum": ["cat", "dog"]},
                                               "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["born", "kind", "lives"]}
    out = chat(real, max_tokens=96, messages=[{"role": "user", "content": "When was the cat born? Answer in JSON."}],
               extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    text = out.choices[0].message.content
    value = json.loads(text)
    assert " " not in text and value["kind"] in ("cat", "dog") and datetime.date.fromisoformat(value["born"]), text
    assert 1 <= value["lives"] <= 9, text
    out = chat(real, messages=FRANCE, max_tokens=8, extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert out.choices[0].message.content in ("Paris", "Lyon")
    done = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower opened:", max_tokens=8,
                                     temperature=1.0, seed=5, n=2, extra_body={"guided_regex": r" ?1[89]\d\d"})
    assert all(re.fullmatch(r" ?1[89]\d\d", c.text) and c.finish_reason == "stop" for c in done.choices), done


@pytest.mark.parametrize(("kw", "param"), [
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                        "multipleOf": 3}}}},
     "response_format.multipleOf"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 3}}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"regex": "(a)\\1"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "string", "format": "uri"}}}},
     "structured_outputs.json.format"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(real: Stack, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(real, messages=FRANCE, **kw)
    assert info.value.param == param
