"""The answer's text and end, against the fake engine (it answers with its prompt less the first token, then EOS):
``skip_special_tokens`` / ``spaces_between_special_tokens``, ``stop`` lists up to their bound, and vLLM's
``stop_reason`` on every choice, chat and completions, whole and streamed."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from helpers import fixtures
from helpers.stack import MODEL, Stack

from dpu_gateway.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOTAL_CHARS

MSGS = [{"role": "user", "content": "hello there, general"}]
PROMPT = "one two three four five six"


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=fixtures.API_KEY, max_retries=0, timeout=60)


async def answer(stack: Stack, chat: bool, stream: bool, **kw: Any) -> tuple[str, str | None, Any]:
    """(text, finish_reason, stop_reason) of the one choice, whole or from the stream's chunks; every streamed
    choice carries stop_reason, null until the chunk that finishes it."""
    kw.setdefault("max_tokens", 200)
    extra = kw.pop("extra_body", {})
    async with client(stack) as c:
        if chat:
            made = await c.chat.completions.create(model=MODEL, messages=MSGS, stream=stream, extra_body=extra, **kw)
        else:
            made = await c.completions.create(model=MODEL, prompt=PROMPT, stream=stream, extra_body=extra, **kw)
        if not stream:
            choice = made.choices[0]
            text = choice.message.content if chat else choice.text
            return text or "", choice.finish_reason, choice.model_extra["stop_reason"]
        chunks = [ch async for ch in made]
    texts, finish, reason = [], None, None
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        texts.append((choice.delta.content if chat else choice.text) or "")
        assert "stop_reason" in choice.model_extra
        if choice.finish_reason is None:
            assert choice.model_extra["stop_reason"] is None
        else:
            finish, reason = choice.finish_reason, choice.model_extra["stop_reason"]
    return "".join(texts), finish, reason


def echo(text: Any, chat: bool, skip: bool = True) -> str:
    ids = text.chat_ids(MSGS) if chat else text.ids(PROMPT)
    return text.tok.decode(ids[1:], skip_special_tokens=skip)


WAYS = [(chat, stream) for chat in (True, False) for stream in (False, True)]
WAY_IDS = [f"{'chat' if c else 'completions'}-{'stream' if s else 'whole'}" for c, s in WAYS]


@pytest.mark.parametrize(("chat", "stream"), WAYS, ids=WAY_IDS)
async def test_special_tokens_in_the_text_when_not_skipped(api_stack: Stack, text, chat: bool,
                                                           stream: bool) -> None:
    plain, _, _ = await answer(api_stack, chat, stream)
    assert plain == echo(text, chat)
    for spaces in (True, False):  # no space is put between special tokens either way (as a fast tokenizer decodes)
        kept, finish, reason = await answer(api_stack, chat, stream, extra_body={
            "skip_special_tokens": False, "spaces_between_special_tokens": spaces})
        assert kept == echo(text, chat, skip=False) and (finish, reason) == ("stop", None)
    if chat:  # the template's turn markers, as they are in the prompt
        assert "hello there, general<|im_end|>\n<|im_start|>assistant\n" in kept and "<|im_end|>" not in plain


@pytest.mark.parametrize(("chat", "stream"), WAYS, ids=WAY_IDS)
async def test_stop_reason_names_what_ended_the_answer(api_stack: Stack, text, chat: bool, stream: bool) -> None:
    whole = echo(text, chat)
    word = "general" if chat else "four"
    got = await answer(api_stack, chat, stream, stop=["zzz", word, "yyy"])
    assert got == (whole[: whole.index(word)], "stop", word)
    kept = await answer(api_stack, chat, stream, stop=[word], extra_body={"include_stop_str_in_output": True})
    assert kept == (whole[: whole.index(word) + len(word)], "stop", word)
    ids = text.chat_ids(MSGS) if chat else text.ids(PROMPT)
    stop_id = ids[3]  # the fake engine's third answer token
    never = next(t for t in range(1000, 2000) if t not in ids)
    for stop_ids in ([stop_id], [never, stop_id, never + 1]):  # which of several: the engine writes it in the slot
        _, finish, reason = await answer(api_stack, chat, stream, extra_body={"stop_token_ids": stop_ids})
        assert (finish, reason) == ("stop", stop_id) and type(reason) is int
    assert await answer(api_stack, chat, stream) == (whole, "stop", None)  # EOS: no stop_reason (as vLLM)
    _, finish, reason = await answer(api_stack, chat, stream, max_tokens=2)
    assert (finish, reason) == ("length", None)


async def test_sixty_four_stop_strings_are_served(api_stack: Stack, text) -> None:
    whole = echo(text, False)
    stops = [f"never-{i}-" + "x" * 40 for i in range(MAX_STOP_STRINGS - 1)] + ["five"]
    assert await answer(api_stack, False, False, stop=stops) == (whole[: whole.index("five")], "stop", "five")
    assert await answer(api_stack, False, True, stop=stops) == (whole[: whole.index("five")], "stop", "five")
    longest = ["a" * MAX_STOP_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS)  # the total bound, exactly
    assert await answer(api_stack, False, False, stop=longest) == (whole, "stop", None)


@pytest.mark.parametrize("stop", [
    [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
    ["a" * MAX_STOP_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS) + ["b"],
    ["a" * (MAX_STOP_CHARS + 1)],
], ids=["count", "total", "length"])
async def test_stop_lists_beyond_the_bound_are_400(api_stack: Stack, stop: list[str]) -> None:
    for chat in (True, False):
        with pytest.raises(openai.BadRequestError) as info:
            await answer(api_stack, chat, False, stop=stop)
        assert info.value.param == "stop"
