"""LangChain's ``ChatOpenAI`` against ``blink serve`` with the real CPU engine: ``bind_tools`` with a forced
call, and ``with_structured_output`` (JSON schema and tool calling), both parsed back by LangChain."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.e2e import ENGINE_ENV, ENGINE_FLAGS, REAL_ENGINE
from helpers.stack import MODEL, Stack, start_stack, stop_stack
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


class Weather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(description="the city")


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    stack: Stack = start_stack(tmp_path_factory.mktemp("langchain"), *ENGINE_FLAGS, "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes", engine_module=REAL_ENGINE, timeout_s=180,
                               env=ENGINE_ENV)
    yield langchain_openai.ChatOpenAI(model=MODEL, base_url=stack.url + "/v1", api_key="unused", temperature=0,
                                      max_tokens=64, max_retries=0, timeout=120)
    stop_stack(stack)


def test_bind_tools_with_a_forced_call(llm) -> None:
    msg = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "Weather" and isinstance(call["args"]["city"], str) and call["id"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method: str) -> None:
    person = llm.with_structured_output(Person, method=method).invoke("Describe a person: name and age.")
    assert isinstance(person, Person) and isinstance(person.age, int)
