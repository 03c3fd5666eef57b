"""The decode-path kernels against their references: the fused QK-norm + RoPE + KV write, and the
split-KV decode attention at the split sizes small batches use. Tiny shapes (interpreter on the CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine.kernels import attention, rope  # noqa: E402
from gpu_engine.kernels.qkv_prep import qkv_prep, qkv_prep_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(T, hq, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(DEV, dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d:].view(T, hk, d)
    return qkv, q, k, v


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rot", [16, 8])  # full and partial rotary
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_qkv_prep_matches_the_unfused_kernels(norm, rot, dtype, tol):
    T, hq, hk, d = 5, 4, 2, 16
    _, q, k, v = _qkv(T, hq, hk, d, dtype)
    cache = rope.build_rope_cache(rot, 64, 10000.0, device=DEV)
    pos = torch.tensor([0, 3, 17, 63, 8], device=DEV)
    slots = torch.tensor([2, -1, 9, 30, 11], device=DEV)
    qn = kn = None
    if norm:
        qn, kn = torch.rand(d, device=DEV).to(dtype) + 0.5, torch.rand(d, device=DEV).to(dtype) + 0.5
    kc, vc = torch.zeros(8, 4, hk, d, device=DEV, dtype=dtype), torch.zeros(8, 4, hk, d, device=DEV, dtype=dtype)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = qkv_prep_ref(q, k, v, pos, cache, want_kc, want_vc, slots, qn, kn, 1e-6)
    qkv_prep(q, k, v, pos, cache, kc, vc, slots, qn, kn, 1e-6)
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kc.float(), want_kc.float(), rtol=tol, atol=tol)
    assert torch.equal(vc, want_vc)
    assert not bool(kc.view(-1, hk, d)[[0, 1]].any())  # slot -1 wrote nothing


def test_qkv_prep_rejects_bad_inputs():
    _, q, k, v = _qkv(2, 4, 2, 16, torch.float32)
    cache = rope.build_rope_cache(16, 8, 10000.0, device=DEV)
    kc = torch.zeros(2, 4, 2, 16, device=DEV)
    pos, slots = torch.zeros(2, dtype=torch.int64, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="slot_mapping"):
        qkv_prep(q, k, v, pos, cache, kc, kc.clone(), slots.int())
    with pytest.raises(ValueError, match="k_cache"):
        qkv_prep(q, k, v, pos, cache, kc[:, :, :1], kc.clone(), slots)
    with pytest.raises(ValueError, match="go together"):
        qkv_prep(q, k, v, pos, cache, kc, kc.clone(), slots, q_norm=torch.ones(16, device=DEV))
    with pytest.raises(ValueError, match="rotary"):
        qkv_prep(q, k, v, pos, torch.zeros(8, 18, device=DEV), kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="multiple"):
        qkv_prep(q[:, :3], k, v, pos, cache, kc, kc.clone(), slots)


def test_decode_partition_is_the_same_for_every_batch():
    """A row's splits (so its sums) do not depend on the batch it runs in: greedy tokens stay batch-invariant."""
    assert {attention.decode_partition(b, 8) for b in (1, 8, 16, 32, 64, 128, 256)} == {256}


def test_decode_attention_with_fine_splits_and_empty_rows():
    from tests.test_kernels import _paged

    kc, vc, bt, ctx = _paged([1, 130, 0, 64, 65], hkv=2, d=16, bs=4, nblocks=80)
    q = torch.randn(5, 8, 16, device=DEV)
    want = attention.decode_attention_ref(q, kc, vc, bt, ctx, 0.25)
    out = torch.full_like(q, float("nan"))
    attention.decode_attention(q, kc, vc, bt, ctx, 0.25, out=out, partition_size=32, block_n=16)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def _linear_case(M, act, dtype):
    """x [M, K] (or [M, 2K] for the SiLU), w [70, 200] (neither a multiple of the tiles), and a poisoned out."""
    g = torch.Generator().manual_seed(M)
    K, N = 200, 70
    x = torch.randn(M, 2 * K if act else K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEV, dtype)
    return x, w, torch.full((M, N), float("nan"), device=DEV, dtype=dtype)


