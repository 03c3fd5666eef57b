"""The Responses API (``POST /v1/responses``, ``dpu_gateway/responses.py``) without an engine: a request's
translation to the chat request that asks for the same output, the 400 naming each field that is not served,
and the response object and stream events built by the gateway's own code from real token ids, each validated
as the ``openai`` client's typed models."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pydantic
import pytest
from aiohttp.test_utils import TestClient
from helpers.fixtures import gateway_without_engine
from helpers.stack import MODEL
from openai.types.responses import Response, ResponseStreamEvent

from dpu_gateway import reasoning as R
from dpu_gateway import responses as api
from dpu_gateway.backend import Backend, RequestStream
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation
from dpu_gateway.params import Plan
from dpu_gateway.protocol import ChatMessage, TextPart, decode_responses
from dpu_gateway.respond import CHAT, Shape, Usage
from dpu_gateway.textio import TextCodec, message_text
from dpu_gateway.tools import FORMATS
from shared import messages as m
from shared import ring_layout as L
from shared.metrics import FrontendMetrics

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def decode(**fields) -> api.ResponsesRequest:
    return decode_responses(msgspec.json.encode({"model": MODEL, "input": "hi", **fields}))


def plain(messages: list[ChatMessage]) -> list[tuple]:
    """Messages as (role, text, calls, tool_call_id, name, reasoning) to compare."""
    return [(msg.role, message_text(msg), msg.tool_calls, msg.tool_call_id, msg.name, msg.reasoning_content)
            for msg in messages]


# ----------------------------------------------------------------------- the request
def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat = api.chat_request(decode(input="What is 2+2?", instructions="Be brief.", max_output_tokens=7,
                                   temperature=0, top_p=0.5, user="u1", metadata={"k": "v"}))
    assert plain(chat.messages) == [("system", "Be brief.", None, None, None, None),
                                    ("user", "What is 2+2?", None, None, None, None)]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.user) == (7, 0, 0.5, "u1")
    assert chat.response_format is None and chat.tools is None and not chat.logprobs


def test_a_reasoning_item_no_answer_follows_is_a_turn_of_reasoning_alone() -> None:
    """The usual loop sends a cut answer's output back as history: a reasoning item, then the user's next message
    (or another reasoning item); each such item is an assistant turn of its reasoning, none is dropped."""
    think = lambda text: {"type": "reasoning", "summary": [], "status": "incomplete",  # noqa: E731
                          "content": [{"type": "reasoning_text", "text": text}]}
    items = [{"role": "user", "content": "a"}, think("One."), {"role": "user", "content": "b"}, think("Two."),
             think("Three."), {"role": "assistant", "content": "c"}, think("Four.")]
    assert plain(api.chat_request(decode(input=items)).messages) == [
        ("user", "a", None, None, None, None), ("assistant", "", None, None, None, "One."),
        ("user", "b", None, None, None, None), ("assistant", "", None, None, None, "Two."),
        ("assistant", "c", None, None, None, "Three."), ("assistant", "", None, None, None, "Four.")]


def test_input_items_become_the_chat_history() -> None:
    """Parts join as chat's text parts do; calls in a row are one assistant turn (after its text); a call's output
    is a tool message naming the call (and its function); a reasoning item is the next assistant turn's."""
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use "}, {"type": "input_text",
                                                                                   "text": "tools."}]},
        {"type": "message", "role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "id": "fc_2", "call_id": "call_b", "name": "weather",
         "arguments": '{"city": "Rome"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_a", "output": "5 C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20 C"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Oslo 5, Rome 20.", "annotations": [], "logprobs": []}]},
        {"role": "assistant", "content": "Anything else?"},
        {"type": "function_call", "call_id": "call_c", "name": "weather", "arguments": "{}"},
    ]
    chat = api.chat_request(decode(input=items))
    call = lambda cid, args: {"id": cid, "type": "function",  # noqa: E731
                              "function": {"name": "weather", "arguments": args}}
    assert plain(chat.messages) == [
        ("developer", "Use tools.", None, None, None, None),
        ("user", "Weather in Oslo and Rome?", None, None, None, None),
        ("assistant", "", [call("call_a", '{"city": "Oslo"}'), call("call_b", '{"city": "Rome"}')], None, None,
         "Two."),
        ("tool", "5 C", None, "call_a", "weather", None),
        ("tool", "20 C", None, "call_b", "weather", None),
        ("assistant", "Oslo 5, Rome 20.", None, None, None, None),
        ("assistant", "Anything else?", [call("call_c", "{}")], None, None, None),
    ]
    assert isinstance(chat.messages[0].content, list) and all(isinstance(p, TextPart)
                                                               for p in chat.messages[0].content)


