"""A decode layer in one launch, or either half of it: the attention half (the qkv product with its RMSNorm and q/k/v
preparation, the decode attention with its splits folded, the o product added into the residual stream) and a dense
MLP half (gate_up with its RMSNorm and SiLU-and-multiply, down added into the stream), as phases of one grid.

The fused runner runs that half as three or four launches (`tiled_linear` with `heads=`, `decode_attention`, its
fold where the step has more than one row, `tiled_linear` with `residual=`), each waiting for the last to end and
its programs to be scheduled. Here each program takes a ticket (`_sync.ticket`) that gives its phase and its place in
it, in the order the phases come, and a program of a later phase spins until the phase before it has finished
(`_sync.wait_for`). The o programs load their first weight tile before they wait, so part of the o weight streams in
while the attention runs. Each phase runs the code of its own kernel (`_heads_program`, `_decode_program`,
`_fold_program`, `_tiled_program`) at the same block sizes and splits, so the result has the same bits as the
separate launches; the launch takes the fewest of its kernels' stages (the depth of the loads in flight changes
no sum).
The MLP half is the same with two `_tiled_program` phases, the down programs loading their first weight tile before
they wait for gate_up's; a whole layer is both, gate_up's programs loading theirs before they wait for o's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import check
from gpu_engine.kernels._sync import arrive, last_to_finish, ticket, wait_for
from gpu_engine.kernels.attention import LOG2E, _check_paged, _decode_program, _fold_program, _prec, decode_partials
from gpu_engine.kernels.pdl import pdl_enter, pdl_launch
from gpu_engine.kernels.qkv_prep import _check as _check_prep
from gpu_engine.kernels.tiled_linear import (
    MAX_ROWS,
    Heads,
    TiledConfig,
    _heads_program,
    _split_scratch,
    _tiled_program,
    heads_grid,
    heads_warps,
    tiled_grid,
)

ONE_LAUNCH_PARTS = ("attention", "mlp", "layer", "moe")


def one_launch_parts(setting: str) -> frozenset[str]:
    """The parts a runner runs in one launch each (`BLINK_ONE_LAUNCH`, `bench/roofline.py --one-launch`): "" none;
    comma-separated, of "attention" (`attention_half_one_launch`), "mlp" (`mlp_half_one_launch`), "layer" (both
    halves in one, `layer_one_launch`, where a step's layer takes both) and "moe" (`moe.moe_mlp_one_launch`); "all"
    every one."""
    parts = frozenset(p.strip() for p in setting.split(",") if p.strip())
    if "all" in parts:
        parts = (parts - {"all"}) | frozenset(ONE_LAUNCH_PARTS)
    if parts - set(ONE_LAUNCH_PARTS):
        raise ValueError(f"one launch: {setting!r}, expected a comma-separated list of {', '.join(ONE_LAUNCH_PARTS)} "
                         "or all")
    return parts


# The counts of a launch of phases: the ticket, then the programs done of each phase (heads, attention, fold, o,
# gate_up, down), then the programs of the last phase done (which sets them all back to zero).
LAYER_COUNTERS = 8


@triton.jit
def _layer_kernel(
    x_ptr, wq_ptr, qkv_ptr, ws_ptr, cnt_ptr, nw_ptr, pos_ptr, rope_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
    bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr, att_ptr, acnt_ptr, wo_ptr, res_ptr, ctr_ptr,
    M, K, HQ, HK, sx, sw, so, k_split, eps, qk_eps, sbt_b, sa_b, sa_h, scale_log2, NSPLIT, N_O, K_O, swo, sres,
    k_split_o,
    mw_ptr, wg_ptr, act_ptr, wd_ptr, I, swg, s_act, k_split_g, m_eps, swd, k_split_d,
    NORM: tl.constexpr, QK_NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PASS: tl.constexpr, HEAD_K: tl.constexpr, HEAD_SPLIT: tl.constexpr,
    HKV: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    PART: tl.constexpr, ATT_N: tl.constexpr, FORM: tl.constexpr, O_N: tl.constexpr, O_K: tl.constexpr,
    O_SPLIT: tl.constexpr,
    M_NORM: tl.constexpr, GU_N: tl.constexpr, GU_K: tl.constexpr, GU_SPLIT: tl.constexpr, DN_N: tl.constexpr,
    DN_K: tl.constexpr, DN_SPLIT: tl.constexpr,
    ATTENTION: tl.constexpr, MLP: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr, ASM: tl.constexpr,
):
    """By ticket, with ATTENTION: (HQ + 2 HK) x HEAD_SPLIT heads programs (head fastest, as `_tiled_heads_kernel`'s
    grid), M x HKV x NSPLIT attention programs (row fastest, then KV head), with FORM "split" M x HKV fold programs,
    then the o programs (column tile fastest, as every tiled phase); then with MLP the gate_up programs (GLU, M_NORM)
    and the down programs (ADD). Each phase waits for every program of the one before; the o, gate_up (after o) and
    down programs load their first weight tile first. The heads phase's x is `x_ptr` (the stream itself in the
    runner), the MLP's the stream `res_ptr`. The last program of the last phase to finish sets the counts back to
    zero."""
    pdl_enter(USE_PDL)
    tk = ticket(ctr_ptr)
    n_att_phases = 0
    n_o = 0
    if ATTENTION:
        n_heads = (HQ + 2 * HK) * HEAD_SPLIT
        n_att = M * HKV * NSPLIT
        n_fold = M * HKV if FORM == "split" else 0
        o_tiles = tl.cdiv(N_O, O_N)
        n_o = o_tiles * O_SPLIT
        n_att_phases = n_heads + n_att + n_fold + n_o
    if tk < n_att_phases:
        if ATTENTION:
            if tk < n_heads:
                _heads_program(x_ptr, wq_ptr, qkv_ptr, ws_ptr, cnt_ptr, nw_ptr, pos_ptr, rope_ptr, kc_ptr, vc_ptr,
                               slot_ptr, qw_ptr, kw_ptr, M, K, HQ, HK, sx, sw, so, k_split, eps, qk_eps,
                               tk % (HQ + 2 * HK), tk // (HQ + 2 * HK), NORM, QK_NORM, D, ROT_HALF, BLOCK_M, BLOCK_R,
                               BLOCK_P, PASS, HEAD_K, HEAD_SPLIT, PREC)
                arrive(ctr_ptr + 1)
            elif tk < n_heads + n_att:
                q = tk - n_heads
                wait_for(ctr_ptr + 1, n_heads, ASM)
                _decode_program(qkv_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr, att_ptr, acnt_ptr,
                                so, D, sbt_b, sa_b, sa_h, scale_log2, NSPLIT, q % M, (q // M) % HKV, q // (M * HKV),
                                NSPLIT, HKV, D, BS, G, BLOCK_G, BLOCK_D, PART, ATT_N, FORM, 0, PREC, False)
                arrive(ctr_ptr + 2)
            elif tk < n_heads + n_att + n_fold:
                q = tk - n_heads - n_att
                wait_for(ctr_ptr + 2, n_att, ASM)
                _fold_program(po_ptr, pm_ptr, pl_ptr, ctx_ptr, att_ptr, sa_b, sa_h, NSPLIT, q % M, q // M, HKV, D, G,
                              BLOCK_G, BLOCK_D, PART, 0)
                arrive(ctr_ptr + 3)
            else:
                q = tk - n_heads - n_att - n_fold
                if FORM == "split":
                    wait_ptr, wait_n = ctr_ptr + 3, n_fold
                else:
                    wait_ptr, wait_n = ctr_ptr + 2, n_att
                _tiled_program(att_ptr, wo_ptr, res_ptr, ws_ptr, cnt_ptr, att_ptr, M, N_O, K_O, sa_b, swo, sres,
                               k_split_o, 0.0, q % o_tiles, q // o_tiles, wait_ptr, wait_n, False, False, False, True,
                               BLOCK_M, O_N, O_K, O_SPLIT, PREC, True, ASM)
                arrive(ctr_ptr + 4)
                if not MLP:
                    _reset_if_last(ctr_ptr, n_o)
    else:
        if MLP:
            q = tk - n_att_phases
            gu_tiles = tl.cdiv(I, GU_N)
            n_gate = gu_tiles * GU_SPLIT
            if q < n_gate:  # after o where the launch has the attention half: its first weight tile before it waits
                _tiled_program(res_ptr, wg_ptr, act_ptr, ws_ptr, cnt_ptr, mw_ptr, M, I, N_O, sres, swg, s_act,
                               k_split_g, m_eps, q % gu_tiles, q // gu_tiles, ctr_ptr + 4, n_o, False, True, M_NORM,
                               False, BLOCK_M, GU_N, GU_K, GU_SPLIT, PREC, ATTENTION, ASM)
                arrive(ctr_ptr + 5)
            else:
                q -= n_gate
                dn_tiles = tl.cdiv(N_O, DN_N)
                _tiled_program(act_ptr, wd_ptr, res_ptr, ws_ptr, cnt_ptr, act_ptr, M, N_O, I, s_act, swd, sres,
                               k_split_d, 0.0, q % dn_tiles, q // dn_tiles, ctr_ptr + 5, n_gate, False, False, False,
                               True, BLOCK_M, DN_N, DN_K, DN_SPLIT, PREC, True, ASM)
                arrive(ctr_ptr + 6)
                _reset_if_last(ctr_ptr, dn_tiles * DN_SPLIT)


@triton.jit
def _reset_if_last(ctr_ptr, n):
    """The last of the last phase's `n` programs to finish sets every count back to zero (each program has its
    ticket and has passed its waits by then)."""
    if last_to_finish(ctr_ptr + 7, n):
        for i in tl.static_range(7):
            tl.store(ctr_ptr + i, 0)


def attention_fits(rows: int, qkv_config: TiledConfig, o_config: TiledConfig) -> bool:
    """Whether the attention half of a `rows`-row step can be one launch: the heads kernel and the o product at the
    attention's 4 warps."""
    return heads_warps(rows, qkv_config) == 4 and o_config.num_warps == 4


