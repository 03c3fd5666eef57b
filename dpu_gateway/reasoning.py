"""Reasoning output, as vLLM's ``--reasoning-parser qwen3`` / ``deepseek_r1``: the model's ``<think>...</think>``
text is returned as ``reasoning_content`` (and ``reasoning``, vLLM's newer name), ``content`` holds what follows.

Both parsers read the same tags and differ only in one switch (``PARSERS``). Where the output starts is decided
from the rendered prompt before the first token comes (``plan_reasoning``), as vLLM decides it from the prompt's
token ids:

- **inside the reasoning**, the default: a template that opens ``<think>`` in the prompt (DeepSeek-R1, QwQ,
  Qwen3 Thinking-2507) and one whose model writes ``<think>`` itself (Qwen3) alike. A ``<think>`` that opens the
  output (after any whitespace) is dropped; everything up to the first ``</think>`` is reasoning, everything
  after it content. An output with no ``</think>`` (cut by ``max_tokens``, or a model that does not think) is
  all reasoning, ``content`` null.
- **in the content**, when the prompt's last think tag is ``</think>`` and no special token follows it (Qwen3's
  template with ``enable_thinking: false`` ends the prompt with ``<think>\\n\\n</think>\\n\\n``; an assistant
  prefill continued past its reasoning), or, for ``qwen3``, when the request's ``chat_template_kwargs`` say
  ``enable_thinking: false``: the whole output is content, tags and all. A ``</think>`` of an earlier turn
  (followed by its end-of-turn token) does not count.

``Splitter`` takes text deltas and gives (reasoning, content) pieces as soon as they are decided: only text that
may still be the start of a tag is held back (at most 7 characters, and the whitespace before a first
``<think>``), so a tag split across deltas anywhere is still found, and the pieces of any chunking join to the
``split`` of the whole text.

With a structured-output constraint, the grammar applies after the reasoning (vLLM: reasoning is free text and
the constraint starts once it ended): ``Reasoning.constraint`` puts "any text without ``</think>``, then
``</think>``" in front of it, or that text alone (the model may end inside its reasoning), where the output starts
inside the reasoning (an ``after_reasoning`` key, ``structured.pattern_of``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from dpu_gateway.structured import Constraint
from dpu_tokenizer.chat import template_variables

START, END = "<think>", "</think>"
# parser -> whether chat_template_kwargs' enable_thinking: false means the output is content (Qwen3's switch)
PARSERS: dict[str, bool] = {"qwen3": True, "deepseek_r1": False}

_LEAD, _REASONING, _CONTENT = 0, 1, 2


def _held(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could start ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class Splitter:
    """One choice's output text in, (reasoning, content) pieces out; ``finish`` gives what was held back."""

    def __init__(self, in_reasoning: bool = True) -> None:
        self.state = _LEAD if in_reasoning else _CONTENT
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == _CONTENT:
            return "", text
        self.buf += text
        if self.state == _LEAD:
            head = self.buf.lstrip()
            if not head or (START.startswith(head) and head != START):
                return "", ""  # whitespace, or what may still become the opening <think>
            if head.startswith(START):
                self.buf = head[len(START):]
            self.state = _REASONING
        end = self.buf.find(END)
        if end >= 0:
            reasoning, content = self.buf[:end], self.buf[end + len(END):]
            self.buf, self.state = "", _CONTENT
            return reasoning, content
        cut = len(self.buf) - _held(self.buf, END)
        reasoning, self.buf = self.buf[:cut], self.buf[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning, since no ``</think>`` followed it."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state != _CONTENT else ("", rest)


def split(text: str, in_reasoning: bool = True) -> tuple[str, str]:
    """A whole output's reasoning and content (what the pieces of ``Splitter`` join to)."""
    s = Splitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


class ChoiceReader:
    """A ``Splitter`` behind a choice's echo (vLLM's chat ``echo``): the echoed text, which the answer's first
    delta carries, is content and is not parsed."""

    def __init__(self, in_reasoning: bool, echo: str = "") -> None:
        self.splitter = Splitter(in_reasoning)
        self.echo_left = len(echo)

    def feed(self, text: str) -> tuple[str, str]:
        echoed, rest = text[: self.echo_left], text[self.echo_left:]
        self.echo_left -= len(echoed)
        reasoning, content = self.splitter.feed(rest) if rest else ("", "")
        return reasoning, echoed + content

    def finish(self) -> tuple[str, str]:
        return self.splitter.finish()


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """What one chat request's output is read with: the parser, whether the output starts inside the
    reasoning, and whether the reasoning is returned (``include_reasoning``)."""

    parser: str
    in_reasoning: bool = True
    include: bool = True

    def reader(self, echo: str = "") -> ChoiceReader:
        return ChoiceReader(self.in_reasoning, echo)

    def split(self, text: str, echo: str = "") -> tuple[str, str]:
        """A whole answer's reasoning and content (``text`` starts with the choice's echo, if any)."""
        reader = self.reader(echo)
        r1, c1 = reader.feed(text)
        r2, c2 = reader.finish()
        return r1 + r2, c1 + c2

    def message_fields(self, reasoning: str) -> dict[str, Any]:
        """The choice message's reasoning fields: vLLM's two names, the same text (empty when ``</think>`` came
        first), null where the output started in the content or ``include_reasoning`` is false."""
        value = reasoning if self.in_reasoning and self.include else None
        return {"reasoning": value, "reasoning_content": value}

    def delta(self, reasoning: str, content: str) -> dict[str, Any]:
        """A stream delta with the pieces that have text (empty when none has)."""
        out: dict[str, Any] = {"content": content} if content else {}
        if reasoning and self.include:
            out["reasoning"] = out["reasoning_content"] = reasoning
        return out

    def constraint(self, c: Constraint | None) -> Constraint | None:
        """The request's output constraint, applied after the reasoning when the output starts inside it."""
        if c is None or not self.in_reasoning or c.on_tokens:
            return c
        return Constraint(json.dumps(["after_reasoning", [END, json.loads(c.key)]], separators=(",", ":")),
                          c.param)


_TAG = re.compile(re.escape(START) + "|" + re.escape(END))


def prompt_ends_reasoning(prompt: str, special: re.Pattern[str] | None) -> bool:
    """Whether the prompt closed the reasoning of the turn being written: its last think tag is ``</think>`` and
    no special token (an end of turn) comes after it."""
    last = max(_TAG.finditer(prompt), key=lambda m: m.start(), default=None)
    if last is None or last.group() != END:
        return False
    return special is None or special.search(prompt, last.end()) is None


def template_kwargs(parser: str | None, kwargs: dict[str, Any] | None, template: str | None) -> dict[str, Any] | None:
    """The request's ``chat_template_kwargs`` as the template gets them. With ``qwen3`` the parser reads
    ``enable_thinking`` too, so a template that does not read it is not given it (rather than the 400 that a
    variable the template does not read gets)."""
    if parser is None or not PARSERS[parser] or not kwargs or "enable_thinking" not in kwargs:
        return kwargs
    if "enable_thinking" in template_variables(template):
        return kwargs
    return {k: v for k, v in kwargs.items() if k != "enable_thinking"}


def plan_reasoning(parser: str | None, prompt: str, special: re.Pattern[str] | None,
                   template_kwargs: dict | None = None, include: bool | None = None) -> Reasoning | None:
    """The request's ``Reasoning`` under the server's ``--reasoning-parser`` (None: no parser)."""
    if parser is None:
        return None
    thinking_off = PARSERS[parser] and (template_kwargs or {}).get("enable_thinking") is False
    in_reasoning = not (thinking_off or prompt_ends_reasoning(prompt, special))
    return Reasoning(parser, in_reasoning, include is not False)
