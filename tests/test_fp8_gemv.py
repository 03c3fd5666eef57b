"""The FP8-weight GEMV (``kernels.fp8_gemv``, W8A16) against its float32 reference: tiny shapes in the interpreter
on the CPU (fp32 and fp16: the interpreter's dot is wrong on bf16), the Llama-3-8B projections in bf16 on a GPU,
beside ``fp8_linear`` (W8A8) there, and replayed from a CUDA graph.

The bound. The kernel's float32 sum y' of a column differs from the exact y = s[n] * sum_k x[m, k] * wq[n, k] by its
accumulation order only (the codes are exact in x's dtype, the products exact in float32): at most
e = K * 2^-22 * s[n] * sum_k |x[m, k] * wq[n, k]| (a chain of K additions, a unit of 2^-24 doubled for truncating
tensor-core adds, and again for torch's own float32 product that stands for y). One rounding to x's dtype of p
mantissa bits then adds at most half an ulp: |out - y| <= 2^-(p+1) * (|y| + e) + e.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine.kernels import fp8_gemv as fp8_gemv_module  # noqa: E402
from gpu_engine.kernels.activation import silu_and_mul  # noqa: E402
from gpu_engine.kernels.fp8_gemv import (  # noqa: E402
    FMA_ROWS,
    FP8_CONFIGS,
    FP8_STEPS,
    Fp8Config,
    fp8_config,
    fp8_gemv,
    fp8_gemv_ref,
    fp8_gemv_scratch,
    fp8_grid,
)
from gpu_engine.kernels.tiled_linear import MAX_ROWS  # noqa: E402
from gpu_engine.models.fp8_weight import Fp8Weight, quantize_fp8  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # [N, K]
SMALL = 16  # tiny tiles for the interpreter: N and K then take several tiles and a ragged last one


def _weight(rows: int, k: int, seed: int, device: str = DEV) -> Fp8Weight:
    """An FP8 weight whose rows' scales differ by up to 100x (a scale applied to the wrong column shows)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * torch.logspace(-3, -1, rows).view(rows, 1)
    return quantize_fp8(w.to(device))


def _x(m: int, k: int, dtype: torch.dtype, seed: int, device: str = DEV) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _exact(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, e): the float32 product the kernel rounds, and the bound of its accumulation error (the docstring)."""
    codes = w.weight.float()
    y = (x.float() @ codes.T) * w.scale
    e = x.shape[1] * 2.0 ** -22 * (x.float().abs() @ codes.abs().T) * w.scale
    return y, e


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, w: Fp8Weight) -> None:
    y, e = _exact(x, w)
    half_ulp = 2.0 ** -(MANTISSA[out.dtype] + 1)
    excess = (out.float() - y).abs() - (half_ulp * (y.abs() + e) + e)
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"row {worst // y.shape[1]} column {worst % y.shape[1]}: {out.flatten()[worst]} "
                               f"against {y.flatten()[worst]}, {excess.max()} past the bound")


CPU_CASES = [("fma", 1), ("fma", 3), ("dot", 1), ("dot", 5), ("dot", 17), ("swap", 1), ("swap", 5), ("swap", 40)]


@pytest.mark.parametrize(("form", "M"), CPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_sm", [1, 8])  # K whole, or in slices (the CPU counts as 4 SMs)
def test_fp8_gemv_is_the_product_rounded_once(form: str, M: int, dtype: torch.dtype, per_sm: int) -> None:
    """N and K not multiples of the tiles (masked last tiles, ragged slices); the reference holds the same bound."""
    w = _weight(70, 200, seed=M)
    x = _x(M, 200, dtype, seed=100 + M)
    out = torch.full((M, 70), float("nan"), device=DEV, dtype=dtype)
    assert fp8_gemv(x, w, out=out, config=Fp8Config(SMALL * 2, SMALL * 2, per_sm, 4, 2, form)) is out
    assert_within_rounding(out, x, w)
    assert_within_rounding(fp8_gemv_ref(x, w), x, w)


@pytest.mark.parametrize("form", ["fma", "swap"])
@pytest.mark.parametrize("per_sm", [1, 8])
def test_fp8_gemv_glu_gives_the_bits_of_the_halves_then_the_silu_kernel(form: str, per_sm: int) -> None:
    """A glu launch (block_n / 2 gate rows and as many up rows a program, each half with its own scales) sums as
    plain launches of half the tile width over each half do, and its SiLU-and-multiply rounds as
    `activation.silu_and_mul` does; both against the reference too."""
    w, x = _weight(140, 200, seed=7), _x(3, 200, torch.float32, seed=8)
    gate, up = (Fp8Weight(c, s) for c, s in zip(w.weight.chunk(2), w.scale.chunk(2), strict=True))
    half = Fp8Config(SMALL * 2, SMALL * 2, per_sm, 4, 2, form)
    plain = torch.cat([fp8_gemv(x, part, config=half) for part in (gate, up)], 1)
    got = fp8_gemv(x, w, act="glu", config=half._replace(block_n=SMALL * 4))
    assert torch.equal(got, silu_and_mul(plain))
    torch.testing.assert_close(got, fp8_gemv_ref(x, w, "glu"), rtol=1e-5, atol=1e-5)


def test_fp8_gemv_strided_rows_and_default_configs() -> None:
    """x's rows 128 apart (a view), the configuration fp8_config picks for the step (fma at 1 row, swap after)."""
    w = _weight(48, 64, seed=1)
    for M in (1, 6):
        x = _x(M, 128, torch.float16, seed=M)[:, :64]
        assert_within_rounding(fp8_gemv(x, w), x, w)