def _refuses_what_every_linear_refuses(launch, max_rows: int):
    """A K that does not match, too many rows, an unknown activation, mixed dtypes."""
    x, w = torch.zeros(2, 8, device=DEV), torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="w: shape"):
        launch(x, w, act="silu_mul")
    with pytest.raises(ValueError, match=f"at most {max_rows}"):
        launch(torch.zeros(max_rows + 1, 8, device=DEV), w)
    with pytest.raises(ValueError, match="act"):
        launch(x, w, act="gelu")
    with pytest.raises(ValueError, match="dtype"):
        launch(x, w.half())
    return x, w


@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("act", [None, "silu_mul"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3)])
@pytest.mark.parametrize("per_sm", [1, 8])  # K in one slice or in four (the CPU counts as 4 SMs)
def test_tiled_linear_matches_the_reference(M, act, dtype, tol, per_sm):
    from gpu_engine.kernels.tiled_linear import _sms, linear_ref, tiled_linear, tiled_split

    x, w, out = _linear_case(M, act, dtype)
    split, _ = tiled_split(w.shape[0], w.shape[1], 16, 32, per_sm, _sms(torch.device(DEV)))
    assert (split > 1) == (per_sm > 1) or DEV == "cuda"
    tiled_linear(x, w, act=act, out=out, block_n=16, block_k=32, per_sm=per_sm)
    torch.testing.assert_close(out.float(), linear_ref(x, w, act).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("M", [1, 5, 17])
@pytest.mark.parametrize(("act", "norm", "add"), [("glu", False, False), (None, True, False), ("glu", True, False),
                                                  (None, False, True), ("glu", True, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3)])
@pytest.mark.parametrize("per_sm", [1, 8])
def test_tiled_linear_fused_forms_match_the_unfused_steps(M, act, norm, add, dtype, tol, per_sm):
    """The forms a decode layer's linears take: the gate_up product with silu(gate) * up as its output (glu), the
    RMSNorm of x applied as it is loaded (norm), the output added into the residual stream (add): each against the
    unfused steps in turn (`tiled_ref`), whole and split over K (the glu partials, gate then up, through the same
    workspace). With add the residual is written in place and returned. The fused norm is refused in fp16 (x times
    the norm's weight is rounded before 1 / RMS scales the product, and a large x would pass fp16's range)."""
    from gpu_engine.kernels.tiled_linear import tiled_linear, tiled_ref

    g = torch.Generator().manual_seed(M + 100 * per_sm)
    K, N = 200, 35
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, dtype)  # rows far from unit RMS: the norm must scale them
    w = (torch.randn(2 * N if act else N, K, generator=g) * 0.1).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    residual = torch.randn(M, N, generator=g).to(DEV, dtype)
    if norm and dtype == torch.float16:
        with pytest.raises(ValueError, match="fp16 would overflow"):
            tiled_linear(x, w, act=act, block_n=16, block_k=32, per_sm=per_sm, norm=(nw, 1e-5))
        return
    want = tiled_ref(x, w, act, (nw, 1e-5) if norm else None, residual if add else None)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=dtype)
    kwargs = {"block_n": 16, "block_k": 32, "per_sm": per_sm, "norm": (nw, 1e-5) if norm else None}
    if add:
        held = residual.clone()
        got = tiled_linear(x, w, act=act, residual=held, **kwargs)
        assert got.data_ptr() == held.data_ptr()
    else:
        got = tiled_linear(x, w, act=act, out=out, **kwargs)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("per_sm", [1, 8])
