"""The FP8 KV cache (``--kv-cache-dtype fp8``): its write, the fused writers and both attentions against their
references at tiny shapes (the interpreter on the CPU, with the GPU's rounding into e4m3: ``helpers.fp8_interpret``),
and the references against attention over the unquantized K/V within a bound derived from e4m3's rounding.

The bound (``attention_bound``). e4m3 keeps 3 significand bits: a value x/s in the normal range [2^-6, 448] is stored
as (x/s)(1 + d) with |d| <= u = 2^-4 (half a step of 2^-3, relative); below 2^-6 the steps are 2^-9 apart, so the
error is at most 2^-10 absolute. So a cached key or value x reads back as x + e with |e| <= u|x| + 2^-10 s. For one
query row with softmax scale c, each score moves by at most E = c max_j sum_d |q_d| (u|k_jd| + 2^-10 s_k). Moving
every score by at most E multiplies each probability by a factor in [exp(-2E), exp(2E)] (numerator and the sum each
by at most exp(E)), so sum_j |p'_j - p_j| <= exp(2E) - 1. The output o_d = sum_j p_j v_jd then moves by at most
sum_j |p'_j - p_j| |v_jd| + sum_j p'_j |e_jd| <= (exp(2E) - 1 + u) max_j |v_jd| + 2^-10 s_v. Both sides are computed
in fp32 (the references), whose own rounding adds ~1e-6 relative; the bound allows 1e-5 for it.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.fp8_interpret import gpu_rounding, interpreter_rounds_like_gpu  # noqa: E402
from helpers.paged import paged_cache  # noqa: E402

from gpu_engine.kernels import attention, kv_cache, rope  # noqa: E402
from gpu_engine.kernels.kv_cache import FP8_KV, quantize_kv_ref  # noqa: E402
from gpu_engine.kernels.qkv_prep import qkv_prep, qkv_prep_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0**-4          # e4m3's unit roundoff (3 significand bits)
SUB = 2.0**-10       # half of e4m3's subnormal step 2^-9: the absolute error below the normal range
SCALES = [(1.0, 1.0), (0.37, 2.5)]
# The attentions' half-precision case: bf16 on a GPU; fp16 under the interpreter, whose bf16 products overflow (so
# its bf16 attention is unusable with any cache, FP8 or not).
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16


@pytest.fixture(autouse=True)
def _gpu_rounding():
    if DEV == "cpu":
        with gpu_rounding():
            yield
    else:
        yield


def ordinal(c: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed integers in value order (adjacent values differ by 1; +0 and -0 are both 0)."""
    bits = c.view(torch.uint8).to(torch.int32)
    return torch.where(bits >= 128, -(bits - 128), bits)


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, scale: float, atol: float) -> None:
    """FP8 caches whose values (codes times `scale`) differ by at most one e4m3 step (2^-3 relative, 2^-9 scale
    below the normal range) plus `atol`: where the kernel's and the reference's activations differ by their own
    rounding (`atol`, the activations' tolerance), a value at a rounding boundary of e4m3 may round either way."""
    a, b = got.float() * scale, want.float() * scale
    allowed = 2.0**-3 * torch.maximum(a.abs(), b.abs()) + 2.0**-9 * scale + atol
    assert bool(((a - b).abs() <= allowed).all()), float(((a - b).abs() - allowed).max())
    assert float((ordinal(got) != ordinal(want)).float().mean()) < 0.05  # most codes equal


def test_the_interpreter_needs_the_gpu_rounding_and_the_reference_rounds_to_nearest_even():
    """The interpreter's own narrowing into e4m3 is not the GPU's (see ``helpers.fp8_interpret``); torch's is:
    ties to even, the carry into the exponent, saturation at 448 after the clamp."""
    if DEV == "cpu":
        with gpu_rounding():
            assert interpreter_rounds_like_gpu()
    x = torch.tensor([3.125, 3.375, 124.0, 500.0, -1e6, 2.0**-10, 0.0])
    assert quantize_kv_ref(x, 1.0, FP8_KV).float().tolist() == [3.0, 3.5, 128.0, 448.0, -448.0, 0.0, 0.0]
    assert quantize_kv_ref(x, 2.0, FP8_KV).float().tolist()[:4] == [1.5, 1.75, 64.0, 256.0]


