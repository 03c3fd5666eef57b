"""CPU weight formats that keep a quantized checkpoint small: Q4_1 linears as GGUF's own blocks and the Q8_0
head over the embedding's codes (``Q4Linear``, ``Q8Head``: C kernels, exact weights, fp32 arithmetic, decode
and prefill alike), packed fp16 linears for other weights, group-int8 embeddings.

``PackedLinear`` holds its weight as fp16 in fbgemm's packed GEMM layout (``quantized.linear_prepack_fp16``)
and multiplies fp32 activations with fp32 accumulation: a GGUF Q4_1/Q8_0 weight (``d * q + m`` with fp16
``d``, ``m``) is stored to within fp16 rounding (relative error <= 2**-11 per weight), a quarter of fp32's
bytes, and the kernel converts it in registers (AVX2 F16C) so no dequantized copy ever exists.

``GroupInt8Embedding`` keeps the token table as int8 with one fp32 scale per group of 32 along the hidden
dim (the Q8_0 layout): rows are dequantized only when looked up. Built from Q8_0-dequantized values the
int8 codes and scales come back exactly (the group's largest code is 127); from other weights each value
is within half a step (``max|w| / 254`` of its group).

Both have a float32 reference (``reference_weight``) that the tests compare against.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_engine.kernels._checks import check

try:
    from gpu_engine.kernels import _cpu_quant  # type: ignore[attr-defined]
except ImportError:  # not built (a source tree without its C extensions): the packed fp16 forms serve
    _cpu_quant = None

EMBED_GROUP = 32
Q_GROUP = 32
# Above this many rows of x (a prefill chunk) the Q4 kernel dequantizes four weight rows at a time into a panel
# and multiplies every row of x by it; at or below it, it reads the 4-bit codes directly (decode). The C's own.
GEMM_ROWS: int = getattr(_cpu_quant, "GEMM_ROWS", 0)


class KernelThreads:
    """Threads of the quantized kernels' own pool: ``count`` when set (> 0), else torch's thread count."""

    count = 0

    @classmethod
    def get(cls) -> int:
        return cls.count or torch.get_num_threads()


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [out, in] stored as packed fp16 (``b`` float32); x, y float32 [..., in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        check("weight", weight, dtype=(torch.float32, torch.float16, torch.bfloat16), shape=(None, None))
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        if bias is not None:
            check("bias", bias, shape=(self.out_features,))
            bias = bias.to(torch.float32).contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(weight.to(torch.float32).contiguous(), bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [..., in] -> [..., out]; with ``out`` (float32 [rows, out]) adds into it."""
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"PackedLinear: expected float32 [..., {self.in_features}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        y = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self._packed)
        return y if out is None else out.add_(y.view_as(out))

    def reference_weight(self) -> torch.Tensor:
        """The stored weight as float32 [out, in] (its fp16 values), for tests and references."""
        w, _ = torch.ops.quantized.linear_unpack_fp16(self._packed)
        return w.to(torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16 packed"


class GroupInt8Embedding(nn.Module):
    """Token embedding as int8 codes [V, H] with fp32 scales [V, H / 32]; lookups return float32 [T, H]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        check("weight", weight, dtype=(torch.float32, torch.float16, torch.bfloat16), shape=(None, None))
        vocab, hidden = int(weight.shape[0]), int(weight.shape[1])
        if hidden % EMBED_GROUP:
            raise ValueError(f"GroupInt8Embedding: hidden size {hidden} is not a multiple of {EMBED_GROUP}")
        groups = weight.to(torch.float32).reshape(vocab, hidden // EMBED_GROUP, EMBED_GROUP)
        scale = groups.abs().amax(-1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        self.codes = nn.Buffer(codes.reshape(vocab, hidden))
        self.scales = nn.Buffer(scale.contiguous())
        self.num_embeddings, self.embedding_dim = vocab, hidden
        self.fused = False  # lookups as one C call (``cpu_pack.fuse_small_ops``, where the kernels run)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (self.fused and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()
                and ids.device.type == "cpu" and self.codes.is_contiguous() and self.scales.is_contiguous()):
            # one C call, the same arithmetic; an id out of range falls to torch's indexing (its error)
            assert _cpu_quant is not None
            out = torch.empty(ids.shape[0], self.embedding_dim)
            if ids.shape[0] == 0 or _cpu_quant.embed_rows(out.data_ptr(), ids.data_ptr(), ids.shape[0],
                                                          self.codes.data_ptr(), self.scales.data_ptr(),
                                                          self.num_embeddings, self.embedding_dim):
                return out
        rows = self.codes[ids].to(torch.float32).view(-1, self.embedding_dim // EMBED_GROUP, EMBED_GROUP)
        return (rows * self.scales[ids].view(-1, rows.shape[1], 1)).view(*ids.shape, self.embedding_dim)

    def reference_weight(self) -> torch.Tensor:
        """The whole table dequantized to float32 [V, H]."""
        return self.forward(torch.arange(self.num_embeddings))


INT4_GROUP = 32


class Int4Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` as 4-bit codes, groups of 32 along ``in`` with a scale and a minimum each (the
    Q4_1 layout), through ``aten._weight_int4pack_mm_for_cpu``: bf16 activations and scales, fp32 in and out.

    Built from Q4_1-dequantized values the codes come back exactly (a group's minimum is its code 0 and its
    maximum its code 15); the scales and offsets are rounded to bf16 (relative error <= 2**-9)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        check("weight", weight, dtype=(torch.float32, torch.float16, torch.bfloat16), shape=(None, None))
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        codes, scale_zero = quantize_int4(weight)
        self.packed = nn.Buffer(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))
        self.scale_zero = nn.Buffer(scale_zero)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [..., in] -> [..., out]; with ``out`` (float32 [rows, out]) adds into it."""
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"Int4Linear: expected float32 [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scale_zero)
        if out is not None:
            return out.add_(y.view_as(out))
        return y.to(torch.float32).reshape(*x.shape[:-1], self.out_features)

    def reference_weight(self) -> torch.Tensor:
        """The stored weight as float32 [out, in]."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        sz = self.scale_zero.to(torch.float32)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye.float(), self.packed, INT4_GROUP, sz).t()


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Int4Linear``'s quantization of ``weight`` [out, in]: codes int32 [out, in] in 0..15 and ``scale_zero``
    bf16 [in / 32, out, 2], the kernel computing ``(code - 8) * scale + zero``."""
    out_features, in_features = int(weight.shape[0]), int(weight.shape[1])
    if in_features % INT4_GROUP:
        raise ValueError(f"Int4Linear: in_features {in_features} is not a multiple of {INT4_GROUP}")
    groups = weight.to(torch.float32).reshape(out_features, -1, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = (high - low) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.int32)
    zero = low + 8 * step
    scale_zero = torch.stack([step, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return codes.reshape(out_features, in_features), scale_zero


def dequantize_int4(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weight that ``quantize_int4``'s codes and scales stand for."""
    sz = scale_zero.to(torch.float32).transpose(0, 1)  # [out, groups, 2]
    groups = codes.to(torch.float32).reshape(codes.shape[0], -1, INT4_GROUP)
    return ((groups - 8) * sz[..., :1] + sz[..., 1:]).reshape(codes.shape)


def quant_kernels_available() -> bool:
    """Whether the quantized-weight kernels (``_cpu_quant``: AVX2 + FMA) are built and run on this CPU."""
    return _cpu_quant is not None and bool(_cpu_quant.available())


def q4_1_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight`` [N, K] as GGUF Q4_1 groups when every value is exactly ``fl(d * q + m)`` for codes q in
    0..15 and fp16 ``d``, ``m`` per group of 32 (what GGUF's dequantizer gives): (codes uint8 [N, K / 2], d
    [N, G], m [N, G] float32), else None. A group's minimum is its code 0 and its maximum its code 15 (the
    Q4_1 quantizer's construction); ``d`` is tried at that fp16 value and one fp16 step either side."""
    n, k = int(weight.shape[0]), int(weight.shape[1])
    if k % Q_GROUP or weight.dtype != torch.float32:
        return None
    groups = weight.reshape(-1, Q_GROUP)
    low = groups.amin(-1)
    if not bool((low.half().float() == low).all()):
        return None
    base = ((groups.amax(-1) - low) / 15).half().view(torch.int16)
    codes, d = _q4_codes(groups, low, base.view(torch.float16).float())
    todo = (d < 0).nonzero().squeeze(1)
    for delta in (1, -1):  # the few groups whose step is one fp16 ulp off the recomputed one
        if todo.numel():
            c, dd = _q4_codes(groups[todo], low[todo], (base[todo] + delta).view(torch.float16).float())
            codes[todo], d[todo] = c, dd
            todo = todo[dd < 0]
    if todo.numel():
        return None
    codes = codes.reshape(n, k // Q_GROUP, Q_GROUP)
    d, low = d.reshape(n, -1), low.reshape(n, -1)
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8).reshape(n, k // 2)
    return packed.contiguous(), d.contiguous(), low.contiguous()


def _q4_codes(groups: torch.Tensor, low: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int32 [G, 32]) and steps of groups [G, 32] at the given minimum and step; the step is -1 where
    ``step * q + low`` is not exactly the group."""
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((groups - low[:, None]) / safe[:, None]).clamp_(0, 15)
    exact = ((step[:, None] * q + low[:, None]) == groups).all(-1) & (step >= 0)
    return q.to(torch.int32), torch.where(exact, step, -torch.ones_like(step))


Q4_BLOCK = 20  # bytes of a GGUF Q4_1 block: fp16 scale, fp16 minimum, 16 bytes of 4-bit codes


def q4_1_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``q4_1_codes``'s parts as GGUF's own Q4_1 blocks, uint8 [N, K / 32 * 20] (``d``, ``m`` hold fp16 values)."""
    n, groups = int(d.shape[0]), int(d.shape[1])
    scales = torch.stack([d.half(), m.half()], -1).view(torch.uint8).reshape(n, groups, 4)
    return torch.cat([scales, codes.reshape(n, groups, 16)], -1).reshape(n, groups * Q4_BLOCK).contiguous()


class Q4Linear(nn.Module):
    """``y = x @ W.T`` with ``W`` [out, in] kept as its GGUF Q4_1 blocks (``q4_1_blocks``): 0.625 bytes per
    weight, every weight exactly its fp32 dequantized value, fp32 arithmetic. Build with ``from_weight``."""

    def __init__(self, blocks: torch.Tensor) -> None:
        super().__init__()
        check("blocks", blocks, dtype=torch.uint8, shape=(None, None))
        if blocks.shape[1] % Q4_BLOCK:
            raise ValueError(f"Q4Linear: {blocks.shape[1]} bytes per row is not a whole number of Q4_1 blocks")
        self.out_features, self.in_features = int(blocks.shape[0]), int(blocks.shape[1]) // Q4_BLOCK * Q_GROUP
        self.blocks = nn.Buffer(blocks.contiguous())
        # x quantized to int8 per group of 32 before the product (llama.cpp's arithmetic): ~2x faster, not exact
        self.int8_activations = False

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Q4Linear | None:
        """The Q4 form of ``weight``, or None when it is not exactly Q4_1 (or the kernels cannot run)."""
        if not quant_kernels_available():
            return None
        found = q4_1_codes(weight.detach())
        return None if found is None else cls(q4_1_blocks(*found))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [..., in] -> [..., out]; with ``out`` (float32 [rows, out], contiguous) adds into it."""
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"Q4Linear: expected float32 [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        if out is not None and not (out.is_contiguous() and out.shape == (rows, self.out_features)):
            raise ValueError(f"Q4Linear: out must be contiguous [{rows}, {self.out_features}]")
        y = torch.empty(rows, self.out_features) if out is None else out
        _cpu_quant.q4_matmul(y.data_ptr(), flat.data_ptr(), self.blocks.data_ptr(), rows, self.out_features,
                             self.in_features, out is not None, KernelThreads.get(), self.int8_activations)
        return y if out is not None else y.reshape(*x.shape[:-1], self.out_features)

    def reference_weight(self) -> torch.Tensor:
        """The weight as float32 [out, in]."""
        w = torch.empty(self.out_features, self.in_features)
        _cpu_quant.q4_dequant(w.data_ptr(), self.blocks.data_ptr(), self.out_features, self.in_features)
        return w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=Q4_1 blocks"


class Q8Head(nn.Module):
    """``y = x @ E.T`` over a ``GroupInt8Embedding``'s own codes and scales (a tied LM head: no second copy),
    fp32 arithmetic, each weight exactly the table's dequantized value."""

    def __init__(self, embed: GroupInt8Embedding) -> None:
        super().__init__()
        self.embed = [embed]  # not a submodule: the embedding owns the buffers
        self.out_features, self.in_features = embed.num_embeddings, embed.embedding_dim
        self.int8_activations = False  # as Q4Linear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"Q8Head: expected float32 [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(flat.shape[0], self.out_features)
        e = self.embed[0]
        _cpu_quant.q8_matmul(y.data_ptr(), flat.data_ptr(), e.codes.data_ptr(), e.scales.data_ptr(), flat.shape[0],
                             self.out_features, self.in_features, False, KernelThreads.get(), self.int8_activations)
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference_weight(self) -> torch.Tensor:
        return self.embed[0].reference_weight()
