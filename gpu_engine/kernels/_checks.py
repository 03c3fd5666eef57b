"""Input checks shared by the kernel launchers: every launcher validates before it launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = True,
) -> None:
    """Raise a ValueError naming `name` when `t` does not have the expected dtype, shape or device.

    `shape` entries of None match any size. `last_contiguous` requires stride 1 in the last dim.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=True))
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name}: shape {tuple(t.shape)} does not match {want}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride {t.stride(-1)})")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
