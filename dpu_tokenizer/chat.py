"""Chat templates: find a model's template and render messages with it in a jinja2 sandbox."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dpu_tokenizer.base import TokenizerError
from dpu_tokenizer.sources import default_model_path, find_gguf, read_gguf_vocab, read_json_if_present

# Used when a model ships no template: ChatML, the most widespread convention.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template does not compile, rejects the messages, or the messages are malformed."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per template text, in the same kind of environment Hugging Face uses."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc


# What the renderer itself gives a template (or vLLM refuses as a template variable): a request's
# chat_template_kwargs may not set them (their own request fields do), nor the environment's globals.
RESERVED_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
    "chat_template", "tokenize", *_environment().globals,
})


@lru_cache(maxsize=32)
def template_variables(template: str | None) -> frozenset[str]:
    """The variables a template reads that it does not set itself (Jinja's undeclared names)."""
    source = template if template is not None else FALLBACK_TEMPLATE
    try:
        return frozenset(meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile (line {exc.lineno}): {exc.message}") from exc


class TemplateVariableError(ChatTemplateError):
    """A variable a request gives the template that it may not give: ``name`` and why."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: {why}")
        self.name = name


class ContinueError(ChatTemplateError):
    """``continue_final_message`` cannot be served: the last message has no text, or the template does not keep
    it whole."""


def check_template_kwargs(template: str | None, kwargs: Mapping[str, Any]) -> None:
    """Each extra variable must be one the template reads, and none that the renderer sets itself: one the
    template does not read would change nothing (a misspelt ``enable_thinking`` served as if absent)."""
    reads = template_variables(template)
    for name in kwargs:
        if name in RESERVED_VARIABLES:
            raise TemplateVariableError(name, "set by the server (a request field of its own where there is one), "
                                        "not a template variable a request may set")
        if name not in reads:
            known = sorted(reads - RESERVED_VARIABLES)
            raise TemplateVariableError(name, "the chat template does not read this variable (it reads "
                                        f"{', '.join(known) if known else 'none beyond the messages'})")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} is not an object")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"message {i} has no string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ChatTemplateError(f"message {i} has content of type {type(content).__name__}")
        out.append(dict(message))
    return out


# Marks where the last message's text ends (continue_final_message): rendered, the prompt is cut there.
_CONTINUE_TAG = "BLINK_CONTINUE_FINAL_MESSAGE "


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` to the prompt text; ``None`` as template means the fallback template.

    ``template_kwargs``: more variables for the template (a request's ``chat_template_kwargs``), each one it
    reads and none the renderer sets (``check_template_kwargs``). ``continue_final_message``: the prompt ends
    where the last message's text does (assistant prefill), as Hugging Face's ``apply_chat_template`` cuts it:
    the text is rendered with a tag after it and the prompt cut at the tag (with the spacing before the tag
    trimmed when the template trimmed the tag's)."""
    compiled = compile_template(template if template is not None else FALLBACK_TEMPLATE)
    if template_kwargs:
        check_template_kwargs(template, template_kwargs)
    msgs = _check_messages(messages)
    final = ""
    if continue_final_message:
        if not msgs or not isinstance(msgs[-1].get("content"), str):
            raise ContinueError("continue_final_message: the last message has no text to continue")
        final = msgs[-1]["content"]
        msgs[-1] = {**msgs[-1], "content": final + _CONTINUE_TAG}
    context = {
        **(template_kwargs or {}),
        "messages": msgs,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **extra,
    }
    try:
        rendered = compiled.render(**context)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc
    return _cut_at_continue(rendered, final) if continue_final_message else rendered


def _cut_at_continue(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ContinueError("continue_final_message: the chat template drops or rewrites the last message's "
                                "text, so the prompt cannot end inside it")
    at = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message: it trimmed its spacing too


def renders_tools(template: str | None) -> bool:
    """Whether a template reads the ``tools`` variable (Hugging Face's convention for tool definitions);
    when it does not, the caller has to put tools and tool messages into plain messages itself."""
    return template is not None and re.search(r"\btools\b", template) is not None


def _template_from_config(config: Mapping[str, Any]) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _template_from_folder(folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.json"):
        found = _template_from_config(read_json_if_present(folder / name))
        if found is not None:
            return found
    gguf = find_gguf(folder)
    return read_gguf_vocab(str(gguf)).chat_template if gguf is not None else None


def load_chat_template(model_path: str | os.PathLike[str] | None = None) -> str | None:
    """The model's own chat template (tokenizer_config.json, chat_template.jinja or GGUF), or None."""
    path = Path(model_path) if model_path is not None else default_model_path()
    if path.is_dir():
        return _template_from_folder(path)
    if path.suffix == ".gguf":
        try:
            return read_gguf_vocab(str(path)).chat_template
        except TokenizerError:
            return None
    if path.suffix == ".json":
        return _template_from_config(read_json_if_present(path))
    return _template_from_folder(path.parent) if path.is_file() else None


def chat_template_from_arg(value: str) -> str:
    """``--chat-template``: a file's text (a ``.json`` tokenizer config: its ``chat_template``), or the
    value itself when it is Jinja text; anything else is a ``ChatTemplateError``."""
    path = Path(value)
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline and path.is_file():
        if path.suffix == ".json":
            found = _template_from_config(read_json_if_present(path))
            if found is None:
                raise ChatTemplateError(f"{value} has no chat_template")
            return found
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read {value}: {exc}") from None
    if looks_inline:
        return value
    raise ChatTemplateError(f"{value!r} is neither a file nor Jinja template text")