@dataclass
class _Part:
    """A part's kernel arguments by name, its programs, and the stages and warps its kernels take."""

    args: dict[str, Any]
    programs: int
    stages: int
    warps: int


def _attention_part(x, w_qkv, heads: Heads, norm, qkv_config: TiledConfig, block_tables, context_lens, scale: float,
                    w_o, residual, o_config: TiledConfig, scratch, attn_counters, partition_size: int,
                    block_n: int) -> _Part:
    """The attention half's arguments, checked, and its buffers (`attention_half_one_launch`)."""
    M, H = x.shape
    N = w_qkv.shape[0]
    check("w_qkv", w_qkv, dtype=x.dtype, shape=(N, H), device=x.device)
    hg = heads_grid(x, w_qkv, heads, norm is not None, qkv_config)  # as `_tiled_heads` launches it (checks heads)
    HQ, HK, D = heads.num_heads, heads.num_kv_heads, hg.D
    check("w_o", w_o, dtype=x.dtype, shape=(None, HQ * D), device=x.device)
    N_O = w_o.shape[0]
    check("residual", residual, dtype=x.dtype, shape=(M, N_O), device=x.device)
    if w_qkv.stride(1) != 1 or w_o.stride(1) != 1:
        raise ValueError("w_qkv, w_o: rows must be contiguous")
    if norm is not None:
        check("norm weight", norm[0], dtype=x.dtype, shape=(H,), device=x.device)
    if not attention_fits(M, qkv_config, o_config):
        raise ValueError(f"one launch: the heads kernel's {hg.warps} warps and the o product's "
                         f"{o_config.num_warps} must be the attention's 4")
    qkv = torch.empty((M, N), dtype=x.dtype, device=x.device)
    q = qkv[:, : HQ * D].view(M, HQ, D)
    _check_prep(q, qkv[:, HQ * D: (HQ + HK) * D].view(M, HK, D), qkv[:, (HQ + HK) * D:].view(M, HK, D),
                heads.positions, heads.cache, heads.k_cache, heads.v_cache, heads.slot_mapping, heads.q_norm,
                heads.k_norm)  # as `_tiled_heads` checks them
    _check_paged(q, heads.k_cache, heads.v_cache, block_tables, context_lens, M)
    if partition_size % block_n:
        raise ValueError("partition_size must be a multiple of block_n")
    if attn_counters is not None:
        check("attn_counters", attn_counters, dtype=(torch.int32,), shape=(None,), device=x.device)
        if attn_counters.numel() < M * HK:
            raise ValueError(f"attn_counters: {attn_counters.numel()}, this launch needs {M * HK} (rows x KV heads)")
    _split_scratch(scratch, hg.split, hg.parts, HQ + 2 * HK, qkv)  # checks its size
    # the attention, as `decode_attention` launches it
    bs = heads.k_cache.shape[1]
    nsplit, (po, pm, pl), consts = decode_partials(q, HK, block_tables.shape[1] * bs, partition_size)
    att = torch.empty((M, HQ, D), dtype=x.dtype, device=x.device)
    # the o product, as `tiled_linear` launches it with a residual
    og = tiled_grid(M, N_O, HQ * D, o_config, x)
    _split_scratch(scratch, og.split, og.parts, og.tiles, residual)
    form = "split" if attn_counters is None else "last"
    nw, eps = norm if norm is not None else (qkv, 0.0)
    qk = heads.q_norm is not None
    args = dict(
        wq_ptr=w_qkv, qkv_ptr=qkv, nw_ptr=nw, pos_ptr=heads.positions, rope_ptr=heads.cache, kc_ptr=heads.k_cache,
        vc_ptr=heads.v_cache, slot_ptr=heads.slot_mapping, qw_ptr=heads.q_norm if qk else qkv,
        kw_ptr=heads.k_norm if qk else qkv, bt_ptr=block_tables, ctx_ptr=context_lens, po_ptr=po, pm_ptr=pm,
        pl_ptr=pl, att_ptr=att, acnt_ptr=qkv if attn_counters is None else attn_counters,
        wo_ptr=w_o, HQ=HQ, HK=HK, sw=w_qkv.stride(0), so=qkv.stride(0), k_split=hg.width, eps=float(eps),
        qk_eps=float(heads.eps), sbt_b=block_tables.stride(0), sa_b=att.stride(0), sa_h=att.stride(1),
        scale_log2=scale * LOG2E, NSPLIT=nsplit, K_O=HQ * D, swo=w_o.stride(0), k_split_o=og.width,
        NORM=norm is not None, QK_NORM=qk, ROT_HALF=hg.rot_half, BLOCK_R=hg.block_r, BLOCK_P=hg.block_p,
        PASS=hg.passing, HEAD_K=qkv_config.block_k, HEAD_SPLIT=hg.split, BS=bs, ATT_N=block_n, FORM=form,
        O_N=og.tile_n, O_K=o_config.block_k, O_SPLIT=og.split, N_O=N_O, ATTENTION=True, **consts)
    programs = (HQ + 2 * HK) * hg.split + M * HK * nsplit + (M * HK if form == "split" else 0) + og.tiles * og.split
    stages = min(hg.stages, og.stages)
    return _Part(args, programs, stages, 4)


