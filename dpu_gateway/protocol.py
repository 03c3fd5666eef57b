"""OpenAI and vLLM request bodies as msgspec types: decoding a body validates it.

The rule: every field of OpenAI's and vLLM's request schemas is declared here and is either
honoured or refused with a 400 naming it (``param`` = the field). **Unknown fields are refused**
(a 400 naming the field, ``code = "unknown_field"``): a misspelt parameter must not be served as
if it were absent. vLLM logs and ignores them instead; ``docs/API.md`` lists this difference.

Fields Blink does not serve are declared loosely typed and listed in ``REFUSED`` with the value
that is a no-op (``tools: []``, ``response_format: {"type": "text"}``, ...); any other value is
refused with a message saying it is not supported. Range checks that msgspec constraints can state
are stated here; the rest are in ``dpu_gateway/params.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dpu_gateway.errors import APIError

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
MAX_N = 16  # choices per request (each is a ring slot)


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # refused when true (no padding field is sent)


class TextPart(_Body, tag_field="type", tag="text"):
    text: str


class ImagePart(_Body, tag_field="type", tag="image_url"):
    image_url: Any = None


class AudioPart(_Body, tag_field="type", tag="input_audio"):
    input_audio: Any = None


class FilePart(_Body, tag_field="type", tag="file"):
    file: Any = None


class RefusalPart(_Body, tag_field="type", tag="refusal"):
    refusal: str = ""


Part = TextPart | ImagePart | AudioPart | FilePart | RefusalPart


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list | None = None          # assistant history: rendered (dpu_gateway/tools.py)
    tool_call_id: str | None = None         # a tool result's call
    function_call: Any = None               # refused (the deprecated form of tool_calls)
    refusal: str | None = None              # assistant history: accepted, not rendered
    audio: Any = None                       # refused
    reasoning_content: str | None = None    # assistant history: given to the chat template (Qwen3's renders it)
    reasoning: str | None = None            # vLLM's newer name of reasoning_content (answers carry both)


class _Common(_Body, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    # vLLM's sampling extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: MinP | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=1)] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # not vLLM's -1 (the whole vocabulary)
    # declared so that they are refused by name (REFUSED says which values are a no-op)
    best_of: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    allowed_token_ids: list | None = None    # enforced as a one-state token table (structured.allowed_ids)
    bad_words: list | None = None            # enforced as a token automaton (structured.bad_words)
    logits_processors: list | None = None
    skip_special_tokens: bool | None = None  # false: special tokens' text is part of the answer
    spaces_between_special_tokens: bool | None = None  # either way no space is put between them (docs/API.md)
    response_format: dict | None = None      # enforced by constrained decoding (dpu_gateway/structured.py)
    guided_json: Any = None                  # enforced (a schema)
    guided_regex: Any = None                 # enforced (a regular expression, dpu_gateway/regex.py)
    guided_choice: list | None = None        # enforced (one of these strings)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    structured_outputs: Any = None           # enforced: json, regex, choice, json_object (structured.py)
    priority: int | None = None
    request_id: str | None = None            # the response's id (routes.response_id)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None     # served: prompt_token_ids and token_ids in the answer (respond.py)
    cache_salt: str | None = None           # requests share cached prefixes only with equal salts (params.py)
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    logprobs_mode: Any = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    echo: bool = False
    tools: list | None = None                # dpu_gateway/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    split_special_tokens: bool = False      # special-token text in messages stays text (dpu_gateway/textio.py)
    # OpenAI fields Blink does not serve
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None   # accepted: only meaningful with store
    prompt_cache_key: str | None = None      # accepted: no prefix cache to key
    safety_identifier: str | None = None     # accepted, like user
    # vLLM chat extensions (REFUSED lists those not served)
    continue_final_message: bool | None = None  # the prompt ends inside the last (assistant) message
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (dpu_tokenizer/chat.py)
    documents: list | None = None
    mm_processor_kwargs: dict | None = None
    include_reasoning: bool | None = None    # served with --reasoning-parser (routes.py); false refused without


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str | list[int]]  # one array type per union (msgspec)
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0: with echo, the prompt only (as vLLM)
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: Any = None


def _off(v: Any) -> bool:
    return v is None or v is False or v == [] or v == {}


_TOOLS = "the deprecated functions API is not supported; use tools and tool_choice"
_JSON = "this kind of structured output (context-free grammars, structural tags, whitespace patterns) is not " \
    "supported by this server; use structured_outputs' json, regex, choice or json_object, or response_format"
# field -> (is the value a no-op, why another value is refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_off, _TOOLS),
    "function_call": (lambda v: v in (None, "none"), _TOOLS),
    "guided_grammar": (_off, _JSON), "guided_decoding_backend": (_off, _JSON),
    "guided_whitespace_pattern": (_off, _JSON), "structural_tag": (_off, _JSON),
    "audio": (lambda v: v is None, "audio output is not supported"),  # any object asks for it ({} is invalid)
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is served"),
    "prediction": (_off, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),  # {} turns it on (OpenAI)
    "reasoning_effort": (_off, "no served chat template takes a reasoning effort (Qwen3's thinking is switched on "
                         "and off with chat_template_kwargs' enable_thinking)"),
    "verbosity": (_off, "verbosity is not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only the default service tier exists"),
    "store": (_off, "completions are not stored"),
    "best_of": (lambda v: v in (None, 1), "best_of is not supported (only 1)"),
    "use_beam_search": (_off, "beam search is not supported"),
    "length_penalty": (lambda v: v in (None, 1.0), "length_penalty applies to beam search, which is not supported"),
    "logits_processors": (_off, "custom logits processors are not supported"),
    "priority": (lambda v: v in (None, 0), "requests are served first come, first served (priority 0 only)"),
    "kv_transfer_params": (_off, "KV transfer is not supported"),
    "vllm_xargs": (_off, "vllm_xargs is not supported"),
    "logprobs_mode": (lambda v: v is None, "logprobs_mode is not supported (log-probs are of the raw logits)"),
    "chat_template": (lambda v: v is None, "a per-request chat template is not supported"),
    "documents": (_off, "documents are not supported"),
    "mm_processor_kwargs": (_off, "the served model takes text only"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
    "prompt_embeds": (_off, "prompt embeddings are not supported"),
}
_MESSAGE_REFUSED = {
    "function_call": _TOOLS,
    "audio": "audio input is not supported",
}
_PART_REFUSED = {ImagePart: "image", AudioPart: "audio", FilePart: "file"}


def refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def check_refused(req: _Common | ResponsesRequest, table: dict[str, tuple[Callable[[Any], bool], str]] | None = None
                  ) -> None:
    """400 naming the first field whose value Blink does not serve (of ``table``, the chat and completions'
    ``REFUSED`` unless given), and stream options without a stream."""
    for name, (noop, why) in (REFUSED if table is None else table).items():
        if hasattr(req, name) and not noop(getattr(req, name)):
            raise refuse(name, why)
    so = req.stream_options
    if so is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options",
                       code="invalid_value")
    if so is not None and so.include_obfuscation:
        raise refuse("stream_options.include_obfuscation", "stream obfuscation is not supported")
    if isinstance(req, ChatCompletionRequest):
        for i, msg in enumerate(req.messages):
            _check_message(i, msg)
        check_continue(req.messages, req.continue_final_message, req.add_generation_prompt)


def check_continue(messages: list[ChatMessage], continue_final: bool | None, add_generation_prompt: bool) -> None:
    """``continue_final_message`` (vLLM): the answer continues the last message, which must be the assistant's,
    so the prompt cannot also open a new one (``add_generation_prompt`` false, as vLLM requires)."""
    if not continue_final:
        return
    if add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                       "add_generation_prompt to false to continue the last message)", param="continue_final_message",
                       code="invalid_value")
    if not messages or messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message: the last message must be the assistant's (the answer continues "
                       "it)", param="continue_final_message", code="invalid_value")


def _check_message(i: int, msg: ChatMessage) -> None:
    for name, why in _MESSAGE_REFUSED.items():
        if not _off(getattr(msg, name)):
            raise refuse(f"messages[{i}].{name}", why)
    if msg.role == "tool" and msg.tool_call_id is None:
        raise APIError(400, f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                       param=f"messages[{i}].tool_call_id", code="invalid_value")
    if msg.tool_calls and msg.role != "assistant":
        raise APIError(400, f"messages[{i}].tool_calls: only assistant messages hold tool calls",
                       param=f"messages[{i}].tool_calls", code="invalid_value")
    if isinstance(msg.content, list):
        for j, part in enumerate(msg.content):
            kind = _PART_REFUSED.get(type(part))
            if kind is not None:
                raise refuse(f"messages[{i}].content[{j}]", f"{kind} content parts are not supported "
                             "(the served model takes text only)")


_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


class _AnyObject(msgspec.Struct):
    """Decodes any JSON object by skipping every field: a cheap pass that meets the nesting depth."""


_DEPTH_PROBE = msgspec.json.Decoder(_AnyObject)


def check_json_text(body: bytes) -> None:
    """400 for a body no JSON decoder should be handed: invalid UTF-8, or nesting past the recursion limit."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                           code="invalid_json") from None
    try:
        _DEPTH_PROBE.decode(body)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
    except msgspec.DecodeError:
        pass