@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_into_fp8_gives_the_reference_codes(dtype, kv_scale):
    """Values divided by their scale, saturated to +-448 (some here are far past it) and rounded to nearest even:
    the reference's codes exactly; a padding slot writes nothing."""
    g = torch.Generator().manual_seed(1)
    spread = torch.tensor([0.01, 1.0, 30.0, 300.0, 3000.0, 0.5])[:, None, None, None]
    kv = (torch.randn(6, 2, 3, 16, generator=g) * spread).to(DEV, dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, 14, 0, 31, 7], device=DEV)
    kc, vc = (torch.zeros(8, 4, 3, 16, device=DEV, dtype=FP8_KV) for _ in range(2))
    want_k, want_v = kc.clone(), vc.clone()
    kv_cache.write_kv_ref(k, v, want_k, want_v, slots, kv_scale)
    kv_cache.write_kv(k, v, kc, vc, slots, kv_scale)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    assert kc.float().abs().max() == 448.0 and not kc.view(-1, 3, 16)[[1, 2, 3, 4]].float().any()


def test_fp8_cache_inputs_are_checked():
    k = torch.randn(2, 2, 16, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    fp8, f32 = torch.zeros(2, 4, 2, 16, device=DEV, dtype=FP8_KV), torch.zeros(2, 4, 2, 16, device=DEV)
    with pytest.raises(ValueError, match="v_cache: dtype"):
        kv_cache.write_kv(k, k, fp8, f32, slots)
    with pytest.raises(ValueError, match="k_cache: dtype"):
        kv_cache.write_kv(k, k, fp8.view(torch.int8), fp8, slots)
    for bad in ((0.0, 1.0), (1.0, float("inf")), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="kv_scale"):
            kv_cache.write_kv(k, k, fp8, fp8.clone(), slots, bad)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_prep_into_fp8_matches_its_reference(norm, dtype):
    """The fused norm, rotation and write: the keys rounded to the activation dtype, then stored as the KV write
    stores them (the values exactly the reference's codes; the rotated keys within one e4m3 step of the reference's
    beyond the activations' tolerance, as the two computations of the rotation may differ in their last bits); the
    queries as into a cache of their own dtype."""
    T, hq, hk, d = 5, 4, 2, 16
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 20).to(DEV, dtype)
    q, k, v = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d: (hq + hk) * d].view(T, hk, d), qkv[:, (hq + hk) * d:]
    v = v.view(T, hk, d)
    cache = rope.build_rope_cache(16, 64, 10000.0, device=DEV)
    pos, slots = torch.tensor([0, 3, 17, 63, 8], device=DEV), torch.tensor([2, -1, 9, 30, 11], device=DEV)
    qn = kn = None
    if norm:
        qn, kn = torch.rand(d, generator=g).to(DEV, dtype) + 0.5, torch.rand(d, generator=g).to(DEV, dtype) + 0.5
    kc, vc = (torch.zeros(8, 4, hk, d, device=DEV, dtype=FP8_KV) for _ in range(2))
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = qkv_prep_ref(q.clone(), k, v, pos, cache, want_kc, want_vc, slots, qn, kn, 1e-6, (0.5, 3.0))
    qkv_prep(q, k, v, pos, cache, kc, vc, slots, qn, kn, 1e-6, kv_scale=(0.5, 3.0))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    assert torch.equal(vc.view(torch.uint8), want_vc.view(torch.uint8))
    assert_fp8_close(kc, want_kc, 0.5, tol)
    assert not kc.view(-1, hk, d)[[0, 1]].float().any()  # slot -1 wrote nothing