def test_tools_choice_format_and_log_probs_become_chats() -> None:
    tool = {"type": "function", "name": "weather", "description": "Now.", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = api.chat_request(decode(tools=[tool], tool_choice={"type": "function", "name": "weather"},
                                   parallel_tool_calls=False, include=[api.LOGPROBS], top_logprobs=3,
                                   text={"format": {"type": "json_schema", "name": "x", "schema": schema,
                                                    "strict": True}}))
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert chat.parallel_tool_calls is False and chat.logprobs and chat.top_logprobs == 3
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": True}}
    for given in ("auto", "none", "required"):
        assert api.chat_request(decode(tools=[tool], tool_choice=given)).tool_choice == given
    assert api.chat_request(decode(text={"format": {"type": "json_object"}})).response_format == {
        "type": "json_object"}
    assert api.chat_request(decode(text={"format": {"type": "text"}})).response_format == {"type": "text"}


REFUSED = [  # fields of the request, and the param the 400 names
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"priority": 1}, "priority"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"include": [api.LOGPROBS, "file_search_call.results"]}, "include[1]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "mcp", "server_label": "x"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {}}}, "text.format.type"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_file", "file_id": "f"}]}]}, "input[0].content[1]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a", "call_id": "c"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"role": "assistant", "content": "a"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
                {"role": "assistant", "content": "a"}]}, "input[0].summary"),
    ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "a", "bogus": 1}]}, "input[0].bogus"),
    ({"text": {"format": {"type": "text"}, "bogus": 1}}, "text.bogus"),
    ({"not_a_field": 1}, "not_a_field"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_each_field_not_served_is_a_400_naming_it(fields: dict, param: str) -> None:
    with pytest.raises((APIError, msgspec.ValidationError)) as info:
        api.chat_request(decode(**fields))
    if isinstance(info.value, APIError):
        assert (info.value.status, info.value.param) == (400, param), info.value.message
    else:  # a type or range error: the middleware answers it as a 400 naming the path
        assert f"`$.{param}`" in str(info.value)


@pytest.mark.parametrize(("chat", "ours"), [
    ("response_format", "text.format"), ("response_format.json_schema", "text.format"),
    ("response_format.json_schema.schema", "text.format.schema"), ("response_format.multipleOf",
                                                                   "text.format.multipleOf"),
    ("max_completion_tokens", "max_output_tokens"), ("logprobs", "include"), ("messages", "input"),
    ("messages[3].tool_calls[0].function.arguments", "input"),
    ("tools[2].function.name", "tools[2].name"), ("tools[0].function.parameters", "tools[0].parameters"),
    ("tool_choice", "tool_choice"), ("stop", "stop"), ("request_id", "request_id"),
])
def test_a_chat_400_names_the_responses_field(chat: str, ours: str) -> None:
    assert api.api_name(chat) == ours
    with pytest.raises(APIError) as info, api.api_names():
        raise APIError(400, f"{chat}: why", param=chat, code="invalid_value")
    assert (info.value.param, info.value.message) == (ours, f"{ours}: why")


def test_a_chat_400_that_does_not_lead_with_the_field_keeps_its_words() -> None:
    why = "logprobs are not returned for answers read as tool calls"
    with pytest.raises(APIError) as info, api.api_names():
        raise APIError(400, why, param="logprobs", code="invalid_value")
    assert (info.value.param, info.value.message) == ("include", why)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[TestClient]:
    """The real gateway app, its engine not up: a request is refused before it needs one."""
    async with gateway_without_engine(tmp_path) as client:
        yield client


async def test_the_route_answers_refusals_as_openai_errors(gateway: TestClient) -> None:
    for fields, param in REFUSED[:6] + REFUSED[-3:]:
        resp = await gateway.post("/v1/responses", json={"model": MODEL, "input": "hi", **fields})
        body = await resp.json()
        assert resp.status == 400 and body["error"]["param"] == param, body
    resp = await gateway.post("/v1/responses", json={"model": "other", "input": "hi"})
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
    resp = await gateway.post("/v1/responses", json={"model": MODEL, "input": "hi"})  # served, but no engine
    assert resp.status == 503


# ----------------------------------------------------------------------- the answer, from real token ids
def answer(codec: TextCodec, text: str, stream: bool, reasoning: R.Reasoning | None = None, tool: bool = False,
           finish: L.FinishReason = L.FinishReason.EOS, logprobs: bool = False, **request) -> dict | list[dict]:
    """The gateway's Responses code for one choice whose engine output is ``text``'s token ids (one event a
    token, then ``finish``): the response object, or the stream's events."""
    async def go() -> dict | list[dict]:
        backend, stream_ = Backend(Path("/nonexistent")), RequestStream(req_id=1)
        plan = Plan(m.Sampling(max_new_tokens=64, logprobs=logprobs, top_logprobs=1 if logprobs else 0), [],
                    tool_format=FORMATS["hermes"] if tool else None)
        gen = Generation(codec, plan, backend, stream_, FrontendMetrics(MODEL), 0.0, 3)
        ids = codec.tokenizer.encode(text)
        for t in ids:
            stream_.events.put_nowait(m.Tokens(req_id=1, ids=[t], logprobs=[-0.5] if logprobs else None,
                                               top=[[(t, -0.5)]] if logprobs else None))
        stream_.events.put_nowait(m.Finished(req_id=1, reason=finish, error=0, generated=len(ids), prompt_len=3))
        shape: Shape = CHAT if reasoning is None else dataclasses.replace(CHAT, reasoning=reasoning)
        reply = api.Reply.of(decode(**request), MODEL, None)
        usage = Usage([gen], 3)
        if not stream:
            resp = await reply.whole(gen, shape, codec, usage)
            return json.loads(resp.body)
        events: list[dict] = []

        async def write(kind: str, obj: dict) -> None:
            assert obj["type"] == kind
            events.append(obj)
        writer = api.EventWriter(reply, write, trim=tool)
        await writer.start()
        await api.stream_choices([gen], shape, codec, api.fmt.Envelope(reply.id, 0, MODEL), usage, writer.chunk)
        await writer.finish(api.usage_of(usage.total()))
        return events
    return asyncio.run(go())


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(None)  # type: ignore[arg-type]


CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
CASES = {  # name: (engine text, answer kwargs, the output items' types, output_text)
    "text": ("Paris is the capital.", {}, ["message"], "Paris is the capital."),
    "cut": ("Paris is", {"finish": L.FinishReason.LENGTH}, ["message"], "Paris is"),
    "logprobs": ("Paris.", {"logprobs": True, "include": [api.LOGPROBS], "top_logprobs": 1}, ["message"], "Paris."),
    "reasoning": ("<think>France, so Paris.</think>Paris.", {"reasoning": R.Reasoning("qwen3")},
                  ["reasoning", "message"], "Paris."),
    "only reasoning": ("<think>Still thinking", {"reasoning": R.Reasoning("qwen3"), "finish": L.FinishReason.LENGTH},
                       ["reasoning"], ""),  # as OpenAI: a reasoning cut by the budget, no message
    "call": (f"Let me look.\n{CALL}", {"tool": True, "tools": [TOOL]}, ["message", "function_call"], "Let me look."),
    "two calls": (f"{CALL}\n{CALL}", {"tool": True, "tools": [TOOL]}, ["function_call", "function_call"], ""),
    "nothing": ("", {}, ["message"], ""),
    "nothing, with tools": ("", {"tool": True, "tools": [TOOL]}, ["message"], ""),
    "white space, with tools": ("  \n", {"tool": True, "tools": [TOOL]}, ["message"], ""),
    "cancelled": ("Paris is", {"finish": L.FinishReason.CANCELLED}, ["message"], "Paris is"),
}


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("case", list(CASES))
def test_whole_and_streamed_answers_are_openai_responses(codec: TextCodec, case: str) -> None:
    """The response object validates as the client's ``Response`` and gives ``output_text``; every event validates
    as a ``ResponseStreamEvent``, in order (sequence numbers from 0, each item added before its deltas and done
    after them), the deltas join to the text, and the last event's response has the whole answer's items."""
    text, kw, kinds, output_text = CASES[case]
    body = answer(codec, text, stream=False, **kw)
    assert isinstance(body, dict)
    whole = Response.model_validate(body)
    assert [item.type for item in whole.output] == kinds and whole.output_text == output_text
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.store is False
    cut = kw.get("finish") == L.FinishReason.LENGTH
    cancelled = kw.get("finish") == L.FinishReason.CANCELLED  # the engine ended it (a shutdown): not a whole answer
    assert whole.status == ("incomplete" if cut else "failed" if cancelled else "completed")
    assert (whole.error.code if cancelled else whole.error) == ("server_error" if cancelled else None)
    assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == ("max_output_tokens" if cut
                                                                                       else None)
    assert whole.usage.output_tokens == len(codec.tokenizer.encode(text)) and whole.usage.input_tokens == 3
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    for item in whole.output:
        assert item.id.startswith({"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[item.type])
        if item.type == "function_call":
            assert (item.name, json.loads(item.arguments), item.call_id[:5]) == ("weather", {"city": "Oslo"}, "call_")

    events = answer(codec, text, stream=True, **kw)
    assert isinstance(events, list)
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed[:2]] == ["response.created", "response.in_progress"]
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    last = parsed[-1]
    assert last.type == ("response.incomplete" if cut else "response.failed" if cancelled else "response.completed")
    assert without_ids([i.model_dump() for i in last.response.output]) == without_ids(
        [i.model_dump() for i in whole.output])
    assert last.response.output_text == output_text and last.response.usage == whole.usage
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == output_text
    added = {e.output_index: e.item.id for e in parsed if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in parsed if e.type == "response.output_item.done"}
    assert list(added) == list(done) == list(range(len(kinds)))
    assert [added[i] for i in added] == [done[i].id for i in done] == [i.id for i in last.response.output]
    for e in parsed:
        if hasattr(e, "item_id"):
            opened = [ev.sequence_number for ev in parsed if ev.type == "response.output_item.added"
                      and ev.output_index == e.output_index]
            closed = [ev.sequence_number for ev in parsed if ev.type == "response.output_item.done"
                      and ev.output_index == e.output_index]
            assert opened[0] < e.sequence_number < closed[0] and added[e.output_index] == e.item_id
    if case == "logprobs":
        entries = whole.output[0].content[0].logprobs
        assert len(entries) == whole.usage.output_tokens and all(e.logprob == -0.5 for e in entries)
        streamed = [lp for e in parsed if e.type == "response.output_text.delta" for lp in e.logprobs]
        assert [lp.token for lp in streamed] == [e.token for e in entries]
    if "reasoning" in case:
        thought = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
        assert thought == whole.output[0].content[0].text == text.removeprefix("<think>").split("</think>")[0]


def test_an_engine_error_mid_stream_is_a_failed_response(codec: TextCodec) -> None:
    async def go() -> list[dict]:
        backend, stream_ = Backend(Path("/nonexistent")), RequestStream(req_id=1)
        gen = Generation(codec, Plan(m.Sampling(max_new_tokens=8), []), backend, stream_, FrontendMetrics(MODEL),
                         0.0, 3)
        stream_.events.put_nowait(m.Tokens(req_id=1, ids=codec.tokenizer.encode("Hello")))
        stream_.events.put_nowait(m.Finished(req_id=1, reason=L.FinishReason.ERROR,
                                             error=int(L.ErrorCode.ENGINE_FAILURE), generated=1, prompt_len=3))
        reply = api.Reply.of(decode(), MODEL, "abc")
        events: list[dict] = []

        async def write(kind: str, obj: dict) -> None:
            events.append(obj)
        writer = api.EventWriter(reply, write)
        await writer.start()
        try:
            await api.stream_choices([gen], CHAT, codec, api.fmt.Envelope(reply.id, 0, MODEL), Usage([gen], 3),
                                     writer.chunk)
        except APIError as exc:
            await writer.failed(exc)
        return events

    events = [EVENT.validate_python(e) for e in asyncio.run(go())]
    assert events[-1].type == "response.failed" and events[-1].response.id == "resp_abc"
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert "output_text.delta" in {e.type.removeprefix("response.") for e in events}
