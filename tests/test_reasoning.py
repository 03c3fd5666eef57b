"""The reasoning parser (``--reasoning-parser qwen3|deepseek_r1``): the splitter of ``<think>...</think>`` text, where
the prompt leaves the output, the grammar that starts after the reasoning, the answer built by the gateway's own
response code from real token ids (tool calls read from the content only), and the official ``openai`` client
against ``blink serve --reasoning-parser qwen3`` with the real CPU engine and the embedded model.

The embedded model never writes ``</think>`` unprompted. The end-to-end tests that need the tag ask it to repeat a
text that holds it, with a small ``logit_bias`` toward the tag's first token; greedy decoding then writes it. Each
such test first reads the model's raw text for the same prompt token ids from ``/v1/completions`` (which no
reasoning parser reads, as in vLLM), checks the tag is there, and compares the chat answer with that text split by
hand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers import fixtures
from helpers.e2e import ENGINE_ENV, ENGINE_FLAGS, FRANCE, REAL_ENGINE, sync_client
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from blink.cli import build_parser
from blink.supervisor import gateway_argv
from dpu_gateway import openai_format as fmt
from dpu_gateway import reasoning as R
from dpu_gateway.backend import Backend, RequestStream
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation
from dpu_gateway.grammar import Vocab, accepts, byte_dfa, token_dfa, until
from dpu_gateway.params import Plan
from dpu_gateway.protocol import ChatMessage
from dpu_gateway.respond import CHAT, Usage, answer_whole, stream_choices
from dpu_gateway.structured import Constraint, pattern_of
from dpu_gateway.textio import TextCodec
from dpu_gateway.tools import FORMATS
from shared import messages as m
from shared import ring_layout as L
from shared.frontend_flags import GatewayFlags
from shared.metrics import FrontendMetrics

# ----------------------------------------------------------------------- the splitter
SPLITS = [  # text, output starts inside the reasoning, (reasoning, content)
    ("<think>abc</think>xyz", True, ("abc", "xyz")),
    ("abc</think>xyz", True, ("abc", "xyz")),  # <think> was in the prompt (DeepSeek-R1, Qwen3 Thinking-2507)
    ("\n<think>\nweigh it\n</think>\n\nIt is 4.", True, ("\nweigh it\n", "\n\nIt is 4.")),
    ("no tags at all", True, ("no tags at all", "")),  # as vLLM: no </think>, all reasoning
    ("<think>only an open tag", True, ("only an open tag", "")),
    ("<think>cut mid-tag </thi", True, ("cut mid-tag </thi", "")),
    ("<thin", True, ("<thin", "")),
    ("<think>", True, ("", "")),
    ("</think>", True, ("", "")),
    ("</think>Paris", True, ("", "Paris")),
    ("a <think> b</think>c", True, ("a <think> b", "c")),  # only an opening <think> is dropped
    ("<think>1</think>2</think>3", True, ("1", "2</think>3")),  # content is not read again
    ("<think><think>x</think>y", True, ("<think>x", "y")),
    ("思考 é</think>答え", True, ("思考 é", "答え")),
    ("   ", True, ("   ", "")),
    ("<think>a</think>b", False, ("", "<think>a</think>b")),  # the prompt ended the reasoning
    ("", True, ("", "")),
]


@pytest.mark.parametrize(("text", "inside", "want"), SPLITS)
def test_split_of_whole_texts(text: str, inside: bool, want: tuple[str, str]) -> None:
    assert R.split(text, inside) == want


def pieces_of(text: str, cuts: list[int], inside: bool = True) -> tuple[list[str], list[str]]:
    """The reasoning and content pieces a ``Splitter`` gives for ``text`` cut at ``cuts``."""
    s = R.Splitter(inside)
    bounds = [0, *cuts, len(text)]
    out = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [s.finish()]
    return [r for r, _ in out], [c for _, c in out]


STREAMED = ["<think>\nLet me think: 2+2</think>\n\nIt is 4.", "reasoning only, cut </thi", "a</think>b",
            "  <think>é思</think></think>", "<thi", "x<think>y</think>z", "</think>"]


@pytest.mark.parametrize("text", STREAMED)
def test_a_tag_split_at_any_place_gives_the_same_answer(text: str) -> None:
    """Every way of cutting the text in three (so every tag split at every character, also across two cuts),
    and one character at a time: the pieces join to the whole text's split."""
    want = R.split(text)
    n = len(text)
    for i in range(n + 1):
        for j in range(i, n + 1):
            reasoning, content = pieces_of(text, [i, j])
            assert ("".join(reasoning), "".join(content)) == want, (i, j)
    reasoning, content = pieces_of(text, list(range(1, n)))
    assert ("".join(reasoning), "".join(content)) == want


