"""The sampling fields end to end: the official ``openai`` client against ``blink serve`` with the real CPU
engine and the embedded model (one server for the module)."""

from __future__ import annotations

import collections
from collections.abc import Iterator

import openai
import pytest
from helpers.e2e import FRANCE, start_real_stack, sync_client
from helpers.stack import MODEL, Stack, stop_stack

REPEAT = "hello " * 12


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_real_stack(tmp_path_factory.mktemp("e2e_fields"))
    yield stack
    stop_stack(stack)


def greedy(stack: Stack, messages: list[dict] = FRANCE, **kw) -> openai.types.chat.ChatCompletion:
    kw.setdefault("max_tokens", 16)
    return sync_client(stack).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_logit_bias_bans_a_token(real: Stack, text) -> None:
    free = greedy(real)
    assert "Paris" in free.choices[0].message.content
    paris = text.tok.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    banned = greedy(real, logit_bias={str(paris[0]): -100}, logprobs=True)
    ids = [text.tok.encode(t.token, add_special_tokens=False) for t in banned.choices[0].logprobs.content]
    assert all(paris[0] not in i for i in ids) and " Paris" not in banned.choices[0].message.content


def test_min_tokens_reached_without_ignore_eos(real: Stack) -> None:
    short = greedy(real, max_tokens=64)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 8
    out = greedy(real, max_tokens=64, extra_body={"min_tokens": n})
    assert out.usage.completion_tokens >= n


def test_penalties_change_a_repetitive_greedy_output(real: Stack) -> None:
    def complete(**kw) -> str:
        return sync_client(real).completions.create(model=MODEL, prompt=REPEAT, max_tokens=16, temperature=0,
                                                    **kw).choices[0].text

    free = complete()
    word, times = collections.Counter(free.split()).most_common(1)[0]
    assert times >= 4, free  # the model goes on repeating
    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        out = complete(**kw)
        assert out != free, kw
        assert collections.Counter(out.split())[word] < times, (kw, free, out)


def test_stop_token_ids_end_the_answer(real: Stack, text) -> None:
    free = greedy(real, logprobs=True)
    second = text.tok.encode(free.choices[0].logprobs.content[1].token, add_special_tokens=False)[0]
    out = greedy(real, extra_body={"stop_token_ids": [second]})
    assert out.usage.completion_tokens == 1 and out.choices[0].finish_reason == "stop"


def test_n_gives_independent_choices(real: Stack) -> None:
    out = sync_client(real).chat.completions.create(model=MODEL, messages=FRANCE, n=2, max_tokens=12,
                                                    temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content
    again = sync_client(real).chat.completions.create(model=MODEL, messages=FRANCE, n=2, max_tokens=12,
                                                      temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_include_stop_str_in_output(real: Stack) -> None:
    plain = greedy(real, stop=["Paris"])
    kept = greedy(real, stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert not plain.choices[0].message.content.endswith("Paris")
    assert kept.choices[0].message.content == plain.choices[0].message.content + "Paris"


def test_return_tokens_as_token_ids_names_every_entry_by_its_id(real: Stack, text) -> None:
    """vLLM's field: log-prob entries name their tokens ``token_id:N`` (bytes of that name), echo's included; the
    ids decode to the answer, and the log-probs are those of the plain request."""
    plain = greedy(real, logprobs=True, top_logprobs=2)
    named = greedy(real, logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    assert named.choices[0].message.content == plain.choices[0].message.content
    ids = []
    for a, b in zip(plain.choices[0].logprobs.content, named.choices[0].logprobs.content, strict=True):
        assert b.token.startswith("token_id:") and bytes(b.bytes) == b.token.encode() and b.logprob == a.logprob
        assert [t.token.startswith("token_id:") for t in b.top_logprobs] == [True, True]
        assert [t.logprob for t in b.top_logprobs] == [t.logprob for t in a.top_logprobs]
        ids.append(int(b.token.removeprefix("token_id:")))
    assert text.tok.decode(ids) == plain.choices[0].message.content
    prompt = text.ids("The capital of France is")
    out = sync_client(real).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1,
                                               echo=True, extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert lp.tokens[: len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs if top for k in top)
    answer = [int(t.removeprefix("token_id:")) for t in lp.tokens[len(prompt):]]
    assert len(answer) == 4 and out.choices[0].text.endswith(text.tok.decode(answer))


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "pattern": "a+"}}}},
     "response_format.pattern"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
])
def test_refused_fields_are_400_naming_them(real: Stack, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        greedy(real, **kw)
    assert info.value.param == param


def test_a_text_body_is_415(real: Stack) -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    req = urllib.request.Request(real.url + "/v1/chat/completions", data=b"{}", method="POST",
                                 headers={"Content-Type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 415
