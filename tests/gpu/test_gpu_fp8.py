"""FP8 products on an sm_90 GPU (``kernels.fp8_linear``): the Triton activation quantization against torch's, and
``torch._scaled_mm`` with its epilogue scales against the float32 reference at Llama-3-8B's layer sizes, eagerly
and replayed from a CUDA graph; then a tiny FP8 checkpoint through the GPU runner against the reference model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down: [N, K]
ROWS = [1, 8, 64, 300, 2048]


@pytest.fixture(autouse=True)
def _hopper() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 row-wise scaled products need sm_90")


def schemes(n: int, k: int) -> dict:
    from gpu_engine.models.fp8_weight import Fp8Weight, quantize_fp8

    w = torch.randn(n, k, device="cuda") * 0.02
    channel, tensor = quantize_fp8(w), quantize_fp8(w, per_tensor=True, act_per_tensor=True)
    static = Fp8Weight(tensor.weight, tensor.scale, True, False, torch.tensor([0.02], device="cuda"))
    return {"channel/token": channel, "tensor/tensor": tensor, "tensor/static": static}


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_scaled_mm_matches_the_reference(M: int, shape: tuple[int, int]) -> None:
    from gpu_engine.kernels.fp8_linear import fp8_linear, fp8_linear_ref, quantize_rows, quantize_rows_ref

    n, k = shape
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    for name, w in schemes(n, k).items():
        q, s = quantize_rows(x, w)
        qr, sr = quantize_rows_ref(x, w)
        torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
        differ = (q.float() != qr.float()).float().mean().item()
        assert differ < 1e-3, (name, differ)  # a tie rounded the other way at most, now and then
        got, want = fp8_linear(x, w), fp8_linear_ref(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (M, n)
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_fp8_linear_is_captured_by_a_cuda_graph() -> None:
    from gpu_engine.kernels.fp8_linear import fp8_linear

    n, k = SHAPES[0]
    w = schemes(n, k)["channel/token"]
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, w)  # compile the Triton program outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, w))


@pytest.mark.parametrize("gemv_rows", [0, 128], ids=["fp8_linear", "fp8_gemv"])
def test_runner_on_an_fp8_checkpoint(tmp_path: Path, gemv_rows: int) -> None:
    """The runner on an FP8 checkpoint, its products through `fp8_linear` (W8A8) or, for steps of up to
    `gemv_rows` rows, the weight-only `fp8_gemv` (`KernelPlan.fp8_gemv_rows`), against the same stored values."""
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kernels.plan import KernelPlan
    from gpu_engine.kv_cache import KVCache
    from gpu_engine.models.attention import build_metadata
    from gpu_engine.models.loader import load_gpu_weights
    from tests.test_fp8 import STEPS, tiny_model, with_linears, write_checkpoint

    model, hf = tiny_model("qwen3")
    write_checkpoint(tmp_path / "ckpt", model, hf, "ct-channel-token")
    got = load_gpu_weights(tmp_path / "ckpt", dtype=torch.bfloat16, device="cuda")
    cfg = got.config
    assert all(w.weight.is_cuda for w in got.quantized.values())
    runner = GpuModelRunner(got.model, KVCache(cfg, 16, 4, dtype=torch.bfloat16, device="cuda"),
                            RunnerLimits(4, 32, 8), quantized=got.quantized,
                            plan=KernelPlan("cublas", fp8_gemv_rows=gemv_rows))
    assert (runner.fp8_scratch is not None) == bool(gemv_rows)
    # the reference on the CPU (its attention is the CPU engine's): the same stored FP8 values, float32 products
    on_cpu = {name: w.to("cpu") for name, w in got.quantized.items()}
    reference = with_linears(copy.deepcopy(got.model).cpu(), on_cpu, False)
    ref_kv = KVCache(cfg, 16, 4, dtype=torch.bfloat16, device="cpu")
    g = torch.Generator().manual_seed(1)
    for seqs, decode, tokens in zip(STEPS, (False, True, False), (32, 4, 16), strict=True):
        meta = build_metadata(seqs, 4)
        ids = torch.randint(0, cfg.vocab_size, (meta.positions.shape[0],), generator=g)
        want = reference(ids, meta, ref_kv)
        runner.stage(ids.cuda(), build_metadata(seqs, 4, device="cuda"))
        runner.forward(4, tokens, decode)
        # the runner keeps bf16 activations between its products, the reference float32: an activation that
        # rounds to a neighbouring FP8 value (one e4m3 step is 6.25% of it) moves a logit of this tiny random
        # model by up to 5.6% of the largest one (measured on an H100); the bound is 10%
        got_logits = runner.buffers.logits[: len(seqs)].float().cpu()
        bound = 0.10 * float(want.float().abs().max())
        assert float((got_logits - want.float()).abs().max()) <= bound, (got_logits - want.float()).abs().max()


def test_a_requests_logits_across_the_gemv_and_cublaslt_paths_stay_within_both_bounds(tmp_path: Path) -> None:
    """Under a plan with `fp8_gemv_rows` (the h100 plan's 8), one request's decode step alone (1 row: the GEMV) and
    beside 11 others (12 rows: cuBLASLt's W8A8 product) round differently; its logits stay within twice the bound
    each path keeps to the reference (`test_runner_on_an_fp8_checkpoint`: 10% of the largest logit)."""
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.kernels.plan import KernelPlan
    from gpu_engine.kv_cache import KVCache
    from gpu_engine.models.attention import build_metadata
    from gpu_engine.models.loader import load_gpu_weights
    from tests.test_fp8 import tiny_model, write_checkpoint

    model, hf = tiny_model("qwen3")
    write_checkpoint(tmp_path / "ckpt", model, hf, "ct-channel-token")
    got = load_gpu_weights(tmp_path / "ckpt", dtype=torch.bfloat16, device="cuda")
    cfg = got.config
    runner = GpuModelRunner(got.model, KVCache(cfg, 64, 4, dtype=torch.bfloat16, device="cuda"),
                            RunnerLimits(16, 64, 8), quantized=got.quantized,
                            plan=KernelPlan("gemv8", fp8_gemv_rows=8))
    g = torch.Generator().manual_seed(3)

    def step(seqs: list, ids: torch.Tensor, decode: bool) -> torch.Tensor:
        runner.stage(ids.cuda(), build_metadata(seqs, 4, device="cuda"))
        runner.forward(len(seqs), int(ids.shape[0]), decode)
        torch.cuda.synchronize()
        return runner.buffers.logits[: len(seqs)].float().cpu()

    step([(0, 7, [0, 1])], torch.randint(0, cfg.vocab_size, (7,), generator=g), False)  # the request's prompt
    token = torch.randint(0, cfg.vocab_size, (1,), generator=g)
    alone = step([(7, 1, [0, 1])], token, True)[0]
    others = [(5, 1, [2 + 2 * k, 3 + 2 * k]) for k in range(11)]
    crowd = step([(7, 1, [0, 1]), *others], torch.cat([token, torch.randint(0, cfg.vocab_size, (11,), generator=g)]),
                 True)[0]
    assert bool(alone.isfinite().all()) and bool(crowd.isfinite().all())
    bound = 2 * 0.10 * float(alone.abs().max())
    assert float((alone - crowd).abs().max()) <= bound, (alone - crowd).abs().max()
