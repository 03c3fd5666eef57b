"""Structured output and forced tool calls through ``blink serve --backend persistent``: the grammar applied on the
device, end to end, with the official ``openai`` client and LangChain's ``ChatOpenAI``.

The model is a 2-layer Llama-3-shaped one with random fp32 weights and the real Llama-3 tokenizer (its chat
template; ``BLINK_TOKENIZER_ASSETS``, set by ``scripts/gpu_run.sh``). Random weights never choose to stop, so the
grammars here have finite languages (enums, booleans, a choice list, tool arguments of those): every answer
must end, parse and match its schema. 64 requests mixing json_schema, json_object, guided_choice, tool_choice
required and a named tool run at once over a KV cache small enough to preempt, prompts sharing a system
prompt (prefix cache hits); their greedy answers must be the CPU engine's on the same weights, token for
token. Marked gpu: skipped without CUDA.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel

from dpu_tokenizer.fetch_assets import default_assets_dir
from harness.models import build_model_folder
from harness.serve_proc import ServeProc

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
SERVED = "tiny"
SYSTEM = "You answer every question with structured data only. " * 4
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "indoor": {"type": "boolean"}},
       "required": ["kind", "indoor"], "additionalProperties": False}
LIGHT = {"type": "object", "properties": {"color": {"enum": ["red", "amber", "green"]},
                                          "blinking": {"type": "boolean"}, "state": {"type": "null"}},
         "required": ["color", "blinking", "state"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"enum": ["Paris", "Rome", "Oslo"]}},
                                             "required": ["city"], "additionalProperties": False}}}
CHOICES = ["yes", "no", "maybe later"]
COMMON = ("--dtype", "float32", "--served-model-name", SERVED, "--max-num-seqs", "32", "--kv-blocks", "48",
          "--block-size", "16", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--no-standby-engine")


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    indoor: bool


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        path = build_model_folder("tiny", default_assets_dir(), tmp_path_factory.mktemp("grammar_e2e"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    torch.manual_seed(6)
    transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path)).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def persistent(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    serve = ServeProc(("--backend", "persistent", "--model", str(folder), *COMMON),
                      tmp_path_factory.mktemp("grammar_persistent")).start(timeout_s=400)
    try:
        yield serve.url
    finally:
        assert serve.stop() == 0


def requests() -> list[tuple[str, dict]]:
    """64 (kind, request) pairs, greedy: chat with json_schema, json_object, a required or a named tool call;
    completions with guided_choice."""
    out: list[tuple[str, dict]] = []
    for k in range(64):
        ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {k}: describe it."}]
        chat = {"messages": ask, "max_tokens": 96, "temperature": 0}
        kind = ("pet", "light", "object", "required", "named", "choice")[k % 6]
        if kind in ("pet", "light"):
            schema = PET if kind == "pet" else LIGHT
            out.append((kind, {**chat, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": kind, "schema": schema}}}))
        elif kind == "object":
            out.append((kind, {**chat, "max_tokens": 8, "response_format": {"type": "json_object"}}))
        elif kind == "required":
            out.append((kind, {**chat, "tools": [WEATHER, TIME], "tool_choice": "required"}))
        elif kind == "named":
            out.append((kind, {**chat, "tools": [WEATHER, TIME],
                               "tool_choice": {"type": "function", "function": {"name": "get_time"}}}))
        else:
            out.append((kind, {"prompt": f"{SYSTEM} Question {k}: shall we?", "max_tokens": 16, "temperature": 0,
                               "extra_body": {"guided_choice": CHOICES}}))
    return out


async def ask_all(url: str) -> list[tuple[str, str, str]]:
    """Each request's (kind, answer, finish reason): the content, the tool call as `name(arguments)`, or the
    completion's text; all 64 in flight at once."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(kind: str, req: dict) -> tuple[str, str, str]:
        if kind == "choice":
            c = (await client.completions.create(model=SERVED, **req)).choices[0]
            return kind, c.text, c.finish_reason
        ch = (await client.chat.completions.create(model=SERVED, **req)).choices[0]
        calls = ch.message.tool_calls or []
        answer = "".join(f"{c.function.name}({c.function.arguments})" for c in calls) or ch.message.content or ""
        return kind, answer, ch.finish_reason

    try:
        return list(await asyncio.gather(*(one(kind, req) for kind, req in requests())))
    finally:
        await client.close()


def check_answer(kind: str, answer: str, reason: str) -> None:
    """Every answer complete and of its schema."""
    if kind == "choice":
        assert answer in CHOICES and reason == "stop", (answer, reason)
        return
    if kind in ("required", "named"):
        # a required call may be followed by more (parallel calls): random weights go on calling to the limit
        m = re.match(r"(get_weather|get_time)\((\{[^)]*\})\)", answer)
        assert m and (reason == "tool_calls" or (kind == "required" and reason == "length")), (answer, reason)
        args = json.loads(m.group(2))
        assert args["city"] in ("Paris", "Rome", "Oslo"), answer
        if kind == "named":
            assert m.group(1) == "get_time" and set(args) == {"city"}, answer
        else:
            assert m.group(1) == "get_time" or args["unit"] in ("c", "f"), answer
        return
    if kind == "object":  # any JSON object: random weights may not close one within 8 tokens
        assert reason in ("stop", "length") and answer.startswith("{"), (answer, reason)
        if reason == "stop":
            assert isinstance(json.loads(answer), dict)
        return
    value = json.loads(answer)
    assert reason == "stop", (answer, reason)
    if kind == "pet":
        Pet.model_validate(value)
    else:
        assert value["color"] in ("red", "amber", "green") and isinstance(value["blinking"], bool), value
        assert value["state"] is None and set(value) == {"color", "blinking", "state"}


def test_64_constrained_requests_match_the_cpu_engine_and_their_schemas(
        folder: Path, persistent: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    got = asyncio.run(ask_all(persistent))
    for kind, answer, reason in got:
        check_answer(kind, answer, reason)
    metrics = openai.OpenAI(base_url=persistent, api_key="unused").get("/metrics", cast_to=str)
    hits = [float(v) for v in re.findall(r'^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$', metrics, re.M)]
    preempted = [float(v) for v in re.findall(r'^vllm:num_preemptions_total\{[^}]*\} (\S+)$', metrics, re.M)]
    assert sum(hits) > 0 and sum(preempted) > 0, (hits, preempted)
    cpu = ServeProc(("--backend", "cpu", "--model", str(folder), *COMMON),
                    tmp_path_factory.mktemp("grammar_cpu")).start(timeout_s=300)
    try:
        want = asyncio.run(ask_all(cpu.url))
    finally:
        assert cpu.stop() == 0
    diff = [k for k, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    examples = [(got[k], want[k]) for k in diff[:3]]
    assert not diff, f"{len(diff)} of 64 answers differ from the CPU engine's, e.g. {examples}"


def test_langchain_structured_output_and_a_forced_tool(persistent: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=SERVED, base_url=persistent + "/v1", api_key="unused", temperature=0,
                                      max_tokens=64, max_retries=0, timeout=120)
    for method in ("json_schema", "function_calling"):
        pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
        assert isinstance(pet, Pet), method
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
