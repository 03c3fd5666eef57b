"""The fused small ops of the CPU serving form (``kernels.cpu_fused``) against the torch forms they replace, and
the packed model with them on against it with them off."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gpu_engine.kernels import cpu_fused
from gpu_engine.kernels.cpu_attention import paged_attention_ref
from gpu_engine.kernels.cpu_linear import KernelThreads, quant_kernels_available
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import build_metadata, write_kv
from gpu_engine.models.cpu_pack import fuse_small_ops, pack_for_cpu
from gpu_engine.models.layers import RMSNorm
from gpu_engine.models.loader import load_model
from gpu_engine.models.reference import greedy_generate
from gpu_engine.models.rope import apply_rotary
from tests.helpers.q4 import q4_1_weight

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no AVX2/FMA, or _cpu_quant not built")


def test_rms_norm_is_the_module_s_arithmetic() -> None:
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    x = torch.randn(7, 96) * 3
    want = norm(x)
    norm.fused = True
    torch.testing.assert_close(norm(x), want, rtol=2e-7, atol=1e-6)


def test_rope_and_cache_write_match_the_torch_forms() -> None:
    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads, dim, bs = 5, 6, 2, 32, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(t, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.tensor([3, 9, 0, 17, 30])
    k_want, v_want = torch.zeros(8, bs, kv_heads, dim, dtype=torch.float16), torch.zeros(8, bs, kv_heads, dim,
                                                                                         dtype=torch.float16)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].reshape(t, -1, dim), cos, sin)
    write_kv(k_want, v_want, qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].reshape(t, kv_heads, dim), slots)
    k_got, v_got = torch.zeros_like(k_want), torch.zeros_like(v_want)
    got = qkv.clone()
    cpu_fused.rope_write_kv(got, cos, sin, k_got, v_got, slots, heads, kv_heads)
    torch.testing.assert_close(got[:, : (heads + kv_heads) * dim], qk.reshape(t, -1), rtol=0, atol=0)
    torch.testing.assert_close(k_got, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_got, v_want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fp16 cache"):
        cpu_fused.rope_write_kv(got, cos, sin, k_got.float(), v_got.float(), slots, heads, kv_heads)


@pytest.mark.parametrize(("window", "dim"), [(None, 16), (5, 16), (None, 64), (5, 80)])
def test_decode_attention_matches_the_per_sequence_loop(window: int | None, dim: int) -> None:
    """(Head sizes of 64 dimensions at a time and of 8 at a time take apart paths of the values' sum.)"""
    gen = torch.Generator().manual_seed(3)
    bs, heads, kv_heads = 4, 6, 2
    k_cache = torch.randn(40, bs, kv_heads, dim, generator=gen).half()
    v_cache = torch.randn(40, bs, kv_heads, dim, generator=gen).half()
    meta = build_metadata([(13, 1, [7, 3, 9, 30]), (2, 1, [20]), (0, 1, [5])], bs)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].reshape(3, heads, dim)
    want = paged_attention_ref(q, k_cache, v_cache, meta.positions, meta.cu_seqlens_q, meta.context_lens,
                               meta.block_tables, dim**-0.5, window)
    got = cpu_fused.attend_decode(qkv, k_cache, v_cache, meta.block_tables, meta.context_lens, heads, dim**-0.5,
                                  window)
    torch.testing.assert_close(got, want.reshape(3, -1), rtol=2e-5, atol=2e-5)


TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "eos_token_id": [2], "bos_token_id": 1}


def test_packed_tiny_model_fused_equals_unfused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=5)
    fused = pack_for_cpu(model)
    assert fused.layers[0].attn.fused and fused.layers[0].residual_in_place and fused.norm.fused
    plain = copy.deepcopy(fused)
    fuse_small_ops(plain, on=False)
    prompts = [[1, 5, 9, 200, 33], [1, 77], [1]]
    want = greedy_generate(plain, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 6)
    got = greedy_generate(fused, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 6)
    assert float((got.logits - want.logits).abs().max()) < 1e-4 * float(want.logits.abs().max())


@pytest.mark.parametrize("int8_activations", [False, True])
def test_decode_stack_equals_the_layers_fused_forms(tmp_path: Path, int8_activations: bool) -> None:
    """With every linear a Q4_1 tensor, a decode step runs as one C call over all layers: its logits are the
    layer-by-layer fused forms' (the same ops; SiLU's exp may differ by an ulp, which with int8 activations can
    move an input across a rounding boundary of its int8 code: a looser bound there), and the same tokens."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, cfg = load_model(tmp_path, random_weights=True, seed=6)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 100 + i)
    stacked = pack_for_cpu(model, int8_activations=int8_activations)
    assert stacked.decode_stack is not None
    layered = copy.deepcopy(stacked)
    layered.decode_stack = None
    prompts = [[1, 5, 9, 200, 33], [1, 77], [1, 250, 3]]
    want = greedy_generate(layered, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 8)
    got = greedy_generate(stacked, KVCache(cfg, 16, 4, dtype=torch.float16), prompts, 8)
    assert got.tokens == want.tokens
    bound = 5e-3 if int8_activations else 1e-5
    assert float((got.logits - want.logits).abs().max()) < bound * float(want.logits.abs().max())
    fuse_small_ops(stacked, on=False)
    assert stacked.decode_stack is None


def test_decode_stack_is_the_same_on_one_thread_and_two(tmp_path: Path) -> None:
    """The pool splits a step's products by weight rows and its attention and SiLU by heads and items, each
    computed as on one thread: two threads give the same bits. (Head size 64: the values' register path.)"""
    config = {**TINY, "hidden_size": 256, "intermediate_size": 320, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, cfg = load_model(tmp_path, random_weights=True, seed=7)
    for i, (name, mod) in enumerate(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            mod.weight.data = q4_1_weight(mod.out_features, mod.in_features, 200 + i)
    stacked = pack_for_cpu(model)
    assert stacked.decode_stack is not None
    gen = torch.Generator().manual_seed(8)  # long contexts: the threads' heads overlap in time
    prompts = [[1, *torch.randint(3, 300, (n,), generator=gen).tolist()] for n in (150, 90, 200)]
    runs = []
    for threads in (1, 2):
        KernelThreads.count = threads
        try:
            runs.append(greedy_generate(stacked, KVCache(cfg, 160, 4, dtype=torch.float16), prompts, 16))
        finally:
            KernelThreads.count = 0
    assert runs[0].tokens == runs[1].tokens
    assert torch.equal(runs[0].logits, runs[1].logits)


def test_decode_stack_refuses_bad_input() -> None:
    shape = cpu_fused.StackShape(64, 96, 4, 2, 16, 4, 0, 1e-6)
    plan = torch.zeros(2, 8, dtype=torch.int64)
    cos = sin = torch.zeros(1, 16)
    args = (cos, sin, torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1, False)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_fused.decode_stack(torch.zeros(1, 32), plan, shape, *args)
    with pytest.raises(ValueError, match="int64"):
        cpu_fused.decode_stack(torch.zeros(1, 64), plan[:, :7].contiguous(), shape, *args)
    with pytest.raises(ValueError, match="bad shape"):
        cpu_fused.decode_stack(torch.zeros(1, 64), plan, dataclasses.replace(shape, head_dim=8), *args)
