"""Chat templates: loading from GGUF / tokenizer_config.json, rendering like transformers, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.chat import FALLBACK_TEMPLATE, ChatTemplateError, load_chat_template, render_chat

USER = [{"role": "user", "content": "What is 2+2? Answer in 한국어 😀"}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "<|im_end|> tricky"},
]
RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if loop.index0 > 5 %}{% break %}{% endif %}{% if m['content'] == '' %}{% continue %}{% endif %}"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def _transformers_render(template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered = chat_utils.render_jinja_template(conversations=[messages], chat_template=template, **kw)
    first = rendered[0] if isinstance(rendered, tuple) else rendered
    return first[0] if isinstance(first, list) else first


def test_smollm2_template_from_gguf_renders_like_transformers() -> None:
    template = load_chat_template()
    assert template is not None and "<|im_start|>" in template
    for messages in (USER, CONVERSATION):
        for gen in (True, False):
            ours = render_chat(
                template,
                messages,
                add_generation_prompt=gen,
                bos_token="<|im_start|>",
                eos_token="<|im_end|>",
            )
            theirs = _transformers_render(
                template,
                messages,
                add_generation_prompt=gen,
                bos_token="<|im_start|>",
                eos_token="<|im_end|>",
            )
            assert ours == theirs
    prompt = render_chat(template, USER)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = load_tokenizer().encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 2


def test_rich_template_features_match_transformers() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]
    messages = [*CONVERSATION, {"role": "user", "content": ""}]
    kw = {"add_generation_prompt": True, "bos_token": "<s>", "eos_token": "</s>", "tools": tools}
    assert render_chat(RICH_TEMPLATE, messages, **kw) == _transformers_render(RICH_TEMPLATE, messages, **kw)


def test_raise_exception_and_bad_input_give_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        render_chat(RICH_TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat("{% for m in messages %}", USER)
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat(None, [{"content": "no role"}])
    with pytest.raises(ChatTemplateError):
        render_chat(None, "not a list")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", USER)
    with pytest.raises(ChatTemplateError):
        render_chat("{% set _ = messages.append(1) %}", USER)


def test_fallback_template() -> None:
    assert render_chat(None, USER) == render_chat(FALLBACK_TEMPLATE, USER)
    assert render_chat(None, USER, add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2? Answer in 한국어 😀<|im_end|>\n"
    )


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}"})
    )
    assert load_chat_template(tmp_path) == "{{ messages[0]['content'] }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert load_chat_template(tmp_path) is None
