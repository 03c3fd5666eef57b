"""A linear weight kept as FP8 (float8_e4m3fn) with float32 scales (``kernels.fp8_linear`` multiplies by it):
torch only, so that the loader needs no Triton.

W[n, k] = weight[n, k] * scale[n]. A per-tensor scale (vLLM's online ``--quantization fp8``, AutoFP8's files) is
held broadcast over the rows, with ``per_tensor`` set: fusing q/k/v (or gate/up) whose per-tensor scales differ
then keeps each part's scale on its own rows, no re-quantization. Activations are quantized at run time: per
token (a scale a row, found in the step) unless ``act_per_tensor`` or a static ``input_scale`` (a calibrated
checkpoint's) says one scale for the whole step.
"""

from __future__ import annotations

import dataclasses

import torch

from gpu_engine.kernels._checks import check

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # the smallest scale a row of zeros gets (vLLM's floor for dynamic scales)


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Weight:
    """``weight`` float8_e4m3fn [N, K], ``scale`` float32 [N] (one a row; a per-tensor scale repeated);
    ``input_scale`` float32 [1] where the activations' scale is static, else None (dynamic)."""

    weight: torch.Tensor
    scale: torch.Tensor
    per_tensor: bool = False  # the weight's scale is one value (every entry of ``scale`` the same)
    act_per_tensor: bool = False  # a dynamic activation scale for the whole step, not one a row
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check("weight", self.weight, dtype=FP8, shape=(None, None))
        check("scale", self.scale, dtype=torch.float32, shape=(self.weight.shape[0],), device=self.weight.device)
        if self.input_scale is not None:
            check("input_scale", self.input_scale, dtype=torch.float32, shape=(1,), device=self.weight.device)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """What the product reads: the FP8 weight and its scales."""
        return self.weight.nbytes + self.scale.nbytes

    @property
    def scheme(self) -> str:
        """e.g. ``channel/token``: the weight's scale / the activations' (``static`` for a calibrated one)."""
        act = "static" if self.input_scale is not None else "tensor" if self.act_per_tensor else "token"
        return f"{'tensor' if self.per_tensor else 'channel'}/{act}"

    def to(self, device: torch.device | str) -> Fp8Weight:
        moved = None if self.input_scale is None else self.input_scale.to(device)
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.per_tensor, self.act_per_tensor, moved)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] weight: each FP8 value times its row's scale in float32, rounded to ``dtype``."""
        return (self.weight.float() * self.scale.unsqueeze(1)).to(dtype)

    @classmethod
    def cat(cls, parts: list[Fp8Weight]) -> Fp8Weight:
        """Weights stacked along N (the runner's fused q/k/v and gate/up). Static input scales (one a part, for the
        one input they share) become their largest, as vLLM takes them; per-tensor stays so where all are equal."""
        first = parts[0]
        if any(p.act_per_tensor != first.act_per_tensor or (p.input_scale is None) != (first.input_scale is None)
               for p in parts):
            raise ValueError("fused FP8 parts quantize their activations differently")
        scale = torch.cat([p.scale for p in parts])
        same = all(p.per_tensor for p in parts) and bool((scale == scale[0]).all())
        statics = [p.input_scale for p in parts if p.input_scale is not None]
        input_scale = torch.stack(statics).amax(0) if statics else None
        return cls(torch.cat([p.weight for p in parts]), scale, same, first.act_per_tensor, input_scale)


def quantize_fp8(weight: torch.Tensor, per_tensor: bool = False, act_per_tensor: bool = False) -> Fp8Weight:
    """``weight`` [N, K] (any float dtype) as FP8: each row (or the whole tensor) scaled so that its largest
    |value| maps to 448, then rounded to nearest float8_e4m3fn; computed in float32 on the weight's device."""
    check("weight", weight, dtype=(torch.float32, torch.float16, torch.bfloat16), shape=(None, None))
    w = weight.float()
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE).expand(w.shape[0]).contiguous()
    codes = (w / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(codes, scale, per_tensor, act_per_tensor)
