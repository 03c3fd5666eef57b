"""The MoE expert paths' rounding (`helpers.moe_rounding`): the bounds against emulations of both paths in
PyTorch and against the kernels under the Triton interpreter, at tiny shapes. The real sizes are
tests/gpu/test_gpu_moe.py's."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import moe_rounding as mr  # noqa: E402

from gpu_engine.kernels import moe  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _step(T, E, H, I, top_k, dtype, seed=0):
    """x, gate_up, down and a routing of `top_k` distinct experts a token, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEV, dtype)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEV, dtype)
    logits = torch.randn(T, E, generator=g).to(DEV)
    weights, ids = moe.route_ref(logits, top_k, True)
    return x, gate_up, down, weights, ids


def _within(got, want, bound):
    """The largest |got - want| / bound, asserted at most 1."""
    ratio = float(((got.double() - want).abs() / bound).max())
    assert ratio <= 1.0, ratio
    return ratio


def test_emulated_paths_lie_within_their_bounds_and_apart():
    """bf16 (rounding to nearest): each path's emulation within its bound of the exact output, the two within the
    sum of the bounds, and not equal: the sorted path's extra roundings move outputs."""
    step = _step(16, 8, 256, 96, 4, torch.bfloat16)
    exact = mr.experts_ref(*step)
    outs = {name: mr.emulate(*step, **how) for name, how in (("small", mr.SMALL), ("sorted", mr.SORTED))}
    errs = {name: mr.path_error(*step, outs[name], mr.BF16_UNIT, **how)
            for name, how in (("small", mr.SMALL), ("sorted", mr.SORTED))}
    for name in outs:
        _within(outs[name], exact, errs[name])
    _within(outs["small"], outs["sorted"].double(), errs["small"] + errs["sorted"])
    assert not torch.equal(outs["small"], outs["sorted"])


def test_emulated_bound_is_not_met_by_a_wrong_weight():
    """The bound tells a rounding from an error: one route weight off by 5% puts the output outside it."""
    x, gate_up, down, weights, ids = _step(4, 8, 128, 64, 2, torch.bfloat16)
    exact = mr.experts_ref(x, gate_up, down, weights, ids)
    off = weights.clone()
    off[0, 0] *= 1.05
    out = mr.emulate(x, gate_up, down, off, ids, **mr.SMALL)
    bound = mr.path_error(x, gate_up, down, weights, ids, out, mr.BF16_UNIT, **mr.SMALL)
    assert bool(((out.double() - exact).abs() > bound).any())


def test_sort_free_kernels_lie_within_the_bound():
    """The sort-free kernels in bf16 under the interpreter (which truncates to bf16: u = 2^-7) within their bound;
    in fp32 both paths within theirs (u = 2^-24: only the sums' orders differ)."""
    step = _step(3, 8, 64, 32, 4, torch.bfloat16, seed=1)
    unit = mr.INTERPRETER_BF16_UNIT if DEV == "cpu" else mr.BF16_UNIT
    out = moe.moe_experts_small(*step)
    _within(out, mr.experts_ref(*step), mr.path_error(*step, out, unit, **mr.SMALL))
    step = _step(3, 8, 64, 32, 4, torch.float32, seed=1)
    exact = mr.experts_ref(*step)
    for fn, how in ((moe.moe_experts_small, mr.SMALL), (moe.moe_experts_sorted, mr.SORTED)):
        out = fn(*step)
        _within(out, exact, mr.path_error(*step, out, 2.0 ** -24, **how))
