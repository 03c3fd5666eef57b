"""GPU compilation of Triton kernels without a GPU: their TTIR for sm_90, built by Triton's own front
end (type and shape rules the CPU interpreter does not enforce; docs/GPU_NOTES.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")
ROOT = Path(__file__).resolve().parent.parent


def compiles(module: str, kernel: str, signature: dict[str, str], constexprs: dict[str, object],
             **more: object) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    spec = json.dumps({"signature": signature, "constexprs": constexprs, **more})
    res = subprocess.run([sys.executable, "-m", "helpers.ttir", module, kernel, spec], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    return res.stdout.strip() + res.stderr[-3000:]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (4, 2)])
def test_fused_qkv_kernel_compiles_for_sm90(norm: bool, hq: int, hk: int) -> None:
    """Query and key heads of different counts (their tiles have different shapes) in one kernel."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "qw_ptr", "kw_ptr")}
    ptrs |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp32"}
    scalars = dict.fromkeys(("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "HQ", "HK"), "i32") | {"eps": "fp32"}
    order = ("q_ptr k_ptr v_ptr pos_ptr cache_ptr kc_ptr vc_ptr slot_ptr qw_ptr kw_ptr "
             "sq_t sq_h sk_t sk_h sv_t sv_h HQ HK eps").split()
    signature = {n: (ptrs | scalars)[n] for n in order}
    consts = {"NORM": norm, "D": 128, "ROT_HALF": 64, "BLOCK_HQ": hq, "BLOCK_HK": hk, "BLOCK_R": 64, "BLOCK_P": 1,
              "BLOCK_D": 128, "USE_PDL": False}
    out = compiles("gpu_engine.kernels.qkv_prep", "_prep_kernel", signature, consts)
    assert out.startswith("True"), out


ROW_KERNELS = {
    "logprobs": ("_logprob_kernel", "x_ptr:*fp32 s_x:i32 want_ptr:*i32 tok_ptr:*i64 lp_ptr:*fp32 ids_ptr:*i64 "
                 "tlp_ptr:*fp32 V:i32 K:i32 s_top:i32", {"BLOCK": 1024}),
    "sampling_select": ("_threshold_kernel", "x_ptr:*fp32 s_x:i32 temp_ptr:*fp32 k_ptr:*i32 p_ptr:*fp32 "
                        "minp_ptr:*fp32 key_ptr:*i32 cnt_ptr:*i32 V:i32", {"BLOCK": 1024, "NCAND": 8}),
}


@pytest.mark.parametrize("module", sorted(ROW_KERNELS))
def test_row_softmax_kernels_compile_for_sm90(module: str) -> None:
    """Both users of the shared softmax_stats helper (with and without its min-p cut) build for the GPU."""
    kernel, sig, consts = ROW_KERNELS[module]
    signature = dict(item.split(":") for item in sig.split())
    out = compiles(f"gpu_engine.kernels.{module}", kernel, signature, consts)
    assert out.startswith("True"), out


MOE_MLP_SIG = ("x_ptr:*bf16 rw_ptr:*bf16 nw_ptr:*bf16 logits_ptr:*fp32 w_ptr:*fp32 ids_ptr:*i64 act_ptr:*bf16 "
               "gu_ptr:*bf16 dn_ptr:*bf16 out_ptr:*bf16 ctr_ptr:*i32 tok_ptr:*i32 T:i32 E:i32 H:i32 I:i32 s_x:i32 "
               "s_r:i32 s_gue:i32 s_gun:i32 s_a:i32 s_de:i32 s_dn:i32 s_o:i32 eps:fp32")
MOE_MLP_CONSTS = {"TOPK": 8, "NORMALIZE": True, "NORM": True, "GROUPS": 32, "BLOCK_G": 4, "ROUTER_K": 512,
                  "BLOCK_E": 128, "GATE_N": 4, "GATE_K": 512, "DOWN_N": 2, "DOWN_K": 256, "SLOTS": 8, "ADD": True,
                  "ASM": True}
ROUTER_SIG = ("x_ptr:*bf16 rw_ptr:*bf16 nw_ptr:*bf16 logits_ptr:*fp32 w_ptr:*fp32 ids_ptr:*i64 cnt_ptr:*i32 E:i32 "
              "K:i32 s_x:i32 s_r:i32 eps:fp32")


@pytest.mark.parametrize(("dtype", "top_k"), [("bf16", 8), ("fp32", 6)])
def test_moe_small_kernels_compile_for_sm90(dtype: str, top_k: int) -> None:
    """The sort-free MoE kernels at the launchers' default blocks, each dtype once; top_k 6 pads the down
    kernel's slots to 8; gate_up with and without the layer's RMSNorm, and the router's product with the routing
    (with the norm)."""
    scalars = "I:i32 K:i32 s_x:i32 s_we:i32 s_wn:i32 s_o:i32 eps:fp32"
    sig = f"x_ptr:*{dtype} w_ptr:*{dtype} ids_ptr:*i64 out_ptr:*{dtype} nw_ptr:*{dtype} {scalars}"
    for norm in (False, True):
        out = compiles("gpu_engine.kernels.moe", "_gate_up_silu_kernel",
                       dict(item.split(":") for item in sig.split()),
                       {"TOPK": top_k, "BLOCK_N": 4, "BLOCK_K": 512, "NORM": norm, "USE_PDL": False})
        assert out.startswith("True"), out
    out = compiles("gpu_engine.kernels.moe", "_router_kernel", _sig(ROUTER_SIG.replace("bf16", dtype)),
                   {"TOPK": top_k, "NORMALIZE": True, "NORM": True, "GROUPS": 32, "BLOCK_G": 4, "BLOCK_K": 512,
                    "BLOCK_E": 128, "USE_PDL": False})
    assert out.startswith("True"), out
    scalars = "N:i32 K:i32 s_a:i32 s_we:i32 s_wn:i32 s_o:i32"
    sig = f"a_ptr:*{dtype} w_ptr:*{dtype} ids_ptr:*i64 rw_ptr:*fp32 out_ptr:*{dtype} {scalars}"
    for add in (False, True):  # the sum alone, or added into the residual stream
        out = compiles("gpu_engine.kernels.moe", "_down_sum_kernel", dict(item.split(":") for item in sig.split()),
                       {"TOPK": top_k, "SLOTS": 8, "BLOCK_N": 2, "BLOCK_K": 256, "ADD": add, "USE_PDL": False})
        assert out.startswith("True"), out
    # the three in one launch, with the norm and the residual add in bf16, without them in fp32
    out = compiles("gpu_engine.kernels.moe", "_moe_mlp_kernel", _sig(MOE_MLP_SIG.replace("bf16", dtype)),
                   {**MOE_MLP_CONSTS, "TOPK": top_k, "NORM": dtype == "bf16", "ADD": dtype == "bf16",
                    "USE_PDL": False})
    assert out.startswith("True"), out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_q8_dequant_kernel_compiles_for_sm90(dtype: str) -> None:
    """The Q8_0 product's dequantizing kernel, into each dtype."""
    sig = f"q_ptr:*i8 s_ptr:*fp16 w_ptr:*{dtype} K:i32 sq:i32 ss:i32 sw:i32"
    out = compiles("gpu_engine.kernels.q8_linear", "_q8_dequant_kernel", dict(item.split(":") for item in sig.split()),
                   {"BLOCK_K": 1024, "GROUP": 32, "UPCAST": False})
    assert out.startswith("True"), out


@pytest.mark.parametrize(("form", "walk_upto", "laned"),
                         [("split", 0, False), ("last", 0, False), ("walk", 0, False), ("split", 2, False),
                          ("last", 2, False), ("walk", 2, False), ("split", 0, True), ("last", 2, True)])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_attention_kernel_compiles_for_sm90(dtype: str, form: str, walk_upto: int, laned: bool) -> None:
    """The decode attention in its three forms (a program per split; the same with the last to finish folding, an
    atomic count; a row walked by one program), the first two with short rows walked and with fewer programs than
    splits (lanes), at the runner's shape, and the fold of the partials."""
    sig = (f"q_ptr:*{dtype} kc_ptr:*{dtype} vc_ptr:*{dtype} bt_ptr:*i32 ctx_ptr:*i32 po_ptr:*fp32 pm_ptr:*fp32 "
           f"pl_ptr:*fp32 out_ptr:*{dtype} cnt_ptr:*i32 sq_b:i32 sq_h:i32 sbt_b:i32 so_b:i32 so_h:i32 "
           "scale_log2:fp32 NSPLIT:i32")
    consts = {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256, "BLOCK_N": 128,
              "FORM": form, "WALK_UPTO": walk_upto, "PREC": "ieee" if dtype == "fp32" else "tf32", "USE_PDL": False,
              "LANED": laned}
    out = compiles("gpu_engine.kernels.attention", "_decode_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out
    sig = f"po_ptr:*fp32 pm_ptr:*fp32 pl_ptr:*fp32 ctx_ptr:*i32 out_ptr:*{dtype} so_b:i32 so_h:i32 NSPLIT:i32"
    consts = {k: consts[k] for k in ("HKV", "D", "G", "BLOCK_G", "BLOCK_D", "PART", "WALK_UPTO", "USE_PDL")}
    out = compiles("gpu_engine.kernels.attention", "_fold_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out


@pytest.mark.parametrize(("dtype", "block_m", "whole"),
                         [("bf16", 64, True), ("bf16", 16, True), ("fp32", 64, True), ("bf16", 64, False)])
def test_prefill_attention_kernel_compiles_for_sm90(dtype: str, block_m: int, whole: bool) -> None:
    """The prefill attention (its whole-tile and diagonal loops, or the diagonal loop alone) at the runner's tile
    sizes."""
    sig = (f"q_ptr:*{dtype} kc_ptr:*{dtype} vc_ptr:*{dtype} bt_ptr:*i32 ctx_ptr:*i32 cu_ptr:*i32 out_ptr:*{dtype} "
           "sq_t:i32 sq_h:i32 so_t:i32 so_h:i32 sbt_b:i32 scale_log2:fp32 NB:i32 T:i32")
    consts = {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": 64,
              "WHOLE": whole, "PREC": "ieee" if dtype == "fp32" else "tf32"}
    out = compiles("gpu_engine.kernels.attention", "_prefill_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out


def test_moe_align_kernel_compiles_for_sm90() -> None:
    """The one-launch MoE align (three program roles) for Qwen3-30B-A3B's 128 experts."""
    sig = ("ids_ptr:*i64 sorted_ptr:*i32 bexp_ptr:*i32 P:i32 E:i32 P_MAX:i32 N_BLOCKS:i32 PAIR_PROGS:i32 "
           "SLOT_PROGS:i32")
    out = compiles("gpu_engine.kernels.moe", "_align_kernel", dict(item.split(":") for item in sig.split()),
                   {"BM": 16, "BLOCK_E": 128, "CHUNK": 64})
    assert out.startswith("True"), out


@pytest.mark.parametrize(("fma", "block_m", "silu"), [(False, 16, False), (True, 1, False), (True, 8, False),
                                                      (True, 1, True), (True, 8, True)])
def test_gemv_kernel_compiles_for_sm90(fma: bool, block_m: int, silu: bool) -> None:
    """The skinny matmul's two forms (a tensor-core dot of rows padded to 16; products in registers, one row
    summed after the loop or several summed each tile), plain and with the SiLU-and-multiply on the x tiles."""
    sig = ("x_ptr:*bf16 w_ptr:*bf16 out_ptr:*bf16 M:i32 N:i32 K:i32 sx:i32 sw:i32 so:i32")
    consts = {"SILU": silu, "BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 256, "PREC": "tf32", "FMA": fma}
    out = compiles("gpu_engine.kernels.gemv", "_gemv_kernel", dict(item.split(":") for item in sig.split()), consts)
    assert out.startswith("True"), out


TILED_SIG = ("x_ptr:*bf16 w_ptr:*bf16 out_ptr:*bf16 ws_ptr:*fp32 cnt_ptr:*i32 nw_ptr:*bf16 M:i32 N:i32 K:i32 "
             "sx:i32 sw:i32 so:i32 k_split:i32 eps:fp32")
PLAIN = {"GLU": False, "NORM": False, "ADD": False}


@pytest.mark.parametrize(("block_m", "split_k", "silu", "fused"),
                         [(16, 1, False, ""), (128, 1, False, ""), (64, 4, False, ""), (128, 2, True, ""),
                          (16, 1, False, "GLU NORM"), (16, 4, False, "GLU NORM"), (64, 2, False, "ADD"),
                          (16, 1, False, "ADD")])
def test_tiled_linear_kernel_compiles_for_sm90(block_m: int, split_k: int, silu: bool, fused: str) -> None:
    """The tiled linear whole and split over K (fp32 partials, the atomic count, the last program's sum in slice
    order), plain, with the SiLU-and-multiply on the x tiles, and in the fused forms of a decode layer (the gate_up
    product's SiLU as its output with the RMSNorm on its x tiles; the output added into the residual)."""
    sig = TILED_SIG
    consts = {"SILU": silu, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split_k, "PREC": "tf32",
              "USE_PDL": False, **PLAIN, **dict.fromkeys(fused.split(), True)}
    out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out


HEADS_SIG = ("x_ptr:*bf16 w_ptr:*bf16 out_ptr:*bf16 ws_ptr:*fp32 cnt_ptr:*i32 nw_ptr:*bf16 pos_ptr:*i64 "
             "cache_ptr:*fp32 kc_ptr:*bf16 vc_ptr:*bf16 slot_ptr:*i64 qw_ptr:*bf16 kw_ptr:*bf16 M:i32 K:i32 HQ:i32 "
             "HK:i32 sx:i32 sw:i32 so:i32 k_split:i32 eps:fp32 qk_eps:fp32")


@pytest.mark.parametrize(("block_m", "split_k", "qk_norm", "norm", "d", "rot_half"),
                         [(16, 1, False, True, 128, 64), (16, 8, False, True, 128, 64), (16, 8, True, False, 128, 64),
                          (64, 8, True, True, 128, 64), (128, 8, True, True, 128, 64), (16, 8, False, True, 96, 16)])
def test_tiled_heads_kernel_compiles_for_sm90_within_half_a_blocks_shared_memory(
        block_m: int, split_k: int, qk_norm: bool, norm: bool, d: int, rot_half: int) -> None:
    """The qkv product with `qkv_prep` as its output at the Llama-3-8B head (128 wide, full rotary: no pass-through
    tile) and at Phi-3's (96 wide, 32 rotary: a pass-through tile), with the h200 plan's qkv configuration, whole
    and split over K, with the QK norms of Qwen3 or the layer's RMSNorm, at 16 to 128 rows, with the warps and
    stages the launcher gives it (`_tiled_heads`, `heads_stages`): it compiles to a cubin within half a block's
    shared memory, so two programs share an SM (a block's at 128 rows, where half would leave one stage). Its
    slices' width is divisible by 16, as a launch's is (then its loads are pipelined and the stages take their
    shared memory)."""
    from gpu_engine.kernels.tiled_linear import SHARED_BYTES, TILED_CONFIGS, heads_stages

    c = TILED_CONFIGS["n64_k128_s4"]
    block_r, block_p = (max(16, 1 << max(0, n - 1).bit_length()) for n in (rot_half, d - 2 * rot_half))
    passing = d > 2 * rot_half
    consts = {"NORM": norm, "QK_NORM": qk_norm, "D": d, "ROT_HALF": rot_half, "BLOCK_M": block_m, "BLOCK_R": block_r,
              "BLOCK_P": block_p, "PASS": passing, "BLOCK_K": c.block_k, "SPLIT_K": split_k, "PREC": "tf32",
              "USE_PDL": False}
    options = {"num_warps": 8 if block_m >= 64 else c.num_warps,
               "num_stages": heads_stages(c.num_stages, block_m, block_r, block_p if passing else 0, c.block_k, 2)}
    out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_heads_kernel", _sig(HEADS_SIG), consts,
                   options=options, divisible=["x_ptr", "w_ptr", "out_ptr", "ws_ptr", "K", "sx", "sw", "so", "k_split"])
    got = re.match(r"\d+", out)
    assert got is not None and int(got.group()) <= (SHARED_BYTES if block_m == 128 else SHARED_BYTES // 2), out


GLU_CHECKED = ("n128_k64_s4_w8", "n256_k64_s4_w8", "n64_k128_s4")  # gate_up's: the h200 plans', and wider


def test_every_tiled_linear_configuration_fits_a_blocks_shared_memory() -> None:
    """Each named configuration at 128 rows, plain, with the SiLU, and (gate_up's) as a glu (half the columns, two
    weight tiles of half the width), compiled for sm_90 to its cubin with the stages the launcher gives it
    (`tiled_stages`): no more shared memory than a block may take (a launch past it fails with out-of-resources on
    the GPU)."""
    from gpu_engine.kernels.tiled_linear import SHARED_BYTES, TILED_CONFIGS, tiled_stages

    sig = TILED_SIG
    divisible = ["x_ptr", "w_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "nw_ptr", "N", "K", "sx", "sw", "so", "k_split"]
    for name, c in TILED_CONFIGS.items():
        # glu: its two half-width tiles take what one plain tile takes; compiled for the gate_up configurations
        forms = ((False, 1, False), (True, 4, False)) + (((False, 1, True),) if name in GLU_CHECKED else ())
        for silu, split, glu in forms:
            consts = {"SILU": silu, "BLOCK_M": 128, "BLOCK_N": c.block_n // 2 if glu else c.block_n,
                      "BLOCK_K": c.block_k, "SPLIT_K": split, "PREC": "tf32", "USE_PDL": False, **PLAIN, "GLU": glu}
            options = {"num_warps": c.num_warps,
                       "num_stages": tiled_stages(c.num_stages, 128, c.block_n, c.block_k, silu, 2)}
            out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_kernel",
                           dict(item.split(":") for item in sig.split()), consts, options=options, divisible=divisible)
            got = re.match(r"\d+", out)  # stdout, then stderr's tail
            assert got is not None and int(got.group()) <= SHARED_BYTES, (name, silu, glu, out)


def _sig(text: str) -> dict[str, str]:
    return dict(item.split(":") for item in text.split())


# The kernels a runner launches with programmatic dependent launch (`kernels/pdl.py`), at Llama-3-8B sizes.
PDL_KERNELS = {
    "rmsnorm": ("gpu_engine.kernels.rmsnorm", "_rmsnorm_kernel",
                _sig("x_ptr:*bf16 res_ptr:*bf16 w_ptr:*bf16 out_ptr:*bf16 n_inner:i32 sx_m:i32 sx_n:i32 sr_m:i32 "
                     "so_m:i32 so_n:i32 D:i32 eps:fp32"), {"HAS_RES": True, "BLOCK_D": 4096}),
    "silu": ("gpu_engine.kernels.activation", "_silu_mul_kernel", _sig("x_ptr:*bf16 out_ptr:*bf16 I:i32 sx:i32 so:i32"),
             {"BLOCK": 1024}),
    "qkv_prep": ("gpu_engine.kernels.qkv_prep", "_prep_kernel",
                 _sig("q_ptr:*bf16 k_ptr:*bf16 v_ptr:*bf16 pos_ptr:*i64 cache_ptr:*fp32 kc_ptr:*bf16 vc_ptr:*bf16 "
                      "slot_ptr:*i64 qw_ptr:*bf16 kw_ptr:*bf16 sq_t:i32 sq_h:i32 sk_t:i32 sk_h:i32 sv_t:i32 sv_h:i32 "
                      "HQ:i32 HK:i32 eps:fp32"),
                 {"NORM": False, "D": 128, "ROT_HALF": 64, "BLOCK_HQ": 32, "BLOCK_HK": 8, "BLOCK_R": 64, "BLOCK_P": 1,
                  "BLOCK_D": 128}),
    "decode": ("gpu_engine.kernels.attention", "_decode_kernel",
               _sig("q_ptr:*bf16 kc_ptr:*bf16 vc_ptr:*bf16 bt_ptr:*i32 ctx_ptr:*i32 po_ptr:*fp32 pm_ptr:*fp32 "
                    "pl_ptr:*fp32 out_ptr:*bf16 cnt_ptr:*i32 sq_b:i32 sq_h:i32 sbt_b:i32 so_b:i32 so_h:i32 "
                    "scale_log2:fp32 NSPLIT:i32"),
               {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256, "BLOCK_N": 128,
                "FORM": "split", "WALK_UPTO": 0, "PREC": "tf32", "LANED": False}),
    "fold": ("gpu_engine.kernels.attention", "_fold_kernel",
             _sig("po_ptr:*fp32 pm_ptr:*fp32 pl_ptr:*fp32 ctx_ptr:*i32 out_ptr:*bf16 so_b:i32 so_h:i32 NSPLIT:i32"),
             {"HKV": 8, "D": 128, "G": 4, "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256, "WALK_UPTO": 0}),
    "tiled": ("gpu_engine.kernels.tiled_linear", "_tiled_kernel",
              _sig(TILED_SIG), {"SILU": False, **PLAIN, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2,
                                "PREC": "tf32"}),
    "tiled_fused": ("gpu_engine.kernels.tiled_linear", "_tiled_kernel",
                    _sig(TILED_SIG), {"SILU": False, "GLU": True, "NORM": True, "ADD": False, "BLOCK_M": 16,
                                      "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "PREC": "tf32"}),
    "tiled_heads": ("gpu_engine.kernels.tiled_linear", "_tiled_heads_kernel", _sig(HEADS_SIG),
                    {"NORM": True, "QK_NORM": True, "D": 128, "ROT_HALF": 64, "BLOCK_M": 16, "BLOCK_R": 64,
                     "BLOCK_P": 16, "PASS": False, "BLOCK_K": 128, "SPLIT_K": 8, "PREC": "tf32"}),
    "moe_route": ("gpu_engine.kernels.moe", "_route_kernel",
                  _sig("logits_ptr:*bf16 w_ptr:*fp32 ids_ptr:*i64 E:i32 s_t:i32"),
                  {"TOPK": 8, "NORMALIZE": True, "BLOCK_E": 128}),
    "moe_gate_up_silu": ("gpu_engine.kernels.moe", "_gate_up_silu_kernel",
                         _sig("x_ptr:*bf16 w_ptr:*bf16 ids_ptr:*i64 out_ptr:*bf16 nw_ptr:*bf16 I:i32 K:i32 s_x:i32 "
                              "s_we:i32 s_wn:i32 s_o:i32 eps:fp32"),
                         {"TOPK": 8, "BLOCK_N": 4, "BLOCK_K": 512, "NORM": True}),
    "moe_router": ("gpu_engine.kernels.moe", "_router_kernel", _sig(ROUTER_SIG),
                   {"TOPK": 8, "NORMALIZE": True, "NORM": True, "GROUPS": 32, "BLOCK_G": 4, "BLOCK_K": 512,
                    "BLOCK_E": 128}),
    "moe_down_sum": ("gpu_engine.kernels.moe", "_down_sum_kernel",
                     _sig("a_ptr:*bf16 w_ptr:*bf16 ids_ptr:*i64 rw_ptr:*fp32 out_ptr:*bf16 N:i32 K:i32 s_a:i32 "
                          "s_we:i32 s_wn:i32 s_o:i32"), {"TOPK": 8, "SLOTS": 8, "BLOCK_N": 2, "BLOCK_K": 256,
                                                          "ADD": True}),
}

LAYER_SIG = ("x_ptr:*bf16 wq_ptr:*bf16 qkv_ptr:*bf16 ws_ptr:*fp32 cnt_ptr:*i32 nw_ptr:*bf16 pos_ptr:*i64 "
             "rope_ptr:*fp32 kc_ptr:*bf16 vc_ptr:*bf16 slot_ptr:*i64 qw_ptr:*bf16 kw_ptr:*bf16 bt_ptr:*i32 "
             "ctx_ptr:*i32 po_ptr:*fp32 pm_ptr:*fp32 pl_ptr:*fp32 att_ptr:*bf16 acnt_ptr:*i32 wo_ptr:*bf16 "
             "res_ptr:*bf16 ctr_ptr:*i32 M:i32 K:i32 HQ:i32 HK:i32 sx:i32 sw:i32 so:i32 k_split:i32 eps:fp32 "
             "qk_eps:fp32 sbt_b:i32 sa_b:i32 sa_h:i32 scale_log2:fp32 NSPLIT:i32 N_O:i32 K_O:i32 swo:i32 sres:i32 "
             "k_split_o:i32 mw_ptr:*bf16 wg_ptr:*bf16 act_ptr:*bf16 wd_ptr:*bf16 I:i32 swg:i32 s_act:i32 "
             "k_split_g:i32 m_eps:fp32 swd:i32 k_split_d:i32")
# Llama-3-8B at one row with the h200_4w plan: qkv n64_k128_s4, o and down n64_k128_s4_x2, gate_up n64_k128_s3_x2
LAYER_CONSTS = {"NORM": True, "QK_NORM": False, "D": 128, "ROT_HALF": 64, "BLOCK_M": 16, "BLOCK_R": 64,
                "BLOCK_P": 16, "PASS": False, "HEAD_K": 128, "HEAD_SPLIT": 8, "HKV": 8, "BS": 16, "G": 4,
                "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256, "ATT_N": 128, "FORM": "last", "O_N": 64, "O_K": 128,
                "O_SPLIT": 4, "M_NORM": True, "GU_N": 32, "GU_K": 128, "GU_SPLIT": 1, "DN_N": 64, "DN_K": 128,
                "DN_SPLIT": 4, "ATTENTION": True, "MLP": True, "PREC": "tf32", "ASM": True}


@pytest.mark.parametrize(("attention", "mlp", "form", "qk_norm"), [
    (True, False, "last", False), (True, False, "split", True), (False, True, "last", False),
    (True, True, "last", False), (True, True, "split", True)])
def test_a_layer_or_its_halves_in_one_launch_compile_for_sm90(attention: bool, mlp: bool, form: str,
                                                              qk_norm: bool) -> None:
    """The phases of a decode layer in one kernel (`kernels.phased`) at Llama-3-8B sizes: the attention half at one
    row (its last program folds) and more (a fold phase; Qwen3's q/k norms), the MLP half, both."""
    out = compiles("gpu_engine.kernels.phased", "_layer_kernel", _sig(LAYER_SIG),
                   {**LAYER_CONSTS, "ATTENTION": attention, "MLP": mlp, "FORM": form, "QK_NORM": qk_norm,
                    "USE_PDL": False})
    assert out.startswith("True"), out


PDL_KERNELS["layer_one_launch"] = ("gpu_engine.kernels.phased", "_layer_kernel", _sig(LAYER_SIG), LAYER_CONSTS)
PDL_KERNELS["moe_mlp_one_launch"] = ("gpu_engine.kernels.moe", "_moe_mlp_kernel", _sig(MOE_MLP_SIG), MOE_MLP_CONSTS)
PDL_KERNELS["decode_last"] = (*PDL_KERNELS["decode"][:3], {**PDL_KERNELS["decode"][3], "FORM": "last"})
# walked short rows (`walk_upto`): the walk launch, the split launch of the long rows, and the fold that skips the rest
PDL_KERNELS["decode_walked"] = (*PDL_KERNELS["decode"][:3], {**PDL_KERNELS["decode"][3], "FORM": "walk",
                                                             "WALK_UPTO": 2})
PDL_KERNELS["decode_long_rows"] = (*PDL_KERNELS["decode"][:3], {**PDL_KERNELS["decode"][3], "WALK_UPTO": 2})
PDL_KERNELS["decode_laned"] = (*PDL_KERNELS["decode"][:3], {**PDL_KERNELS["decode"][3], "LANED": True})
PDL_KERNELS["fold_long_rows"] = (*PDL_KERNELS["fold"][:3], {**PDL_KERNELS["fold"][3], "WALK_UPTO": 2})


@pytest.mark.parametrize("kernel", sorted(PDL_KERNELS))
def test_pdl_kernels_wait_for_the_kernel_before_only_when_launched_so(kernel: str) -> None:
    """Compiled for sm_90 to PTX: with USE_PDL each kernel waits on the grid before it (griddepcontrol.wait) before
    its first access to global memory (a load, store, atomic or async copy, predicated or not), and lets the one
    after it in only as it finishes (no griddepcontrol.launch_dependents: an early one measured 1.57x slower steps
    on the H200); without it, neither is in the code (the default launch is the kernel it was)."""
    module, name, signature, consts = PDL_KERNELS[kernel]
    for on in (False, True):
        out = compiles(module, name, signature, {**consts, "USE_PDL": on}, ptx=True)
        assert out.startswith("{"), out
        got = json.JSONDecoder().raw_decode(out)[0]  # stdout, then stderr's tail
        assert got["first_memory"] >= 0, (kernel, got)  # the pattern finds the kernel's memory accesses
        if on:
            assert got["wait"] >= 1 and got["launch_dependents"] == 0, (kernel, got)
            assert 0 <= got["first_wait"] < got["first_memory"], (kernel, got)
        else:
            assert got["wait"] == 0 and got["launch_dependents"] == 0, (kernel, got)