def test_tiled_linear_glu_gives_the_bits_of_the_product_then_the_silu_kernel(per_sm):
    """A glu launch whose programs take block_n / 2 gate and up rows each sums every column as plain launches with
    half the tile width over the gate and the up rows do (the same tiles, so the same slices), and its
    SiLU-and-multiply rounds as `activation.silu_and_mul` does: the same bits, so the fusion changes no token."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.tiled_linear import tiled_linear

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 200, generator=g).to(DEV)
    w = (torch.randn(140, 200, generator=g) * 0.1).to(DEV)
    plain = torch.cat([tiled_linear(x, half, block_n=16, block_k=32, per_sm=per_sm) for half in w.chunk(2)], 1)
    assert torch.equal(tiled_linear(x, w, act="glu", block_n=32, block_k=32, per_sm=per_sm), silu_and_mul(plain))


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("per_sm", [1, 8])
@pytest.mark.parametrize(("qk_norm", "rot", "norm"), [(False, 16, False), (True, 16, True), (True, 8, False),
                                                      (False, 8, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3)])
def test_tiled_linear_heads_give_the_qkv_prep_of_the_product(M, per_sm, qk_norm, rot, norm, dtype, tol):
    """The qkv product with `qkv_prep` as its output (a program a head, whole or split over K; QK norms or not;
    full or partial rotary; the layer's RMSNorm on the x tiles or not): the query heads rotated in the product's
    columns and the keys and values in the caches at each row's slot (none for slot -1), as the product followed
    by `qkv_prep_ref` leaves them; the caches' other slots untouched."""
    from gpu_engine.kernels.tiled_linear import Heads, tiled_linear, tiled_ref

    g = torch.Generator().manual_seed(M + 10 * per_sm + rot)
    HQ, HK, D, K = 4, 2, 16, 64
    N = (HQ + 2 * HK) * D
    x = (torch.randn(M, K, generator=g) * 2).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.2).to(DEV, dtype)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV, dtype)
    cache = rope.build_rope_cache(rot, 64, 10000.0, device=DEV)
    pos = torch.tensor([0, 3, 17, 63, 8][:M], device=DEV)
    slots = torch.tensor([2, -1, 9, 30, 11][:M], device=DEV)
    qn = kn = None
    if qk_norm:
        qn, kn = (torch.rand(D, generator=g) + 0.5).to(DEV, dtype), (torch.rand(D, generator=g) + 0.5).to(DEV, dtype)
    caches = [torch.full((8, 4, HK, D), 7.0, device=DEV, dtype=dtype) for _ in range(4)]
    got_heads = Heads(HQ, HK, pos, cache, caches[0], caches[1], slots, qn, kn, 1e-6)
    want_heads = Heads(HQ, HK, pos, cache, caches[2], caches[3], slots, qn, kn, 1e-6)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=dtype)
    if norm and dtype == torch.float16:  # refused, as in the fused forms' test
        with pytest.raises(ValueError, match="fp16 would overflow"):
            tiled_linear(x, w, out=out, block_k=32, per_sm=per_sm, heads=got_heads, norm=(nw, 1e-5))
        return
    tiled_linear(x, w, out=out, block_k=32, per_sm=per_sm, heads=got_heads, norm=(nw, 1e-5) if norm else None)
    want = tiled_ref(x, w, norm=(nw, 1e-5) if norm else None, heads=want_heads)
    torch.testing.assert_close(out[:, : HQ * D].float(), want[:, : HQ * D].float(), rtol=tol, atol=tol)
    for got_cache, want_cache in zip(caches[:2], caches[2:], strict=True):
        torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=tol, atol=tol)
        assert int((got_cache != 7).any(-1).any(-1).sum()) == int((slots >= 0).sum())  # the rows' slots, no other
    with pytest.raises(ValueError, match="heads: 3 query"):
        tiled_linear(x, w, heads=got_heads._replace(num_heads=3))
    with pytest.raises(ValueError, match="heads: the qkv_prep output takes a plain product"):
        tiled_linear(x, w, heads=got_heads, residual=torch.zeros(M, N, device=DEV, dtype=dtype))


def test_tiled_linear_refuses_fused_forms_it_cannot_take():
    from gpu_engine.kernels.tiled_linear import tiled_linear

    x, w, nw = torch.zeros(2, 64, device=DEV), torch.zeros(64, 64, device=DEV), torch.ones(64, device=DEV)
    with pytest.raises(ValueError, match="glu needs"):
        tiled_linear(x, torch.zeros(63, 64, device=DEV), act="glu")
    with pytest.raises(ValueError, match="norm weight"):
        tiled_linear(x, w, norm=(nw[:32], 1e-5))
    with pytest.raises(ValueError, match="norm: the fused RMSNorm"):
        tiled_linear(torch.zeros(2, 128, device=DEV), w, act="silu_mul", norm=(nw, 1e-5))
    with pytest.raises(ValueError, match="residual: must not alias"):
        tiled_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="writes into the residual"):
        tiled_linear(x, w, residual=torch.zeros(2, 64, device=DEV), out=torch.zeros(2, 64, device=DEV))


