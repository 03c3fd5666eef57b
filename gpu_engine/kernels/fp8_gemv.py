"""Decode-step product on FP8 weights with 16-bit activations (W8A16): one launch, no activation quantization.

The math. W is an ``Fp8Weight``: float8_e4m3fn codes ``wq`` [N, K] (row-major, last dimension contiguous, any row
stride) and a float32 scale a row ``s`` [N]. x [M, K] (M <= 128, a decode step) stays in its own dtype:

    out[m, n] = round( s[n] * sum_k x[m, k] * wq[n, k] )

with the sum in float32 and one rounding to x's dtype at the end. Every e4m3 value is exact in bf16 and fp16 (3
mantissa bits; exponents 2^-9 to 2^8), so the codes are converted to x's dtype in registers and multiplied
exactly; only the float32 accumulation order differs from ``fp8_gemv_ref``. With ``act="glu"`` W is a gate_up
weight [2N, K] (gate rows, then up rows, each with its own scales) and out = silu(gate) * up of the two rounded
products, as ``activation.silu_and_mul`` takes them (``tiled_linear._finish``'s epilogue).

Unlike ``fp8_linear`` (per-token FP8 activations, then ``torch._scaled_mm``: two launches, and cuBLASLt's FP8
kernels poor at a few rows), nothing here rounds x: the result is the FP8 weight's own product, more exact than
W8A8's, and a weight's static ``input_scale`` or per-tensor activation setting is not used.

The layout of a launch follows ``tiled_linear``: a program (column tile, slice of K) holds all the step's rows
for ``block_n`` columns, so the weight is read once; K is cut in slices (``tiled_split``) where the column tiles
alone would leave SMs idle, the slices' fp32 sums meet in a workspace and the last program of a tile to finish
adds them in slice order (``_sync.last_to_finish``; the count is left zero, so a CUDA graph replays it with no
memset). The scale multiplies the tile's total in the epilogue. Three inner products (``Fp8Config.form``):

- ``fma``: CUDA cores, x [BLOCK_M, BLOCK_K] times the codes in float32 into a [BLOCK_M, BLOCK_N, BLOCK_K]
  accumulator summed over K after the loop; for steps of at most ``FMA_ROWS`` rows (BLOCK_M is M's power of two).
- ``dot``: tensor cores, x @ w.T as the bf16 tiled linear multiplies (BLOCK_M padded to 16 or more).
- ``swap``: tensor cores, w @ x.T: the weight's rows fill the MMA's wide side and the step's few rows its narrow
  one, the converted codes an operand straight from registers.

Grids and shapes are fixed by (M, N, K, config), and nothing is read back to the host: a runner captures it.
``FP8_CONFIGS`` names the measured candidates (``bench/kernels.py --only fp8``); ``fp8_config`` picks one by the
step's rows (``FP8_STEPS``). ``fp8_gemv_scratch`` sizes one workspace for a model's launches.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check
from gpu_engine.kernels._sync import last_to_finish
from gpu_engine.kernels.activation import silu_and_mul_ref
from gpu_engine.kernels.tiled_linear import (
    MAX_ROWS,
    _finish,
    _slice_totals,
    _sms,
    _split_scratch,
    _store_slice,
    _x_tile,
    tiled_scratch,
    tiled_split,
    tiled_stages,
)
from gpu_engine.models.fp8_weight import FP8, Fp8Weight

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read as triton.jit reads it, when the module loads
FORMS = ("fma", "dot", "swap")
FMA_ROWS = 4  # the fma form holds a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 sum: 171 registers a thread at 4 rows (sm_90)


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORM: tl.constexpr):
    """The accumulator of a form: [M, N, K] (fma), [M, N] (dot), [N, M] (swap), float32."""
    if FORM == "fma":
        return tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    elif FORM == "dot":
        return tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        return tl.zeros([BLOCK_N, BLOCK_M], tl.float32)


@triton.jit
def _accumulate(acc, x, codes, FORM: tl.constexpr, PREC: tl.constexpr):
    """acc plus x [BLOCK_M, BLOCK_K] times an FP8 tile [BLOCK_N, BLOCK_K], the codes converted (exactly) to x's
    dtype for the tensor-core forms, to float32 for fma."""
    if FORM == "fma":
        return acc + x.to(tl.float32)[:, None, :] * codes.to(tl.float32)[None, :, :]
    elif FORM == "dot":
        return tl.dot(x, tl.trans(codes.to(x.dtype)), acc, input_precision=PREC)
    else:
        return tl.dot(codes.to(x.dtype), tl.trans(x), acc, input_precision=PREC)


@triton.jit
def _sums(acc, FORM: tl.constexpr):
    """A form's accumulator as the tile's [BLOCK_M, BLOCK_N] sums."""
    if FORM == "fma":
        return tl.sum(acc, axis=2)
    elif FORM == "dot":
        return acc
    else:
        return tl.trans(acc)


@triton.jit
def _scaled_finish(optrs, omask, total, total_u, s_ptr, n, N, GLU: tl.constexpr):
    """The tile's output from its sums over all of K: each column times its row's scale (the up rows' from s[N:]
    with GLU), then `tiled_linear._finish` (rounded; silu(gate) * up with GLU)."""
    scale = tl.load(s_ptr + n, mask=n < N, other=0.0)
    if GLU:
        total_u = total_u * tl.load(s_ptr + N + n, mask=n < N, other=0.0)[None, :]
    _finish(optrs, omask, total * scale[None, :], total_u, GLU, False)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, sx, sw, so, k_split,
                     GLU: tl.constexpr, FORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr):
    """Program (column tile pn, slice s of K): rows m < M of out for columns n of the tile. The loop's stages are
    named on it (`tl.range`): the launch's num_stages alone pipelines only loads that feed a dot, and the fma
    form's would then wait on each tile (no cp.async in its sm_90 build)."""
    pn, s = tl.program_id(0), tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    rows = w_ptr + n[:, None].to(tl.int64) * sw
    acc = _zeros(BLOCK_M, BLOCK_N, BLOCK_K, FORM)
    acc_u = _zeros(BLOCK_M, BLOCK_N, BLOCK_K, FORM)
    k_lo = s * k_split  # a multiple of BLOCK_K: a tile never straddles two slices
    for k0 in tl.range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        wmask = (n[:, None] < N) & (k[None, :] < K)
        x = _x_tile(x_ptr, sx, m, k, M, K, False)
        acc = _accumulate(acc, x, tl.load(rows + k[None, :], mask=wmask, other=0.0), FORM, PREC)
        if GLU:
            acc_u = _accumulate(acc_u, x, tl.load(rows + N * sw + k[None, :], mask=wmask, other=0.0), FORM, PREC)
    total, total_u = _sums(acc, FORM), _sums(acc_u, FORM)
    omask = (m[:, None] < M) & (n[None, :] < N)
    optrs = out_ptr + m[:, None] * so + n[None, :]
    if SPLIT_K == 1:
        _scaled_finish(optrs, omask, total, total_u, s_ptr, n, N, GLU)
    else:
        _store_slice(ws_ptr, s, m, n, M, N, omask, total, total_u, GLU)
        if last_to_finish(cnt_ptr + pn, SPLIT_K):
            total, total_u = _slice_totals(ws_ptr, m, n, M, N, omask, GLU, BLOCK_M, BLOCK_N, SPLIT_K)
            _scaled_finish(optrs, omask, total, total_u, s_ptr, n, N, GLU)


