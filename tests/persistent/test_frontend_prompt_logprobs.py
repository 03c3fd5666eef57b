"""Prompt log-probs on the persistent backend end to end: the official ``openai`` client against ``blink serve
--backend persistent`` on a 2-layer Llama-3-shaped model with random fp32 weights saved as a Hugging Face folder
(the real Llama-3 tokenizer), checked against ``transformers`` in fp32 on the same files: completions' ``echo``
with ``logprobs``, and vLLM's ``prompt_logprobs`` on a prompt longer than the score graph's 256 positions a
launch. Needs the Llama-3 tokenizer files (``BLINK_TOKENIZER_ASSETS``, set by ``scripts/gpu_run.sh``); marked
gpu."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from dpu_tokenizer.fetch_assets import default_assets_dir
from harness.models import build_model_folder
from harness.serve_proc import ServeProc

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")
SERVED = "tiny"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        folder = build_model_folder("tiny", default_assets_dir(), tmp_path_factory.mktemp("plp_persistent"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    torch.manual_seed(5)
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg.initializer_range = 0.2  # distributions far from uniform: ranks and top-k without near-ties
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def client(weights, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    folder, _ = weights
    serve = ServeProc(("--backend", "persistent", "--dtype", "float32", "--model", str(folder), "--served-model-name",
                       SERVED, "--max-batch", "16", "--kv-blocks", "512", "--top-logprobs", "3",
                       "--no-standby-engine"), tmp_path_factory.mktemp("plp_serve")).start(timeout_s=300)
    try:
        yield openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120), serve.url
    finally:
        assert serve.stop() == 0


def reference(model: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)  # type: ignore[operator]


def token_ids(url: str, prompt: str) -> list[int]:
    body = json.dumps({"model": SERVED, "prompt": prompt}).encode()
    req = urllib.request.Request(url + "/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return list(json.load(r)["tokens"])


def test_echo_with_logprobs_gives_transformers_prompt_entries(client, weights) -> None:
    (api, url), (_, model) = client, weights
    out = api.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    ids = token_ids(url, PROMPT)
    assert out.choices[0].text.startswith(PROMPT) and lp.token_logprobs[0] is None
    ref = reference(model, ids)
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-3)


def test_prompt_logprobs_across_score_launches(client, weights) -> None:
    """A 600-token prompt: one prefill step, three launches of the score graph (256 positions each)."""
    (api, _), (_, model) = client, weights
    ids = torch.randint(1000, 100000, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    out = api.completions.create(model=SERVED, prompt=ids, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    got = out.choices[0].model_extra["prompt_logprobs"]
    ref = reference(model, ids)
    assert len(got) == len(ids) and got[0] is None
    for p, step in enumerate(got[1:], 1):
        want = float(ref[p - 1, ids[p]])
        assert step[str(ids[p])]["logprob"] == pytest.approx(want, abs=1e-3), p
        top = sorted((v["logprob"] for v in step.values() if v["rank"] <= 3), reverse=True)
        assert top == pytest.approx(torch.topk(ref[p - 1], 3).values.tolist(), abs=1e-3), p
