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


# An FP8 KV cache's kernels are compiled to a cubin for sm_90 (`options`: Triton's whole pipeline and ptxas), not
# only to TTIR: the e4m3 conversions are lowered there.
CUBIN = {"options": {"num_warps": 4}}


def _built(out: str, kv: str) -> bool:
    """Whether `compiles` built the kernel: its TTIR (True), or for an FP8 cache its cubin (its shared bytes)."""
    return re.match(r"\d+", out) is not None if kv == "fp8e4nv" else out.startswith("True")


@pytest.mark.parametrize("kv", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (4, 2)])
def test_fused_qkv_kernel_compiles_for_sm90(norm: bool, hq: int, hk: int, kv: str) -> None:
    """Query and key heads of different counts (their tiles have different shapes) in one kernel; into a cache of
    the activations' dtype or FP8."""
    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr")} | {"kc_ptr": f"*{kv}",
                                                                                  "vc_ptr": f"*{kv}"}
    ptrs |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp32"}
    scalars = dict.fromkeys(("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "HQ", "HK"), "i32")
    scalars |= dict.fromkeys(("eps", "k_scale", "v_scale"), "fp32")
    order = ("q_ptr k_ptr v_ptr pos_ptr cache_ptr kc_ptr vc_ptr slot_ptr qw_ptr kw_ptr "
             "sq_t sq_h sk_t sk_h sv_t sv_h HQ HK eps k_scale v_scale").split()
    signature = {n: (ptrs | scalars)[n] for n in order}
    consts = {"NORM": norm, "D": 128, "ROT_HALF": 64, "BLOCK_HQ": hq, "BLOCK_HK": hk, "BLOCK_R": 64, "BLOCK_P": 1,
              "BLOCK_D": 128}
    out = compiles("gpu_engine.kernels.qkv_prep", "_prep_kernel", signature, consts, **(CUBIN if kv != "bf16" else {}))
    assert _built(out, kv), out


@pytest.mark.parametrize("act", ["bf16", "fp16", "fp32"])
def test_kv_write_kernel_compiles_into_an_fp8_cache_for_sm90(act: str) -> None:
    """The KV write from each activation dtype into an FP8 cache, to its cubin."""
    sig = (f"k_ptr:*{act} v_ptr:*{act} kc_ptr:*fp8e4nv vc_ptr:*fp8e4nv slot_ptr:*i64 sk_t:i32 sk_h:i32 sv_t:i32 "
           "sv_h:i32 H:i32 D:i32 k_scale:fp32 v_scale:fp32")
    out = compiles("gpu_engine.kernels.kv_cache", "_write_kv_kernel", _sig(sig), {"BLOCK_H": 8, "BLOCK_D": 128},
                   **CUBIN)
    assert _built(out, "fp8e4nv"), out


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
                       {"TOPK": top_k, "BLOCK_N": 4, "BLOCK_K": 512, "NORM": norm})
        assert out.startswith("True"), out
    out = compiles("gpu_engine.kernels.moe", "_router_kernel", _sig(ROUTER_SIG.replace("bf16", dtype)),
                   {"TOPK": top_k, "NORMALIZE": True, "NORM": True, "GROUPS": 32, "BLOCK_G": 4, "BLOCK_K": 512,
                    "BLOCK_E": 128})
    assert out.startswith("True"), out
    scalars = "N:i32 K:i32 s_a:i32 s_we:i32 s_wn:i32 s_o:i32"
    sig = f"a_ptr:*{dtype} w_ptr:*{dtype} ids_ptr:*i64 rw_ptr:*fp32 out_ptr:*{dtype} {scalars}"
    for add in (False, True):  # the sum alone, or added into the residual stream
        out = compiles("gpu_engine.kernels.moe", "_down_sum_kernel", dict(item.split(":") for item in sig.split()),
                       {"TOPK": top_k, "SLOTS": 8, "BLOCK_N": 2, "BLOCK_K": 256, "ADD": add})
        assert out.startswith("True"), out
    # the routing apart from the router's product
    out = compiles("gpu_engine.kernels.moe", "_route_kernel",
                   _sig(f"logits_ptr:*{dtype} w_ptr:*fp32 ids_ptr:*i64 E:i32 s_t:i32"),
                   {"TOPK": top_k, "NORMALIZE": True, "BLOCK_E": 128})
    assert out.startswith("True"), out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_q8_dequant_kernel_compiles_for_sm90(dtype: str) -> None:
    """The Q8_0 product's dequantizing kernel, into each dtype."""
    sig = f"q_ptr:*i8 s_ptr:*fp16 w_ptr:*{dtype} K:i32 sq:i32 ss:i32 sw:i32"
    out = compiles("gpu_engine.kernels.q8_linear", "_q8_dequant_kernel", dict(item.split(":") for item in sig.split()),
                   {"BLOCK_K": 1024, "GROUP": 32, "UPCAST": False})
    assert out.startswith("True"), out


@pytest.mark.parametrize("form", ["split", "last"])
@pytest.mark.parametrize(("dtype", "kv"), [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")])
def test_decode_attention_kernel_compiles_for_sm90(dtype: str, kv: str, form: str) -> None:
    """The decode attention in its two forms (a program per split; the same with the last to finish folding, an
    atomic count) at the runner's shape, over a cache of the queries' dtype or FP8, and the fold of the partials."""
    sig = (f"q_ptr:*{dtype} kc_ptr:*{kv} vc_ptr:*{kv} bt_ptr:*i32 ctx_ptr:*i32 po_ptr:*fp32 pm_ptr:*fp32 "
           f"pl_ptr:*fp32 out_ptr:*{dtype} cnt_ptr:*i32 sq_b:i32 sq_h:i32 sbt_b:i32 so_b:i32 so_h:i32 "
           "scale_log2:fp32 v_scale:fp32 NSPLIT:i32")
    consts = {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256, "BLOCK_N": 128,
              "FORM": form, "PREC": "ieee" if dtype == "fp32" else "tf32"}
    out = compiles("gpu_engine.kernels.attention", "_decode_kernel", dict(item.split(":") for item in sig.split()),
                   consts, **(CUBIN if kv == "fp8e4nv" else {}))
    assert _built(out, kv), out
    sig = f"po_ptr:*fp32 pm_ptr:*fp32 pl_ptr:*fp32 ctx_ptr:*i32 out_ptr:*{dtype} so_b:i32 so_h:i32 NSPLIT:i32"
    consts = {k: consts[k] for k in ("HKV", "D", "G", "BLOCK_G", "BLOCK_D", "PART")}
    out = compiles("gpu_engine.kernels.attention", "_fold_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out


# kernel: (its signature over an FP8 cache, queries and output of dtype Q; its constants at the runner's shapes; the
# arguments a launch of the runner's takes as multiples of 16: pointers and head strides, not the block tables' 513)
FP8_ATTENTION = {
    "_decode_kernel": ("q_ptr:*Q kc_ptr:*fp8e4nv vc_ptr:*fp8e4nv bt_ptr:*i32 ctx_ptr:*i32 po_ptr:*fp32 pm_ptr:*fp32 "
                       "pl_ptr:*fp32 out_ptr:*Q cnt_ptr:*i32 sq_b:i32 sq_h:i32 sbt_b:i32 so_b:i32 so_h:i32 "
                       "scale_log2:fp32 v_scale:fp32 NSPLIT:i32",
                       {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_G": 16, "BLOCK_D": 128, "PART": 256,
                        "BLOCK_N": 128, "FORM": "split", "PREC": "tf32"},
                       ("q_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "ctx_ptr", "po_ptr", "pm_ptr", "pl_ptr", "out_ptr",
                        "cnt_ptr", "sq_b", "sq_h", "so_b", "so_h")),
    "_prefill_kernel": ("q_ptr:*Q kc_ptr:*fp8e4nv vc_ptr:*fp8e4nv bt_ptr:*i32 ctx_ptr:*i32 cu_ptr:*i32 "
                        "out_ptr:*Q sq_t:i32 sq_h:i32 so_t:i32 so_h:i32 sbt_b:i32 scale_log2:fp32 v_scale:fp32 "
                        "NB:i32 T:i32",
                        {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_D": 128, "BLOCK_M": 64, "BLOCK_N": 64,
                         "WHOLE": True, "PREC": "tf32", "PACKED": True, "BLOCK_B": 512},
                        ("q_ptr", "kc_ptr", "vc_ptr", "bt_ptr", "ctx_ptr", "cu_ptr", "out_ptr", "sq_t", "sq_h", "so_t",
                         "so_h")),
}


@pytest.mark.parametrize("kernel", FP8_ATTENTION)
def test_attention_over_fp8_with_fp16_queries_widens_the_codes_natively(kernel: str) -> None:
    """The decode (split form) and prefill attention over an FP8 cache at the runner's shapes, with bf16 queries
    (the engine's) and with fp16 ones (what `bench.kernels --only attention_fp8` times as `fp8_f16`): with fp16
    queries the codes need no f16 -> bf16 conversion after the native e4m3 -> f16 one, and the kernel is shorter."""
    sig, consts, divisible = FP8_ATTENTION[kernel]
    counts = {}
    for q in ("bf16", "fp16"):
        out = compiles("gpu_engine.kernels.attention", kernel,
                       dict(item.split(":") for item in sig.replace("*Q", f"*{q}").split()), consts,
                       ptx=["cvt.bf16.f16", "cvt.rn.f16x2.e4m3x2"], divisible=divisible, **CUBIN)
        counts[q] = json.JSONDecoder().raw_decode(out)[0] if out.startswith("{") else out
    assert isinstance(counts["bf16"], dict) and isinstance(counts["fp16"], dict), counts
    assert counts["bf16"]["cvt.bf16.f16"] > 0 and counts["fp16"]["cvt.bf16.f16"] == 0, counts
    assert counts["fp16"]["cvt.rn.f16x2.e4m3x2"] > 0, counts
    assert counts["fp16"]["instructions"] < counts["bf16"]["instructions"], counts


@pytest.mark.parametrize(("dtype", "block_m", "whole", "kv", "packed"),
                         [("bf16", 64, True, "bf16", True), ("bf16", 16, True, "bf16", True),
                          ("fp32", 64, True, "fp32", True), ("bf16", 64, False, "bf16", True),
                          ("bf16", 64, True, "fp8e4nv", True), ("bf16", 16, True, "fp8e4nv", True),
                          ("bf16", 64, True, "bf16", False)])
def test_prefill_attention_kernel_compiles_for_sm90(dtype: str, block_m: int, whole: bool, kv: str,
                                                    packed: bool) -> None:
    """The prefill attention (its whole-tile and diagonal loops, or the diagonal loop alone) at the runner's tile
    sizes, over a cache of the queries' dtype or FP8, on the packed grid (a mixed step of 256 rows: 257 sequences'
    tile counts summed in the program) and on the sequence grid."""
    sig = (f"q_ptr:*{dtype} kc_ptr:*{kv} vc_ptr:*{kv} bt_ptr:*i32 ctx_ptr:*i32 cu_ptr:*i32 out_ptr:*{dtype} "
           "sq_t:i32 sq_h:i32 so_t:i32 so_h:i32 sbt_b:i32 scale_log2:fp32 v_scale:fp32 NB:i32 T:i32")
    consts = {"HKV": 8, "D": 128, "BS": 16, "G": 4, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": 64,
              "WHOLE": whole, "PREC": "ieee" if dtype == "fp32" else "tf32", "PACKED": packed, "BLOCK_B": 512}
    out = compiles("gpu_engine.kernels.attention", "_prefill_kernel", dict(item.split(":") for item in sig.split()),
                   consts, **(CUBIN if kv == "fp8e4nv" else {}))
    assert _built(out, kv), out


def test_moe_align_kernels_compile_for_sm90() -> None:
    """The MoE align's kernels for Qwen3-30B-A3B's 128 experts: the one launch (three program roles), and the two
    (the count, the placing with the same roles)."""
    sig = ("ids_ptr:*i64 sorted_ptr:*i32 bexp_ptr:*i32 P:i32 E:i32 P_MAX:i32 N_BLOCKS:i32 PAIR_PROGS:i32 "
           "SLOT_PROGS:i32")
    out = compiles("gpu_engine.kernels.moe", "_align_one_kernel", dict(item.split(":") for item in sig.split()),
                   {"BM": 16, "BLOCK_E": 128, "CHUNK": 64})
    assert out.startswith("True"), out
    sig = "ids_ptr:*i64 hist_ptr:*i32 P:i32"
    out = compiles("gpu_engine.kernels.moe", "_align_count_kernel", dict(item.split(":") for item in sig.split()),
                   {"CHUNK": 64, "BLOCK_E": 128})
    assert out.startswith("True"), out
    sig = ("ids_ptr:*i64 hist_ptr:*i32 sorted_ptr:*i32 bexp_ptr:*i32 P:i32 E:i32 P_MAX:i32 N_BLOCKS:i32 "
           "N_CHUNKS:i32 PAIR_PROGS:i32 SLOT_PROGS:i32")
    out = compiles("gpu_engine.kernels.moe", "_align_place_kernel", dict(item.split(":") for item in sig.split()),
                   {"BM": 16, "BLOCK_E": 128, "CHUNK": 64, "ROWS": 16})
    assert out.startswith("True"), out


def test_moe_gemm_kernels_compile_for_sm90() -> None:
    """The sorted path's grouped GEMM at the launcher's tile, and the experiment's with the SiLU-and-multiply in its
    epilogue (`bench.moe_glu`)."""
    sig = ("a_ptr:*bf16 w_ptr:*bf16 c_ptr:*bf16 sorted_ptr:*i32 bexp_ptr:*i32 rw_ptr:*fp32 N:i32 K:i32 P:i32 "
           "A_DIV:i32 sa_m:i32 sw_e:i32 sw_n:i32 sc_m:i32 E:i32")
    out = compiles("gpu_engine.kernels.moe", "_moe_gemm_kernel", dict(item.split(":") for item in sig.split()),
                   {"MUL_WEIGHT": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PREC": "tf32"})
    assert out.startswith("True"), out
    sig = sig.replace("rw_ptr:*fp32 ", "")
    out = compiles("bench.moe_glu", "_glu_gemm_kernel", dict(item.split(":") for item in sig.split()),
                   {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PREC": "tf32"})
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
              **PLAIN, **dict.fromkeys(fused.split(), True)}
    out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_kernel", dict(item.split(":") for item in sig.split()),
                   consts)
    assert out.startswith("True"), out


HEADS_SIG = ("x_ptr:*bf16 w_ptr:*bf16 out_ptr:*bf16 ws_ptr:*fp32 cnt_ptr:*i32 nw_ptr:*bf16 pos_ptr:*i64 "
             "cache_ptr:*fp32 kc_ptr:*bf16 vc_ptr:*bf16 slot_ptr:*i64 qw_ptr:*bf16 kw_ptr:*bf16 M:i32 K:i32 HQ:i32 "
             "HK:i32 sx:i32 sw:i32 so:i32 k_split:i32 eps:fp32 qk_eps:fp32 k_scale:fp32 v_scale:fp32")


@pytest.mark.parametrize(("block_m", "split_k", "qk_norm", "norm", "d", "rot_half", "kv"),
                         [(16, 1, False, True, 128, 64, "bf16"), (16, 8, False, True, 128, 64, "bf16"),
                          (16, 8, True, False, 128, 64, "bf16"), (64, 8, True, True, 128, 64, "bf16"),
                          (128, 8, True, True, 128, 64, "bf16"), (16, 8, False, True, 96, 16, "bf16"),
                          (16, 8, True, True, 128, 64, "fp8e4nv"), (16, 1, False, True, 96, 16, "fp8e4nv")])
def test_tiled_heads_kernel_compiles_for_sm90_within_half_a_blocks_shared_memory(
        block_m: int, split_k: int, qk_norm: bool, norm: bool, d: int, rot_half: int, kv: str) -> None:
    """The qkv product with `qkv_prep` as its output at the Llama-3-8B head (128 wide, full rotary: no pass-through
    tile) and at Phi-3's (96 wide, 32 rotary: a pass-through tile), into a cache of the activations' dtype or FP8,
    with the h200 plan's qkv configuration, whole
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
              "BLOCK_P": block_p, "PASS": passing, "BLOCK_K": c.block_k, "SPLIT_K": split_k, "PREC": "tf32"}
    options = {"num_warps": 8 if block_m >= 64 else c.num_warps,
               "num_stages": heads_stages(c.num_stages, block_m, block_r, block_p if passing else 0, c.block_k, 2)}
    sig = HEADS_SIG.replace("kc_ptr:*bf16 vc_ptr:*bf16", f"kc_ptr:*{kv} vc_ptr:*{kv}")
    out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_heads_kernel", _sig(sig), consts,
                   options=options, divisible=["x_ptr", "w_ptr", "out_ptr", "ws_ptr", "K", "sx", "sw", "so", "k_split"])
    got = re.match(r"\d+", out)
    assert got is not None and int(got.group()) <= (SHARED_BYTES if block_m == 128 else SHARED_BYTES // 2), out


GLU_CHECKED = ("n128_k64_s4_w8", "n256_k64_s4_w8", "n64_k128_s4")  # gate_up's: the h200 plan's, and wider


@pytest.mark.parametrize("which", ["planned", pytest.param("all", marks=pytest.mark.slow)])
def test_every_tiled_linear_configuration_fits_a_blocks_shared_memory(which: str) -> None:
    """Each named configuration at 128 rows, plain, with the SiLU, and (gate_up's) as a glu (half the columns, two
    weight tiles of half the width), compiled for sm_90 to its cubin with the stages the launcher gives it
    (`tiled_stages`): no more shared memory than a block may take (a launch past it fails with out-of-resources on
    the GPU). In CI the configurations a kernel plan runs; all of them (the benchmark's too) with ``-m slow``."""
    from gpu_engine.kernels.plan import PLANS
    from gpu_engine.kernels.tiled_linear import SHARED_BYTES, TILED_CONFIGS, tiled_stages

    planned = {name for plan in PLANS.values() for steps in plan.linears.values() for _, name in steps}
    assert planned <= set(TILED_CONFIGS)
    sig = TILED_SIG
    divisible = ["x_ptr", "w_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "nw_ptr", "N", "K", "sx", "sw", "so", "k_split"]
    for name, c in TILED_CONFIGS.items():
        if which == "planned" and name not in planned:
            continue
        # glu: its two half-width tiles take what one plain tile takes; compiled for the gate_up configurations
        forms = ((False, 1, False), (True, 4, False)) + (((False, 1, True),) if name in GLU_CHECKED else ())
        for silu, split, glu in forms:
            consts = {"SILU": silu, "BLOCK_M": 128, "BLOCK_N": c.block_n // 2 if glu else c.block_n,
                      "BLOCK_K": c.block_k, "SPLIT_K": split, "PREC": "tf32", **PLAIN, "GLU": glu}
            options = {"num_warps": c.num_warps,
                       "num_stages": tiled_stages(c.num_stages, 128, c.block_n, c.block_k, silu, 2)}
            out = compiles("gpu_engine.kernels.tiled_linear", "_tiled_kernel",
                           dict(item.split(":") for item in sig.split()), consts, options=options, divisible=divisible)
            got = re.match(r"\d+", out)  # stdout, then stderr's tail
            assert got is not None and int(got.group()) <= SHARED_BYTES, (name, silu, glu, out)


def _sig(text: str) -> dict[str, str]:
    return dict(item.split(":") for item in text.split())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_norm_and_silu_kernels_compile_for_sm90(dtype: str) -> None:
    """The RMSNorm (with the residual add, at Llama-3-8B's width) and the SiLU-and-multiply, each dtype."""
    out = compiles("gpu_engine.kernels.rmsnorm", "_rmsnorm_kernel",
                   _sig(f"x_ptr:*{dtype} res_ptr:*{dtype} w_ptr:*{dtype} out_ptr:*{dtype} n_inner:i32 sx_m:i32 "
                        "sx_n:i32 sr_m:i32 so_m:i32 so_n:i32 D:i32 eps:fp32"), {"HAS_RES": True, "BLOCK_D": 4096})
    assert out.startswith("True"), out
    out = compiles("gpu_engine.kernels.activation", "_silu_mul_kernel",
                   _sig(f"x_ptr:*{dtype} out_ptr:*{dtype} I:i32 sx:i32 so:i32"), {"BLOCK": 1024})
    assert out.startswith("True"), out


FP8_SIG = ("x_ptr:*bf16 w_ptr:*fp8e4nv s_ptr:*fp32 out_ptr:*bf16 ws_ptr:*fp32 cnt_ptr:*i32 M:i32 N:i32 K:i32 sx:i32 "
           "sw:i32 so:i32 k_split:i32")


@pytest.mark.parametrize("which", ["stepped", pytest.param("all", marks=pytest.mark.slow)])
def test_fp8_gemv_configurations_compile_for_sm90_within_a_blocks_shared_memory(which: str) -> None:
    """The FP8 GEMV (`kernels.fp8_gemv`) in each configuration `FP8_STEPS` names (all candidates with ``-m slow``) at
    the most rows its form takes (fma: FMA_ROWS; the tensor-core forms: 128), split over K and as a glu, with the
    stages the launcher gives it (`fp8_stages`): a cubin within a block's shared memory."""
    from gpu_engine.kernels.fp8_gemv import FMA_ROWS, FP8_CONFIGS, FP8_STEPS, fp8_stages
    from gpu_engine.kernels.tiled_linear import SHARED_BYTES

    stepped = {name for _, name in FP8_STEPS}
    divisible = ["x_ptr", "w_ptr", "s_ptr", "out_ptr", "ws_ptr", "N", "K", "sx", "sw", "so", "k_split"]
    for name, c in FP8_CONFIGS.items():
        if which == "stepped" and name not in stepped:
            continue
        block_m = FMA_ROWS if c.form == "fma" else 128
        stages = fp8_stages(c, block_m, 2)
        for split, glu in ((4, False), (1, True)):
            consts = {"GLU": glu, "FORM": c.form, "BLOCK_M": block_m, "BLOCK_N": c.block_n // 2 if glu else c.block_n,
                      "BLOCK_K": c.block_k, "SPLIT_K": split, "PREC": "tf32", "STAGES": stages}
            out = compiles("gpu_engine.kernels.fp8_gemv", "_fp8_gemv_kernel", _sig(FP8_SIG), consts,
                           options={"num_warps": c.num_warps, "num_stages": stages}, divisible=divisible)
            got = re.match(r"\d+", out)
            assert got is not None and int(got.group()) <= SHARED_BYTES, (name, glu, out)
