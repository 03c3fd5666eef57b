"""Where the MoE expert paths round, and elementwise bounds on their errors, derived from that.

Pair p = (token t, slot s) of expert e = ids[t, s] and route weight w = weights[t, s] (fp32); x, gate_up and down
in a 16-bit dtype whose rounding r(z) = z (1 + d) has |d| <= u (bf16: u = 2^-8 rounding to nearest; the Triton
interpreter truncates, u = 2^-7); every sum in fp32. With g, v = gate_e @ x, up_e @ x and f = silu(g) * v
(`kernels.moe`):

    sort-free (`moe_experts_small`):   a = r(f(g, v))         out = r(sum_s w_s (down_e @ a))
    sorted (`moe_experts_sorted`):     a = r(f(r(g), r(v)))   out = r(sum_s r(w_s (down_e @ a)))

The sorted path's grouped GEMM stores g, v (`inter`) and each pair's weighted down product (`y`) in x's dtype, and
`silu_and_mul` and the sum over slots read them back: three roundings the sort-free path does not make, which
keeps g, v and the pairs' products in fp32 registers. Both paths also sum in other fp32 orders.

Error of one path against the exact result, elementwise, to first order in u and in the fp32 terms (an fp32 sum of
n terms in any order lies within gamma_n = n 2^-23 of the sum of their magnitudes: one truncation an add, as tensor
cores may accumulate; the functions evaluated in fp32 within 2^-20 relative); `rounds_gv` and `rounds_pairs` name
the sorted path's extra roundings:

    dg = gamma_H |gate_e| @ |x| + [rounds_gv] u |g|              (dv alike)
    df = |silu(g)| dv + L dg (|v| + dv) + 2^-20 |f|              (L = 1.1 >= max |silu'|)
    da = df + u (|f| + df)                                        (the activation rounded once)
    A  = sum_s |w_s| (|down_e| @ (|f| + da))                      (the magnitude of the down sums' terms)
    err = sum_s |w_s| (|down_e| @ da) + (gamma_I + gamma_k + [rounds_pairs] u) A + u |out| / (1 - u)

Two paths then differ by at most the sum of their errors. The reference here sums in float64 (its own error, near
2^-53 relative, is left out) and is the exact result of the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SILU_LIPSCHITZ = 1.1  # max |silu'(z)| is 1.0998, at z = 2.40
FN_REL = 2.0 ** -20  # silu(g) * v evaluated in fp32: exp, a division and two products, each within a few ulps
BF16_UNIT = 2.0 ** -8  # rounding to nearest
INTERPRETER_BF16_UNIT = 2.0 ** -7  # the Triton interpreter's float-to-bf16 conversion truncates


def gamma(n: int) -> float:
    """The relative error of an fp32 sum of n terms in any order, of the sum of their magnitudes."""
    return n * 2.0 ** -23


@dataclass
class Pairs:
    """Each pair's float64 reference: gate and up products and their magnitudes [P, I]."""

    g: torch.Tensor
    v: torch.Tensor
    g_mag: torch.Tensor
    v_mag: torch.Tensor


def by_expert(ids: torch.Tensor):
    """(expert, the flat pair indices routed to it) for each expert some pair takes."""
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        yield e, (flat == e).nonzero().flatten()


def pair_products(x: torch.Tensor, gate_up: torch.Tensor, ids: torch.Tensor) -> Pairs:
    """g, v and |gate_e| @ |x|, |up_e| @ |x| of every pair, in float64."""
    top_k, inter = ids.shape[1], gate_up.shape[1] // 2
    prod = torch.empty(ids.numel(), 2 * inter, dtype=torch.float64, device=x.device)
    mag = torch.empty_like(prod)
    for e, pairs in by_expert(ids):
        xs, w = x[pairs // top_k].double(), gate_up[e].double()
        prod[pairs], mag[pairs] = xs @ w.T, xs.abs() @ w.abs().T
    return Pairs(prod[:, :inter], prod[:, inter:], mag[:, :inter], mag[:, inter:])


def act_error(p: Pairs, unit: float, hidden: int, rounds_gv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, da): each pair's exact activation and the bound on a path's rounded one's distance from it."""
    g_err = gamma(hidden) * p.g_mag + (unit * p.g.abs() if rounds_gv else 0.0)
    v_err = gamma(hidden) * p.v_mag + (unit * p.v.abs() if rounds_gv else 0.0)
    f = F.silu(p.g) * p.v
    df = F.silu(p.g).abs() * v_err + SILU_LIPSCHITZ * g_err * (p.v.abs() + v_err) + FN_REL * f.abs()
    return f, df + unit * (f.abs() + df)


def down_sums(a: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              magnitude: bool) -> torch.Tensor:
    """sum_s w_s (down_e @ a_p) of every token [T, H] in float64; `magnitude`: of |w_s|, |down_e| and a >= 0."""
    T, top_k = ids.shape
    out = torch.zeros(T, down.shape[1], dtype=torch.float64, device=a.device)
    w = weights.reshape(-1).double()
    for e, pairs in by_expert(ids):
        d = down[e].double()
        terms = a[pairs] @ (d.abs() if magnitude else d).T
        out.index_add_(0, pairs // top_k, terms * (w[pairs].abs() if magnitude else w[pairs])[:, None])
    return out


def experts_ref(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The exact expert output [T, H] (float64) of the given routing."""
    p = pair_products(x, gate_up, ids)
    return down_sums(F.silu(p.g) * p.v, down, weights, ids, magnitude=False)


def path_error(x, gate_up, down, weights, ids, out: torch.Tensor, unit: float, *, rounds_gv: bool,
               rounds_pairs: bool) -> torch.Tensor:
    """The bound [T, H] on |out - exact| of a path that computed `out` (see the module's text)."""
    f, da = act_error(pair_products(x, gate_up, ids), unit, x.shape[1], rounds_gv)
    spread = down_sums(da, down, weights, ids, magnitude=True)
    mag = down_sums(f.abs() + da, down, weights, ids, magnitude=True)
    sums = gamma(down.shape[2]) + gamma(ids.shape[1]) + (unit if rounds_pairs else 0.0)
    return spread + sums * mag + unit * out.double().abs() / (1 - unit)


SMALL = {"rounds_gv": False, "rounds_pairs": False}
SORTED = {"rounds_gv": True, "rounds_pairs": True}


def emulate(x, gate_up, down, weights, ids, *, rounds_gv: bool, rounds_pairs: bool) -> torch.Tensor:
    """A path's output with its roundings (to x's dtype) where the module's text puts them, its sums in float64."""
    top_k, dt = ids.shape[1], x.dtype
    p = pair_products(x, gate_up, ids)
    g, v = (p.g.to(dt).double(), p.v.to(dt).double()) if rounds_gv else (p.g, p.v)
    a = (F.silu(g) * v).to(dt).double()
    w = weights.reshape(-1).double()
    pair_out = torch.empty(ids.numel(), down.shape[1], dtype=torch.float64, device=x.device)
    for e, pairs in by_expert(ids):
        pair_out[pairs] = (a[pairs] @ down[e].double().T) * w[pairs, None]
    if rounds_pairs:
        pair_out = pair_out.to(dt).double()
    return pair_out.view(-1, top_k, down.shape[1]).sum(1).to(dt)