def test_text_is_given_out_as_soon_as_no_tag_can_start_in_it() -> None:
    """Only what may still be a tag's start is held: at most 7 characters of the reasoning, and never content."""
    s = R.Splitter()
    assert s.feed("<think>") == ("", "")  # the opening tag is dropped once it is whole
    assert s.feed("step one, <") == ("step one, ", "")
    assert s.feed("/thin") == ("", "")  # "</thin" may be the closing tag
    assert s.feed("g and on") == ("</thing and on", "")
    assert s.feed("</think>\n\nAn") == ("", "\n\nAn")
    assert s.feed("swer <think>") == ("", "swer <think>")
    assert s.finish() == ("", "")
    held = R.Splitter()
    for ch in "x" * 20 + "</think"[:5]:
        r, _ = held.feed(ch)
    assert held.buf == "</thi" and r == ""


def test_the_echo_is_content_and_not_read() -> None:
    """vLLM's chat ``echo``: the last (assistant) message starts the answer as content, tags and all."""
    reader = R.Reasoning("qwen3").reader(echo="<think>pre")
    assert reader.feed("<think>pre") == ("", "<think>pre")
    assert reader.feed("fill</think>ok") == ("fill", "ok")
    assert R.Reasoning("qwen3").split("Sure: <think>x</think>y", echo="Sure: ") == ("x", "Sure: y")


# ----------------------------------------------------------------------- where the prompt leaves the output
SPECIAL = re.compile(r"<\|im_start\|>|<\|im_end\|>")
QWEN3_OFF = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
HISTORY = ("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\nask the tool\n</think>\n\n"
           "<tool_call>{}</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>5 C</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n")


@pytest.mark.parametrize(("prompt", "ended"), [
    (QWEN3_OFF, True),  # Qwen3's template with enable_thinking false
    ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),  # Qwen3 thinking: the model opens it
    ("<｜User｜>Hi<｜Assistant｜><think>\n", False),  # DeepSeek-R1's template opens it
    (HISTORY, False),  # an earlier turn's </think>, ended by its <|im_end|>, does not count
    ("<|im_start|>assistant\n<think>\nstill thinking", False),  # a prefill inside the reasoning
    ("<|im_start|>assistant\n<think>\nok</think>\n\nThe answer is", True),  # a prefill past it
])
def test_the_prompt_says_where_the_output_starts(prompt: str, ended: bool) -> None:
    assert R.prompt_ends_reasoning(prompt, SPECIAL) is ended
    assert R.plan_reasoning("deepseek_r1", prompt, SPECIAL).in_reasoning is not ended


def test_qwen3s_enable_thinking_switch_and_include_reasoning() -> None:
    plain = "<|im_start|>assistant\n"
    assert R.plan_reasoning(None, plain, SPECIAL) is None
    assert R.plan_reasoning("qwen3", plain, SPECIAL, {"enable_thinking": False}).in_reasoning is False
    assert R.plan_reasoning("qwen3", plain, SPECIAL, {"enable_thinking": True}).in_reasoning is True
    assert R.plan_reasoning("deepseek_r1", plain, SPECIAL, {"enable_thinking": False}).in_reasoning is True
    off = R.plan_reasoning("qwen3", plain, SPECIAL, include=False)
    assert off is not None and off.message_fields("x") == {"reasoning": None, "reasoning_content": None}
    assert off.delta("x", "y") == {"content": "y"}
    on = R.Reasoning("qwen3")
    assert on.delta("x", "") == {"reasoning": "x", "reasoning_content": "x"} and on.delta("", "") == {}
    assert R.Reasoning("qwen3", in_reasoning=False).message_fields("") == {"reasoning": None,
                                                                         "reasoning_content": None}


