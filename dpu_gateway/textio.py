"""The gateway's use of the tokenizer library: chat template, detokenizer, token text.

Every call into ``dpu_tokenizer`` from the gateway goes through ``TextCodec``.
"""

from __future__ import annotations

from typing import Any, Protocol

from dpu_gateway.protocol import ChatMessage, TextPart
from dpu_gateway.tools import FORMATS, Format, Tool, history, plain_messages
from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.chat import load_chat_template, render_chat, renders_tools
from dpu_tokenizer.detok import IncrementalDetokenizer


def message_text(msg: ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    return "".join(p.text for p in msg.content if isinstance(p, TextPart))


class TextCodec:
    def __init__(self, model: str, chat_template: str | None = None) -> None:
        """``chat_template``: the template text to use instead of the model's own."""
        self.tokenizer = load_tokenizer(model)
        self.template = chat_template if chat_template is not None else load_chat_template(model)
        self.renders_tools = renders_tools(self.template)
        self.bos = self._special_text(self.tokenizer.bos_token_id)
        eos = self.tokenizer.eos_token_ids
        self.eos = self._special_text(eos[0] if eos else None)

    def _special_text(self, token: int | None) -> str:
        return "" if token is None else self.token_text(token)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[Tool] | None = None, fmt: Format | None = None) -> str:
        """The prompt text. Tools and tool messages go to a template that renders them as Hugging Face's
        ``tools`` and message fields; otherwise into plain messages in ``fmt``'s words (Hermes by default)."""
        msgs = history(messages, message_text)
        extra: dict[str, Any] = {}
        uses_tools = bool(tools) or any("tool_calls" in m or m["role"] == "tool" for m in msgs)
        if uses_tools and not self.renders_tools:
            msgs = plain_messages(fmt or FORMATS["hermes"], msgs, tools or [])
        elif tools:
            extra["tools"] = [t.openai() for t in tools]
        return render_chat(self.template, msgs, add_generation_prompt=add_generation_prompt, bos_token=self.bos,
                           eos_token=self.eos, **extra)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def detokenizer(self, stop: list[str]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, stop)

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

