"""The Responses API end to end: the official ``openai`` client's ``responses`` calls against ``blink serve
--enable-auto-tool-choice --tool-call-parser hermes`` with the real CPU engine and the embedded model (one server
for the module). Each answer is compared with the chat endpoint's for the same messages: the Responses API is a
translation of a chat request, so greedy decoding gives the same tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from helpers.e2e import ENGINE_ENV, ENGINE_FLAGS, FRANCE, REAL_ENGINE, finished, sync_client, wait_for
from helpers.stack import MODEL, Stack, start_stack, stop_stack
from openai.types.responses import Response

QUESTION = FRANCE[0]["content"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("responses"), *ENGINE_FLAGS, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    yield stack
    stop_stack(stack)


def respond(stack: Stack, **kw) -> Response:
    kw.setdefault("input", QUESTION)
    kw.setdefault("max_output_tokens", 16)
    return sync_client(stack).responses.create(model=MODEL, temperature=0, **kw)


def chat(stack: Stack, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    kw.setdefault("max_tokens", 16)
    return sync_client(stack).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_answer_to_the_same_message(real: Stack) -> None:
    out = respond(real, metadata={"run": "e2e"}, user="someone")
    same = chat(real, FRANCE)
    assert out.output_text == same.choices[0].message.content and "Paris" in out.output_text
    assert out.status == "completed" and out.incomplete_details is None and out.error is None
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (
        same.usage.prompt_tokens, same.usage.completion_tokens, same.usage.total_tokens)
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert out.id.startswith("resp_") and out.model == MODEL and out.metadata == {"run": "e2e"}
    assert out.max_output_tokens == 16 and out.temperature == 0 and out.store is False
    Response.model_validate(out.model_dump())  # every field the client's type asks for is there


def test_instructions_are_a_system_message_first(real: Stack) -> None:
    system = "Answer in one word."
    out = respond(real, instructions=system)
    same = chat(real, [{"role": "system", "content": system}, *FRANCE])
    assert out.output_text == same.choices[0].message.content
    assert out.instructions == system and out.usage.input_tokens == same.usage.prompt_tokens
    items = respond(real, input=[{"role": "system", "content": system},
                                 {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == out.output_text


def test_a_stream_gives_the_same_text_and_ends_completed(real: Stack) -> None:
    whole = respond(real)
    with sync_client(real).responses.stream(model=MODEL, input=QUESTION, temperature=0,
                                            max_output_tokens=16) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.output_text == whole.output_text and final.status == "completed"
    counts = lambda u: (u.input_tokens, u.output_tokens, u.total_tokens)  # noqa: E731  (cached tokens may differ)
    assert counts(final.usage) == counts(whole.usage)
    raw = respond(real, stream=True)  # the plain stream of events, as the client types them
    kinds = [e.type for e in raw]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_max_output_tokens_cuts_the_answer_incomplete(real: Stack) -> None:
    out = respond(real, max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2 and out.output[0].status == "incomplete"
    assert out.output_text == chat(real, FRANCE, max_tokens=2).choices[0].message.content
    events = list(respond(real, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_json_schema_format_is_enforced(real: Stack) -> None:
    schema = {"type": "object", "required": ["city", "population"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    out = respond(real, text={"format": fmt}, max_output_tokens=64)
    value = json.loads(out.output_text)
    assert set(value) == {"city", "population"} and isinstance(value["city"], str) and len(value["city"]) <= 20
    assert isinstance(value["population"], int) and out.text.format.type == "json_schema"
    same = chat(real, FRANCE, max_tokens=64, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": schema, "strict": True}})
    assert out.output_text == same.choices[0].message.content
    assert json.loads(respond(real, text={"format": {"type": "json_object"}}, max_output_tokens=64).output_text) \
        is not None


def test_log_probs_are_chats(real: Stack) -> None:
    out = respond(real, include=["message.output_text.logprobs"], top_logprobs=2)
    same = chat(real, FRANCE, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    entries = out.output[0].content[0].logprobs
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries] == [
        (e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in same]


def test_a_forced_call_then_its_result_in_the_input(real: Stack) -> None:
    """A named tool choice gives a function_call item; sending it back with its output is answered as chat answers
    the same history (an assistant tool_calls message, then a tool message)."""
    first = respond(real, input=ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=64)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str) and first.output_text == ""
    same = chat(real, [{"role": "user", "content": ASK}], tools=[CHAT_WEATHER], max_tokens=64,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.arguments == same.choices[0].message.tool_calls[0].function.arguments

    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    answer = respond(real, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=24)
    assert answer.status in ("completed", "incomplete") and answer.output_text
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                                                                      "function": {"name": call.name,
                                                                                   "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}]
    same = chat(real, messages, tools=[CHAT_WEATHER], tool_choice="none", max_tokens=24)
    assert answer.output_text == same.choices[0].message.content
    assert answer.usage.input_tokens == same.usage.prompt_tokens


def test_streamed_calls_and_auto(real: Stack) -> None:
    with sync_client(real).responses.stream(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0,
                                            max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = [i for i in final.output if i.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments and json.loads(call.arguments)["city"]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    auto = respond(real, input=ASK, tools=[WEATHER], max_output_tokens=64)  # tool_choice auto: the parser reads it
    assert auto.tool_choice == "auto" and auto.output and auto.status in ("completed", "incomplete")


@pytest.mark.parametrize(("kw", "param"), [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}}},
     "text.format.pattern"),
    ({"tools": [{**WEATHER, "name": "has space"}], "tool_choice": "required"}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_x"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
])
def test_refused_fields_are_400_naming_them(real: Stack, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        respond(real, **kw)
    assert info.value.param == param


def test_a_client_that_leaves_mid_stream_cancels_its_request(real: Stack) -> None:
    aborted = finished(real, "abort")
    with sync_client(real).responses.create(model=MODEL, input="Count from 1 to 500, one number a line.",
                                            temperature=0, max_output_tokens=256, stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    wait_for(lambda: real.metric("blink:slots_in_use") == 0, 60)
    # freed because the client left (an abort), not because the output budget ran out
    assert finished(real, "abort") == aborted + 1
    assert respond(real, max_output_tokens=2).status == "incomplete"  # still serving
    counted = [line for line in real.get("/metrics")[1].decode().splitlines()
               if line.startswith("http_requests_total{") and 'handler="/v1/responses"' in line]
    assert counted and any('status="2xx"' in line for line in counted)  # by route, as every handler
