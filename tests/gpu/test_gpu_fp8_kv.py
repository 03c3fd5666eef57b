"""The FP8 KV cache (``--kv-cache-dtype fp8``) on an sm_89+ GPU at real sizes: the KV write's codes against torch's
(the GPU's own rounding into e4m3), decode and prefill attention over FP8 caches against their references and against
float attention within the bound tests/test_kernels_fp8_kv.py derives, in the runner's graphs; then a Llama-shaped
random model through the runner over FP8 and bf16 caches (``helpers.fp8_kv_runner``'s bound)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _ada_or_later() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need sm_89 or later")


def _paged(lens, kv_scale, hkv=8, d=128, bs=16, spread=2.0, seed=0):
    from tests.test_kernels_fp8_kv import _paged_fp8

    return _paged_fp8(lens, kv_scale, hkv=hkv, d=d, bs=bs, nblocks=sum(-(-n // bs) for n in lens) + 4, seed=seed,
                      spread=spread)


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_gives_torch_s_codes(dtype: torch.dtype, kv_scale: tuple[float, float]) -> None:
    """Llama-3-8B's KV heads, 512 tokens of values from 1e-3 to 1e3 (past 448 saturated): the GPU's codes are torch's
    exactly (round to nearest even, the saturating clamp)."""
    from gpu_engine.kernels.kv_cache import write_kv, write_kv_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    spread = torch.logspace(-3, 3, 512, device="cuda")[:, None, None]
    k = (torch.randn(512, 8, 128, device="cuda", generator=g) * spread).to(dtype)
    v = (torch.randn(512, 8, 128, device="cuda", generator=g) * spread).to(dtype)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:512]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, device="cuda", dtype=FP8) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots, kv_scale)
    write_kv_ref(k, v, caches[2], caches[3], slots, kv_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


LENS = [1, 255, 256, 257, 2048, 4000]


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("form", ["split", "last"])
def test_decode_attention_over_fp8_at_real_sizes(form: str, kv_scale: tuple[float, float]) -> None:
    """32 query heads over 8 KV heads of 128, contexts up to 4,000 tokens: the kernel against its reference (the same
    tolerance as over a bf16 cache), the reference against float attention over the unquantized K/V within the
    derived bound."""
    from gpu_engine.kernels.attention import decode_attention, decode_attention_ref, prefill_attention_ref
    from tests.test_kernels_fp8_kv import attention_bound

    kf, vf, k8, v8, bt, ctx = _paged(LENS, kv_scale)
    q = torch.randn(len(LENS), 32, 128, device="cuda", dtype=torch.bfloat16)
    scale = 128**-0.5
    got = decode_attention(q, k8, v8, bt, ctx, scale, form=form, kv_scale=kv_scale)
    want = decode_attention_ref(q, k8, v8, bt, ctx, scale, kv_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    cu = torch.arange(len(LENS) + 1, dtype=torch.int32, device="cuda")  # one query a row: a decode
    exact = prefill_attention_ref(q.float(), kf, vf, bt, ctx, cu, scale)
    bound = attention_bound(q.float(), kf, vf, bt, ctx, cu, scale, kv_scale)
    assert bool(((want.float() - exact).abs() <= bound + 2**-8 * exact.abs()).all())  # + want's bf16 rounding


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_prefill_attention_over_fp8_at_real_sizes(kv_scale: tuple[float, float]) -> None:
    """Chunks over cached prefixes, 1 to 1,024 query rows: the kernel against its reference."""
    from gpu_engine.kernels.attention import prefill_attention, prefill_attention_ref

    q_lens, ctx_lens = [1, 17, 300, 1024], [1, 400, 300, 3000]
    _, _, k8, v8, bt, ctx = _paged(ctx_lens, kv_scale)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    got = prefill_attention(q, k8, v8, bt, ctx, cu, 128**-0.5, kv_scale=kv_scale)
    want = prefill_attention_ref(q, k8, v8, bt, ctx, cu, 128**-0.5, kv_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_writers_into_fp8_match_their_references(qk_norm: bool) -> None:
    """`qkv_prep` and the tiled heads kernel at Llama-3-8B's heads (32 + 8 + 8 of 128) into FP8 caches: the values'
    codes exactly the reference's, the rotated keys within one e4m3 step beyond bf16's own tolerance."""
    from gpu_engine.kernels import rope
    from gpu_engine.kernels.qkv_prep import qkv_prep, qkv_prep_ref
    from tests.test_kernels_fp8_kv import assert_fp8_close

    T, hq, hk, d = 64, 32, 8, 128
    qkv = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16) * 4
    q, k, v = (qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d: (hq + hk) * d].view(T, hk, d),
               qkv[:, (hq + hk) * d:].view(T, hk, d))
    cache = rope.build_rope_cache(d, 4096, 500000.0, device="cuda")
    pos = torch.randint(0, 4096, (T,), device="cuda")
    slots = torch.randperm(32 * 16, device="cuda")[:T]
    qn = kn = None
    if qk_norm:
        qn, kn = (torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    caches = [torch.zeros(32, 16, hk, d, device="cuda", dtype=FP8) for _ in range(4)]
    want_q = qkv_prep_ref(q.clone(), k, v, pos, cache, caches[2], caches[3], slots, qn, kn, 1e-6, (0.5, 2.0))
    qkv_prep(q, k, v, pos, cache, caches[0], caches[1], slots, qn, kn, 1e-6, kv_scale=(0.5, 2.0))
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert_fp8_close(caches[0], caches[2], 0.5, 2e-2 * 4)


def test_runner_logits_over_fp8_within_the_bound_of_bf16_kv() -> None:
    """A random Llama-shaped model (hidden 1024, 4 layers, 16 query and 4 KV heads of 64, a 2,000-token vocabulary)
    in bf16, over a bf16 cache and over an FP8 one: 4 prompts of 200 tokens then 60 greedy decode steps on the same
    tokens, each step's logits within 2u x layers x max|logit| of the bf16 cache's (``helpers.fp8_kv_runner``), and
    the same greedy token in every row whose top-2 margin exceeds twice that bound. (Random weights give near-flat
    logits: on an H100 only 37 of 61 steps had all four rows' tokens equal, every one within the bound.)"""
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kv_cache import KVCache
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty, init_random
    from tests.helpers.fp8_kv_runner import compare, logit_bound

    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 2000, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 1024})
    model = build_empty(cfg, torch.bfloat16, "cuda")
    init_random(model, 0)
    limits = RunnerLimits(4, 1024, 20)  # 17 blocks of 16 hold a row's 260 tokens
    plain = GpuModelRunner(model, KVCache(cfg, 80, 16, dtype=torch.bfloat16, device="cuda"), limits)
    fp8 = GpuModelRunner(model, KVCache(cfg, 80, 16, dtype=FP8, device="cuda"), limits)
    pairs = compare(plain, fp8, num_seqs=4, prompt=200, decodes=60, vocab=cfg.vocab_size, device="cuda")
    for want, got in pairs:
        bound = logit_bound(cfg.num_layers, want)
        assert float((got - want).abs().max()) <= bound
        top = want.float().topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 2 * bound
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert any(not torch.equal(got, want) for want, got in pairs)
