"""A linear weight kept as GGUF's Q8_0 on the GPU (``kernels.q8_linear`` multiplies by it): torch only, so that
the loader needs no Triton."""

from __future__ import annotations

import dataclasses

import torch

from gpu_engine.kernels._checks import check

GROUP = 32  # K values per scale (Q8_0's block)

BLOCK_BYTES = 2 + GROUP  # a Q8_0 block in a GGUF file: its fp16 scale, then 32 int8 codes


@dataclasses.dataclass(frozen=True, slots=True)
class Q8Weight:
    """A linear weight kept as Q8_0: ``codes`` int8 [N, K], ``scales`` fp16 [N, K / 32] (``q8_linear``'s form)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        check("codes", self.codes, dtype=torch.int8, shape=(None, None))
        n, k = self.codes.shape
        if k % GROUP:
            raise ValueError(f"codes: K = {k} is not a multiple of {GROUP} (Q8_0 blocks)")
        check("scales", self.scales, dtype=torch.float16, shape=(n, k // GROUP), device=self.codes.device)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor) -> Q8Weight:
        """From a GGUF Q8_0 tensor's stored rows, uint8 [N, K / 32 * 34]: the same codes and scales, no rounding."""
        check("blocks", blocks, dtype=torch.uint8, shape=(None, None))
        n, width = blocks.shape
        if width % BLOCK_BYTES:
            raise ValueError(f"blocks: {width} bytes a row is not a whole number of {BLOCK_BYTES}-byte Q8_0 blocks")
        b = blocks.contiguous().view(n, width // BLOCK_BYTES, BLOCK_BYTES)
        scales = b[:, :, :2].contiguous().view(torch.float16).view(n, -1)
        codes = b[:, :, 2:].contiguous().view(torch.int8).view(n, -1)
        return cls(codes, scales)

    @classmethod
    def cat(cls, parts: list[Q8Weight]) -> Q8Weight:
        """Weights stacked along N (the runner's fused q/k/v and gate/up): codes and scales alike."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def to(self, device: torch.device | str) -> Q8Weight:
        return Q8Weight(self.codes.to(device), self.scales.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q8_dequantize(self.codes, self.scales, dtype)


def q8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight: codes * scales per group of 32 in fp32, rounded to ``dtype``."""
    n, k = codes.shape
    w = codes.float().view(n, k // GROUP, GROUP) * scales.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)