_FLOAT_FOR_INT = re.compile(r"Expected `[^`]*\bint\b[^`]*`, got `float` - at `\$(?P<path>[^`]*)`")
_PATH_STEP = re.compile(r"\.(?P<name>[A-Za-z_]\w*)|\[(?P<index>\d+|\.\.\.)\]")
INTEGRAL_PASSES = 32  # integer fields holding integral floats mended in one body; past them the 400 stands


def _integral(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer()


def _int_at(node: Any, steps: list[str]) -> bool:
    """The integral float at `steps` below `node` (decoded JSON; a step is a field name, a list index, or "..." for
    any key of a mapping) made an int, in place, and so at every sibling path: an index or "..." stands for every
    item of that list or mapping, whose items share one type (one pass mends a field in every message, every
    prompt of a batch). False where nothing changed."""
    step, rest = steps[0], steps[1:]
    keys: list[Any]
    if isinstance(node, list) and step.isdigit():
        keys = list(range(len(node)))
    elif isinstance(node, dict) and step == "...":
        keys = list(node)
    elif isinstance(node, dict) and not step.isdigit():
        keys = [step] if step in node else []
    else:
        return False
    if rest:
        return any([_int_at(node[k], rest) for k in keys])  # noqa: C419  (every key walked)
    changed = False
    for k in keys:
        if _integral(node[k]):
            node[k] = int(node[k])
            changed = True
    return changed


def _strict_or_integral(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """The body decoded as it is. Where an integer field held a number with no fractional part (5.0), JSON Schema's
    `integer` admits it and so does vLLM's parsing (`"max_tokens": 5.0` is 5): that field, the one msgspec's error
    names, made an int and the body decoded again, field after field. Nothing else changes (an integral float in a
    free-form field, a schema's `"minimum": 1.0`, stays a float); a string or a fraction stays refused, with the
    error naming it."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        error = exc
    tree: Any = None
    for _ in range(INTEGRAL_PASSES):
        match = _FLOAT_FOR_INT.search(str(error))
        if match is None:
            break
        tree = msgspec.json.decode(body) if tree is None else tree  # parsed once; each pass validates the tree
        steps = [m.group("name") or m.group("index") for m in _PATH_STEP.finditer(match.group("path"))]
        if not steps or not _int_at(tree, steps):
            break
        try:
            return msgspec.convert(tree, type=decoder.type)
        except msgspec.ValidationError as exc:
            error = exc
    raise error


def _decode(decoder: msgspec.json.Decoder, body: bytes, refused: bool = True) -> Any:
    """One parse. A body that decodes is valid UTF-8 nested within the limit (msgspec checks every
    string it keeps, and every struct here refuses unknown fields rather than skip them), so
    `check_json_text` runs only when decoding failed; its 400s then come before the decoder's."""
    try:
        req = _strict_or_integral(decoder, body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        check_json_text(body)
        match = _UNKNOWN.search(str(exc)) if isinstance(exc, msgspec.ValidationError) else None
        if match is None:
            raise
        where = match.group(2) or ""
        param = f"{where}.{match.group(1)}" if where else match.group(1)
        raise APIError(400, f"Unknown field `{param}`: this server refuses fields it does not know "
                       "rather than ignore them", param=param, code="unknown_field") from None
    if refused:
        check_refused(req)
    return req


ChatDecoder = msgspec.json.Decoder(ChatCompletionRequest)
CompletionDecoder = msgspec.json.Decoder(CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(ChatDecoder, body)


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(CompletionDecoder, body)


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize`` body: a prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = None
    tools: list | None = None  # rendered into the prompt as chat completions do
    split_special_tokens: bool = False  # as in chat completions
    continue_final_message: bool | None = None  # as in chat completions
    chat_template_kwargs: dict[str, Any] | None = None  # as in chat completions


class DetokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    tokens: list[int]


_TokenizeDecoder = msgspec.json.Decoder(TokenizeRequest)
_DetokenizeDecoder = msgspec.json.Decoder(DetokenizeRequest)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    req = _decode(_TokenizeDecoder, body, refused=False)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt", code="invalid_value")
    if req.return_token_strs:
        raise refuse("return_token_strs", "token strings are not returned")
    for i, msg in enumerate(req.messages or []):
        _check_message(i, msg)
    if req.messages is not None:
        check_continue(req.messages, req.continue_final_message, req.add_generation_prompt)
    elif req.continue_final_message or req.chat_template_kwargs:
        param = "continue_final_message" if req.continue_final_message else "chat_template_kwargs"
        raise APIError(400, f"{param} applies to messages, not to a prompt", param=param, code="invalid_value")
    return req


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return _decode(_DetokenizeDecoder, body, refused=False)


# ---- the Responses API (POST /v1/responses; dpu_gateway/responses.py translates it to a chat request) ----


class InputText(_Body, tag_field="type", tag="input_text"):
    text: str


class OutputText(_Body, tag_field="type", tag="output_text"):
    """An earlier answer's text, sent back as history: its annotations and log-probs are not rendered."""

    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputImage(_Body, tag_field="type", tag="input_image"):
    image_url: Any = None
    file_id: Any = None
    detail: Any = None


class InputFile(_Body, tag_field="type", tag="input_file"):
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None


class InputAudio(_Body, tag_field="type", tag="input_audio"):
    input_audio: Any = None


class OutputRefusal(_Body, tag_field="type", tag="refusal"):
    refusal: str = ""


class ReasoningText(_Body, tag_field="type", tag="reasoning_text"):
    text: str


class SummaryText(_Body, tag_field="type", tag="summary_text"):
    text: str


InputPart = InputText | OutputText | InputImage | InputFile | InputAudio | OutputRefusal
RESPONSES_PART_REFUSED: dict[type, str] = {InputImage: "image", InputFile: "file", InputAudio: "audio"}


class InputItem(_Body):
    """One item of ``input``: a message (``type`` "message" or left out), an earlier function call
    (``function_call``), its result (``function_call_output``) or an earlier answer's reasoning (``reasoning``).
    Which fields each type takes is checked by ``dpu_gateway/responses.py``."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart | ReasoningText] | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[SummaryText] | None = None
    encrypted_content: str | None = None


class ReasoningParams(_Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of summary


class TextConfig(_Body):
    format: dict | None = None                # text, json_object or json_schema (responses.text_format)
    verbosity: str | None = None              # refused


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = None   # refused when true (no padding field is sent)


MetadataKey = Annotated[str, Meta(max_length=64)]
MetadataValue = Annotated[str, Meta(max_length=512)]


class ResponsesRequest(_Body, kw_only=True):
    """OpenAI's ``POST /v1/responses`` body, with vLLM's extensions; see docs/API.md (Responses API)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list | None = None                 # function tools (responses.chat_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Meta(max_length=16)] | None = None  # echoed
    user: str | None = None                   # accepted, as chat
    safety_identifier: str | None = None      # accepted, as chat
    prompt_cache_key: str | None = None       # accepted, as chat
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    include: list[str] | None = None          # message.output_text.logprobs only
    reasoning: ReasoningParams | None = None  # effort and summary refused (as chat's reasoning_effort)
    truncation: Literal["auto", "disabled"] | None = None  # auto refused
    store: bool | None = None                 # true refused: nothing is stored
    service_tier: str | None = None
    # vLLM's extensions that chat serves
    request_id: str | None = None
    cache_salt: str | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: MinP | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    priority: int | None = None
    # declared so that they are refused by name (RESPONSES_REFUSED)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    background_options: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    mm_processor_kwargs: dict | None = None
    enable_response_messages: bool | None = None
    previous_input_messages: list | None = None


_STORED = "this server keeps no responses: each request must carry its whole input"
RESPONSES_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_off, "responses are not stored (store must be false or left out)"),
    "previous_response_id": (lambda v: v is None, _STORED),
    "conversation": (lambda v: v is None, _STORED),
    "background": (_off, "background responses are not supported (nothing is stored to poll)"),
    "background_options": (lambda v: v is None, "background responses are not supported"),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported"),
    "max_tool_calls": (lambda v: v is None, "built-in tools are not served, so there is nothing to bound"),
    "context_management": (lambda v: v is None, "context management (compaction) is not supported"),
    "access_programs": (lambda v: v is None, "access programs are not supported"),
    "image": (lambda v: v is None, "image generation is not supported"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
    "prompt_cache_options": (lambda v: v is None, "prompt cache options are not supported"),
    "prompt_cache_retention": (lambda v: v is None, "prompt cache retention is not supported"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation \"auto\" is not supported: an input longer "
                   "than the context is refused, never cut"),
    "service_tier": REFUSED["service_tier"],
    "priority": REFUSED["priority"],
    "mm_processor_kwargs": REFUSED["mm_processor_kwargs"],
    "enable_response_messages": (_off, "response messages are not returned"),
    "previous_input_messages": (_off, _STORED),
}


def refused_fields(body: type) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """The table of fields declared only to be refused (with their no-op values) of a request type."""
    return RESPONSES_REFUSED if body is ResponsesRequest else REFUSED


ResponsesDecoder = msgspec.json.Decoder(ResponsesRequest)


def decode_responses(body: bytes) -> ResponsesRequest:
    req = _decode(ResponsesDecoder, body, refused=False)
    check_refused(req, RESPONSES_REFUSED)
    return req