def _mlp_part(x, w_gate_up, norm, gate_up_config: TiledConfig, w_down, residual, down_config: TiledConfig,
              scratch) -> _Part:
    """The MLP half's arguments, checked, and its buffer (`mlp_half_one_launch`)."""
    M, H = x.shape
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
    if gate_up_config.num_warps != down_config.num_warps:
        raise ValueError(f"one launch: gate_up's {gate_up_config.num_warps} warps and down's "
                         f"{down_config.num_warps} differ")
    act = torch.empty((M, I), dtype=x.dtype, device=x.device)
    # both products as `tiled_linear` launches them: gate_up with glu (and the norm), down with a residual
    gg = tiled_grid(M, I, H, gate_up_config, x, glu=True, norm=norm is not None)
    _split_scratch(scratch, gg.split, gg.parts, gg.tiles, act)
    dg = tiled_grid(M, H, I, down_config, x)
    _split_scratch(scratch, dg.split, dg.parts, dg.tiles, residual)
    nw, eps = norm if norm is not None else (x, 0.0)
    args = dict(mw_ptr=nw, wg_ptr=w_gate_up, act_ptr=act, wd_ptr=w_down, I=I, swg=w_gate_up.stride(0),
                s_act=act.stride(0), k_split_g=gg.width, m_eps=float(eps), swd=w_down.stride(0), k_split_d=dg.width,
                M_NORM=norm is not None, GU_N=gg.tile_n, GU_K=gate_up_config.block_k, GU_SPLIT=gg.split,
                DN_N=dg.tile_n, DN_K=down_config.block_k, DN_SPLIT=dg.split, MLP=True, N_O=H)
    return _Part(args, gg.tiles * gg.split + dg.tiles * dg.split, min(gg.stages, dg.stages),
                 gate_up_config.num_warps)


