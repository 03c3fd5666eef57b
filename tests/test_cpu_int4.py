"""``--cpu-weights int4``: the decoder layers' linears as group-int4 (``Int4Linear``), selected by a flag, with
greedy output within a stated bound of the float32 model on the embedded SmolLM2's fixed prompts.

The bound (bf16 activations and scales, the Q4_1 codes themselves exact): while the int4 model's greedy
tokens equal float32's, its logits stay within 0.5 of float32's (the fp16-packed default: 0.05); at least
5 of the 6 prompts give float32's 16 greedy tokens exactly, and every prompt its first 3.
"""

from __future__ import annotations

import pytest
import torch

from gpu_engine.kernels.cpu_linear import Int4Linear, Q8Head
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.cpu_pack import pack_for_cpu
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.loader import default_model_path, load_model
from gpu_engine.models.reference import greedy_generate
from gpu_engine.serve import parse_args
from shared.config import EngineConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three primary colors are", "Water boils at a temperature of",
           "The largest planet in our solar system is"]
STEPS = 16
LOGIT_BOUND = 0.5


def test_the_flag_selects_int4_and_refuses_where_it_does_not_apply() -> None:
    assert parse_args([]).cpu_weights == "auto"
    assert parse_args(["--cpu-weights", "int4", "--backend", "cpu"]).cpu_weights == "int4"
    with pytest.raises(SystemExit):
        parse_args(["--cpu-weights", "int8"])
    for other in ({"backend": "persistent"}, {"backend": "host"}, {"dtype": "float32"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="--cpu-weights int4 applies to the CPU backend with --dtype auto"):
            EngineConfig(cpu_weights="int4", **other)  # type: ignore[arg-type]


def agreeing_steps(want: list[int], got: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))


def test_embedded_model_int4_greedy_within_the_stated_bound() -> None:
    try:
        path = default_model_path()
    except ModelLoadError:
        pytest.skip("embedded model not installed")
    from dpu_tokenizer.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    model, cfg = load_model(path)
    want = greedy_generate(model, KVCache(cfg, 64, 16), prompts, STEPS)
    int4 = pack_for_cpu(model, int4_layers=True)
    linears = [m for name, m in int4.named_modules() if name.startswith("layers.") and hasattr(m, "in_features")]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)
    assert isinstance(int4.lm_head, Q8Head)  # the lossless Q8_0 table, shared with the embedding
    got = greedy_generate(int4, KVCache(cfg, 64, 16, dtype=torch.float16), prompts, STEPS)
    same = [agreeing_steps(w, g) for w, g in zip(want.tokens, got.tokens, strict=True)]
    assert min(same) >= 3 and sum(s == STEPS for s in same) >= len(PROMPTS) - 1, same
    for p, s in enumerate(same):  # logits [steps, prompts, vocab], compared while both saw the same tokens
        n = min(s + 1, STEPS)
        diff = float((got.logits[:n, p] - want.logits[:n, p]).abs().max())
        assert diff < LOGIT_BOUND, (PROMPTS[p], diff)
