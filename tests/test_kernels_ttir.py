"""GPU compilation of Triton kernels without a GPU: their TTIR for sm_90, built by Triton's own front
end (type and shape rules the CPU interpreter does not enforce; docs/GPU_NOTES.md)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler")


def ttir(fn, signature: dict[str, str], constexprs: dict[str, object]) -> str:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = nvidia.CUDABackend(target)
    options = backend.parse_options({"num_warps": 4})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    module = ASTSource(fn, sig, constexprs).make_ir(target, options, backend.get_codegen_implementation(options),
                                                    backend.get_module_map(), ctx)
    return str(module)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (4, 2)])
def test_fused_qkv_kernel_compiles_for_sm90(norm: bool, hq: int, hk: int) -> None:
    """Query and key heads of different counts (their tiles have different shapes) in one kernel."""
    from gpu_engine.kernels import qkv_prep

    ptrs = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "qw_ptr", "kw_ptr")}
    ptrs |= {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp32"}
    scalars = dict.fromkeys(("sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "HQ", "HK"), "i32") | {"eps": "fp32"}
    order = ("q_ptr k_ptr v_ptr pos_ptr cache_ptr kc_ptr vc_ptr slot_ptr qw_ptr kw_ptr "
             "sq_t sq_h sk_t sk_h sv_t sv_h HQ HK eps").split()
    signature = {n: (ptrs | scalars)[n] for n in order}
    consts = {"NORM": norm, "D": 128, "ROT_HALF": 64, "BLOCK_HQ": hq, "BLOCK_HK": hk, "BLOCK_R": 64, "BLOCK_P": 1,
              "BLOCK_D": 128}
    assert "tt.func" in ttir(qkv_prep._prep_kernel, signature, consts)
