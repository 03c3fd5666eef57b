"""vLLM's chat-template fields: ``chat_template_kwargs``, ``continue_final_message``, ``add_generation_prompt``.

The rendered prompt is checked against Hugging Face's ``apply_chat_template`` on the same tokenizer files (the
embedded SmolLM2 GGUF, read by transformers), directly and through ``blink serve`` (the fake engine, which
answers with its prompt, so the prompt the server built is seen in the answer); every refusal is a 400 naming
the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from dpu_gateway.errors import APIError
from dpu_gateway.protocol import ChatMessage
from dpu_gateway.textio import Rendering, TextCodec
from dpu_tokenizer.chat import TemplateVariableError, load_chat_template, render_chat
from dpu_tokenizer.sources import default_model_path

# A template that switches a model's thinking off the way Qwen3's does: with enable_thinking false the prompt
# opens the answer with an empty think block.
THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# One that trims what it renders (its spacing does not survive).
TRIMMING = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
PREFILL = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
TRAILING = [*ASK, {"role": "assistant", "content": "Well,  \n"}]
EMPTY = [*ASK, {"role": "assistant", "content": ""}]


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers' tokenizer of the embedded model, from the same GGUF file Blink reads."""
    auto = pytest.importorskip("transformers").AutoTokenizer
    gguf = default_model_path()
    return auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def theirs(hf: Any, template: str | None, messages: list[dict], tokenize: bool = False, **kw: Any) -> Any:
    kw.setdefault("add_generation_prompt", not kw.get("continue_final_message", False))
    return hf.apply_chat_template(messages, chat_template=template or hf.chat_template, tokenize=tokenize,
                                  return_dict=False, **kw)


def ours(template: str | None, messages: list[dict], **kw: Any) -> str:
    kw.setdefault("add_generation_prompt", not kw.get("continue_final_message", False))
    return render_chat(template, messages, bos_token="<|im_start|>", eos_token="<|im_end|>", **kw)


# ---------------------------------------------------------------------- the renderer, against transformers
@pytest.mark.parametrize("name", ["model", "thinking", "trimming"])
def test_continue_final_message_renders_as_transformers(hf: Any, name: str) -> None:
    template = {"model": load_chat_template(), "thinking": THINKING, "trimming": TRIMMING}[name]
    for messages in (PREFILL, TRAILING, EMPTY):
        prompt = ours(template, messages, continue_final_message=True)
        assert prompt == theirs(hf, template, messages, continue_final_message=True), messages
        if name != "trimming":  # the prompt ends inside the last message: no end of turn after it
            assert prompt.endswith(messages[-1]["content"])


def test_add_generation_prompt_renders_as_transformers(hf: Any) -> None:
    for template in (load_chat_template(), THINKING):
        for gen in (True, False):
            assert ours(template, ASK, add_generation_prompt=gen) == theirs(hf, template, ASK,
                                                                            add_generation_prompt=gen)
    assert ours(THINKING, ASK).endswith("<|im_start|>assistant\n")
    assert not ours(THINKING, ASK, add_generation_prompt=False).endswith("assistant\n")


def test_template_kwargs_render_as_transformers(hf: Any) -> None:
    for value in (False, True):
        prompt = ours(THINKING, ASK, template_kwargs={"enable_thinking": value})
        assert prompt == theirs(hf, THINKING, ASK, enable_thinking=value)
        assert prompt.endswith("<think>\n\n</think>\n\n") is (not value)


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "bos_token", "raise_exception",
                                  "chat_template"])
def test_template_kwargs_cannot_set_what_the_renderer_sets(name: str) -> None:
    template = THINKING.replace("enable_thinking", name) if name != "messages" else THINKING
    with pytest.raises(TemplateVariableError) as info:
        ours(template, ASK, template_kwargs={name: False})
    assert info.value.name == name


