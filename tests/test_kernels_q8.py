"""The Q8_0 linear kernel (``kernels.q8_linear``) against its reference in the interpreter, and its launcher's
refusals."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from gpu_engine.kernels.q8_linear import q8_linear, q8_linear_ref  # noqa: E402
from gpu_engine.models.q8_weight import Q8Weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, seed: int = 0) -> tuple[Q8Weight, torch.Tensor]:
    """A Q8_0 weight quantized by the gguf package, and that package's own dequantization of it."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    blocks = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    dense = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).copy())
    return Q8Weight.from_blocks(torch.from_numpy(blocks.copy())).to(DEV), dense


def test_from_blocks_keeps_the_file_values() -> None:
    qw, dense = _weight(24, 96)
    assert qw.shape == (24, 96) and qw.codes.dtype == torch.int8 and qw.scales.dtype == torch.float16
    assert qw.nbytes == 24 * 96 + 24 * 3 * 2  # 8.5 bits a weight
    assert torch.equal(qw.dequantize().cpu(), dense)
    cat = Q8Weight.cat([qw, qw])
    assert cat.shape == (48, 96) and torch.equal(cat.dequantize()[24:], qw.dequantize())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 65])
def test_q8_linear_matches_reference(dtype: torch.dtype, tol: float, m: int) -> None:
    """Decode-sized and prefill-sized steps alike."""
    n, k = 40, 96  # neither a power of two; K three Q8_0 blocks, not a multiple of BLOCK_K
    qw, dense = _weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(DEV, dtype)
    got = q8_linear(x, qw.codes, qw.scales)
    want = q8_linear_ref(x, qw.codes, qw.scales)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the reference is the dense product on the gguf package's dequantized weight
    torch.testing.assert_close(want.float(), x.float() @ dense.to(DEV, dtype).float().T, rtol=tol, atol=tol)


def test_q8_linear_strided_rows_and_out() -> None:
    qw, _ = _weight(40, 64)
    x = torch.randn(5, 128, device=DEV)[:, :64]  # rows 128 apart
    out = torch.full((5, 40), float("nan"), device=DEV)
    assert q8_linear(x, qw.codes, qw.scales, out=out) is out
    torch.testing.assert_close(out, q8_linear_ref(x, qw.codes, qw.scales), rtol=1e-5, atol=1e-5)


def test_q8_linear_refuses_bad_input() -> None:
    qw, _ = _weight(40, 64)
    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(ValueError, match="codes: shape"):
        q8_linear(torch.randn(3, 96, device=DEV), qw.codes, qw.scales)
    with pytest.raises(ValueError, match="codes: dtype"):
        q8_linear(x, qw.codes.to(torch.uint8), qw.scales)
    with pytest.raises(ValueError, match="scales: dtype"):
        q8_linear(x, qw.codes, qw.scales.float())
    with pytest.raises(ValueError, match="scales: shape"):
        q8_linear(x, qw.codes, qw.scales[:, :1])
    with pytest.raises(ValueError, match="x: dtype"):
        q8_linear(x.to(torch.int32), qw.codes, qw.scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_linear(torch.randn(3, 40, device=DEV), torch.zeros(8, 40, dtype=torch.int8, device=DEV),
                  torch.zeros(8, 1, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="out: dtype"):
        q8_linear(x, qw.codes, qw.scales, out=torch.empty(3, 40, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="whole number"):
        Q8Weight.from_blocks(torch.zeros(4, 35, dtype=torch.uint8))


@pytest.mark.gpu
def test_q8_linear_on_gpu_at_serving_sizes() -> None:
    """Decode and prefill sizes of an 8B Llama's projections, bf16."""
    for m in (1, 16, 64, 300, 2048):
        qw, _ = _weight(4096, 4096, seed=m)
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(q8_linear(x, qw.codes, qw.scales), q8_linear_ref(x, qw.codes, qw.scales),
                                   rtol=2e-2, atol=2e-2)


def test_chunked_dequantization_gives_the_whole_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuBLAS path dequantizes a weight of more than CHUNK values whole rows at a time."""
    import gpu_engine.kernels.q8_linear as q8

    qw, _ = _weight(40, 64)
    x = torch.randn(70, 64, device=DEV)
    want = q8_linear(x, qw.codes, qw.scales)
    monkeypatch.setattr(q8, "CHUNK", 64 * 7)  # 7 rows at a time: six chunks, the last of 5
    torch.testing.assert_close(q8_linear(x, qw.codes, qw.scales), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
def test_q8_product_is_the_dense_product(m: int) -> None:
    """The product is the dense model's: the weight dequantized to bf16 as the dense load rounds it, then the
    same cuBLAS call (one chunk: the same bits)."""
    qw, _ = _weight(4096, 4096)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(q8_linear(x, qw.codes, qw.scales), torch.nn.functional.linear(x, qw.dequantize(torch.bfloat16)))
