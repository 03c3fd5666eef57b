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
                                                                                         "pattern": "(?=a)"}}}},
     "response_format.pattern"),
    ({"extra_body": {"guided_grammar": "root ::= 'a'"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= 'a'"}}}, "structured_outputs.grammar"),
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


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' tokenizer of the embedded model (the same GGUF file the server reads)."""
    from dpu_tokenizer.sources import default_model_path  # noqa: PLC0415

    auto = pytest.importorskip("transformers").AutoTokenizer
    gguf = default_model_path()
    return auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_stop_reason_names_the_stop_string_or_token(real: Stack, text) -> None:
    """vLLM's stop_reason: the stop string that ended the answer, the stop token id (which of several the engine
    says), null for EOS and length; in the whole response and in the stream's finishing chunk."""
    out = greedy(real, stop=["Paris"])
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", "Paris")
    free = greedy(real, logprobs=True)
    assert free.choices[0].finish_reason == "stop" and free.choices[0].model_extra["stop_reason"] is None
    second = text.tok.encode(free.choices[0].logprobs.content[1].token, add_special_tokens=False)[0]
    never = next(t for t in range(1000, 2000) if t not in text.tok.encode(free.choices[0].message.content))
    out = greedy(real, extra_body={"stop_token_ids": [never, second, never + 1]})
    assert out.choices[0].model_extra["stop_reason"] == second and out.usage.completion_tokens == 1
    assert greedy(real, max_tokens=2).choices[0].model_extra["stop_reason"] is None
    comp = sync_client(real).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                temperature=0, stop=[" Paris", "zzz"], stream=True)
    last = [ch for ch in comp if ch.choices and ch.choices[0].finish_reason][-1].choices[0]
    assert (last.finish_reason, last.model_extra["stop_reason"]) == ("stop", " Paris")


def test_sixty_four_stop_strings(real: Stack) -> None:
    free = greedy(real).choices[0].message.content
    stops = [f"never {i} seen" for i in range(63)] + ["Paris"]
    out = greedy(real, stop=stops)
    assert out.choices[0].message.content == free[: free.index("Paris")]
    assert out.choices[0].model_extra["stop_reason"] == "Paris"


def test_skip_special_tokens_false_keeps_their_text(real: Stack, hf_tok) -> None:
    """Past EOS (ignore_eos) the model writes its turn markers: with skip_special_tokens false they are in the text,
    as the model's tokenizer decodes the same ids, streamed or not; by default they are not."""
    kw = {"max_tokens": 48, "logprobs": True,
          "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    plain = greedy(real, **kw)
    ids = [int(e.token.removeprefix("token_id:")) for e in plain.choices[0].logprobs.content]
    assert plain.choices[0].message.content == hf_tok.decode(ids, skip_special_tokens=True)
    kw["extra_body"] = {**kw["extra_body"], "skip_special_tokens": False}
    kept = greedy(real, **kw)
    assert kept.choices[0].message.content == hf_tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in kept.choices[0].message.content  # the EOS it was told to ignore, at least
    stream = sync_client(real).chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stream=True,
                                                       max_tokens=48, extra_body=kw["extra_body"])
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == kept.choices[0].message.content


def test_continue_final_message_continues_the_assistant(real: Stack, hf_tok) -> None:
    prefill = [*FRANCE, {"role": "assistant", "content": "The capital of France is"}]
    out = greedy(real, messages=prefill, max_tokens=4,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})
    want = hf_tok.apply_chat_template(prefill, tokenize=True, continue_final_message=True, return_dict=False)
    assert out.usage.prompt_tokens == len(want)
    assert out.choices[0].message.content.startswith(" Paris")  # the sentence goes on, not a new answer
    with pytest.raises(openai.BadRequestError) as info:  # add_generation_prompt is true unless set false
        greedy(real, messages=prefill, extra_body={"continue_final_message": True})
    assert info.value.param == "continue_final_message"


def test_chat_template_kwargs_the_template_does_not_read_are_400(real: Stack) -> None:
    """SmolLM2's template reads no enable_thinking: the switch would change nothing, so it is refused by name."""
    with pytest.raises(openai.BadRequestError) as info:
        greedy(real, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert info.value.param == "chat_template_kwargs.enable_thinking"


def test_return_token_ids_on_completions_and_chat(real: Stack, text) -> None:
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's, whole or a chunk at a time; the ids
    spell the text (up to the token that completed a stop string), the stream's add up to the whole's."""
    client = sync_client(real)
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=2,
                                      stop=["."], extra_body={"return_token_ids": True}).model_dump()
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == text.ids(prompt)
        spelled = text.tok.decode(choice["token_ids"], skip_special_tokens=True)
        assert spelled.startswith(choice["text"]) and len(choice["token_ids"]) <= whole["usage"]["completion_tokens"]
        if choice["finish_reason"] == "stop" and choice["stop_reason"] == ".":
            assert "." in spelled[len(choice["text"]):] and "." not in text.tok.decode(choice["token_ids"][:-1])
    chunks = [c.model_dump() for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, stop=["."],
        extra_body={"return_token_ids": True})]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == text.ids(prompt)
    assert all(c["choices"][0].get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]

    chat = greedy(real, max_tokens=12, extra_body={"return_token_ids": True}).model_dump()
    ids = chat["choices"][0]["token_ids"]
    assert text.tok.decode(ids, skip_special_tokens=False) == chat["choices"][0]["message"]["content"]  # no EOS
    assert len(ids) == chat["usage"]["completion_tokens"] and len(chat["prompt_token_ids"]) == \
        chat["usage"]["prompt_tokens"]
    stream = [c.model_dump() for c in client.chat.completions.create(
        model=MODEL, messages=FRANCE, max_tokens=12, temperature=0, stream=True,
        extra_body={"return_token_ids": True})]
    assert stream[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in stream[1:])
    assert [t for c in stream for ch in c["choices"] for t in ch.get("token_ids") or []] == ids
    plain = greedy(real, max_tokens=12).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_request_id_names_the_response(real: Stack) -> None:
    client = sync_client(real)
    out = greedy(real, max_tokens=2, extra_body={"request_id": "job-7"})
    assert out.id == "chatcmpl-job-7"
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"request_id": "job-8"},
                                    extra_headers={"X-Request-Id": "trace-1"})
    assert out.id == "cmpl-trace-1"  # as vLLM: the header before the field
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, stream=True,
                                                 extra_body={"request_id": "job-9"}))
    assert {c.id for c in chunks} == {"chatcmpl-job-9"}
    with pytest.raises(openai.BadRequestError) as info:
        greedy(real, max_tokens=2, extra_body={"request_id": "a\nb"})
    assert info.value.param == "request_id"


def test_allowed_token_ids_keep_every_sampled_token_in_the_list(real: Stack, text) -> None:
    client = sync_client(real)
    ids = text.tok.encode(" Paris Lyon Nice", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=1.0,
                                    seed=3, n=3, extra_body={"allowed_token_ids": ids, "return_token_ids": True})
    for choice in out.model_dump()["choices"]:  # no EOS listed: no end before max_tokens (as vLLM)
        assert set(choice["token_ids"]) <= set(ids) and len(choice["token_ids"]) == 5, choice
        assert choice["finish_reason"] == "length"
    ended = greedy(real, max_tokens=40, extra_body={"allowed_token_ids": [*ids, *text.tok.eos_token_ids],
                                                   "return_token_ids": True}).model_dump()["choices"][0]
    assert set(ended["token_ids"]) <= set(ids) and ended["finish_reason"] in ("stop", "length"), ended
    for bad in ([], ["a"], [-1], [text.tok.vocab_size + 5]):
        with pytest.raises(openai.BadRequestError) as info:
            greedy(real, max_tokens=2, extra_body={"allowed_token_ids": bad})
        assert info.value.param == "allowed_token_ids", bad
    with pytest.raises(openai.BadRequestError) as info:
        greedy(real, max_tokens=2, response_format={"type": "json_object"}, extra_body={"allowed_token_ids": ids})
    assert info.value.param == "allowed_token_ids"


def test_bad_words_never_complete_in_the_answer(real: Stack, text) -> None:
    """vLLM's ``bad_words``: the greedy answer's " Paris" is masked at its last token, with and without the
    leading space; the rest of the answer goes on."""
    free = greedy(real, max_tokens=12, extra_body={"return_token_ids": True}).model_dump()["choices"][0]
    assert "Paris" in free["message"]["content"]
    out = greedy(real, max_tokens=12, extra_body={"bad_words": ["Paris"], "return_token_ids": True})
    answer = out.model_dump()["choices"][0]
    ids = answer["token_ids"]
    paris = [text.tok.encode(word, add_special_tokens=False) for word in ("Paris", " Paris")]
    for seq in paris:
        assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids))), (seq, ids)
    assert answer["message"]["content"] != free["message"]["content"]
    eos_text = text.tok.decode([text.tok.eos_token_ids[0]], skip_special_tokens=False)
    for bad in (["  "], [3], "Paris", [eos_text], ["x" * 20_000]):  # an end token is never banned
        with pytest.raises(openai.BadRequestError) as info:
            greedy(real, max_tokens=2, extra_body={"bad_words": bad})
        assert info.value.param == "bad_words", bad
    long = greedy(real, max_tokens=20, extra_body={"bad_words": ["Paris"], "min_tokens": 20, "ignore_eos": True,
                                                   "return_token_ids": True}).model_dump()  # both served with it
    ids = long["choices"][0]["token_ids"]
    assert long["usage"]["completion_tokens"] == 20 and not any(
        ids[i:i + len(seq)] == seq for seq in paris for i in range(len(ids)))