class Fp8Config(NamedTuple):
    """A launch's cut: `block_n` weight rows a program (gate and up half each with glu), `block_k` K a step,
    `per_sm` programs an SM runs at once (as `tiled_split` counts them), warps, pipeline stages, and the inner
    product's `form` (`FORMS`)."""

    block_n: int
    block_k: int
    per_sm: int
    num_warps: int
    num_stages: int
    form: str = "swap"


# Candidates, to be measured by `bench/kernels.py --only fp8` (not yet run on a GPU). Their sm_90 builds (no GPU
# needed, tests/test_kernels_ttir.py): the fma tiles take 56-64 registers a thread at one row, 171-190 at four;
# the swap form multiplies with wgmma, the dot form with mma.sync up to 16 rows; swap_n64_k256_s3 spills at 128
# rows. The tensor-core tiles are the bf16 tiled linear's, whose x tile every program reads from L2 (2 x M /
# block_n bytes of x a weight byte): wider tiles for the larger steps.
FP8_CONFIGS = {
    "fma_n16_k256": Fp8Config(16, 256, 4, 4, 3, "fma"), "fma_n32_k128": Fp8Config(32, 128, 4, 4, 3, "fma"),
    "fma_n16_k512_w8": Fp8Config(16, 512, 2, 8, 3, "fma"),
    "swap_n64_k128_s4": Fp8Config(64, 128, 2, 4, 4), "swap_n64_k256_s3": Fp8Config(64, 256, 2, 4, 3),
    "swap_n128_k128_s3_w8": Fp8Config(128, 128, 1, 8, 3), "swap_n256_k64_s3_w8": Fp8Config(256, 64, 1, 8, 3),
    "dot_n64_k128_s4": Fp8Config(64, 128, 1, 4, 4, "dot"), "dot_n128_k64_s4_w8": Fp8Config(128, 64, 1, 8, 4, "dot"),
}
# (most rows, FP8_CONFIGS name), rows increasing to MAX_ROWS: a first choice until the bench picks.
FP8_STEPS = ((2, "fma_n16_k256"), (32, "swap_n64_k128_s4"), (64, "swap_n128_k128_s3_w8"),
             (MAX_ROWS, "swap_n256_k64_s3_w8"))


