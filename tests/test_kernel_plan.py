"""The kernel plan (`gpu_engine.kernels.plan`): resolved once from --kernel-plan and the GPU's name, checked when
built, and the only kernel switch an engine has (no BLINK_* variable picks kernels)."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_engine.kernels.plan import GPU_PLANS, H200_LINEARS, PLANS, KernelPlan, resolve_plan
from gpu_engine.kernels.tiled_linear import MAX_ROWS, TILED_CONFIGS
from shared.config import KERNEL_PLANS, EngineConfig
from shared.env import Env

GONE = ("BLINK_TILED_LINEAR", "BLINK_PDL", "BLINK_ONE_LAUNCH", "BLINK_SKINNY_MATMUL", "BLINK_DECODE_WALK",
        "BLINK_DECODE_LANES")


def test_auto_is_each_measured_gpus_plan_and_cublas_on_any_other_gpu() -> None:
    assert resolve_plan("auto", "NVIDIA H200") is PLANS["h200"]
    assert resolve_plan("auto", "NVIDIA H100 80GB HBM3") is PLANS["h100"]
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", ""):
        assert resolve_plan("auto", other) is PLANS["cublas"], other
    assert GPU_PLANS == {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100"}
    assert set(GPU_PLANS.values()) <= set(PLANS)


def test_the_h100_plan_is_cublas_with_fp8_weights_in_small_steps_through_the_gemv() -> None:
    h100, cublas = PLANS["h100"], PLANS["cublas"]
    assert h100.linears == cublas.linears == {} and not h100.fused
    assert h100.fp8_gemv_rows == 8 and cublas.fp8_gemv_rows == 0
    assert h100.summary()["fp8_gemv_rows"] == 8


def test_a_named_plan_is_that_plan_whatever_the_gpu() -> None:
    for name, plan in PLANS.items():
        assert plan.name == name
        for gpu in ("NVIDIA H200", "NVIDIA L4"):
            assert resolve_plan(name, gpu) is plan


@pytest.mark.parametrize("setting", ["fastest", "off", "h200+fused", "h200_wide", "h200_4w", "n64_k128_s4", "AUTO"])
def test_an_unknown_setting_is_refused_naming_the_choices(setting: str) -> None:
    with pytest.raises(ValueError, match=r"expected auto or one of \['cublas', 'h100', 'h200'\]") as refused:
        resolve_plan(setting, "NVIDIA H200")
    assert repr(setting) in str(refused.value)


def test_the_plans_are_cublas_and_the_h200_s_fused_tiled_linears() -> None:
    """cuBLAS for every product, no fused form; the H200's: the Llama-3-8B projections (not its LM head) and
    Qwen3-30B-A3B's attention linears up to the steps its MoE layers take sort-free (whose fused kernels come with
    the fused plan), fused."""
    from gpu_engine.kernels.moe import small_path

    assert set(PLANS) == {"cublas", "h100", "h200"}
    cublas, h200 = PLANS["cublas"], PLANS["h200"]
    assert not cublas.linears and not cublas.fused and cublas.configs() == []
    assert all(cublas.config_for(rows, (4096, 4096)) is None for rows in (1, 8, MAX_ROWS))
    assert h200.fused and dict(h200.linears) == H200_LINEARS
    assert set(H200_LINEARS) == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # Llama-3-8B
                                 (5120, 2048), (2048, 4096)}  # Qwen3-30B-A3B's attention
    assert None not in H200_LINEARS and (128256, 4096) not in H200_LINEARS
    most = max(t for t in range(1, MAX_ROWS + 1) if small_path(t, 8))  # its 8 experts a token
    assert {rows for shape in ((5120, 2048), (2048, 4096)) for rows, _ in H200_LINEARS[shape]} == {most}
    assert h200.config_for(1, (6144, 4096)) == TILED_CONFIGS["n64_k128_s4"]
    assert h200.config_for(2, (6144, 4096)) is None
    assert h200.config_for(16, (4096, 4096)) == TILED_CONFIGS["n64_k128_s4_x2"]
    assert h200.config_for(17, (4096, 4096)) == h200.config_for(32, (4096, 4096)) == TILED_CONFIGS["n64_k128_s4"]
    assert h200.config_for(33, (4096, 4096)) is None
    assert h200.config_for(1, (128256, 4096)) is None  # a shape the plan does not name: cuBLAS
    names = sorted({config for steps in H200_LINEARS.values() for _, config in steps})
    assert h200.configs() == [TILED_CONFIGS[n] for n in names]
    assert len(h200.configs()) == len(set(h200.configs()))
    summary = h200.summary()
    assert summary["kernel_plan"] == "h200" and summary["fused"] is True
    assert summary["tiled_linears"]["4096x4096"] == ["<=16:n64_k128_s4_x2", "<=32:n64_k128_s4"]
    assert cublas.summary() == {"kernel_plan": "cublas", "fused": False, "tiled_linears": "none (cuBLAS)"}


def test_every_weight_takes_every_shape_up_to_the_tiled_linear_s_rows() -> None:
    plan = KernelPlan.every_weight("n32_k128_s4")
    assert (plan.name, plan.fused, dict(plan.linears)) == ("n32_k128_s4", False, {None: ((MAX_ROWS, "n32_k128_s4"),)})
    fused = KernelPlan.every_weight("n32_k128_s4", fused=True)
    assert (fused.name, fused.fused) == ("n32_k128_s4+fused", True)
    for shape in ((64, 64), (128256, 4096)):
        assert plan.config_for(1, shape) == plan.config_for(MAX_ROWS, shape) == TILED_CONFIGS["n32_k128_s4"]
        assert plan.config_for(MAX_ROWS + 1, shape) is None
    named = KernelPlan("some", {None: ((8, "n64_k64_s6"),), (64, 64): ((4, "n32_k128_s4"),)})
    assert named.config_for(4, (64, 64)) == TILED_CONFIGS["n32_k128_s4"]
    assert named.config_for(5, (64, 64)) is None  # a named shape follows its own steps, not the default's
    assert named.config_for(8, (96, 64)) == TILED_CONFIGS["n64_k64_s6"] and named.config_for(9, (96, 64)) is None


@pytest.mark.parametrize(("linears", "fused", "message"), [
    ({(64, 64): ((8, "n64_k64_s6"), (4, "n32_k128_s4"))}, False, "must increase"),
    ({(64, 64): ((4, "n64_k64_s6"), (4, "n32_k128_s4"))}, False, "must increase"),
    ({(64, 64): ((0, "n64_k64_s6"),)}, False, "within 1..128"),
    ({None: ((MAX_ROWS + 1, "n64_k64_s6"),)}, False, "within 1..128"),
    ({(64, 64): ((4, "n64_k64_s6"),), (64, 96): ((-1, "n64_k64_s6"),)}, False, "within 1..128"),
    ({(64, 64): ((4, "n64_tiny"),)}, False, r"no configuration \['n64_tiny'\]"),
    ({None: ((MAX_ROWS, "fma_n8_k512"),)}, True, "no configuration"),  # the skinny matmul's names are gone
    ({}, True, "fused forms come with the tiled linear"),
])
def test_a_plan_refuses_what_no_runner_could_follow(linears: dict, fused: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KernelPlan("bad", linears, fused)
    with pytest.raises(ValueError, match="no configuration"):
        KernelPlan.every_weight("n64_tiny")


def test_the_fp8_gemv_takes_steps_of_at_most_its_rows_and_only_the_h100_plan_sends_them_there() -> None:
    for rows in (-1, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="fp8_gemv_rows"):
            KernelPlan("bad", fp8_gemv_rows=rows)
    assert KernelPlan("x", fp8_gemv_rows=64).summary()["fp8_gemv_rows"] == 64
    assert "fp8_gemv_rows" not in PLANS["cublas"].summary()
    # measured faster than cuBLASLt's FP8 product at 1 and 8 rows on an H100, slower at 64; not measured on an H200
    assert {name: plan.fp8_gemv_rows for name, plan in PLANS.items()} == {"cublas": 0, "h100": 8, "h200": 0}


def test_a_plan_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PLANS["h200"].fused = False  # type: ignore[misc]


def test_the_flag_s_choices_are_auto_and_the_plans() -> None:
    assert KERNEL_PLANS[0] == "auto" and len(KERNEL_PLANS) == len(set(KERNEL_PLANS))
    assert set(KERNEL_PLANS) == {"auto", *PLANS}
    assert set(KERNEL_PLANS) - {"auto"} == set(GPU_PLANS.values()) | {"cublas"}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_a_kernel_plan_other_than_auto_is_refused_on_the_cpu_backend(plan: str) -> None:
    with pytest.raises(ValueError, match=f"--kernel-plan {plan} applies to the GPU backends"):
        EngineConfig(backend="cpu", kernel_plan=plan)
    assert EngineConfig(backend="cpu").kernel_plan == "auto"
    for backend in ("auto", "host", "persistent"):
        assert EngineConfig(backend=backend, kernel_plan=plan).kernel_plan == plan


def test_no_variable_picks_kernels() -> None:
    """The variables that switched kernel variants are gone: --kernel-plan is the one switch."""
    declared = Env.variables()
    assert not set(GONE) & set(declared), sorted(set(GONE) & set(declared))
    for field in ("tiled_linear", "pdl", "one_launch", "skinny_matmul", "decode_walk", "decode_lanes"):
        assert not hasattr(Env(), field), field
