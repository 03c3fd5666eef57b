"""Tool calling: the call formats and their streaming parsers, the request checks, the prompt, and the
official ``openai`` client against ``blink serve --enable-auto-tool-choice --tool-call-parser hermes`` with the
real CPU engine and the embedded model (whose template knows no tools: the gateway writes them in)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from helpers.e2e import ENGINE_ENV, ENGINE_FLAGS, REAL_ENGINE, sync_client
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from blink.cli import tool_flags_problem
from dpu_gateway.errors import APIError
from dpu_gateway.grammar import accepts, byte_dfa
from dpu_gateway.protocol import ChatMessage
from dpu_gateway.structured import pattern_of
from dpu_gateway.tools import FORMATS, Call, Tool, parse_all, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_calls_whole_and_streamed_one_character_at_a_time() -> None:
    content, calls = parse_all(FORMATS["hermes"], HERMES)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    parser, events = FORMATS["hermes"].parser(), []
    for ch in HERMES:
        events += parser.feed(ch)
    events += parser.finish()
    assert "".join(e for e in events if isinstance(e, str)) == "Let me look."
    assert [e.name for e in events if isinstance(e, Call)] == ["get_weather", "get_time"]


@pytest.mark.parametrize(("text", "content", "names"), [
    ("no calls here <tool", "no calls here <tool", []),
    ('<tool_call>\n{"name": "f", "arguments": {}}', "", ["f"]),  # ended before its closing tag
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_hermes_edge_cases(text: str, content: str, names: list[str]) -> None:
    got, calls = parse_all(FORMATS["hermes"], text)
    assert got == content and [c.name for c in calls] == names


def test_llama3_json_calls() -> None:
    content, calls = parse_all(FORMATS["llama3_json"], '{"name": "a", "parameters": {"x": 1}}; {"name": "b", '
                               '"parameters": {}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert parse_all(FORMATS["llama3_json"], "Just text.") == ("Just text.", [])


NAMES = ("get_weather", "get_time")


@pytest.mark.parametrize(("fmt", "text", "names", "want"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', NAMES,
     ("get_weather", '{"city": "Par')),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argum', NAMES, ("get_weather", "")),  # before the arguments
    ("hermes", '<tool_call>\n{"name": "get_t', NAMES, ("get_time", "")),  # inside a name only one completes
    ("hermes", '<tool_call>\n{"name": "get_', NAMES, None),  # inside a name both could complete
    ("hermes", '<tool_c', ("get_weather",), ("get_weather", "")),  # a named choice: its name whatever was cut
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_', NAMES,
     ("get_weather", '{"city": "Paris"}')),  # cut in the closing tag: the arguments are whole
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}', NAMES,
     ("get_weather", '{"city": "Paris"}')),  # the arguments' own brace is not the call's
    ("hermes", "plain words", NAMES, None),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "U', NAMES, ("get_time", '{"tz": "U')),
])
def test_a_forced_call_cut_short_keeps_its_name_and_the_arguments_written(fmt, text, names, want) -> None:
    call = FORMATS[fmt].partial_call(text, names)
    assert (call if call is None else (call.name, call.arguments)) == want


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_parallel_forced_calls_cut_in_the_second_keep_the_first_whole(fmt) -> None:
    """The parser gives the whole first call, and the cut second one's text apart, which becomes a call of its
    name with no arguments yet."""
    f = FORMATS[fmt]
    first = f.open + '{"name": "get_time", "' + f.args_key + '": {}}' + f.close
    parser = f.parser()
    out = [*parser.feed(first + f.joiner + f.open + '{"name": "get_weather", "' + f.args_key[:3]), *parser.finish()]
    calls = [e for e in out if not isinstance(e, str)]
    rest = "".join(e for e in out if isinstance(e, str))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {})]
    cut = f.partial_call(rest, NAMES)
    assert cut is not None and (cut.name, cut.arguments) == ("get_weather", "")


def test_forced_call_grammar_accepts_only_calls_of_the_tools() -> None:
    plan = plan_tools([WEATHER, TIME], "required", False, None, False)
    dfa = byte_dfa(pattern_of(json.dumps(plan.pattern_key())))
    assert accepts(dfa, b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert not accepts(dfa, b'<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert not accepts(dfa, b'<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, None, False)
    assert [t.name for t in named.forced()] == ["get_time"]


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([WEATHER], "auto", "tool_choice"),  # auto without --enable-auto-tool-choice
    ([], "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "bad name"}}], "none", "tools[0].function.name"),
    ([WEATHER, WEATHER], "none", "tools[1].function.name"),
    ([{"type": "retrieval"}], "none", "tools[0]"),
])
def test_bad_tool_requests_name_the_field(tools: list, choice, param: str) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, None, None, False)
    assert info.value.param == param


def test_the_cli_takes_vllms_tool_flags_and_refuses_unknown_parsers() -> None:
    assert tool_flags_problem(True, "hermes") is None and tool_flags_problem(False, "llama3_json") is None
    assert "unknown parser 'mistral'" in (tool_flags_problem(True, "mistral") or "")
    assert "needs --tool-call-parser" in (tool_flags_problem(True, None) or "")


def test_a_template_without_tools_gets_them_in_plain_messages(text_codec) -> None:
    history = [ChatMessage(role="user", content="Weather in Paris?"),
               ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
               ChatMessage(role="tool", tool_call_id="c1", content="18 C, sunny")]
    tool = Tool("get_weather", "Current weather", WEATHER["function"]["parameters"])
    prompt = text_codec.render_chat(history, True, [tool], FORMATS["hermes"])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_a_template_that_renders_tools_gets_them(text_codec) -> None:
    from dpu_gateway.textio import TextCodec

    codec = TextCodec.__new__(TextCodec)
    codec.template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}" \
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %};{% endfor %}"
    codec.renders_tools, codec.bos, codec.eos = True, "", ""
    msgs = [ChatMessage(role="assistant", tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]), ChatMessage(role="tool", tool_call_id="c",
                                                                                content="5 C")]
    out = codec.render_chat(msgs, False, [Tool("get_weather", "", {})])
    assert out == "[get_weather]assistantOslo;tool;"


@pytest.fixture(scope="module")
def text_codec():
    from dpu_gateway.textio import TextCodec

    return TextCodec(None)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("tools"), *ENGINE_FLAGS, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    yield stack
    stop_stack(stack)


def ask(stack: Stack, **kw):
    kw.setdefault("max_tokens", 64)
    kw.setdefault("messages", ASK)
    return sync_client(stack).chat.completions.create(model=MODEL, temperature=0, tools=[WEATHER, TIME], **kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_always_calls(real: Stack, choice) -> None:
    out = ask(real, tool_choice=choice, parallel_tool_calls=False).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_a_call_with_the_arguments_written(real: Stack, stream: bool) -> None:
    """As OpenAI: the call, its name, its arguments as far as the limit let them come (not JSON yet), finish
    ``length``; never the call format's raw text as content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    if not stream:
        out = ask(real, tool_choice=named, max_tokens=12).choices[0]
        assert out.finish_reason == "length" and out.message.content is None, out
        (call,) = out.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        calls: dict[int, dict] = {}
        finish, content = None, ""
        for chunk in ask(real, tool_choice=named, max_tokens=12, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and content == "" and list(calls) == [0], (finish, content, calls)
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    assert name == "get_weather"
    whole = ask(real, tool_choice=named).choices[0].message.tool_calls[0].function.arguments  # greedy: the same start
    assert json.loads(whole) and whole.startswith(arguments) and arguments != whole


def test_streamed_calls_assemble_as_openai_sends_them(real: Stack) -> None:
    stream = ask(real, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert "city" in json.loads(calls[0]["arguments"])


def test_auto_and_a_history_with_a_tool_result(real: Stack) -> None:
    first = ask(real, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    out = ask(real, messages=history, tool_choice="auto").choices[0]
    assert out.finish_reason in ("stop", "tool_calls", "length")
    assert out.message.content or out.message.tool_calls
    none = ask(real, tool_choice="none", max_tokens=8).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


def test_logprobs_with_tool_calls_is_refused(real: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(real, tool_choice="auto", logprobs=True)
    assert info.value.param == "logprobs"
