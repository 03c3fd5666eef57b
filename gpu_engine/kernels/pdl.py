"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step at small batch is some 330 short kernels (600 on the 48-layer MoE model), and each waits for the
one before it to finish and for its own blocks to be scheduled: `scripts/pdl_probe.py` measured 0.3-0.4 us a
boundary to gain on the H200 (`bench/results/pdl_probe.json`). A kernel launched with `launch_pdl=True` may be
scheduled while the one before it runs. It calls `pdl_enter` first, which waits (`griddepcontrol.wait`) until
that kernel has finished and its writes are visible, then lets the kernel after it be scheduled in turn. Every
write and every read of another kernel's output therefore comes after the wait, and a kernel that is not
launched so (cuBLAS, torch's own) is waited for in full as before. The flag is a constexpr: without it the code
is what it was.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch keywords: programmatic serialization after the kernel before, where `pdl`."""
    return {"launch_pdl": True} if pdl else {}