def test_template_kwargs_the_template_does_not_read_are_refused() -> None:
    with pytest.raises(TemplateVariableError, match="does not read") as info:
        ours(THINKING, ASK, template_kwargs={"enable_thinkng": False})  # misspelt: would change nothing
    assert info.value.name == "enable_thinkng"
    with pytest.raises(TemplateVariableError, match="enable_thinking"):
        ours(load_chat_template(), ASK, template_kwargs={"enable_thinking": False})  # SmolLM2's reads none


# ---------------------------------------------------------------------- through blink serve
@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("template_fields")
    (tmp / "thinking.jinja").write_text(THINKING)
    s = start_stack(tmp, "--chat-template", str(tmp / "thinking.jinja"))
    yield s
    stop_stack(s)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(stack: Stack, body: dict) -> tuple[int, dict]:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    req = urllib.request.Request(stack.url + "/tokenize", data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def echoed(stack: Stack, messages: list[dict], **extra: Any) -> tuple[str, int]:
    """The fake engine's answer (its prompt less the first token, special tokens' text kept) and the prompt's
    length."""
    out = client(stack).chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                                extra_body={"skip_special_tokens": False, **extra})
    return out.choices[0].message.content or "", out.usage.prompt_tokens


@pytest.mark.parametrize(("extra", "kw"), [
    ({}, {}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
])
def test_the_served_prompt_is_transformers(stack: Stack, hf: Any, extra: dict, kw: dict) -> None:
    want = theirs(hf, THINKING, ASK, tokenize=True, **kw)
    status, body = tokenize(stack, {"messages": ASK, **extra})
    assert status == 200 and body["tokens"] == want, body
    answer, prompt_tokens = echoed(stack, ASK, **extra)
    assert prompt_tokens == len(want)
    assert answer == hf.decode(want[1:], skip_special_tokens=False)


def test_continue_final_message_is_served_as_transformers(stack: Stack, hf: Any) -> None:
    for messages in (PREFILL, TRAILING, EMPTY):
        want = theirs(hf, THINKING, messages, tokenize=True, continue_final_message=True)
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        status, body = tokenize(stack, {"messages": messages, **extra})
        assert status == 200 and body["tokens"] == want, body
        answer, prompt_tokens = echoed(stack, messages, **extra)
        assert prompt_tokens == len(want) and answer == hf.decode(want[1:], skip_special_tokens=False)
    assert answer.endswith("<|im_start|>assistant\n")  # the empty prefill: the answer starts the turn's text


REFUSALS = [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": ASK}, "continue_final_message"),
    ({"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs.enable_thinkng"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSALS, ids=[p for _, p in REFUSALS])
def test_refusals_name_the_field(stack: Stack, extra: dict, param: str) -> None:
    body = {"messages": PREFILL, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client(stack).chat.completions.create(model=MODEL, max_tokens=2, **{"messages": body.pop("messages")},
                                              extra_body=body)
    assert info.value.param == param, info.value
    status, answer = tokenize(stack, {"messages": PREFILL, **extra})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_prompt_tokenize_refuses_message_fields(stack: Stack) -> None:
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs")):
        status, answer = tokenize(stack, {"prompt": "hi", **extra})
        assert status == 400 and answer["error"]["param"] == param, answer


def test_a_template_that_raises_is_a_400() -> None:
    """A template's own refusal (its raise_exception) is the client's error, a 400 as vLLM answers it."""
    template = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last turn must be the user') }}"
                "{% endif %}{{ messages[-1]['content'] }}")
    codec = TextCodec(str(default_model_path()), chat_template=template)
    with pytest.raises(APIError) as info:
        codec.render_chat([ChatMessage(role="assistant", content="hi")])
    assert info.value.status == 400 and "the last turn must be the user" in info.value.message
    assert info.value.param == "messages"
    dropping = TextCodec(str(default_model_path()), chat_template="{{ messages[0]['content'] }}")
    with pytest.raises(APIError) as info:  # the last message is not rendered: nothing to continue
        dropping.render_chat([ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="x")],
                             False, how=Rendering(continue_final=True))
    assert info.value.status == 400 and info.value.param == "continue_final_message"
