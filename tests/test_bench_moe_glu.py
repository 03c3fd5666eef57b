"""The experiment's gate_up GEMM with the SiLU-and-multiply in its epilogue (`bench.moe_glu`), in the Triton
interpreter on the CPU: its activations are the products' own SiLU-and-multiply, and the sorted path with it is the
expert output, so a GPU run of its benchmark times a correct kernel."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import moe_glu  # noqa: E402
from gpu_engine.kernels import moe  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("N", "block_n"), [(24, 16), (40, 32)])
def test_glu_gemm_takes_the_silu_and_multiply_in_its_epilogue(N: int, block_n: int) -> None:
    """Each sorted pair's silu(gate) * up of its expert, from the fp32 products (a column tile that ends past N
    included), against the products' own SiLU-and-multiply; an odd row count refused."""
    g = torch.Generator().manual_seed(N)
    E, K, T, k = 5, 48, 7, 2
    x = torch.randn(T, K, generator=g).to(DEV)
    gate_up = (torch.randn(E, 2 * N, K, generator=g) * 0.3).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    sorted_pairs, block_expert = moe.moe_align(ids, E, 16)
    act = torch.full((T * k, N), float("nan"), device=DEV)
    moe_glu.glu_gemm(x, gate_up, act, sorted_pairs, block_expert, a_div=k, block_m=16, block_n=block_n)
    gu = torch.stack([gate_up[e] @ x[p // k] for p, e in enumerate(ids.reshape(-1).tolist())])
    torch.testing.assert_close(act, torch.nn.functional.silu(gu[:, :N]) * gu[:, N:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even row count"):
        moe_glu.glu_gemm(x, gate_up[:, 1:].contiguous(), act, sorted_pairs, block_expert, a_div=k, block_m=16)


def test_the_sorted_path_with_it_is_the_expert_output() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g).to(DEV)
    router = torch.randn(6, 32, generator=g).to(DEV)
    gate_up = (torch.randn(6, 2 * 24, 32, generator=g) * 0.2).to(DEV)
    down = (torch.randn(6, 32, 24, generator=g) * 0.2).to(DEV)
    weights, ids = moe.moe_route(torch.nn.functional.linear(x, router), 2, True)
    torch.testing.assert_close(moe_glu.sorted_path_glu(x, gate_up, down, weights, ids),
                               moe.fused_moe_ref(x, router, gate_up, down, 2, True).to(x.dtype), rtol=1e-4, atol=1e-4)
