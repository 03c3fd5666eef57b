"""The kernel plan: which kernel takes each product of a step, resolved once per engine from the GPU it runs on.

A `KernelPlan` is one frozen value. The engine resolves it at start (`resolve_plan`: the plan measured fastest on
this GPU by its name in `GPU_PLANS`, `cublas` elsewhere, or the one `--kernel-plan` names) and hands it whole to
the runner, whose dispatch reads nothing else. A plan names, for each dense weight shape it was measured on, the
tiled linear's configuration (`tiled_linear.TILED_CONFIGS`) that beat cuBLAS up to some number of rows; every
other product goes to cuBLAS. With `fused`, the products the tiled linear takes bring the kernels around them
into their launch: the RMSNorm before qkv and gate_up, the SiLU-and-multiply as gate_up's output, the residual
add after o and down, the q/k norms, RoPE and KV cache write as qkv's output; an MoE layer's small steps take
the same in their own kernels (`moe.fused_moe`), and one-row decode steps fold their attention splits in the split
launch (`attention.LAST_FOLD_ROWS`). With `fp8_gemv_rows`, FP8 weights in steps of up to that many rows go
through the weight-only FP8 GEMV (bf16 activations) and larger steps through cuBLASLt's FP8 product (activations
quantized per token). Every plan gives the same tokens within rounding (the fused norm rounds once less); within
one plan a request's bits do not depend on its neighbours in the step, except where steps of different sizes take
different kernels: an MoE layer's small path, and FP8 weights under `fp8_gemv_rows` (each path within the
quantization's bound of the reference, not the same bits; docs/GPU_NOTES.md).

A variant enters this table only after a same-machine measurement shows it faster on that GPU at the step sizes
serving uses (`bench/roofline.py --plan`, `bench/kernels.py`); the benchmarks build any other plan they compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gpu_engine.kernels.tiled_linear import MAX_ROWS, TILED_CONFIGS, TiledConfig

Shape = tuple[int, int]  # a dense weight's (N, K)
Steps = tuple[tuple[int, str], ...]  # (most rows, TILED_CONFIGS name), rows increasing


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """`linears`: for each weight shape (None: any shape), the tiled linear's configuration by step size; a step
    past the last entry, and a shape not named, goes to cuBLAS. `fused`: the fused forms (the module's docstring),
    which need the tiled linear to take the product."""

    name: str
    linears: Mapping[Shape | None, Steps] = dataclasses.field(default_factory=dict)
    fused: bool = False
    fp8_gemv_rows: int = 0  # FP8 weights in steps of at most this many rows: `fp8_gemv` (weight-only, one launch)

    def __post_init__(self) -> None:
        for shape, steps in self.linears.items():
            rows = [most for most, _ in steps]
            if rows != sorted(set(rows)) or not all(1 <= r <= MAX_ROWS for r in rows):
                raise ValueError(f"plan {self.name}: {shape}: rows {rows} must increase within 1..{MAX_ROWS}")
            unknown = [config for _, config in steps if config not in TILED_CONFIGS]
            if unknown:
                raise ValueError(f"plan {self.name}: {shape}: no configuration {unknown} in {sorted(TILED_CONFIGS)}")
        if not 0 <= self.fp8_gemv_rows <= MAX_ROWS:
            raise ValueError(f"plan {self.name}: fp8_gemv_rows {self.fp8_gemv_rows} outside 0..{MAX_ROWS}")
        if self.fused and not self.linears:
            raise ValueError(f"plan {self.name}: the fused forms come with the tiled linear, which it never takes")

    @classmethod
    def every_weight(cls, config: str, fused: bool = False) -> KernelPlan:
        """Every dense weight through one configuration up to `MAX_ROWS` rows (benchmarks and tests)."""
        return cls(f"{config}{'+fused' if fused else ''}", {None: ((MAX_ROWS, config),)}, fused)

    def config_for(self, rows: int, shape: Shape) -> TiledConfig | None:
        """The tiled linear's configuration for a weight of `shape` in a step of `rows` rows, or None (cuBLAS)."""
        for most, name in self.linears.get(shape, self.linears.get(None, ())):
            if rows <= most:
                return TILED_CONFIGS[name]
        return None

    def configs(self) -> list[TiledConfig]:
        """Every configuration the plan names, once."""
        return [TILED_CONFIGS[name] for name in sorted({n for steps in self.linears.values() for _, n in steps})]

    def summary(self) -> dict[str, Any]:
        """What the engine's start log prints."""
        shapes = {"any" if s is None else f"{s[0]}x{s[1]}": [f"<={r}:{c}" for r, c in steps]
                  for s, steps in self.linears.items()}
        out = {"kernel_plan": self.name, "fused": self.fused, "tiled_linears": shapes or "none (cuBLAS)"}
        if self.fp8_gemv_rows:
            out["fp8_gemv_rows"] = self.fp8_gemv_rows
        return out


# The H200's plan: the Llama-3-8B projections' fastest configurations where they beat cuBLAS by more than the run's
# noise (`bench/kernels.py --only tiled`; the down projection with the SiLU apart): 1-3 us a projection at 1-64
# rows, none at 128, none on the LM head; and Qwen3-30B-A3B's qkv and o up to 8 rows, the steps its MoE layers take
# sort-free (`moe.small_path`). Fused, the Llama-3-8B step at batch 1 and 8 measured 1.25x and 1.31x its floor
# against 1.31x and 1.33x unfused, and the Qwen3-30B-A3B step at batch 1 3.30 against 3.66 ms (BENCHMARKS.md).
H200_LINEARS: dict[Shape | None, Steps] = {
    (6144, 4096): ((1, "n64_k128_s4"),),  # Llama-3-8B qkv
    (4096, 4096): ((16, "n64_k128_s4_x2"), (32, "n64_k128_s4")),  # o
    (28672, 4096): ((64, "n128_k64_s4_w8"),),  # gate_up
    (4096, 14336): ((32, "n64_k128_s4_x2"), (64, "n64_k128_s4")),  # down
    (5120, 2048): ((8, "n64_k128_s4"),),  # Qwen3-30B-A3B qkv
    (2048, 4096): ((8, "n64_k128_s4_x2"),),  # Qwen3-30B-A3B o
}

# The H100's plan: cuBLAS for the bf16 products; FP8 weights in steps of up to 8 rows through the weight-only GEMV.
# Llama-3-8B decode steps with FP8 weights took 4.03 against 5.58 ms (cuBLASLt's FP8 product) at batch 1 and 4.91
# against 5.65 at 8, context 512, and 7.95 against 6.99 at 64 (10.12 against 9.17 at served contexts) on an H100
# (BENCHMARKS.md, "FP8 weights and FP8 KV beside bf16").
H100_FP8_GEMV_ROWS = 8

PLANS = {
    "cublas": KernelPlan("cublas"),
    "h100": KernelPlan("h100", fp8_gemv_rows=H100_FP8_GEMV_ROWS),
    "h200": KernelPlan("h200", H200_LINEARS, fused=True),
}
# torch.cuda.get_device_name() -> the plan measured fastest there; any other GPU gets "cublas"
GPU_PLANS = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100"}


def resolve_plan(setting: str, device_name: str) -> KernelPlan:
    """The plan for `--kernel-plan`: "auto", this GPU's (`GPU_PLANS`, else cuBLAS); otherwise the `PLANS` entry."""
    if setting == "auto":
        return PLANS[GPU_PLANS.get(device_name, "cublas")]
    if setting not in PLANS:
        raise ValueError(f"kernel plan {setting!r}: expected auto or one of {sorted(PLANS)}")
    return PLANS[setting]
