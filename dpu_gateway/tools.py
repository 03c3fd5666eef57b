"""Tool calling as vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME`` does it.

- **Requests**: ``tools`` (functions with JSON-Schema parameters), ``tool_choice`` ``none`` / ``auto`` /
  ``required`` / ``{"type": "function", "function": {"name": ...}}``, ``parallel_tool_calls``.
- **Prompt**: a chat template that renders ``tools`` gets them (and the history's ``tool_calls`` and
  ``tool`` messages) as Hugging Face templates expect; for one that does not (the embedded SmolLM2's), the
  gateway writes the tools into the system message in the parser's format, the history's calls into the
  assistant's text and the tool results into user turns (``plain_messages``).
- **Output**: a ``Format`` (one per parser) reads calls out of the text, incrementally for streams:
  ``hermes`` is Hermes/Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  ``llama3_json`` is Llama 3.x's ``{"name": ..., "parameters": {...}}`` (several joined by ``; ``).
- **Forced calls** (``required``, a named function) are enforced by constrained decoding: the grammar
  of the parser's format with the tools' parameter schemas (``call_pattern``); a backend that cannot
  constrain answers 400.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from dpu_gateway.errors import APIError
from dpu_gateway.grammar import Pat, alt, lit, seq, star
from dpu_gateway.json_grammar import encode, schema_pattern

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def parse_tools(raw: list | None) -> list[Tool]:
    tools: list[Tool] = []
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise _bad(where, 'each tool must be {"type": "function", "function": {...}}')
        if set(item) - {"type", "function"}:
            raise _bad(f"{where}.{sorted(set(item) - {'type', 'function'})[0]}", "unknown field")
        fn = item["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"{where}.function.{sorted(unknown)[0]}", "unknown field")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, '_', '.' or '-'")
        if any(t.name == name for t in tools):
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON Schema object")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"{where}.function.description", "must be a string")
        tools.append(Tool(name, desc, params))
    return tools


@dataclasses.dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str                 # none, auto, required, named
    name: str | None = None   # the named function


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise _bad("tool_choice", f'"{raw}" needs tools')
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                   '{"name": ...}}')
    if not any(t.name == name for t in tools):
        raise _bad("tool_choice", f"names the function {name!r}, which is not among the tools")
    return ToolChoice("named", name)


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_of(obj: Any, args_key: str) -> Call | None:
    """A parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclasses.dataclass(frozen=True, slots=True)
class Format:
    """How one parser's model writes calls: the prompt's instructions, history calls, and the grammar."""

    name: str
    args_key: str   # "arguments" or "parameters"
    open: str       # text before each call's JSON
    close: str      # text after it
    joiner: str     # between two calls

    def call_text(self, name: str, arguments: Any) -> str:
        return f"{self.open}{encode({'name': name, self.args_key: arguments})}{self.close}"

    def instructions(self, tools: list[Tool]) -> str:
        listed = "\n".join(encode(t.openai()) for t in tools)
        example = self.call_text("<function name>", "<arguments as a JSON object>")
        example = example.replace('"<', "<").replace('>"', ">")
        return ("You can call functions to help answer. Their signatures, as JSON, between <tools> tags:\n"
                f"<tools>\n{listed}\n</tools>\n\nTo call one, write only this, once per call:\n{example}")

    def pattern(self, tools: list[Tool], many: bool) -> Pat:
        """Grammar of one call (``many``: one or more) to one of ``tools``, arguments per their schemas."""
        one = alt(*(seq(lit(self.open + '{"name": ' + encode(t.name) + f', "{self.args_key}": '),
                        schema_pattern(t.parameters), lit("}" + self.close)) for t in tools))
        return seq(one, star(seq(lit(self.joiner), one))) if many else one

    def parser(self) -> CallParser:
        return HermesParser(self) if self.name == "hermes" else JsonParser(self)

    def partial_call(self, text: str, names: tuple[str, ...]) -> Call | None:
        """A forced call that the token limit cut short, as OpenAI gives one: its name, and its arguments as far as
        they were written (then no JSON of their own; empty when cut before them). ``text`` is what the parser left
        unread, which the forced grammar made the start of one call to one of ``names`` (the parsers give the whole
        calls before it apart). None when that text does not name one of them whole (cut inside a name that several
        could complete)."""
        text, mark = text.strip(), self.open.strip()
        if text.startswith(mark):
            body = text[len(mark):].lstrip()
        elif mark.startswith(text):  # cut inside the opening tag
            body = ""
        else:
            return None
        heads = {name: f'{{"name": {encode(name)}, "{self.args_key}": ' for name in names}
        for name, head in heads.items():
            if body.startswith(head):
                args = body[len(head):]
                try:  # arguments written whole, then the cut inside the call's end: the arguments alone
                    args = args[:json.JSONDecoder().raw_decode(args)[1]]
                except ValueError:
                    pass
                return Call(name, args)
        started = [name for name, head in heads.items() if head.startswith(body)]
        return Call(started[0], "") if len(started) == 1 else None


FORMATS = {
    "hermes": Format("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n"),
    "llama3_json": Format("llama3_json", "parameters", "", "", "; "),
}


class CallParser:
    """Text in (deltas), content text and calls out; ``finish`` flushes what was held back."""

    def feed(self, text: str) -> list[str | Call]:
        raise NotImplementedError

    def finish(self) -> list[str | Call]:
        raise NotImplementedError