def test_fp8_gemv_empty_steps() -> None:
    w = _weight(32, 64, seed=2)
    assert fp8_gemv(torch.zeros(0, 64, device=DEV), w).shape == (0, 32)
    empty_k = Fp8Weight(torch.zeros(32, 0, device=DEV).to(w.weight.dtype), w.scale)
    out = fp8_gemv(torch.zeros(3, 0, device=DEV), empty_k, out=torch.full((3, 32), 5.0, device=DEV))
    assert torch.equal(out, torch.zeros(3, 32, device=DEV))


def test_fp8_gemv_scratch_is_reused_and_left_zero() -> None:
    """A split launch with a model's scratch: the same bits as with its own, every count back to zero after."""
    w, x = _weight(70, 200, seed=3), _x(5, 200, torch.float32, seed=4)
    config = Fp8Config(SMALL * 2, SMALL * 2, 8, 4, 2, "swap")
    ws, cnt = fp8_gemv_scratch([(70, 200), (140, 200)], [config], DEV)
    widest = fp8_grid(MAX_ROWS, 140, 200, config, x)
    assert widest.split > 1 and ws.numel() >= widest.parts and cnt.numel() >= widest.tiles
    want = fp8_gemv(x, w, config=config)
    for _ in range(2):
        assert torch.equal(fp8_gemv(x, w, config=config, scratch=(ws, cnt)), want)
        assert not cnt.any()
    with pytest.raises(ValueError, match="scratch"):
        fp8_gemv(x, w, config=config, scratch=(ws[:10], cnt))


def test_fp8_config_by_rows() -> None:
    rows = [most for most, _ in FP8_STEPS]
    assert rows == sorted(rows) and rows[-1] == MAX_ROWS and all(name in FP8_CONFIGS for _, name in FP8_STEPS)
    for M in range(1, MAX_ROWS + 1):
        config = fp8_config(M)
        assert config.form != "fma" or M <= FMA_ROWS
    with pytest.raises(ValueError, match="at most 128"):
        fp8_config(MAX_ROWS + 1)


def test_fp8_gemv_refuses_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weight(32, 64, seed=5)
    x = torch.zeros(3, 64, device=DEV)
    refused = {
        "expected an Fp8Weight": lambda: fp8_gemv(x, w.dequantize()),
        "x: dtype": lambda: fp8_gemv(x.to(torch.int32), w),
        "x: shape": lambda: fp8_gemv(x[0], w),
        r"weight: shape \(32, 64\)": lambda: fp8_gemv(torch.zeros(3, 48, device=DEV), w),
        "x: last dimension": lambda: fp8_gemv(torch.zeros(64, 3, device=DEV).t(), w),
        "act": lambda: fp8_gemv(x, w, act="silu_mul"),
        "glu needs": lambda: fp8_gemv(x, _weight(33, 64, seed=6), act="glu"),
        "at most 128": lambda: fp8_gemv(torch.zeros(MAX_ROWS + 1, 64, device=DEV), w),
        "out: dtype": lambda: fp8_gemv(x, w, out=torch.empty(3, 32, device=DEV, dtype=torch.float16)),
        "out: shape": lambda: fp8_gemv(x, w, act="glu", out=torch.empty(3, 32, device=DEV)),
        "form": lambda: fp8_gemv(x, w, config=Fp8Config(32, 32, 1, 4, 2, "wmma")),
        "block_k 48": lambda: fp8_gemv(x, w, config=Fp8Config(32, 48, 1, 4, 2)),
        "glu takes": lambda: fp8_gemv(x, w, act="glu", config=Fp8Config(16, 32, 1, 4, 2)),
        "fma form takes at most": lambda: fp8_gemv(torch.zeros(FMA_ROWS + 1, 64, device=DEV), w,
                                                   config=Fp8Config(16, 32, 1, 4, 2, "fma")),
    }
    for match, call in refused.items():
        with pytest.raises((ValueError, TypeError), match=match):
            call()
    monkeypatch.setattr(fp8_gemv_module, "INTERPRETED", False)
    with pytest.raises(ValueError, match="runs on CUDA"):
        fp8_gemv(x.cpu(), w.to("cpu"))


