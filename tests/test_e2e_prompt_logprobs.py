"""Prompt log-probs end to end: the official ``openai`` client against ``blink serve`` with the real CPU engine
on the embedded model's weights in float32, checked against ``transformers`` in float32 on the same GGUF
(completions' echo with logprobs, echo with max_tokens 0, vLLM's prompt_logprobs on both endpoints, n > 1, the
400s)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch
from helpers.e2e import ENGINE_ENV, ENGINE_FLAGS, FRANCE, REAL_ENGINE, sync_client, wait_for
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from gpu_engine.models.loader import default_model_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

MAX_PL = 48  # --max-prompt-logprobs-tokens of this server
BLOCK = 16  # the engine's default --block-size
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("e2e_plp"), *ENGINE_FLAGS, "--dtype", "float32",
                        "--max-prompt-logprobs-tokens", str(MAX_PL), engine_module=REAL_ENGINE, timeout_s=240,
                        env=ENGINE_ENV)
    sync_client(stack).completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def hf() -> object:
    gguf = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def reference(model: object, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids) - 1, vocab]: the distributions that predict prompt tokens 1.."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def complete(stack: Stack, **kw) -> openai.types.Completion:
    return sync_client(stack).completions.create(model=MODEL, temperature=0, **kw)


def test_prompt_logprobs_equal_transformers(real: Stack, hf: object, text) -> None:
    ids = text.ids(PROMPT)
    out = complete(real, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 3})
    got = out.choices[0].model_extra["prompt_logprobs"]
    ref = reference(hf, ids)
    assert len(got) == len(ids) and got[0] is None
    for p, step in enumerate(got[1:], 1):
        mine = step[str(ids[p])]  # the prompt token is always there
        want = float(ref[p - 1, ids[p]])
        assert mine["logprob"] == pytest.approx(want, abs=2e-3)
        assert abs(mine["rank"] - (1 + int((ref[p - 1] > want).sum()))) <= 1  # near-ties may move it by one
        assert mine["decoded_token"] == text.tok.decode([ids[p]])
        best = sorted(((v["rank"], v["logprob"]) for k, v in step.items() if v["rank"] <= 3))
        assert [r for r, _ in best][:3] == [1, 2, 3] or mine["rank"] <= 3
        assert [lp for _, lp in best] == sorted((lp for _, lp in best), reverse=True)  # top k best first
        top = torch.topk(ref[p - 1], 3).values.tolist()
        assert [lp for r, lp in best if r <= 3][:3] == pytest.approx(top, abs=2e-3)


def test_echo_with_logprobs_gives_the_prompt_then_the_output(real: Stack, hf: object, text) -> None:
    ids = text.ids(PROMPT)
    out = complete(real, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(lp.tokens) == len(ids) + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(hf, ids)
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=2e-3)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = complete(real, prompt=PROMPT, max_tokens=3, logprobs=2)
    assert lp.tokens[len(ids):] == plain.choices[0].logprobs.tokens  # the output's entries as without echo


def test_echo_with_max_tokens_0_is_the_prompt_only(real: Stack, text) -> None:
    ids = text.ids(PROMPT)
    out = complete(real, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"  # vLLM samples one token and drops it
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    bare = complete(real, prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


def test_prompt_logprobs_of_a_request_whose_first_token_ends_it(real: Stack, text) -> None:
    """No output token: the prompt's log-probs come with the finish."""
    ids, stop = text.ids(PROMPT), 7
    out = complete(real, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                   logit_bias={str(stop): 100}, extra_body={"stop_token_ids": [stop], "prompt_logprobs": 0})
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "stop" and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert len(choice.model_extra["prompt_logprobs"]) == len(ids)


def test_streamed_echo_carries_the_prompt_logprobs_first(real: Stack, text) -> None:
    ids = text.ids(PROMPT)
    chunks = list(sync_client(real).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                                       echo=True, logprobs=1, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(ids)
    assert first.logprobs.token_logprobs[0] is None and all(x is not None for x in first.logprobs.token_logprobs[1:])
    whole = complete(real, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_each_choice_echoes_its_own_prompt(real: Stack, text) -> None:
    prompts = ["One two three", "Four five six seven"]
    out = complete(real, prompt=prompts, max_tokens=2, n=2, echo=True, logprobs=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        prompt = prompts[c.index // 2]
        assert c.text.startswith(prompt)
        assert len(c.logprobs.tokens) == len(text.ids(prompt)) + 2 and c.logprobs.token_logprobs[0] is None


def cache_hits(stack: Stack) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("blink:prefix_cache_hits_total{"))


def test_n_choices_share_one_computation_of_the_prompt_logprobs(real: Stack, text) -> None:
    """n=2: both choices carry the prompt's entries, but only the first slot asked for them: the second looks its
    prompt up in the prefix cache (a slot that asks never does) and finds the blocks a plain run left there."""
    prompt = ("Rivers flow from the mountains to the sea, carrying water, stones and the stories of every valley. "
              "Forests hold the rain and feed the springs.")
    ids = text.ids(prompt)
    cached = (len(ids) - 1) // BLOCK * BLOCK  # every full block but the one holding the last token
    assert cached and len(ids) <= MAX_PL  # a block to find, rows enough for the prompt log-probs
    complete(real, prompt=ids, max_tokens=1)  # leaves the prompt's full blocks in the cache
    time.sleep(0.3)  # the engine publishes its counters every 0.1 s
    before = cache_hits(real)
    out = complete(real, prompt=ids, max_tokens=2, n=2, echo=True, logprobs=1, extra_body={"prompt_logprobs": 2})
    first, second = sorted(out.choices, key=lambda c: c.index)
    assert first.model_extra["prompt_logprobs"] == second.model_extra["prompt_logprobs"]
    assert len(first.model_extra["prompt_logprobs"]) == len(ids)
    n = len(ids)
    for c in (first, second):
        assert c.logprobs.token_logprobs[0] is None and all(x is not None for x in c.logprobs.token_logprobs[1:n])
    assert first.logprobs.token_logprobs[:n] == second.logprobs.token_logprobs[:n]
    wait_for(lambda: cache_hits(real) - before >= cached, 60, 0.1)  # the second choice's lookup found them


def test_chat_prompt_logprobs_are_the_response_s(real: Stack) -> None:
    raw = sync_client(real).chat.completions.with_raw_response.create(
        model=MODEL, messages=FRANCE, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    body = raw.http_response.json()
    plp = body["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(step) == 1 and next(iter(step.values()))["rank"] >= 1 for step in plp[1:])


@pytest.mark.parametrize(("kw", "param", "code"), [
    ({"prompt": "word " * (MAX_PL + 4), "echo": True, "logprobs": 1}, "echo", "context_length_exceeded"),
    ({"prompt": "word " * (MAX_PL + 4), "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs",
     "context_length_exceeded"),
    ({"prompt": "Hi", "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", "unsupported_value"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
])
def test_what_cannot_be_served_is_a_400(real: Stack, kw: dict, param: str, code: str) -> None:
    kw.setdefault("max_tokens", 2)
    with pytest.raises(openai.BadRequestError) as err:
        complete(real, **kw)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param and body["code"] == code, body
    if code == "context_length_exceeded":
        assert f"at most {MAX_PL} tokens" in body["message"] and "--max-prompt-logprobs-tokens" in body["message"]
