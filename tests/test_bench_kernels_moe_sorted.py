"""bench.kernels' sorted-MoE rows without a GPU: every GEMM configuration it would time runs, on tiny shapes in the
Triton interpreter, and computes what the sorted path's GEMM computes (so that a broken configuration or launcher
argument shows here, not in a GPU run)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench.kernels as bk  # noqa: E402

E, H, I, K, B, LAYERS = 6, 32, 24, 2, 5, 2


def routes_of(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's K distinct experts (int64) and route weights (fp32)."""
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B)])
    return torch.rand(B, K, generator=g), ids


@pytest.mark.parametrize("bm", (*bk.SORTED_HEIGHTS, bk.TALL_HEIGHT))
def test_every_sorted_configuration_computes_the_grouped_products(bm: int) -> None:
    g = torch.Generator().manual_seed(bm)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) for _ in range(LAYERS)]
    down = [torch.randn(E, H, I, generator=g) for _ in range(LAYERS)]
    xs = [torch.randn(B, H, generator=g) for _ in range(LAYERS)]
    routes = [routes_of(g) for _ in range(LAYERS)]
    acts = [torch.randn(B * K, I, generator=g) for _ in range(LAYERS)]
    cases = bk._sorted_gemms(B, bm, gate_up, down, xs, routes, acts)
    assert set(cases) == ({bk.sorted_name(gemm, bm, tile) for tile in bk.SORTED_TILES for gemm in ("gate_up", "down")}
                          | {bk.sorted_name("glu", bm, tile) for tile in bk.GLU_TILES} | {f"gate_up+silu bm={bm}"})
    assert bk.sorted_name("down", 16, (64, 64, 4, None)) == "down bm=16 bn=64 bk=64 w4"  # the launcher's: no stages
    for layer in range(LAYERS):
        weights, ids = routes[layer]
        experts = ids.reshape(-1)
        want_inter = torch.stack([gate_up[layer][e] @ xs[layer][p // K] for p, e in enumerate(experts.tolist())])
        want_y = torch.stack([down[layer][e] @ acts[layer][p] * weights.reshape(-1)[p]
                              for p, e in enumerate(experts.tolist())])
        want_act = torch.nn.functional.silu(want_inter[:, :I]) * want_inter[:, I:]
        for name, (fn, outs) in cases.items():
            outs[layer].fill_(float("nan"))
            fn(layer)
            gemm = name.split()[0]
            want = {"gate_up": want_inter, "down": want_y, "glu": want_act, "gate_up+silu": want_act}[gemm]
            torch.testing.assert_close(outs[layer], want, rtol=1e-4, atol=1e-4, msg=name)
