"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step at small batch is some 330 short kernels (600 on the 48-layer MoE model), and each waits for the
one before it to finish and for its own blocks to be scheduled: `scripts/pdl_probe.py` measured 0.3-0.4 us a
boundary to gain on the H200 (`bench/results/pdl_probe.json`). A kernel launched with `launch_pdl=True` may be
scheduled while the one before it runs. It calls `pdl_enter` first, which waits (`griddepcontrol.wait`) until
that kernel has finished and its writes are visible; the kernel after it is let in as its programs finish. Every
write and every read of another kernel's output therefore comes after the wait, and a kernel that is not
launched so (cuBLAS, torch's own) is waited for in full as before. The flag is a constexpr: without it the code
is what it was.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL: it waits for the kernel before. The kernel
    after is let in as this one's programs finish (no early trigger): with `gdc_launch_dependents` right after the
    wait, the H200 ran a decode step 1.57x slower than without PDL (BENCHMARKS.md)."""
    if USE_PDL:
        gdc_wait()


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch keywords: programmatic serialization after the kernel before, where `pdl`."""
    return {"launch_pdl": True} if pdl else {}