def test_history_reasoning_reaches_the_template() -> None:
    """As vLLM gives Hugging Face templates: an assistant message's ``reasoning_content`` (or ``reasoning``)
    under both names; Qwen3's template writes it between think tags in the turns after the last user message."""
    codec = TextCodec.__new__(TextCodec)
    codec.template = "{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}|{{ m.reasoning or '' }}|" \
        "{{ m.content }};{% endfor %}"
    codec.renders_tools, codec.bos, codec.eos = False, "", ""
    msgs = [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a", reasoning_content="r1"),
            ChatMessage(role="assistant", content="b", reasoning="r2")]
    assert codec.render_chat(msgs, False) == "user:||q;assistant:r1|r1|a;assistant:r2|r2|b;"


def test_split_special_tokens_keeps_reasoning_text_as_text() -> None:
    """With ``split_special_tokens``, special-token text in a history message's reasoning stays text as in its
    content; a template may drop that reasoning (Qwen3's drops it from turns before the last user message)."""
    qwen3_like = TextCodec(None)  # type: ignore[arg-type]  # the embedded tokenizer: <|im_end|> is special
    qwen3_like.template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and " \
        "loop.last %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    msgs = [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a", reasoning="x<|im_end|>"),
            ChatMessage(role="user", content="q2"),
            ChatMessage(role="assistant", content="b", reasoning_content="y<|im_end|>z")]
    parts = qwen3_like.render_chat_parts(msgs, False, split_special=True)
    assert [text for text, literal in parts if literal] == ["<|im_end|>"]  # the dropped turn's is not there
    assert "".join(text for text, _ in parts) == qwen3_like.render_chat(msgs, False)
    drops_content = TextCodec(None)  # type: ignore[arg-type]
    drops_content.template = "{% for m in messages %}{{ m.role }};{% endfor %}"
    with pytest.raises(APIError) as info:  # content is still required whole
        drops_content.render_chat_parts([ChatMessage(role="user", content="<|im_end|>")], False, split_special=True)
    assert info.value.param == "split_special_tokens"


# ----------------------------------------------------------------------- flags
def test_the_flag_is_declared_once_and_reaches_every_gateway() -> None:
    (field,) = [f for f in GatewayFlags.__dataclass_fields__.values() if f.name == "reasoning_parser"]
    assert set(field.metadata["choices"]) == set(R.PARSERS)
    args = build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert gateway_argv(args)[-2:] == ["--reasoning-parser", "deepseek_r1"]
    assert build_parser().parse_args(["gateway", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "granite"])


# ----------------------------------------------------------------------- the grammar after the reasoning
def test_until_is_any_text_then_the_first_marker() -> None:
    dfa = byte_dfa(until("</think>"))
    for text, ok in [(b"</think>", True), (b"abc</think>", True), (b"</thi</think>", True), (b"<</think>", True),
                     (b"a</think>b", False), (b"</think></think>", False), (b"abc", False), (b"", False)]:
        assert accepts(dfa, text) is ok, text


def test_a_constraint_starts_after_the_reasoning() -> None:
    choice = Constraint(json.dumps(["choice", ["Paris", "Rome"]]), "guided_choice")
    assert R.Reasoning("qwen3", in_reasoning=False).constraint(choice) == choice
    after = R.Reasoning("qwen3").constraint(choice)
    assert after is not None and after.param == "guided_choice"
    dfa = byte_dfa(pattern_of(after.key))
    # the model may end inside the reasoning (vLLM: no grammar before it ended); after </think>, only the choice
    for text, ok in [(b"</think>Paris", True), (b"<think>hmm, Rome?</think>Rome", True), (b"Paris", True),
                     (b"", True), (b"still </thin", True), (b"x</think>", False), (b"x</think>\n\nParis", False),
                     (b"x</think>Lyon", False), (b"a</think>b</think>Rome", False), (b"a</think>Rom", False)]:
        assert accepts(dfa, text) is ok, text
    call = Constraint(json.dumps(["tool_call", ["hermes", False, [{"type": "function", "function": {
        "name": "f", "description": "", "parameters": {"type": "object", "properties": {}}}}]]]), "tool_choice")
    forced = R.Reasoning("deepseek_r1").constraint(call)
    assert forced is not None
    text = "why</think>" + FORMATS["hermes"].call_text("f", {})
    assert accepts(byte_dfa(pattern_of(forced.key)), text.encode())


