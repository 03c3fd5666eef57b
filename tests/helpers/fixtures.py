"""Pytest fixtures shared by the frontend test modules (import the ones a module uses)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from dpu_gateway.app import create_app
from dpu_gateway.state import GatewayConfig
from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.chat import load_chat_template, render_chat
from dpu_tokenizer.service import resolve_model
from helpers.stack import MODEL, Stack, start_stack, stop_stack

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def api_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One ``blink serve`` (fake engine, API key, 64 KiB body limit) for the API tests."""
    stack = start_stack(tmp_path_factory.mktemp("api"), "--num-slots", "96", "--max-body-bytes", "65536",
                        api_key=API_KEY)
    yield stack
    stop_stack(stack)


@contextlib.asynccontextmanager
async def gateway_without_engine(tmp_path: Path, **config: Any) -> AsyncIterator[TestClient]:
    """The real gateway app on a ring no engine has created (as while the weights load): what it answers before
    it needs an engine."""
    cfg = GatewayConfig(run_dir=tmp_path, ring_name=f"blink-absent-{uuid.uuid4().hex[:8]}", model=resolve_model(None),
                        served_model_name=MODEL, **config)
    client = TestClient(TestServer(create_app(cfg)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


class Text:
    """The real tokenizer of the default model, to compute what the fake engine must echo."""

    def __init__(self) -> None:
        self.tok = load_tokenizer(None)
        self.template = load_chat_template(None)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(render_chat(self.template, messages), add_special_tokens=False)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True)

    def echo(self, prompt: list[int], n: int | None = None) -> str:
        """What the fake engine answers: the prompt without its first token (n tokens of it)."""
        body = prompt[1:] if len(prompt) > 1 else prompt
        return self.tok.decode(body[:n] if n is not None else body)


@pytest.fixture(scope="session")
def text() -> Text:
    return Text()