def fp8_config(rows: int, steps: tuple[tuple[int, str], ...] = FP8_STEPS) -> Fp8Config:
    """The configuration `steps` gives a step of `rows` rows (1..MAX_ROWS)."""
    for most, name in steps:
        if rows <= most:
            return FP8_CONFIGS[name]
    raise ValueError(f"rows: {rows}, the FP8 GEMV takes at most {MAX_ROWS}")


class Fp8Grid(NamedTuple):
    """How an FP8 launch is cut (`fp8_grid`)."""

    tile_n: int  # output columns a program takes
    split: int  # slices of K
    width: int  # a slice's width
    tiles: int  # column tiles
    parts: int  # fp32 partials of a split launch
    block_m: int
    stages: int


def fp8_grid(M: int, N: int, K: int, config: Fp8Config, x: torch.Tensor, glu: bool = False) -> Fp8Grid:
    """The cut of a launch of `config` over an [M, K] x and N output columns (half the weight's rows with glu)."""
    tile_n = config.block_n // 2 if glu else config.block_n
    split, width = tiled_split(N, K, tile_n, config.block_k, config.per_sm, _sms(x.device))
    block_m = triton.next_power_of_2(M) if config.form == "fma" else max(16, triton.next_power_of_2(M))
    return Fp8Grid(tile_n, split, width, triton.cdiv(N, tile_n), split * M * N * (2 if glu else 1), block_m,
                   fp8_stages(config, block_m, x.element_size()))


