"""The sort-free filter boundary and the per-row log-probs against the reference (`gpu_engine.sampling`).

Tiny shapes through Triton's interpreter on the CPU; real sizes in tests/gpu/test_gpu_sampling.py.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine import sampling as ref  # noqa: E402
from gpu_engine.kernels.logprobs import logprobs_ref, token_logprobs  # noqa: E402
from gpu_engine.kernels.sampling import sample  # noqa: E402
from gpu_engine.kernels.sampling_select import boundary_mask, filter_boundary  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(B: int, V: int, seed: int) -> tuple[torch.Tensor, ...]:
    """bf16-rounded logits (many ties, as a bf16 LM head gives), some -inf, and mixed filter settings."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * torch.rand(B, 1, generator=g) * 6).bfloat16().float()
    x[: B // 8, : V // 4] = float("-inf")  # masked by a processor
    x[B // 8: B // 4] = torch.round(x[B // 8: B // 4])  # whole runs of equal logits
    k = torch.randint(-1, 40, (B,), generator=g).int()
    k[:3] = torch.tensor([1, V - 1, V], dtype=torch.int32)
    p = torch.where(torch.rand(B, generator=g) < 0.7, torch.rand(B, generator=g), torch.ones(B))
    p[3:6] = torch.tensor([0.0, float("nan"), 1e-6])
    min_p = torch.where(torch.rand(B, generator=g) < 0.3, torch.rand(B, generator=g) * 0.3, torch.zeros(B))
    min_p[6] = 1.5  # above the top token's own ratio: only the top token stays
    return x, k, p, min_p


@pytest.mark.parametrize("V", [200, 513])
def test_boundary_keeps_exactly_what_filter_logits_keeps(V):
    B = 48
    x, k, p, min_p = _rows(B, V, V)
    temp = torch.ones(B)
    keys, counts = filter_boundary(x.to(DEV), temp.to(DEV), k.to(DEV), p.to(DEV), min_p.to(DEV))
    got = boundary_mask(x, keys.cpu(), counts.cpu())
    want = ref.filter_logits(x, k.long(), p, min_p) > float("-inf")
    finite = x > float("-inf")  # the reference cannot show whether it kept a -inf token
    assert torch.equal(got & finite, want)
    assert bool(got.any(-1).all())  # the top token always stays


def test_boundary_is_everything_for_greedy_and_unfiltered_rows():
    x = torch.randn(3, 64).to(DEV)
    temp = torch.tensor([0.0, 1.0, 0.0], device=DEV)
    k = torch.tensor([5, 0, 0], dtype=torch.int32, device=DEV)
    p, min_p = torch.tensor([0.5, 1.0, 1.0], device=DEV), torch.zeros(3, device=DEV)
    keys, counts = filter_boundary(x, temp, k, p, min_p)
    assert bool(boundary_mask(x.cpu(), keys.cpu(), counts.cpu()).all())


def _kernel(logits, specs, seeds, steps, sort_free=True, want=None, k=3):
    B, dev = logits.shape[0], logits.device

    def col(attr, dtype):
        return torch.tensor([getattr(s, attr) for s in specs], dtype=dtype, device=dev)

    out = (torch.full((B,), -1, device=dev), torch.full((B,), float("nan"), device=dev),
           torch.full((B, k), -1, device=dev), torch.full((B, k), float("nan"), device=dev))
    sample(logits, col("temperature", torch.float32), col("top_k", torch.int32), col("top_p", torch.float32),
           col("min_p", torch.float32), seeds, steps, *out, sort_free=sort_free, want_logprobs=want)
    return out


SPECS = [ref.SamplingSpec(0.0), ref.SamplingSpec(1.0), ref.SamplingSpec(0.7, top_k=4),
         ref.SamplingSpec(1.0, top_p=0.6), ref.SamplingSpec(0.8, min_p=0.2),
         ref.SamplingSpec(1.3, top_k=20, top_p=0.9, min_p=0.01), ref.SamplingSpec(2.0, top_k=2),
         ref.SamplingSpec(0.5, top_p=0.3)]


def test_sort_free_sampling_draws_the_reference_tokens():
    B, V = len(SPECS), 300
    seeds = torch.tensor([3, -7, 2**40 + 1, 11, 12, 13, 14, 15], device=DEV)
    g = torch.Generator().manual_seed(5)
    moved = 0
    for step in range(4):
        logits = (torch.randn(B, V, generator=g) * 3).bfloat16().float().to(DEV)
        steps = torch.arange(B, device=DEV) * 100 + step
        want = ref.sample(logits, SPECS, steps, seeds)
        got = _kernel(logits, SPECS, seeds, steps)
        assert torch.equal(got[0], want.tokens)
        assert torch.equal(_kernel(logits, SPECS, seeds, steps, sort_free=False)[0], want.tokens)
        moved += int((got[0] != logits.argmax(-1)).sum())
    assert moved  # the random rows really drew


def test_logprobs_only_where_asked_and_tokens_unchanged():
    B, V = len(SPECS), 300
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(2)) * 3).to(DEV)
    seeds, steps = torch.arange(B, device=DEV), torch.zeros(B, dtype=torch.int64, device=DEV)
    want = torch.tensor([1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.int32, device=DEV)
    every = _kernel(logits, SPECS, seeds, steps)
    some = _kernel(logits, SPECS, seeds, steps, want=want)
    none = _kernel(logits, SPECS, seeds, steps, want=torch.zeros_like(want))
    assert torch.equal(some[0], every[0]) and torch.equal(none[0], every[0])
    lp, ids, tlp = logprobs_ref(logits, want, every[0], 3)
    torch.testing.assert_close(some[1], lp, rtol=1e-5, atol=1e-5)
    assert torch.equal(some[2], ids)
    torch.testing.assert_close(some[3], tlp, rtol=1e-5, atol=1e-5)
    full = ref.sample(logits, [ref.SamplingSpec(s.temperature, s.top_p, s.top_k, s.min_p, int(seeds[i]),
                                                want_logprobs=True) for i, s in enumerate(SPECS)], steps, seeds)
    torch.testing.assert_close(every[1], full.logprobs, rtol=1e-5, atol=1e-5)
    assert bool((none[1] == 0).all() and (none[2] == 0).all())


def test_top_logprobs_break_ties_by_index_without_repeats():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], device=DEV)
    ids = torch.zeros(1, 4, dtype=torch.int64, device=DEV)
    vals, lp = torch.zeros(1, 4, device=DEV), torch.zeros(1, device=DEV)
    token_logprobs(logits, torch.ones(1, dtype=torch.int32, device=DEV), torch.tensor([5], device=DEV), lp, ids,
                   vals)
    assert ids.tolist() == [[1, 3, 4, 2]]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 5])


