"""A decode layer's halves in one launch each: the attention half (the qkv product with its RMSNorm and q/k/v
preparation, the decode attention with its splits folded, the o product added into the residual stream) and a dense
MLP half (gate_up with its RMSNorm and SiLU-and-multiply, down added into the stream), as phases of one grid.

The fused runner runs that half as three or four launches (`tiled_linear` with `heads=`, `decode_attention`, its
fold where the step has more than one row, `tiled_linear` with `residual=`), each waiting for the last to end and
its programs to be scheduled. Here each program takes a ticket (`_sync.ticket`) that gives its phase and its place in
it, in the order the phases come, and a program of a later phase spins until the phase before it has finished
(`_sync.wait_for`). The o programs load their first weight tile before they wait, so part of the o weight streams in
while the attention runs. Each phase runs the code of its own kernel (`_heads_program`, `_decode_program`,
`_fold_program`, `_tiled_program`) at the same block sizes and splits, so the result has the same bits as the
separate launches; the launch takes the heads kernel's stages (the depth of the loads in flight changes no sum).
The MLP half is the same with two `_tiled_program` phases, the down programs loading their first weight tile before
they wait for gate_up's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import check, next_pow2
from gpu_engine.kernels._sync import arrive, last_to_finish, ticket, wait_for
from gpu_engine.kernels.attention import LOG2E, _check_paged, _decode_program, _fold_program, _prec
from gpu_engine.kernels.pdl import pdl_enter, pdl_launch
from gpu_engine.kernels.tiled_linear import (
    MAX_ROWS,
    Heads,
    TiledConfig,
    _heads_program,
    _sms,
    _split_scratch,
    _tiled_program,
    heads_stages,
    tiled_split,
    tiled_stages,
)

ONE_LAUNCH_PARTS = ("attention", "mlp", "moe")


def one_launch_parts(setting: str) -> frozenset[str]:
    """The parts a runner runs in one launch each (`BLINK_ONE_LAUNCH`, `bench/roofline.py --one-launch`): "" none;
    comma-separated, of "attention" (`attention_half_one_launch`), "mlp" (`mlp_half_one_launch`) and "moe"
    (`moe.moe_mlp_one_launch`); "all" every one."""
    parts = frozenset(p.strip() for p in setting.split(",") if p.strip())
    if parts == {"all"}:
        return frozenset(ONE_LAUNCH_PARTS)
    if parts - set(ONE_LAUNCH_PARTS):
        raise ValueError(f"one launch: {setting!r}, expected a comma-separated list of {', '.join(ONE_LAUNCH_PARTS)} "
                         "or all")
    return parts


# The counts of an attention half's launch: the ticket, then the programs done of each phase (heads, attention,
# fold, o).
HALF_COUNTERS = 5


@triton.jit
def _attention_half_kernel(
    x_ptr, wq_ptr, qkv_ptr, ws_ptr, cnt_ptr, nw_ptr, pos_ptr, rope_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
    bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr, att_ptr, acnt_ptr, wo_ptr, res_ptr, ctr_ptr,
    M, K, HQ, HK, sx, sw, so, k_split, eps, qk_eps,
    sbt_b, sa_b, sa_h, scale_log2, NSPLIT,
    N_O, K_O, swo, sres, k_split_o,
    NORM: tl.constexpr, QK_NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PASS: tl.constexpr, HEAD_K: tl.constexpr, HEAD_SPLIT: tl.constexpr,
    HKV: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PART: tl.constexpr, ATT_N: tl.constexpr, FORM: tl.constexpr,
    O_N: tl.constexpr, O_K: tl.constexpr, O_SPLIT: tl.constexpr,
    PREC: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):
    """By ticket: (HQ + 2 HK) x HEAD_SPLIT heads programs (head fastest, as `_tiled_heads_kernel`'s grid), then
    M x HKV x NSPLIT attention programs (row fastest, then KV head), then with FORM "split" M x HKV fold programs,
    then the o programs (column tile fastest). Each phase waits for every program of the one before; the o programs
    load their first weight tile first. The last o program to finish sets the counts back to zero."""
    pdl_enter(USE_PDL)
    n_heads = (HQ + 2 * HK) * HEAD_SPLIT
    n_att = M * HKV * NSPLIT
    n_fold = M * HKV if FORM == "split" else 0
    tk = ticket(ctr_ptr)
    if tk < n_heads:
        _heads_program(x_ptr, wq_ptr, qkv_ptr, ws_ptr, cnt_ptr, nw_ptr, pos_ptr, rope_ptr, kc_ptr, vc_ptr, slot_ptr,
                       qw_ptr, kw_ptr, M, K, HQ, HK, sx, sw, so, k_split, eps, qk_eps, tk % (HQ + 2 * HK),
                       tk // (HQ + 2 * HK), NORM, QK_NORM, D, ROT_HALF, BLOCK_M, BLOCK_R, BLOCK_P, PASS, HEAD_K,
                       HEAD_SPLIT, PREC)
        arrive(ctr_ptr + 1)
    elif tk < n_heads + n_att:
        q = tk - n_heads
        wait_for(ctr_ptr + 1, n_heads, ASM)
        _decode_program(qkv_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr, att_ptr, acnt_ptr, so, D,
                        sbt_b, sa_b, sa_h, scale_log2, NSPLIT, q % M, (q // M) % HKV, q // (M * HKV), NSPLIT, HKV, D,
                        BS, G, BLOCK_G, BLOCK_D, PART, ATT_N, FORM, 0, PREC, False)
        arrive(ctr_ptr + 2)
    elif tk < n_heads + n_att + n_fold:
        q = tk - n_heads - n_att
        wait_for(ctr_ptr + 2, n_att, ASM)
        _fold_program(po_ptr, pm_ptr, pl_ptr, ctx_ptr, att_ptr, sa_b, sa_h, NSPLIT, q % M, q // M, HKV, D, G,
                      BLOCK_G, BLOCK_D, PART, 0)
        arrive(ctr_ptr + 3)
    else:
        q = tk - n_heads - n_att - n_fold
        tiles = tl.cdiv(N_O, O_N)
        if FORM == "split":
            wait_ptr, wait_n = ctr_ptr + 3, n_fold
        else:
            wait_ptr, wait_n = ctr_ptr + 2, n_att
        _tiled_program(att_ptr, wo_ptr, res_ptr, ws_ptr, cnt_ptr, att_ptr, M, N_O, K_O, sa_b, swo, sres, k_split_o,
                       0.0, q % tiles, q // tiles, wait_ptr, wait_n, False, False, False, True, BLOCK_M, O_N, O_K,
                       O_SPLIT, PREC, True, ASM)
        if last_to_finish(ctr_ptr + 4, tiles * O_SPLIT):  # every program has its ticket: all start over
            tl.store(ctr_ptr, 0)
            tl.store(ctr_ptr + 1, 0)
            tl.store(ctr_ptr + 2, 0)
            tl.store(ctr_ptr + 3, 0)


def attention_half_one_launch(
    x: torch.Tensor, w_qkv: torch.Tensor, heads: Heads, norm: tuple[torch.Tensor, float] | None,
    qkv_config: TiledConfig, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    w_o: torch.Tensor, residual: torch.Tensor, o_config: TiledConfig, scratch: tuple[torch.Tensor, torch.Tensor],
    counters: torch.Tensor, attn_counters: torch.Tensor | None = None, partition_size: int = 256,
    block_n: int = 128, pdl: bool = False,
) -> torch.Tensor:
    """A decode step's attention half, one row a sequence, in one launch (`_attention_half_kernel`):
    `tiled_linear(x, w_qkv, norm=norm, heads=heads)` with `qkv_config`'s blocks, then `decode_attention` of its
    query heads over the caches (form "last" with `attn_counters`, one a (row, KV head), else "split" and the fold),
    then `tiled_linear(attention, w_o, residual=residual)` with `o_config`'s, giving their bits. `x` may be
    `residual` itself (the fused runner's stream, with `norm`): the o phase adds into it only once every program that
    reads it has finished. `scratch`: the tiled linear's (`tiled_scratch`), for both products; `counters`: int32,
    zero, `HALF_COUNTERS`, which every launch leaves zero. Both configurations must have the attention's 4 warps
    (else ValueError, and the runner launches the kernels apart). Returns `residual`."""
    check("x", x, dtype=(torch.bfloat16, torch.float32), shape=(None, None))
    M, H = x.shape
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"x: {M} rows, the attention half in one launch takes 1 to {MAX_ROWS}")
    N = w_qkv.shape[0]
    check("w_qkv", w_qkv, dtype=x.dtype, shape=(N, H), device=x.device)
    HQ, HK = heads.num_heads, heads.num_kv_heads
    D = N // max(1, HQ + 2 * HK)
    if HQ <= 0 or HK <= 0 or (HQ + 2 * HK) * D != N:
        raise ValueError(f"heads: {HQ} query and {HK} KV heads do not divide the product's {N} columns")
    check("w_o", w_o, dtype=x.dtype, shape=(None, HQ * D), device=x.device)
    N_O = w_o.shape[0]
    check("residual", residual, dtype=x.dtype, shape=(M, N_O), device=x.device)
    if w_qkv.stride(1) != 1 or w_o.stride(1) != 1:
        raise ValueError("w_qkv, w_o: rows must be contiguous")
    if norm is not None:
        check("norm weight", norm[0], dtype=x.dtype, shape=(H,), device=x.device)
    check("counters", counters, dtype=(torch.int32,), shape=(None,), device=x.device)
    if counters.numel() < HALF_COUNTERS:
        raise ValueError(f"counters: {counters.numel()}, this launch needs {HALF_COUNTERS}")
    warps = 8 if max(16, triton.next_power_of_2(M)) >= 64 else qkv_config.num_warps  # as `_tiled_heads` takes them
    if warps != 4 or o_config.num_warps != 4:
        raise ValueError(f"one launch: the heads kernel's {warps} warps and the o product's {o_config.num_warps} must "
                         "be the attention's 4")
    qkv = torch.empty((M, N), dtype=x.dtype, device=x.device)
    q = qkv[:, : HQ * D].view(M, HQ, D)
    _check_paged(q, heads.k_cache, heads.v_cache, block_tables, context_lens, M)
    if partition_size % block_n:
        raise ValueError("partition_size must be a multiple of block_n")
    form = "split" if attn_counters is None else "last"
    if attn_counters is not None:
        check("attn_counters", attn_counters, dtype=(torch.int32,), shape=(None,), device=x.device)
        if attn_counters.numel() < M * HK:
            raise ValueError(f"attn_counters: {attn_counters.numel()}, this launch needs {M * HK} (rows x KV heads)")
    sms = _sms(x.device)
    # the heads product, as `_tiled_heads` launches it
    split, width = tiled_split(N, H, D, qkv_config.block_k, qkv_config.per_sm, sms)
    _split_scratch(scratch, split, split * M * (N + (1 if norm is not None else 0)), HQ + 2 * HK, qkv)  # checks
    rot_half = heads.cache.shape[1] // 2
    block_m = max(16, triton.next_power_of_2(M))
    block_r, block_p = max(16, triton.next_power_of_2(rot_half)), max(16, triton.next_power_of_2(D - 2 * rot_half))
    passing = D > 2 * rot_half
    stages = heads_stages(qkv_config.num_stages, block_m, block_r, block_p if passing else 0, qkv_config.block_k,
                          x.element_size())
    # the attention, as `decode_attention` launches it
    bs = heads.k_cache.shape[1]
    nsplit = triton.cdiv(block_tables.shape[1] * bs, partition_size)
    bd = next_pow2(D)
    att = torch.empty((M, HQ, D), dtype=x.dtype, device=x.device)
    po = torch.empty((M, HQ, nsplit, bd), dtype=torch.float32, device=x.device)
    pm = torch.empty((M, HQ, nsplit), dtype=torch.float32, device=x.device)
    pl = torch.empty_like(pm)
    # the o product, as `tiled_linear` launches it with a residual
    o_split, o_width = tiled_split(N_O, HQ * D, o_config.block_n, o_config.block_k, o_config.per_sm, sms)
    o_tiles = triton.cdiv(N_O, o_config.block_n)
    _split_scratch(scratch, o_split, o_split * M * N_O, o_tiles, residual)
    ws, cnt = scratch  # both products' partials and counts, one phase after the other
    programs = (HQ + 2 * HK) * split + M * HK * nsplit + (M * HK if form == "split" else 0) + o_tiles * o_split
    nw, eps = norm if norm is not None else (qkv, 0.0)
    qk = heads.q_norm is not None
    _attention_half_kernel[(programs,)](
        x, w_qkv, qkv, ws, cnt, nw, heads.positions, heads.cache, heads.k_cache, heads.v_cache, heads.slot_mapping,
        heads.q_norm if qk else qkv, heads.k_norm if qk else qkv,
        block_tables, context_lens, po, pm, pl, att, qkv if attn_counters is None else attn_counters, w_o, residual,
        counters,
        M, H, HQ, HK, x.stride(0), w_qkv.stride(0), qkv.stride(0), width, float(eps), float(heads.eps),
        block_tables.stride(0), att.stride(0), att.stride(1), scale * LOG2E, nsplit,
        N_O, HQ * D, w_o.stride(0), residual.stride(0), o_width,
        NORM=norm is not None, QK_NORM=qk, D=D, ROT_HALF=rot_half, BLOCK_M=block_m, BLOCK_R=block_r,
        BLOCK_P=block_p, PASS=passing, HEAD_K=qkv_config.block_k, HEAD_SPLIT=split,
        HKV=HK, BS=bs, G=HQ // HK, BLOCK_G=max(16, next_pow2(HQ // HK)), BLOCK_D=bd, PART=partition_size,
        ATT_N=block_n, FORM=form, O_N=o_config.block_n, O_K=o_config.block_k, O_SPLIT=o_split, PREC=_prec(x.dtype),
        USE_PDL=pdl, ASM=x.device.type == "cuda", num_warps=4, num_stages=stages, **pdl_launch(pdl),
    )
    return residual


# The counts of an MLP half's launch: the ticket, then the programs done of gate_up and of down.
MLP_COUNTERS = 3


@triton.jit
def _mlp_half_kernel(x_ptr, wg_ptr, act_ptr, ws_ptr, cnt_ptr, nw_ptr, wd_ptr, res_ptr, ctr_ptr, M, H, I, sx, swg, sa,
                     k_split, eps, swd, sres, k_split_d, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                     GU_N: tl.constexpr, GU_K: tl.constexpr, GU_SPLIT: tl.constexpr, DN_N: tl.constexpr,
                     DN_K: tl.constexpr, DN_SPLIT: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr,
                     ASM: tl.constexpr):
    """By ticket: the gate_up programs (`_tiled_program` with GLU, and NORM; column tile fastest), then the down
    programs (with ADD into the stream), which load their first weight tile, then wait for every gate_up program.
    The last down program to finish sets the counts back to zero."""
    pdl_enter(USE_PDL)
    gu_tiles = tl.cdiv(I, GU_N)
    n_gate = gu_tiles * GU_SPLIT
    tk = ticket(ctr_ptr)
    if tk < n_gate:
        _tiled_program(x_ptr, wg_ptr, act_ptr, ws_ptr, cnt_ptr, nw_ptr, M, I, H, sx, swg, sa, k_split, eps,
                       tk % gu_tiles, tk // gu_tiles, ctr_ptr, 0, False, True, NORM, False, BLOCK_M, GU_N, GU_K,
                       GU_SPLIT, PREC, False, ASM)
        arrive(ctr_ptr + 1)
    else:
        q = tk - n_gate
        dn_tiles = tl.cdiv(H, DN_N)
        _tiled_program(act_ptr, wd_ptr, res_ptr, ws_ptr, cnt_ptr, act_ptr, M, H, I, sa, swd, sres, k_split_d, 0.0,
                       q % dn_tiles, q // dn_tiles, ctr_ptr + 1, n_gate, False, False, False, True, BLOCK_M, DN_N,
                       DN_K, DN_SPLIT, PREC, True, ASM)
        if last_to_finish(ctr_ptr + 2, dn_tiles * DN_SPLIT):
            tl.store(ctr_ptr, 0)
            tl.store(ctr_ptr + 1, 0)


def mlp_half_one_launch(x: torch.Tensor, w_gate_up: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
                        gate_up_config: TiledConfig, w_down: torch.Tensor, residual: torch.Tensor,
                        down_config: TiledConfig, scratch: tuple[torch.Tensor, torch.Tensor], counters: torch.Tensor,
                        pdl: bool = False) -> torch.Tensor:
    """A dense MLP half in one launch (`_mlp_half_kernel`): `tiled_linear(x, w_gate_up, act="glu", norm=norm)` with
    `gate_up_config`'s blocks, then `tiled_linear(act, w_down, residual=residual)` with `down_config`'s, giving
    their bits. `x` may be `residual` itself (the fused runner's stream, with `norm`): the down phase adds into it
    only once every gate_up program has finished. The two configurations must have the same warps (ValueError);
    the launch takes the larger of their stages. `scratch`: the tiled linear's (`tiled_scratch`), for both
    products; `counters`: int32, zero, `MLP_COUNTERS`, which every launch leaves zero. Returns `residual`."""
    check("x", x, dtype=(torch.bfloat16, torch.float32), shape=(None, None))
    M, H = x.shape
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"x: {M} rows, the MLP half in one launch takes 1 to {MAX_ROWS}")
    I2 = w_gate_up.shape[0]
    check("w_gate_up", w_gate_up, dtype=x.dtype, shape=(I2, H), device=x.device)
    if I2 % 2:
        raise ValueError(f"w_gate_up: {I2} rows, expected gate then up rows (an even count)")
    I = I2 // 2
    check("w_down", w_down, dtype=x.dtype, shape=(None, I), device=x.device)
    check("residual", residual, dtype=x.dtype, shape=(M, H), device=x.device)
    if w_down.shape[0] != H:
        raise ValueError(f"w_down: {w_down.shape[0]} rows, the stream has {H} columns")
    if w_gate_up.stride(1) != 1 or w_down.stride(1) != 1:
        raise ValueError("w_gate_up, w_down: rows must be contiguous")
    if norm is not None:
        check("norm weight", norm[0], dtype=x.dtype, shape=(H,), device=x.device)
    check("counters", counters, dtype=(torch.int32,), shape=(None,), device=x.device)
    if counters.numel() < MLP_COUNTERS:
        raise ValueError(f"counters: {counters.numel()}, this launch needs {MLP_COUNTERS}")
    if gate_up_config.num_warps != down_config.num_warps:
        raise ValueError(f"one launch: gate_up's {gate_up_config.num_warps} warps and down's "
                         f"{down_config.num_warps} differ")
    sms = _sms(x.device)
    act = torch.empty((M, I), dtype=x.dtype, device=x.device)
    gu_n = gate_up_config.block_n // 2  # output columns a glu program takes (`tiled_linear`)
    split, width = tiled_split(I, H, gu_n, gate_up_config.block_k, gate_up_config.per_sm, sms)
    _split_scratch(scratch, split, split * M * (2 * I + (1 if norm is not None else 0)), triton.cdiv(I, gu_n), act)
    d_split, d_width = tiled_split(H, I, down_config.block_n, down_config.block_k, down_config.per_sm, sms)
    d_tiles = triton.cdiv(H, down_config.block_n)
    _split_scratch(scratch, d_split, d_split * M * H, d_tiles, residual)
    ws, cnt = scratch
    block_m = max(16, triton.next_power_of_2(M))
    stages = max(tiled_stages(gate_up_config.num_stages, block_m, gate_up_config.block_n, gate_up_config.block_k,
                              False, x.element_size()),
                 tiled_stages(down_config.num_stages, block_m, down_config.block_n, down_config.block_k, False,
                              x.element_size()))
    nw, eps = norm if norm is not None else (x, 0.0)
    programs = triton.cdiv(I, gu_n) * split + d_tiles * d_split
    _mlp_half_kernel[(programs,)](
        x, w_gate_up, act, ws, cnt, nw, w_down, residual, counters, M, H, I, x.stride(0), w_gate_up.stride(0),
        act.stride(0), width, float(eps), w_down.stride(0), residual.stride(0), d_width, NORM=norm is not None,
        BLOCK_M=block_m, GU_N=gu_n, GU_K=gate_up_config.block_k, GU_SPLIT=split, DN_N=down_config.block_n,
        DN_K=down_config.block_k, DN_SPLIT=d_split, PREC=_prec(x.dtype), USE_PDL=pdl, ASM=x.device.type == "cuda",
        num_warps=gate_up_config.num_warps, num_stages=stages, **pdl_launch(pdl),
    )
    return residual