def fp8_stages(config: Fp8Config, block_m: int, itemsize: int) -> int:
    """The configuration's stages, or fewer where they would not fit a block's shared memory (`tiled_stages`): a
    stage holds x's tile and block_n weight rows of one byte a value, as many bytes as block_n / itemsize rows of
    x's dtype (glu's gate and up halves together the same)."""
    return tiled_stages(config.num_stages, block_m, max(1, config.block_n // itemsize), config.block_k, False,
                        itemsize)


def fp8_gemv_scratch(shapes: Iterable[tuple[int, int]], configs: Iterable[Fp8Config],
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace, counters) for launches of at most MAX_ROWS rows over FP8 weights of `shapes` ((rows, K) as
    stored: a gate_up weight's 2N rows, whether launched plain or with glu) with any of `configs`: fp32 partials
    for the widest split launch, one zeroed int32 count a column tile, left zero by every launch (`tiled_scratch`,
    whose sizing is the same). Allocated once for launches that run one after another, it needs no memset."""
    return tiled_scratch(list(shapes), list(configs), device)


def check_fp8_gemv(x: torch.Tensor, w: Fp8Weight, act: str | None,
                   out: torch.Tensor | None) -> tuple[int, int, int, torch.Tensor]:
    """The launcher's checks, each a ValueError naming what is wrong; returns (M, N, K, out)."""
    if not isinstance(w, Fp8Weight):
        raise TypeError(f"w: expected an Fp8Weight, got {type(w).__name__}")
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"x: on {x.device}; the FP8 GEMV runs on CUDA (or in the Triton interpreter)")
    M, K = x.shape
    check("weight", w.weight, dtype=FP8, shape=(None, K), device=x.device)
    check("scale", w.scale, dtype=torch.float32, shape=(w.weight.shape[0],), device=x.device)
    if act not in (None, "glu"):
        raise ValueError(f"act: {act!r} is not None or 'glu'")
    if act == "glu" and w.weight.shape[0] % 2:
        raise ValueError(f"weight: glu needs [2N, K] (gate rows, then up rows), got {tuple(w.weight.shape)}")
    if M > MAX_ROWS:
        raise ValueError(f"x: {M} rows, the FP8 GEMV takes at most {MAX_ROWS}")
    N = w.weight.shape[0] // 2 if act == "glu" else w.weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, dtype=x.dtype, shape=(M, N), device=x.device)
    return M, N, K, out


def check_config(config: Fp8Config, M: int, glu: bool) -> None:
    """That `config` can take a step of M rows (ValueError otherwise)."""
    if config.form not in FORMS:
        raise ValueError(f"config: form {config.form!r} not in {FORMS}")
    tile_n = config.block_n // 2 if glu else config.block_n
    for name, v in (("block_n", config.block_n), ("block_k", config.block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"config: {name} {v} must be a power of two >= 16")
    if tile_n < 16 and config.form != "fma":  # a tensor-core product's sides are 16 or more
        raise ValueError(f"config: glu takes block_n / 2 gate and up rows, {tile_n} < 16 for the {config.form} form")
    if config.form == "fma" and M > FMA_ROWS:
        raise ValueError(f"config: the fma form takes at most {FMA_ROWS} rows, x has {M}")


def fp8_gemv(x: torch.Tensor, w: Fp8Weight, act: str | None = None, out: torch.Tensor | None = None,
             config: Fp8Config | None = None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
    """x [M, K] (bf16 on the GPU; any float dtype, rows may be strided) times the FP8 weight `w` [N, K] (or [2N, K]
    with act="glu") -> out [M, N] in x's dtype (the module's docstring), in one launch; M <= MAX_ROWS.
    `config`: an `Fp8Config` (default `fp8_config(M)`); `scratch`: (workspace, counters) from `fp8_gemv_scratch`
    for the weight's shape (without it a launch that splits K allocates and zeroes its own: not for capture)."""
    M, N, K, out = check_fp8_gemv(x, w, act, out)
    config = fp8_config(max(1, M)) if config is None else config
    check_config(config, M, act == "glu")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    g = fp8_grid(M, N, K, config, x, act == "glu")
    ws, cnt = _split_scratch(scratch, g.split, g.parts, g.tiles, out)
    _fp8_gemv_kernel[(g.tiles, g.split)](
        x, w.weight, w.scale, out, ws, cnt, M, N, K, x.stride(0), w.weight.stride(0), out.stride(0), g.width,
        GLU=act == "glu", FORM=config.form, BLOCK_M=g.block_m, BLOCK_N=g.tile_n, BLOCK_K=config.block_k,
        SPLIT_K=g.split, PREC="ieee" if x.dtype == torch.float32 else "tf32", STAGES=g.stages,
        num_warps=config.num_warps, num_stages=g.stages,
    )
    return out


def fp8_gemv_ref(x: torch.Tensor, w: Fp8Weight, act: str | None = None) -> torch.Tensor:
    """Plain PyTorch in float32: (x @ codes.T) times the rows' scales, rounded to x's dtype; with act="glu", the
    gate and up halves so rounded, then silu(gate) * up (`activation.silu_and_mul_ref`). Runs on the CPU."""
    y = ((x.float() @ w.weight.float().T) * w.scale.float()).to(x.dtype)
    return silu_and_mul_ref(y) if act == "glu" else y
