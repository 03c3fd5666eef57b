"""The grammar mask in the sampling graph (the persistent backend): each constrained row keeps only the tokens
its DFA state allows, read from the scheduler's device arena, with no host on the path.

The persistent scheduler stages, per row (`gpu_engine/csrc/sched_step.cuh`, `stage_grammar`):

- `bits` [B] int64: the byte offset in `arena` of the row's state's allowed-token bits (`np.packbits` order: bit
  `t` is `0x80 >> (t % 8)` of byte `t // 8`), -1 for a row without a grammar (left as it is: one load), -2 for a
  row that left its grammar (only its end tokens remain);
- `ends` [B, GRAM_COLS] int32: whether the row's text is complete (its end tokens are then allowed too), how
  many end tokens it has, and those ids (its stop ids, then EOS unless ignored).

Every other token of a constrained row becomes -inf in the temperature-scaled logits, after the processors and
before the filter and the draw, the order of the host backends (`gpu_engine.grammar_mask.allowed_tokens`, where
the same tokens get -inf added); greedy rows take their argmax of the same masked logits. A row's state is
walked by the scheduler after the step (`grammar_step`), from the token the graph sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_engine.gpu.sched_structs import GRAM_COLS, GRAM_MAX_END
from gpu_engine.kernels._checks import check

BLOCK = 2048  # vocabulary entries per program


@dataclass(frozen=True, slots=True)
class DeviceGrammar:
    """What `grammar_mask` reads: the staged rows and the arena (module docstring)."""

    bits: torch.Tensor  # [B] int64
    ends: torch.Tensor  # [B, GRAM_COLS] int32
    arena: torch.Tensor  # [bytes] uint8

    def check(self, B: int, dev) -> None:
        check("gram_bits", self.bits, dtype=torch.int64, shape=(B,), device=dev)
        check("gram_ends", self.ends, dtype=torch.int32, shape=(B, GRAM_COLS), device=dev)
        check("gram_arena", self.arena, dtype=torch.uint8, shape=(None,), device=dev)
        if not (self.bits.is_contiguous() and self.ends.is_contiguous() and self.arena.is_contiguous()):
            raise ValueError("grammar buffers must be contiguous")


@triton.jit
def _mask_kernel(x_ptr, bits_ptr, ends_ptr, arena_ptr, V, s_x, NCOL: tl.constexpr, MAX_END: tl.constexpr,
                 BLOCK: tl.constexpr):
    b = tl.program_id(0)
    off = tl.load(bits_ptr + b)
    if off != -1:
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = idx < V
        if off >= 0:
            byte = tl.load(arena_ptr + off + (idx >> 3), mask=m, other=0).to(tl.int32)
            allowed = ((byte >> (7 - (idx & 7))) & 1) != 0
        else:
            allowed = idx < 0
        row = ends_ptr + b * NCOL
        complete = tl.load(row) != 0
        n_end = tl.load(row + 1)
        k = tl.arange(0, MAX_END)
        end = tl.load(row + 2 + k, mask=k < n_end, other=-1)
        is_end = tl.sum((idx[:, None] == end[None, :]).to(tl.int32), axis=1) > 0
        allowed = allowed | (is_end & complete)
        x = tl.load(x_ptr + b * s_x + idx, mask=m)
        tl.store(x_ptr + b * s_x + idx, tl.where(allowed, x, float("-inf")), mask=m)


def grammar_mask(scaled: torch.Tensor, dg: DeviceGrammar) -> None:
    """Set every token a constrained row may not sample to -inf in `scaled` [B, V] f32, in place; rows whose
    `bits` is -1 are left as they are. No sync, capturable."""
    check("scaled", scaled, dtype=torch.float32, shape=(None, None))
    B, V = scaled.shape
    if scaled.stride(1) != 1:
        raise ValueError("scaled must be row-major")
    dg.check(B, scaled.device)
    if B:
        _mask_kernel[(B, triton.cdiv(V, BLOCK))](scaled, dg.bits, dg.ends, dg.arena, V, scaled.stride(0),
                                                 NCOL=GRAM_COLS, MAX_END=GRAM_MAX_END, BLOCK=BLOCK, num_warps=8)