class HermesParser(CallParser):
    """Content streams as it comes, except a possible ``<tool_call>`` start held back until it is decided;
    each call is given once its closing tag arrives (or at the end, if its JSON is complete)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: Format) -> None:
        self.fmt, self.buf, self.in_call, self.after_call = fmt, "", False, False

    def feed(self, text: str) -> list[str | Call]:
        self.buf += text
        out: list[str | Call] = []
        while True:
            if self.after_call:  # whitespace between calls is not content
                self.buf = self.buf.lstrip()
                self.after_call = not self.buf
            if self.in_call:
                end = self.buf.find(self.CLOSE)
                if end < 0:
                    return out
                out += self._call(self.buf[:end])
                self.buf, self.in_call, self.after_call = self.buf[end + len(self.CLOSE):], False, True
                continue
            start = self.buf.find(self.OPEN)
            if start < 0:
                keep = _held(self.buf, self.OPEN)
                if len(self.buf) > keep:
                    out.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if start:
                out.append(self.buf[:start])
            self.buf, self.in_call = self.buf[start + len(self.OPEN):], True

    def _call(self, body: str) -> list[str | Call]:
        try:
            call = _call_of(json.loads(body), self.fmt.args_key)
        except ValueError:
            call = None
        return [call] if call is not None else [self.OPEN + body + self.CLOSE]

    def finish(self) -> list[str | Call]:
        rest, self.buf = self.buf, ""
        if not self.in_call:
            return [rest] if rest else []
        found = self._call(rest)
        return found if isinstance(found[0], Call) else [self.OPEN + rest]


class JsonParser(CallParser):
    """Llama 3.x JSON calls: an answer that starts with ``{`` is held to the end and read as calls joined
    by ``;``; one that does not is content, streamed."""

    def __init__(self, fmt: Format) -> None:
        self.fmt, self.buf = fmt, ""
        self.decided: bool | None = None  # True: calls, False: content

    def feed(self, text: str) -> list[str | Call]:
        if self.decided is False:
            return [text] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if self.decided is None and head:
            self.decided = head.startswith(("{", "<|python_tag|>"))
            if not self.decided:
                out, self.buf = self.buf, ""
                return [out]
        return []

    def finish(self) -> list[str | Call]:
        text, self.buf = self.buf.strip().removeprefix("<|python_tag|>"), ""
        if not text:
            return []
        calls: list[str | Call] = []
        dec, pos = json.JSONDecoder(), 0
        while pos < len(text):
            try:
                obj, pos = dec.raw_decode(text, pos)
            except ValueError:  # the calls before it, and the rest as text (a cut call's, `Format.partial_call`)
                return [*calls, text[pos:]] if calls else [text]
            call = _call_of(obj, self.fmt.args_key)
            if call is None:
                return [text]
            calls.append(call)
            while pos < len(text) and text[pos] in " ;\n":
                pos += 1
        return calls


def _held(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could start ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_all(fmt: Format, text: str) -> tuple[str, list[Call]]:
    """A whole answer's content (calls taken out) and its calls."""
    p = fmt.parser()
    events = p.feed(text) + p.finish()
    content = "".join(e for e in events if isinstance(e, str)).strip()
    return content, [e for e in events if isinstance(e, Call)]


def history(messages: list[Any], text_of: Any) -> list[dict]:
    """Chat messages as Hugging Face templates take them: calls with their arguments as objects, an assistant's
    reasoning as ``reasoning_content`` (Qwen3's template writes it between think tags in the turns after the last
    user message, and drops it from earlier ones)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": text_of(m)}
        if m.tool_calls:
            msg["tool_calls"] = [_history_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            msg["name"] = m.name
        reasoning = getattr(m, "reasoning_content", None) or getattr(m, "reasoning", None)
        if reasoning is not None and m.role == "assistant":  # both names, as vLLM gives templates
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        out.append(msg)
    return out


def _history_call(where: str, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(where, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}')
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise _bad(f"{where}.function.arguments", "must be a JSON object (as text)") from None
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": parsed}}


def plain_messages(fmt: Format, msgs: list[dict], tools: list[Tool]) -> list[dict]:
    """``history`` for a template that knows no tools: the tools in the system message, calls in the
    assistant's text, results in user turns between ``<tool_response>`` tags."""
    out = []
    for m in msgs:
        text = m.get("content") or ""
        if m.get("tool_calls"):
            calls = fmt.joiner.join(fmt.call_text(c["function"]["name"], c["function"]["arguments"])
                                    for c in m["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": text})
    if tools:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{fmt.instructions(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": fmt.instructions(tools)})
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tool fields ask: the tools to render, the format to read calls in (None: the
    answer is plain text), whether several calls may come, and the grammar of a forced call."""

    tools: list[Tool]
    choice: ToolChoice
    fmt: Format | None = None
    parallel: bool = True

    def forced(self) -> list[Tool]:
        """The tools one of which must be called (empty unless the choice forces a call)."""
        if self.choice.mode == "required":
            return self.tools
        return [t for t in self.tools if t.name == self.choice.name] if self.choice.mode == "named" else []

    def pattern_key(self) -> tuple[str, Any]:
        many = self.parallel and self.choice.mode == "required"
        assert self.fmt is not None
        return "tool_call", [self.fmt.name, many, [t.openai() for t in self.forced()]]


def plan_tools(raw_tools: list | None, raw_choice: Any, parallel: bool | None, parser: str | None,
               auto_enabled: bool) -> ToolPlan:
    """The request's tool plan under the server's ``--enable-auto-tool-choice`` / ``--tool-call-parser``."""
    tools = parse_tools(raw_tools)
    choice = parse_tool_choice(raw_choice, tools)
    if choice.mode == "none":
        return ToolPlan(tools, choice)
    if choice.mode == "auto" and not (auto_enabled and parser):
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                       "--tool-call-parser (or give tool_choice \"none\", \"required\" or a named function)",
                       param="tool_choice", code="invalid_value")
    return ToolPlan(tools, choice, FORMATS[parser or "hermes"], parallel is not False)
