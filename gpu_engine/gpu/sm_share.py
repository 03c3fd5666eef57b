"""Leave the persistent scheduler's SM to it: GEMM libraries size their grids for the rest.

The scheduler is one resident block on one SM for as long as the engine runs. A library kernel
that launches exactly one CTA per SM and lets CTAs wait on each other (a stream-K or split-K
GEMM whose partial tiles are reduced in place) can then hang: its last CTA finds no room, and the
CTAs that wait for it never finish. cuBLAS takes an SM-count target for exactly this case; it
must be set before the graphs are captured, since capture records the kernels chosen then.
"""

from __future__ import annotations

import ctypes
import os

_CUBLAS_SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


def _loaded_cublas() -> ctypes.CDLL | None:
    """The cuBLAS that torch already loaded (never a second copy)."""
    for name in _CUBLAS_SONAMES:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def reserve_sms(count: int = 1) -> dict[str, int]:
    """Target all SMs but ``count`` in cuBLAS and cuBLASLt calls made from this thread from now on.

    Returns what was set: ``{"sms": total, "target": total - count, "cublas": 0 or 1}`` (``cublas``
    is 1 when the plain cuBLAS handle took the target too, not only the cuBLASLt paths).
    """
    import torch

    if count < 0:
        raise ValueError("count must be >= 0")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if count >= total:
        raise ValueError(f"cannot reserve {count} of {total} SMs")
    torch._C._set_sm_carveout_experimental(count or None)  # cuBLASLt: SM_COUNT_TARGET per matmul
    done = 0
    lib = _loaded_cublas()
    if lib is not None:
        set_target = lib.cublasSetSmCountTarget
        set_target.argtypes = [ctypes.c_void_p, ctypes.c_int]
        set_target.restype = ctypes.c_int
        status = set_target(ctypes.c_void_p(torch.cuda.current_blas_handle()), total - count if count else 0)
        if status != 0:
            raise RuntimeError(f"cublasSetSmCountTarget failed with status {status}")
        done = 1
    return {"sms": total, "target": total - count, "cublas": done}
