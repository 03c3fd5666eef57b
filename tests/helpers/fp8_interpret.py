"""Triton's CPU interpreter with the GPU's rounding into float8_e4m3fn.

The interpreter (triton 3.x, ``triton.runtime.interpreter._convert_float``) narrows a float to e4m3 by truncating
the significand and adding the first dropped bit: ties round away from zero instead of to even, and a carry out of
the significand lands on the exponent's low bit (at an odd exponent it halves the value, 124 -> 64). The GPU's
``cvt.rn.satfinite.e4m3x2.f32`` (sm_89 and later) rounds to nearest even, as torch does. ``gpu_rounding`` swaps the
interpreter's narrowing into e4m3 for torch's while it is active, so a kernel's FP8 stores under the interpreter are
the codes the GPU writes; widening out of e4m3 is left as it is (exact in the interpreter but for the NaN codes,
which a saturating store never writes). ``interpreter_rounds_like_gpu`` tells whether the swap is still needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def _module():
    import triton.runtime.interpreter as interp

    return interp


def interpreter_rounds_like_gpu() -> bool:
    """Whether the interpreter's own narrowing into e4m3 gives torch's codes at the ties and carries above."""
    import triton.language as tl

    x = np.array([3.125, 124.0, 0.01171875, -13.0], dtype=np.float32)
    got = _module()._convert_float(x, tl.float32, tl.float8e4nv, _rtne())
    return bool(np.array_equal(got.view(np.uint8), torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8)
                               .numpy()))


def _rtne():
    from triton._C.libtriton import ir

    return ir.ROUNDING_MODE.RTNE


@contextlib.contextmanager
def gpu_rounding() -> Iterator[None]:
    """While active, the interpreter narrows fp32/fp16/bf16 into e4m3 as torch (and the GPU) do."""
    import triton.language as tl

    interp = _module()
    own = interp._convert_float
    wide = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in wide:
            return own(data, input_dtype, output_dtype, rounding_mode)
        src = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).copy()).view(wide[input_dtype])
        return src.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)

    interp._convert_float = convert
    try:
        yield
    finally:
        interp._convert_float = own