# what an absent part's arguments are (never read: the phases that would read them are not compiled in)
_NO_ATTENTION = dict(
    wq_ptr=None, qkv_ptr=None, nw_ptr=None, pos_ptr=None, rope_ptr=None, kc_ptr=None, vc_ptr=None, slot_ptr=None,
    qw_ptr=None, kw_ptr=None, bt_ptr=None, ctx_ptr=None, po_ptr=None, pm_ptr=None, pl_ptr=None, att_ptr=None,
    acnt_ptr=None, wo_ptr=None, HQ=1, HK=1, sw=0, so=0, k_split=0, eps=0.0, qk_eps=0.0, sbt_b=0, sa_b=0, sa_h=0,
    scale_log2=0.0, NSPLIT=1, K_O=0, swo=0, k_split_o=0, NORM=False, QK_NORM=False, D=16, ROT_HALF=8, BLOCK_R=16,
    BLOCK_P=16, PASS=False, HEAD_K=16, HEAD_SPLIT=1, HKV=1, BS=1, G=1, BLOCK_G=16, BLOCK_D=16, PART=16, ATT_N=16,
    FORM="split", O_N=16, O_K=16, O_SPLIT=1, ATTENTION=False)
_NO_MLP = dict(mw_ptr=None, wg_ptr=None, act_ptr=None, wd_ptr=None, I=0, swg=0, s_act=0, k_split_g=0, m_eps=0.0,
               swd=0, k_split_d=0, M_NORM=False, GU_N=16, GU_K=16, GU_SPLIT=1, DN_N=16, DN_K=16, DN_SPLIT=1, MLP=False)