def test_launchers_reject_bad_inputs():
    x = torch.zeros(2, 8, device=DEV)
    i32, f32 = torch.zeros(2, dtype=torch.int32, device=DEV), torch.zeros(2, device=DEV)
    with pytest.raises(ValueError, match="top_k"):
        filter_boundary(x, f32, i32.long(), f32, f32)
    with pytest.raises(ValueError, match="scaled"):
        filter_boundary(x.half(), f32, i32, f32, f32)
    ids, vals = torch.zeros(2, 3, dtype=torch.int64, device=DEV), torch.zeros(2, 3, device=DEV)
    tok = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="want"):
        token_logprobs(x, f32, tok, f32, ids, vals)
    with pytest.raises(ValueError, match="out_top_logprobs"):
        token_logprobs(x, i32, tok, f32, ids, vals[:, :2])
    with pytest.raises(ValueError, match="row stride"):
        token_logprobs(x, i32, tok, f32, ids, torch.zeros(2, 6, device=DEV)[:, :3])


def test_runner_stages_want_logprobs_and_pads_it_off():
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kv_cache import KVCache
    from gpu_engine.models.attention import build_metadata
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty, init_random

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
                               "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "max_position_embeddings": 64})
    model = build_empty(cfg, torch.float32, "cpu")
    init_random(model, 0)
    runner = GpuModelRunner(model, KVCache(cfg, 16, 4), RunnerLimits(4, 16, 4))
    buf = runner.buffers
    assert buf.want_logprobs.tolist() == [1, 1, 1, 1]  # a writer that stages nothing keeps every row's
    meta = build_metadata([(0, 3, [0]), (0, 2, [1])], 4)
    ids = torch.tensor([5, 6, 7, 8, 9])
    runner.stage(ids, meta, {"want_logprobs": torch.tensor([0, 1], dtype=torch.int32)})
    assert buf.want_logprobs.tolist() == [0, 1, 0, 0]
    runner.forward(4, 16, False)
    logp = torch.log_softmax(buf.logits[:2], -1)
    assert float(buf.token_logprobs[0]) == 0.0
    torch.testing.assert_close(buf.token_logprobs[1], logp[1, buf.next_tokens[1]], rtol=1e-5, atol=1e-5)
    runner.stage(ids, meta)
    assert buf.want_logprobs.tolist() == [1, 1, 0, 0]