def test_the_grammar_compiles_against_the_served_vocabulary() -> None:
    codec = TextCodec(None)  # type: ignore[arg-type]  # the embedded model's tokenizer
    tok = codec.tokenizer
    texts = [None if tok.is_special(i) else codec.token_bytes(i) for i in range(tok.vocab_size)]
    key = R.Reasoning("qwen3").constraint(Constraint(json.dumps(["choice", ["Paris"]]), "guided_choice"))
    assert key is not None
    table = token_dfa(byte_dfa(pattern_of(key.key)), Vocab.of(texts, tok.vocab_size))
    done = table.walk(tok.encode("some thought</think>Paris"))
    assert done >= 0 and table.accept[done]
    assert table.walk(tok.encode("some thought</think>Lyon")) < 0
    assert table.accept[table.walk(tok.encode("some thought"))]  # an end inside the reasoning, as vLLM allows
    assert not table.accept[table.walk(tok.encode("some thought</think>"))]  # none between it and the answer


# ----------------------------------------------------------------------- the answer, from real token ids
def run_answer(codec: TextCodec, text: str, reasoning: R.Reasoning, stream: bool, tool: bool = False,
               echo: str = "", return_token_ids: bool = False) -> dict | list[dict]:
    """The gateway's own response code (``answer_whole`` / ``stream_choices``) for one choice whose engine output is
    ``text``'s token ids, one ``Tokens`` event per token, then EOS."""
    async def go() -> dict | list[dict]:
        backend, stream_ = Backend(Path("/nonexistent")), RequestStream(req_id=1)
        plan = Plan(m.Sampling(max_new_tokens=64), [], echo=echo, tool_format=FORMATS["hermes"] if tool else None,
                    return_token_ids=return_token_ids)
        gen = Generation(codec, plan, backend, stream_, FrontendMetrics(MODEL), 0.0, 1)
        ids = codec.tokenizer.encode(text)
        for t in ids:
            stream_.events.put_nowait(m.Tokens(req_id=1, ids=[t]))
        stream_.events.put_nowait(m.Finished(req_id=1, reason=L.FinishReason.EOS, error=0, generated=len(ids),
                                             prompt_len=1))
        shape = dataclasses.replace(CHAT, reasoning=reasoning)
        usage = Usage([gen], 1)
        if not stream:
            resp = await answer_whole([gen], shape, codec, MODEL, usage)
            return json.loads(resp.body)["choices"][0]
        chunks: list[dict] = []

        async def write(obj: dict) -> None:
            chunks.append(obj)
        await stream_choices([gen], shape, codec, fmt.Envelope.new("chatcmpl", MODEL), usage, write)
        return chunks
    return asyncio.run(go())


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(None)  # type: ignore[arg-type]


