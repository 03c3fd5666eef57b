"""The sort-free sampler and the per-row log-probs at real vocabulary sizes, against the reference."""

import dataclasses

import pytest
import torch

from gpu_engine import sampling as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"
SPECS = [ref.SamplingSpec(0.0), ref.SamplingSpec(1.0), ref.SamplingSpec(0.7, top_k=40),
         ref.SamplingSpec(1.0, top_p=0.9), ref.SamplingSpec(0.8, min_p=0.05),
         ref.SamplingSpec(1.1, top_k=100, top_p=0.95, min_p=0.01), ref.SamplingSpec(2.0, top_k=1),
         ref.SamplingSpec(0.5, top_p=0.5)]


@pytest.mark.parametrize("V", [32000, 128256, 151936])
def test_gpu_boundary_matches_filter_logits(V):
    from gpu_engine.kernels.sampling_select import boundary_mask, filter_boundary

    B = 64
    g = torch.Generator(device=DEV).manual_seed(V)
    x = (torch.randn(B, V, device=DEV, generator=g) * 4).bfloat16().float()  # ties, as a bf16 head gives
    k = torch.randint(0, 200, (B,), device=DEV, generator=g).int()
    p = torch.where(torch.rand(B, device=DEV, generator=g) < 0.8, torch.rand(B, device=DEV, generator=g),
                    torch.ones(B, device=DEV))
    min_p = torch.where(torch.rand(B, device=DEV, generator=g) < 0.3, torch.rand(B, device=DEV, generator=g) * 0.1,
                        torch.zeros(B, device=DEV))
    keys, counts = filter_boundary(x, torch.ones(B, device=DEV), k, p, min_p)
    got = boundary_mask(x, keys, counts)
    want = ref.filter_logits(x, k.long(), p, min_p) > float("-inf")
    exact = p >= 1  # top-k and min-p only: counts and values, no sums in another order
    assert torch.equal(got[exact], want[exact])
    # a nucleus edge may move by tokens whose probabilities sum to within float rounding of top_p
    moved = torch.where(got != want, torch.softmax(x, -1), 0.0).sum(-1)
    assert float(moved.max()) < 1e-5


def _cols(specs):
    def col(attr, dtype):
        return torch.tensor([getattr(s, attr) for s in specs], dtype=dtype, device=DEV)

    return (col("temperature", torch.float32), col("top_k", torch.int32), col("top_p", torch.float32),
            col("min_p", torch.float32))


@pytest.mark.parametrize("B", [8, 128])
def test_gpu_sort_free_sampling_and_masked_logprobs(B):
    from gpu_engine.kernels.sampling import sample

    V = 128256
    specs = [dataclasses.replace(SPECS[i % len(SPECS)], num_top_logprobs=5) for i in range(B)]
    logits = (torch.randn(B, V, device=DEV) * 4).bfloat16().float()
    seeds = torch.arange(B, device=DEV) * 7919 - 3
    steps = torch.arange(B, device=DEV) * 1000
    want = ref.sample(logits, specs, steps, seeds)
    outs = {}
    for name, kw in {"sort_free": {}, "sort": {"sort_free": False},
                     "masked": {"want_logprobs": (torch.arange(B, device=DEV) % 3 == 0).int()}}.items():
        out = (torch.full((B,), -1, device=DEV), torch.full((B,), float("nan"), device=DEV),
               torch.full((B, 5), -1, device=DEV), torch.full((B, 5), float("nan"), device=DEV))
        sample(logits, *_cols(specs), seeds, steps, *out, **kw)
        outs[name] = out
    assert torch.equal(outs["sort_free"][0], want.tokens)
    assert torch.equal(outs["sort"][0], want.tokens)
    assert torch.equal(outs["masked"][0], want.tokens)
    torch.testing.assert_close(outs["sort_free"][1], want.logprobs, rtol=1e-5, atol=1e-5)
    # bf16 logits tie: the top entries must be the same values (ours break ties by lowest index)
    assert torch.equal(logits.gather(1, outs["sort_free"][2]), logits.gather(1, want.top_ids))
    rows = torch.arange(B, device=DEV) % 3 == 0
    torch.testing.assert_close(outs["masked"][1][rows], want.logprobs[rows], rtol=1e-5, atol=1e-5)
    assert bool((outs["masked"][1][~rows] == 0).all())