# On a GPU: the Llama-3-8B projections in bf16, with a model's scratch (one for all shapes and configurations).


def _on_gpu(name: str, M: int, seed: int = 0) -> tuple[Fp8Weight, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need sm_89 or later")
    N, K = SHAPES[name]
    torch.manual_seed(seed)
    w = quantize_fp8(torch.randn(N, K, device="cuda") * 0.02)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    return w, x, fp8_gemv_scratch(SHAPES.values(), FP8_CONFIGS.values(), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 128])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gpu_fp8_gemv_at_the_8b_shapes(name: str, M: int) -> None:
    """The launcher's configuration for the step; the counts left zero for the next launch."""
    w, x, scratch = _on_gpu(name, M)
    out = fp8_gemv(x, w, scratch=scratch)
    assert out.dtype == torch.bfloat16 and out.shape == (M, SHAPES[name][0])
    assert_within_rounding(out, x, w)
    assert_within_rounding(fp8_gemv_ref(x, w), x, w)
    assert not scratch[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 128])
def test_gpu_every_configuration_at_the_o_shape(M: int) -> None:
    """Each candidate the benchmark times (the fma form up to FMA_ROWS rows) gives the product too."""
    w, x, scratch = _on_gpu("o", M)
    for name, config in FP8_CONFIGS.items():
        if config.form == "fma" and M > FMA_ROWS:
            continue
        out = fp8_gemv(x, w, config=config, scratch=scratch)
        try:
            assert_within_rounding(out, x, w)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
def test_gpu_glu_at_gate_up(M: int) -> None:
    """silu(gate) * up of gate_up in one launch: within a bf16 ulp of the plain launches' halves through
    `activation.silu_and_mul` (the same sums; the bits on the CPU), and near the reference."""
    w, x, scratch = _on_gpu("gate_up", M)
    config = fp8_config(M)
    gate, up = (Fp8Weight(c, s) for c, s in zip(w.weight.chunk(2), w.scale.chunk(2), strict=True))
    half = config._replace(block_n=max(16, config.block_n // 2))  # a launch's tiles are 16 wide or more
    plain = torch.cat([fp8_gemv(x, part, config=half, scratch=scratch) for part in (gate, up)], 1)
    assert_within_rounding(plain, x, Fp8Weight.cat([gate, up]))
    got = fp8_gemv(x, w, act="glu", config=config, scratch=scratch)
    assert got.shape == (M, SHAPES["gate_up"][0] // 2)
    torch.testing.assert_close(got, silu_and_mul(plain), rtol=2.0 ** -7, atol=1e-6)
    ref = fp8_gemv_ref(x, w, "glu")  # near zero a relative bound is none: a bf16 step of the largest value there
    torch.testing.assert_close(got, ref, rtol=2.0 ** -6, atol=2.0 ** -8 * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 128])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gpu_fp8_gemv_against_fp8_linear(name: str, M: int) -> None:
    """W8A16 against W8A8 (``fp8_linear``: x per token to e4m3, then ``torch._scaled_mm``): they differ by what
    rounding x to FP8 changes, d, computed in float32 from the very FP8 x the product took (``quantize_rows``),
    plus each one's own rounding to bf16 and accumulation: |a - b| <= |d| + 2^-8 (|a| + |b|) + e_a + e_b. And the
    typical departure is d's: the RMS of a - b within 1.25x d's plus the roundings'."""
    from gpu_engine.kernels.fp8_linear import fp8_linear, quantize_rows

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("row-wise scaled FP8 products need sm_90")
    w, x, scratch = _on_gpu(name, M)
    a, b = fp8_gemv(x, w, scratch=scratch).float(), fp8_linear(x, w).float()
    xq, sa = quantize_rows(x, w)
    ya, ea = _exact(x, w)
    yb, eb = _exact(xq.float() * sa, w)
    d = (ya - yb).abs()
    rounding = 2.0 ** -8 * (a.abs() + b.abs())
    excess = (a - b).abs() - (d + rounding + ea + eb)
    assert excess.max() <= 0, excess.max()
    rms = (a - b).pow(2).mean().sqrt()
    assert rms <= 1.25 * d.pow(2).mean().sqrt() + rounding.pow(2).mean().sqrt(), rms


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "M", "act"), [("o", 1, None), ("qkv", 8, None), ("gate_up", 64, "glu")])
def test_gpu_fp8_gemv_replays_from_a_cuda_graph(name: str, M: int, act: str | None) -> None:
    """Captured with a model's scratch (split launches: the counts must come back to zero between replays), then
    replayed on new x twice: the eager launch's bits each time."""
    w, x, scratch = _on_gpu(name, M)
    fp8_gemv(x, w, act=act, scratch=scratch)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, w, act=act, scratch=scratch)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8_gemv(x, w, act=act, scratch=scratch))
        assert not scratch[1].any()
