"""OpenAI request bodies as msgspec types: decoding a body validates it.

Unknown fields are ignored (clients send many optional ones). Range checks that msgspec
constraints can state are stated here; the rest are in ``dpu_gateway/params.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: dict


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions (as in vLLM)
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: MinP | None = None
    ignore_eos: bool = False


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str | list[int]]  # one array type per union (msgspec)
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


ChatDecoder = msgspec.json.Decoder(ChatCompletionRequest)
CompletionDecoder = msgspec.json.Decoder(CompletionRequest)