@pytest.mark.parametrize("qk_norm", [False, True])
def test_tiled_heads_into_fp8_match_the_reference(qk_norm):
    """The qkv product with the fused preparation as its output, into FP8 caches: as the product followed by
    `qkv_prep_ref` leaves them (values exact, rotated keys as in the fused preparation's test), the queries as
    before."""
    from gpu_engine.kernels.tiled_linear import Heads, tiled_linear, tiled_ref

    g = torch.Generator().manual_seed(11)
    M, HQ, HK, D, K = 3, 4, 2, 16, 64
    N = (HQ + 2 * HK) * D
    x, w = (torch.randn(M, K, generator=g) * 2).to(DEV), (torch.randn(N, K, generator=g) * 0.5).to(DEV)
    cache = rope.build_rope_cache(16, 64, 10000.0, device=DEV)
    pos, slots = torch.tensor([0, 17, 63], device=DEV), torch.tensor([2, -1, 30], device=DEV)
    qn = kn = None
    if qk_norm:
        qn, kn = (torch.rand(D, generator=g) + 0.5).to(DEV), (torch.rand(D, generator=g) + 0.5).to(DEV)
    caches = [torch.zeros(8, 4, HK, D, device=DEV, dtype=FP8_KV) for _ in range(4)]
    got = Heads(HQ, HK, pos, cache, caches[0], caches[1], slots, qn, kn, 1e-6, (2.0, 0.25))
    out = torch.empty(M, N, device=DEV)
    tiled_linear(x, w, out=out, block_k=32, per_sm=8, heads=got)
    want = tiled_ref(x, w, heads=got._replace(k_cache=caches[2], v_cache=caches[3]))
    torch.testing.assert_close(out[:, : HQ * D], want[:, : HQ * D], rtol=1e-4, atol=1e-4)
    assert_fp8_close(caches[0], caches[2], 2.0, 1e-4)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert int(caches[0].float().ne(0).any(-1).any(-1).sum()) == 2  # the two rows with a slot


def _paged_fp8(lens, kv_scale, hkv=2, d=16, bs=4, nblocks=40, seed=0, spread=3.0):
    """Float32 K/V caches and the same quantized to FP8, with their block tables and context lengths."""
    kc, vc, tables, lens_t = paged_cache(lens, DEV, hkv=hkv, d=d, bs=bs, nblocks=nblocks, seed=seed)
    kf, vf = kc * spread, vc * spread
    k8, v8 = quantize_kv_ref(kf, kv_scale[0], FP8_KV), quantize_kv_ref(vf, kv_scale[1], FP8_KV)
    return kf, vf, k8, v8, tables, lens_t


@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (HALF, 2e-2)])
def test_decode_attention_over_fp8_matches_its_reference(dtype, tol, kv_scale):
    """Codes widened to the queries' dtype, the key scale in the scores and the value scale on the sums: the
    reference's fp32 dequantized attention, in both forms, empty rows zero."""
    _, _, k8, v8, bt, ctx = _paged_fp8([1, 37, 0, 70], kv_scale)
    q = torch.randn(4, 8, 16, device=DEV).to(dtype)
    want = attention.decode_attention_ref(q, k8, v8, bt, ctx, 0.25, kv_scale)
    for form in attention.DECODE_FORMS:
        got = attention.decode_attention(q, k8, v8, bt, ctx, 0.25, partition_size=32, block_n=16, form=form,
                                         kv_scale=kv_scale)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not got[2].float().any()