def _launch(x: torch.Tensor, residual: torch.Tensor, scratch, counters: torch.Tensor, pdl: bool,
            attention: _Part | None, mlp: _Part | None) -> torch.Tensor:
    """One `_layer_kernel` launch of the parts given, at the fewest of their stages (the depth of the loads in
    flight changes no sum; the fewest keep shared memory within each configuration's programs an SM)."""
    check("counters", counters, dtype=(torch.int32,), shape=(None,), device=x.device)
    if counters.numel() < LAYER_COUNTERS:
        raise ValueError(f"counters: {counters.numel()}, this launch needs {LAYER_COUNTERS}")
    M = x.shape[0]
    parts = [p for p in (attention, mlp) if p is not None]
    if len({p.warps for p in parts}) != 1:
        raise ValueError(f"one launch: the parts' warps differ ({[p.warps for p in parts]})")
    args: dict[str, Any] = {**_NO_ATTENTION, **_NO_MLP}
    for part in parts:
        args.update(part.args)
    args = {k: (x if v is None else v) for k, v in args.items()}  # an absent part's pointers: any tensor
    ws, cnt = scratch
    _layer_kernel[(sum(p.programs for p in parts),)](
        x_ptr=x, ws_ptr=ws, cnt_ptr=cnt, res_ptr=residual, ctr_ptr=counters, M=M, K=x.shape[1], sx=x.stride(0),
        sres=residual.stride(0), BLOCK_M=max(16, triton.next_power_of_2(M)), PREC=_prec(x.dtype), USE_PDL=pdl,
        ASM=x.device.type == "cuda", num_warps=parts[0].warps, num_stages=min(p.stages for p in parts), **args,
        **pdl_launch(pdl))
    return residual


