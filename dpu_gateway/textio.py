"""The gateway's use of the tokenizer library: chat template, detokenizer, token text.

Every call into ``dpu_tokenizer`` from the gateway goes through ``TextCodec``.

Special-token text in a message (a user writing ``<|im_end|>``) is, by default, the special token once the
template's output is tokenized, as in vLLM and Hugging Face's ``apply_chat_template``. With the request's
``split_special_tokens`` (Hugging Face's name for the tokenizer option), each such occurrence stays text:
the message text is rendered with the occurrence hidden behind a tag, the prompt is cut at the tags, and
each occurrence is encoded apart, in pieces that cannot spell a special token (``encode_parts``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from dpu_gateway.errors import APIError
from dpu_gateway.protocol import ChatMessage, TextPart
from dpu_gateway.tools import FORMATS, Format, Tool, history, plain_messages
from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.chat import (
    ChatTemplateError,
    ContinueError,
    TemplateVariableError,
    load_chat_template,
    render_chat,
    renders_tools,
)
from dpu_tokenizer.detok import IncrementalDetokenizer


def _cut_at_tags(text: str, tag: str, hidden: list[str], optional: frozenset[int] = frozenset()) -> list[Part]:
    """``text`` cut at each tag, the hidden text it stands for as a literal part. Each tag must come out once,
    except those of ``optional`` (an assistant's reasoning, which templates such as Qwen3's drop from earlier
    turns), which may also be left out."""
    parts: list[Part] = []
    pos = 0
    found: list[int] = []
    for match in re.finditer(re.escape(tag) + r"([0-9]+)" + _TAG_END, text):
        found.append(int(match.group(1)))
        parts += [(text[pos: match.start()], False), (hidden[found[-1]], True)]
        pos = match.end()
    if len(set(found)) != len(found) or set(range(len(hidden))) - set(found) - optional:
        raise APIError(400, "split_special_tokens: this model's chat template rewrites message text, so special-"
                       "token text in it cannot be kept as text", param="split_special_tokens",
                       code="unsupported_value")
    return [*parts, (text[pos:], False)]


async def encode_parts(codec: TextCodec, parts: list[Part], encode: Callable[[str, bool], Awaitable[list[int]]],
                       add_special: bool) -> list[int]:
    """The ids of ``parts`` (``encode(text, add_special)`` is the tokenizer service's): plain parts as they
    are, literal ones in pieces that spell no special token. ``add_special`` applies to the first part."""
    jobs = []
    for i, (text, literal) in enumerate(parts):
        for piece in codec.literal_pieces(text) if literal else [text]:
            if piece or (i == 0 and add_special):
                jobs.append(encode(piece, add_special and i == 0))
    return [t for ids in await asyncio.gather(*jobs) for t in ids]


def message_text(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    return "".join(p.text for p in msg.content if isinstance(p, TextPart))


Part = tuple[str, bool]  # prompt text, and whether it is literal (special-token text in it stays text)


@dataclasses.dataclass(frozen=True, slots=True)
class Rendering:
    """A request's chat-template options (vLLM's fields): ``continue_final_message``, ``chat_template_kwargs``."""

    continue_final: bool = False
    kwargs: dict[str, Any] | None = None
_TAG_END = "\ue001"


class TextCodec:
    def __init__(self, model: str, chat_template: str | None = None) -> None:
        """``chat_template``: the template text to use instead of the model's own."""
        self.tokenizer = load_tokenizer(model)
        self.template = chat_template if chat_template is not None else load_chat_template(model)
        self.renders_tools = renders_tools(self.template)
        self.bos = self._special_text(self.tokenizer.bos_token_id)
        eos = self.tokenizer.eos_token_ids
        self.eos = self._special_text(eos[0] if eos else None)
        specials = {self.token_text(i) for i in range(self.tokenizer.vocab_size) if self.tokenizer.is_special(i)}
        specials.discard("")
        self.special_re = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) \
            if specials else None

    def _special_text(self, token: int | None) -> str:
        return "" if token is None else self.token_text(token)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[Tool] | None = None, fmt: Format | None = None, how: Rendering | None = None) -> str:
        """The prompt text. Tools and tool messages go to a template that renders them as Hugging Face's
        ``tools`` and message fields; otherwise into plain messages in ``fmt``'s words (Hermes by default)."""
        msgs, extra = self._messages(messages, tools, fmt)
        return self._render(msgs, add_generation_prompt, extra, how or Rendering())

    def _messages(self, messages: list[ChatMessage], tools: list[Tool] | None,
                  fmt: Format | None) -> tuple[list[dict], dict[str, Any]]:
        msgs = history(messages, message_text)
        extra: dict[str, Any] = {}
        uses_tools = bool(tools) or any("tool_calls" in m or m["role"] == "tool" for m in msgs)
        if uses_tools and not self.renders_tools:
            msgs = plain_messages(fmt or FORMATS["hermes"], msgs, tools or [])
        elif tools:
            extra["tools"] = [t.openai() for t in tools]
        return msgs, extra

    def _render(self, msgs: list[dict], add_generation_prompt: bool, extra: dict[str, Any], how: Rendering) -> str:
        """The template's text; a template that refuses the request (its ``raise_exception``, a variable it may
        not be given, a last message it does not keep whole for ``continue_final_message``) is a 400."""
        try:
            return render_chat(self.template, msgs, add_generation_prompt=add_generation_prompt, bos_token=self.bos,
                               eos_token=self.eos, continue_final_message=how.continue_final,
                               template_kwargs=how.kwargs, **extra)
        except TemplateVariableError as exc:
            raise APIError(400, f"chat_template_kwargs.{exc}", param=f"chat_template_kwargs.{exc.name}",
                           code="invalid_value") from None
        except ContinueError as exc:
            raise APIError(400, str(exc), param="continue_final_message", code="invalid_value") from None
        except ChatTemplateError as exc:
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages",
                           code="invalid_value") from None

    def render_chat_parts(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          tools: list[Tool] | None = None, fmt: Format | None = None,
                          split_special: bool = False, how: Rendering | None = None) -> list[Part]:
        """``render_chat`` as parts for ``encode_parts``; with ``split_special`` the special-token text
        found in the messages' text comes out as literal parts."""
        msgs, extra = self._messages(messages, tools, fmt)
        how = how or Rendering()
        if not split_special or self.special_re is None:
            return [(self._render(msgs, add_generation_prompt, extra, how), False)]
        tag, hidden = "\ue000" + uuid.uuid4().hex, []

        def hide(match: re.Match[str]) -> str:
            hidden.append(match.group())
            return f"{tag}{len(hidden) - 1}{_TAG_END}"
        msgs = [{**m, "content": self.special_re.sub(hide, m["content"])} if isinstance(m.get("content"), str)
                else m for m in msgs]
        required = len(hidden)
        msgs = [{**m, **{k: self.special_re.sub(hide, m[k]) for k in ("reasoning_content", "reasoning") if k in m}}
                for m in msgs]
        optional = frozenset(range(required, len(hidden)))
        return _cut_at_tags(self._render(msgs, add_generation_prompt, extra, how), tag, hidden, optional)

    def literal_pieces(self, text: str) -> list[str]:
        """``text`` cut one character into each special-token text, so that no piece spells one."""
        pieces, pos = [], 0
        while self.special_re is not None and (found := self.special_re.search(text, pos)) is not None:
            pieces.append(text[pos: found.start() + 1])
            pos = found.start() + 1
        return [*pieces, text[pos:]]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, stop: list[str], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """``skip_special_tokens`` false: special tokens' text (``<|im_end|>``) is part of the text, joined to its
        neighbours with no space added, as the model's tokenizer decodes."""
        return IncrementalDetokenizer(self.tokenizer, stop, skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        return bytes(self.tokenizer.token_bytes(int(token)))

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", "replace")


class TokenNames(Protocol):
    """How a log-prob entry names a token: its text and bytes (``TextCodec``, or ``TokenIdNames``)."""

    def token_bytes(self, token: int) -> bytes: ...

    def token_text(self, token: int) -> str: ...


class TokenIdNames:
    """vLLM's ``return_tokens_as_token_ids``: every log-prob entry names its token ``token_id:N`` (and its bytes
    are that name's), so a client gets the ids back without the tokenizer, even for tokens that are not whole
    UTF-8 characters. The answer's text is unchanged."""

    def token_bytes(self, token: int) -> bytes:
        return self.token_text(token).encode()

    def token_text(self, token: int) -> str:
        return f"token_id:{int(token)}"