@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (HALF, 2e-2)])
def test_prefill_attention_over_fp8_matches_its_reference(dtype, tol, kv_scale):
    lens_q, ctx_lens = [5, 0, 19, 1], [5, 3, 27, 9]
    _, _, k8, v8, bt, ctx = _paged_fp8(ctx_lens, kv_scale)
    cu = torch.tensor([0, 5, 5, 24, 25], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens_q), 8, 16, device=DEV).to(dtype)
    want = attention.prefill_attention_ref(q, k8, v8, bt, ctx, cu, 0.3, kv_scale)
    got = attention.prefill_attention(q, k8, v8, bt, ctx, cu, 0.3, block_m=16, block_n=16, kv_scale=kv_scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _rows_bound(q, k, v, scale, kv_scale, q_pos):
    """The module's bound for q [M, H, D] over k/v [N, Hkv, D] (fp32, unquantized), query i seeing keys
    0..q_pos[i]: [M, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    err = torch.einsum("mhd,nhd->mhn", q.abs(), U * k.abs() + SUB * kv_scale[0]) * scale  # [M, H, N]
    seen = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [M, N]
    e = err.masked_fill(~seen[:, None, :], 0.0).amax(-1)  # [M, H]
    vmax = (v.abs()[None] * seen[:, :, None, None]).amax(1)  # [M, H, D]
    return (torch.expm1(2 * e)[..., None] + U) * vmax + SUB * kv_scale[1] + 1e-5


def attention_bound(q, kf, vf, tables, lens, cu, scale, kv_scale):
    """The bound of the module's docstring for each output of a packed prefill (queries at the end of each row's
    context), from the unquantized caches."""
    out = torch.zeros_like(q, dtype=torch.float32)
    bs = kf.shape[1]
    for b in range(tables.shape[0]):
        lo, hi, n = int(cu[b]), int(cu[b + 1]), int(lens[b])
        if hi == lo:
            continue
        idx = torch.arange(n, device=q.device)
        blocks = tables[b][idx // bs].long()
        pos = torch.arange(n - (hi - lo), n, device=q.device)
        out[lo:hi] = _rows_bound(q[lo:hi].float(), kf[blocks, idx % bs], vf[blocks, idx % bs], scale, kv_scale, pos)
    return out


@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.05, 0.05), (4.0, 0.5)])
@pytest.mark.parametrize("spread", [0.3, 3.0])
def test_fp8_reference_is_within_the_derived_bound_of_float_attention(kv_scale, spread):
    """Prefill and decode references over the FP8 caches against the same over the unquantized float32 caches:
    every output within the module's bound (which grows with the scores' size: exp(2E)); and the bound is not
    loose by orders: the largest error reaches a part of it. Where the scores are small, a read that drops the
    scales breaks it."""
    lens_q, ctx_lens = [5, 0, 19, 1, 40], [5, 3, 27, 9, 40]
    kf, vf, k8, v8, bt, ctx = _paged_fp8(ctx_lens, kv_scale, d=32, nblocks=60, spread=spread)
    cu = torch.tensor([0, 5, 5, 24, 25, 65], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens_q), 8, 32, device=DEV)
    scale = 32**-0.5
    exact = attention.prefill_attention_ref(q, kf, vf, bt, ctx, cu, scale)
    fp8 = attention.prefill_attention_ref(q, k8, v8, bt, ctx, cu, scale, kv_scale)
    bound = attention_bound(q, kf, vf, bt, ctx, cu, scale, kv_scale)
    err = (fp8 - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((err / bound).max()) > 0.02  # a worst case: it takes every rounding error aligned, none cancelling
    dropped = attention.prefill_attention_ref(q, k8, v8, bt, ctx, cu, scale, (1.0, 1.0))
    if kv_scale != (1.0, 1.0) and spread < 1:  # small scores: the bound is near u max|v|, which a lost scale passes
        assert not bool(((dropped - exact).abs() <= bound).all())
    last = cu[1:].long() - 1  # each row's last query is the decode query at that context
    rows = [b for b in range(len(lens_q)) if lens_q[b]]
    dec = attention.decode_attention_ref(q[last[rows]], k8, v8, bt[rows], ctx[rows], scale, kv_scale)
    assert bool(((dec - exact[last[rows]]).abs() <= bound[last[rows]]).all())


def test_the_bound_is_the_rounding_of_e4m3():
    """The unit roundoff the bound takes is e4m3's: every value in the normal range reads back within u relative,
    and some value gets close to it (so u is not chosen loose)."""
    x = torch.linspace(2.0**-6, 440.0, 200001)
    rel = (quantize_kv_ref(x, 1.0, FP8_KV).float() - x).abs() / x
    assert float(rel.max()) <= U and float(rel.max()) > 0.99 * U / (1 + U)  # the worst: (1 + u) rounded to 1
    tiny = torch.linspace(0, 2.0**-6, 1001)
    assert float((quantize_kv_ref(tiny, 1.0, FP8_KV).float() - tiny).abs().max()) <= SUB
    assert math.isclose(torch.finfo(FP8_KV).max, kv_cache.FP8_MAX)