def _rows(x: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    check("x", x, dtype=(torch.bfloat16, torch.float32), shape=(None, None))
    if scratch is None:
        raise ValueError("scratch: the tiled linear's (tiled_scratch), for the launch's products")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x: {x.shape[0]} rows, a decode layer's parts in one launch take 1 to {MAX_ROWS}")


def attention_half_one_launch(
    x: torch.Tensor, w_qkv: torch.Tensor, heads: Heads, norm: tuple[torch.Tensor, float] | None,
    qkv_config: TiledConfig, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    w_o: torch.Tensor, residual: torch.Tensor, o_config: TiledConfig, scratch: tuple[torch.Tensor, torch.Tensor],
    counters: torch.Tensor, attn_counters: torch.Tensor | None = None, partition_size: int = 256,
    block_n: int = 128, pdl: bool = False,
) -> torch.Tensor:
    """A decode step's attention half, one row a sequence, in one launch (`_layer_kernel`):
    `tiled_linear(x, w_qkv, norm=norm, heads=heads)` with `qkv_config`'s blocks, then `decode_attention` of its
    query heads over the caches (form "last" with `attn_counters`, one a (row, KV head), else "split" and the fold),
    then `tiled_linear(attention, w_o, residual=residual)` with `o_config`'s, giving their bits. `x` may be
    `residual` itself (the fused runner's stream, with `norm`): the o phase adds into it only once every program that
    reads it has finished. `scratch`: the tiled linear's (`tiled_scratch`), for both products; `counters`: int32,
    zero, `LAYER_COUNTERS`, which every launch leaves zero. Both configurations must have the attention's 4 warps
    (else ValueError, and the runner launches the kernels apart). Returns `residual`."""
    _rows(x, scratch)
    part = _attention_part(x, w_qkv, heads, norm, qkv_config, block_tables, context_lens, scale, w_o, residual,
                           o_config, scratch, attn_counters, partition_size, block_n)
    return _launch(x, residual, scratch, counters, pdl, part, None)


def mlp_half_one_launch(x: torch.Tensor, w_gate_up: torch.Tensor, norm: tuple[torch.Tensor, float] | None,
                        gate_up_config: TiledConfig, w_down: torch.Tensor, residual: torch.Tensor,
                        down_config: TiledConfig, scratch: tuple[torch.Tensor, torch.Tensor], counters: torch.Tensor,
                        pdl: bool = False) -> torch.Tensor:
    """A dense MLP half in one launch (`_layer_kernel`): `tiled_linear(x, w_gate_up, act="glu", norm=norm)` with
    `gate_up_config`'s blocks, then `tiled_linear(act, w_down, residual=residual)` with `down_config`'s, giving
    their bits. `x` must be `residual` (the fused runner's stream): the down phase adds into it only once every
    gate_up program has finished. The two configurations must have the same warps (ValueError); the launch takes
    the fewer of their stages. `scratch`, `counters`: as `attention_half_one_launch` takes them. Returns
    `residual`."""
    _rows(x, scratch)
    if x.data_ptr() != residual.data_ptr():
        raise ValueError("x: the MLP half's x is the stream it adds into (residual)")
    part = _mlp_part(x, w_gate_up, norm, gate_up_config, w_down, residual, down_config, scratch)
    return _launch(x, residual, scratch, counters, pdl, None, part)


def layer_one_launch(
    x: torch.Tensor, w_qkv: torch.Tensor, heads: Heads, attn_norm: tuple[torch.Tensor, float] | None,
    qkv_config: TiledConfig, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    w_o: torch.Tensor, o_config: TiledConfig, w_gate_up: torch.Tensor, mlp_norm: tuple[torch.Tensor, float] | None,
    gate_up_config: TiledConfig, w_down: torch.Tensor, down_config: TiledConfig,
    scratch: tuple[torch.Tensor, torch.Tensor], counters: torch.Tensor, attn_counters: torch.Tensor | None = None,
    partition_size: int = 256, block_n: int = 128, pdl: bool = False,
) -> torch.Tensor:
    """A whole dense decode layer in one launch: `attention_half_one_launch` then `mlp_half_one_launch` on the
    stream `x` (both halves' products through 4-warp configurations), the same bits. Returns `x`."""
    _rows(x, scratch)
    attention = _attention_part(x, w_qkv, heads, attn_norm, qkv_config, block_tables, context_lens, scale, w_o, x,
                                o_config, scratch, attn_counters, partition_size, block_n)
    mlp = _mlp_part(x, w_gate_up, mlp_norm, gate_up_config, w_down, x, down_config, scratch)
    return _launch(x, x, scratch, counters, pdl, attention, mlp)