def joined(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_tool_parser_reads_the_content_only(codec: TextCodec) -> None:
    """A call written inside the reasoning is reasoning text, never a call; one in the content is a call."""
    text = f"<think>I could write {CALL} here</think>\n\n{CALL}"
    whole = run_answer(codec, text, R.Reasoning("qwen3"), stream=False, tool=True)
    assert isinstance(whole, dict)
    msg = whole["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == f"I could write {CALL} here"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["content"] is None and whole["finish_reason"] == "tool_calls"
    chunks = run_answer(codec, text, R.Reasoning("qwen3"), stream=True, tool=True)
    assert isinstance(chunks, list)
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == f"I could write {CALL} here"
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [tc["function"]["name"] for tc in calls if "id" in tc] == ["get_weather"]
    assert joined(chunks, "content").strip() == ""  # the whitespace before the call, as without reasoning
    only_thought = run_answer(codec, f"<think>{CALL}", R.Reasoning("qwen3"), stream=False, tool=True)
    assert isinstance(only_thought, dict) and "tool_calls" not in only_thought["message"]
    assert only_thought["message"]["reasoning_content"] == CALL and only_thought["finish_reason"] == "stop"


@pytest.mark.parametrize("reasoning", [R.Reasoning("qwen3"), R.Reasoning("qwen3", include=False),
                                       R.Reasoning("qwen3", in_reasoning=False)])
def test_whole_and_streamed_answers_agree(codec: TextCodec, reasoning: R.Reasoning) -> None:
    text = "<think>\nTwo and two: four.\n</think>\n\nIt is 4."
    whole = run_answer(codec, text, reasoning, stream=False)
    chunks = run_answer(codec, text, reasoning, stream=True)
    assert isinstance(whole, dict) and isinstance(chunks, list)
    want_r, want_c = R.split(text, reasoning.in_reasoning)
    shown = want_r if reasoning.include and reasoning.in_reasoning else None
    assert whole["message"]["reasoning_content"] == whole["message"]["reasoning"] == shown
    assert whole["message"]["content"] == want_c
    assert joined(chunks, "reasoning_content") == (shown or "") and joined(chunks, "content") == want_c
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    echoed = run_answer(codec, text, reasoning, stream=False, echo="Sure: ")  # the echo comes first
    assert isinstance(echoed, dict) and echoed["message"]["content"] == "Sure: " + want_c


# ----------------------------------------------------------------------- end to end
REPEAT = [{"role": "user", "content": "Please repeat the following text exactly, with nothing else: `</think>Paris`"}]
# The embedded model's template, with what Qwen3's adds: an assistant's reasoning_content between think tags, and
# enable_thinking false closing an empty reasoning in the generation prompt. Without them it renders the same text.
THINKING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("reasoning"), *ENGINE_FLAGS, "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template",
                        THINKING_TEMPLATE, engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    yield stack
    stop_stack(stack)


def tag_bias(stack: Stack) -> dict[str, int]:
    """A small push toward the first token of ``</think>``."""
    ids = post(stack, "/tokenize", {"prompt": "</think>", "add_special_tokens": False})["tokens"]
    return {str(ids[0]): 5}


def post(stack: Stack, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(stack.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def raw_text(stack: Stack, messages: list[dict], rendering: dict | None = None, **kw) -> str:
    """What the model writes for the chat prompt of ``messages`` (rendered with ``rendering``'s fields), unread:
    ``/v1/completions`` on its token ids."""
    ids = post(stack, "/tokenize", {"messages": messages, **(rendering or {})})["tokens"]
    return sync_client(stack).completions.create(model=MODEL, prompt=ids, temperature=0, **kw).choices[0].text


def by_hand(raw: str) -> tuple[str, str | None]:
    """The text split as vLLM's qwen3 parser does, written out here: an opening <think> dropped, the rest up to
    the first </think> is reasoning, what follows content (null when empty)."""
    body = raw.lstrip().removeprefix("<think>") if raw.lstrip().startswith("<think>") else raw
    reasoning, tag, content = body.partition("</think>")
    return (reasoning, content or None) if tag else (body, None)


def chat(stack: Stack, messages: list[dict], **kw):
    return sync_client(stack).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def streamed(stack: Stack, messages: list[dict], **kw) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    for chunk in chat(stack, messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_an_answer_without_tags_is_reasoning(real: Stack) -> None:
    """The embedded model writes no tags: everything is reasoning (vLLM's qwen3: no </think>, all reasoning)."""
    raw = raw_text(real, FRANCE, max_tokens=12)
    assert "</think>" not in raw
    msg = chat(real, FRANCE, max_tokens=12).choices[0].message
    assert msg.content is None
    assert msg.reasoning_content == msg.reasoning == raw
    assert streamed(real, FRANCE, max_tokens=12)[:2] == (raw, "")


def test_the_model_writes_the_closing_tag(real: Stack) -> None:
    bias = tag_bias(real)
    raw = raw_text(real, REPEAT, max_tokens=16, logit_bias=bias)
    assert "</think>" in raw, f"the model did not write </think> for this prompt ({raw!r}): the test needs one"
    reasoning, content = by_hand(raw)
    out = chat(real, REPEAT, max_tokens=16, logit_bias=bias).choices[0]
    assert (out.message.reasoning_content, out.message.content) == (reasoning, content)
    assert streamed(real, REPEAT, max_tokens=16, logit_bias=bias) == (reasoning, content or "", out.finish_reason)
    hidden = chat(real, REPEAT, max_tokens=16, logit_bias=bias, extra_body={"include_reasoning": False}).choices[0]
    assert hidden.message.reasoning_content is None and hidden.message.content == content
    assert streamed(real, REPEAT, max_tokens=16, logit_bias=bias, extra_body={"include_reasoning": False})[:2] == (
        "", content or "")
    # the answer goes back into the history as the client has it (both reasoning names): served, and the reasoning
    # reaches the template
    history = [*REPEAT, out.message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks."}]
    assert chat(real, history, max_tokens=2).choices[0].finish_reason in ("stop", "length")
    thought = [*REPEAT, {"role": "assistant", "content": "Paris", "reasoning_content": "They want Paris."},
               {"role": "user", "content": "Thanks."}]
    prompt = post(real, "/detokenize", {"tokens": post(real, "/tokenize", {"messages": thought})["tokens"]})
    assert "assistant\n<think>\nThey want Paris.\n</think>\n\nParis<|im_end|>\n" in prompt["prompt"]


def test_where_the_prompt_leaves_the_output(real: Stack) -> None:
    """Qwen3's enable_thinking switch, and an assistant prefill (continue_final_message) past its reasoning, make
    the whole answer content; a prefill inside the reasoning leaves the answer in it."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = raw_text(real, FRANCE, off, max_tokens=8)
    out = chat(real, FRANCE, max_tokens=8, extra_body=off).choices[0].message
    assert (out.content, out.reasoning_content) == (raw, None)
    assert streamed(real, FRANCE, max_tokens=8, extra_body=off)[:2] == ("", raw)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    past = [*FRANCE, {"role": "assistant", "content": "<think>\nEasy.</think>\n\nThe capital of France is"}]
    raw_past = raw_text(real, past, cont, max_tokens=6)
    out = chat(real, past, max_tokens=6, extra_body=cont).choices[0].message
    assert (out.content, out.reasoning_content) == (raw_past, None)
    inside = [*FRANCE, {"role": "assistant", "content": "<think>\nThe capital of France"}]
    raw_inside = raw_text(real, inside, cont, max_tokens=6)
    assert "</think>" not in raw_inside
    out = chat(real, inside, max_tokens=6, extra_body=cont).choices[0].message
    assert (out.reasoning_content, out.content) == (raw_inside, None)


def test_a_constraint_applies_after_the_reasoning(real: Stack) -> None:
    """guided_choice and a forced tool call constrain the content, once </think> was written (vLLM: the grammar
    starts when the reasoning ended)."""
    bias = tag_bias(real)
    out = chat(real, REPEAT, max_tokens=24, logit_bias=bias, extra_body={"guided_choice": ["Rome", "Oslo"]})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in ("Rome", "Oslo")
    assert "</think>" not in (choice.message.reasoning_content or "")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
    called = chat(real, REPEAT, max_tokens=48, logit_bias=bias, tools=tools, tool_choice="required",
                  parallel_tool_calls=False).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.content is None
    (call,) = called.message.tool_calls or []
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert called.message.reasoning_content is not None
    # a model that ends inside its reasoning ends so with a constraint too (vLLM applies it after the reasoning)
    free = chat(real, FRANCE, max_tokens=40).choices[0]
    ruled = chat(real, FRANCE, max_tokens=40, extra_body={"guided_choice": ["Paris", "London"]}).choices[0]
    assert free.finish_reason == "stop" and free.message.content is None, free  # the premise: no </think>
    assert (ruled.finish_reason, ruled.message.content) == ("stop", None)
    assert ruled.message.reasoning_content == free.message.reasoning_content


def test_qwen3s_switch_is_read_by_the_parser_when_the_template_does_not_read_it(tmp_path: Path) -> None:
    """With ``qwen3``, ``enable_thinking`` is the parser's too: a template that does not read it is not given it
    (no 400), and the answer is content. Another variable the template does not read is still refused."""
    embedded = TextCodec(None).template  # type: ignore[arg-type]  # reads no enable_thinking
    assert R.template_kwargs("qwen3", {"enable_thinking": False, "x": 1}, embedded) == {"x": 1}
    assert R.template_kwargs("qwen3", {"enable_thinking": False}, THINKING_TEMPLATE) == {"enable_thinking": False}
    assert R.template_kwargs("deepseek_r1", {"enable_thinking": False}, embedded) == {"enable_thinking": False}
    assert R.template_kwargs(None, {"enable_thinking": False}, embedded) == {"enable_thinking": False}
    stack = start_stack(tmp_path, "--reasoning-parser", "qwen3")  # the fake engine, the embedded template
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        off = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
        on = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4)
        assert on.choices[0].message.reasoning_content == off.choices[0].message.content
        assert on.choices[0].message.content is None
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4,
                                           extra_body={"chat_template_kwargs": {"thinking": False}})
        assert info.value.param == "chat_template_kwargs.thinking"
    finally:
        stop_stack(stack)


def test_without_a_parser_include_reasoning_false_is_refused_and_reasoning_effort_stays_refused(
        api_stack: Stack) -> None:
    client = openai.OpenAI(base_url=api_stack.url + "/v1", api_key=fixtures.API_KEY, max_retries=0)
    for extra, param in [({"include_reasoning": False}, "include_reasoning"), ({"reasoning_effort": "low"},
                                                                            "reasoning_effort")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, extra_body=extra)
        assert info.value.param == param
    served = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2,
                                            extra_body={"include_reasoning": True})
    assert served.choices[0].message.content is not None
    assert "reasoning_content" not in served.choices[0].message.model_dump(exclude_none=True)


@pytest.mark.parametrize("tool", [False, True])
def test_token_ids_add_up_whatever_holds_text_back(codec: TextCodec, tool: bool) -> None:
    """``return_token_ids`` where the reasoning reader and the tool parser hold text back (chunks then do not
    follow tokens): every id reaches some chunk once, in order, and the whole answer lists them all."""
    text = f"<think>I could write {CALL} here</think>\n\n{CALL}" if tool else "<think>so</think>Paris it is."
    ids = codec.tokenizer.encode(text)
    whole = run_answer(codec, text, R.Reasoning("qwen3"), stream=False, tool=tool, return_token_ids=True)
    assert isinstance(whole, dict) and whole["token_ids"] == ids
    chunks = run_answer(codec, text, R.Reasoning("qwen3"), stream=True, tool=tool, return_token_ids=True)
    assert isinstance(chunks, list)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    plain = run_answer(codec, text, R.Reasoning("qwen3"), stream=True, tool=tool)
    assert isinstance(plain, list) and all("token_ids" not in c["choices"][0] for c in plain)


@pytest.mark.parametrize("together", [False, True])
def test_stop_strings_are_looked_for_after_each_token_whatever_the_messages(codec: TextCodec, together: bool) -> None:
    """The reader may hand over several steps' ids in one message: the answer, its stop string, usage, log-probs
    and token ids are those of one id a message (vLLM looks for stops after each token), and the ids past the
    one that completed a stop are not the answer's."""
    ids = codec.tokenizer.encode("A xyz B and more")

    async def go() -> dict:
        backend, stream_ = Backend(Path("/nonexistent")), RequestStream(req_id=1)
        plan = Plan(m.Sampling(max_new_tokens=64, logprobs=True), ["xyz", "y"], return_token_ids=True)
        gen = Generation(codec, plan, backend, stream_, FrontendMetrics(MODEL), 0.0, 1)
        for part in ([ids] if together else [[t] for t in ids]):
            stream_.events.put_nowait(m.Tokens(req_id=1, ids=part, logprobs=[-0.5] * len(part)))
        resp = await answer_whole([gen], CHAT, codec, MODEL, Usage([gen], 1))
        return json.loads(resp.body)
    body = asyncio.run(go())
    choice = body["choices"][0]
    kept = choice["token_ids"]
    assert choice["message"]["content"] == "A x" and choice["stop_reason"] == "y", choice
    assert codec.tokenizer.decode(kept).startswith("A xy") and len(kept) < len(ids)
    assert body["usage"]["completion_tokens"] == len(kept) == len(choice["logprobs"]["content"])