def test_tiled_split_covers_k_once_and_splits_only_narrow_outputs():
    """Slices are whole tiles deep, cover K once with none empty (a program that never counts would leave its
    tile unwritten), and split only where the column tiles leave SMs idle: on 132 SMs with 64-column tiles, the
    Llama-3-8B o and down projections in 2 slices, qkv in 4, gate_up and the LM head whole."""
    from gpu_engine.kernels.tiled_linear import MAX_SPLIT, tiled_split

    got = {name: tiled_split(N, K, 64, 128, 1, 132)[0] for name, N, K in (
        ("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
        ("lm_head", 128256, 4096))}
    assert got == {"qkv": 4, "o": 2, "gate_up": 1, "down": 2, "lm_head": 1}
    for N in (16, 70, 4096):
        for K in (1, 31, 32, 200, 14336):
            for block_k in (16, 32, 128):
                for per_sm in (1, 2, 8):
                    split, width = tiled_split(N, K, 16, block_k, per_sm, 132)
                    assert 1 <= split <= MAX_SPLIT and width % block_k == 0
                    assert (split - 1) * width < K <= split * width, (N, K, block_k, per_sm)


def test_tiled_linear_leaves_its_counters_zero_and_repeats_its_bits():
    """A split launch with the runner's shared scratch: the counts are back at zero for the next launch (a graph
    replays no memset), a second launch gives the same bits, and so does one on another weight in between."""
    from gpu_engine.kernels.tiled_linear import TiledConfig, tiled_linear, tiled_scratch

    g = torch.Generator().manual_seed(5)
    config = TiledConfig(32, 32, 8, 4, 2)
    x = torch.randn(9, 200, generator=g).to(DEV)
    w = (torch.randn(70, 200, generator=g) * 0.1).to(DEV)
    w2 = (torch.randn(40, 200, generator=g) * 0.1).to(DEV)
    scratch = tiled_scratch([(70, 200), (40, 200)], [config], DEV)
    assert scratch[0].numel() > 1  # these shapes split
    first = tiled_linear(x, w, **config._asdict(), scratch=scratch)
    assert int(scratch[1].abs().sum()) == 0
    tiled_linear(x, w2, **config._asdict(), scratch=scratch)
    assert torch.equal(tiled_linear(x, w, **config._asdict(), scratch=scratch), first)
    assert int(scratch[1].abs().sum()) == 0


def test_tiled_linear_rows_do_not_depend_on_their_neighbours_within_a_size():
    """Steps of 17 to 32 rows pad to 32: a row's sums are the same whichever of those sizes its step has."""
    from gpu_engine.kernels.tiled_linear import tiled_linear

    g = torch.Generator().manual_seed(12)
    x = torch.randn(32, 200, generator=g).to(DEV)
    w = (torch.randn(70, 200, generator=g) * 0.1).to(DEV)
    full = tiled_linear(x, w, block_n=32, block_k=32, per_sm=8)
    for M in (17, 24, 31):
        assert torch.equal(tiled_linear(x[:M], w, block_n=32, block_k=32, per_sm=8), full[:M]), M


def test_tiled_linear_rejects_bad_inputs():
    from gpu_engine.kernels.tiled_linear import MAX_ROWS, tiled_linear

    x, w = _refuses_what_every_linear_refuses(tiled_linear, MAX_ROWS)
    with pytest.raises(ValueError, match="powers of two"):
        tiled_linear(x, w, block_n=48)
    with pytest.raises(ValueError, match="contiguous"):  # the kernel steps along K with stride 1
        tiled_linear(torch.zeros(8, 2, device=DEV).t(), w)
    with pytest.raises(ValueError, match="scratch"):
        tiled_linear(torch.zeros(2, 64, device=DEV), torch.zeros(64, 64, device=DEV), block_n=16, block_k=16,
                     per_sm=8, scratch=(torch.empty(1, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV)))
