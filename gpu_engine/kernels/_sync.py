"""How programs of a launch hand work to each other: the last of a group to finish does what needs all of them (sums
split partials, folds attention splits, routes a token), after an atomic count that it resets."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_finish(count_ptr, n):
    """Whether this program is the last of the `n` that count at `count_ptr` (an int32 that is zero at rest). Every
    thread's stores come before the count (a barrier, then an acquire-release atomic at GPU scope), so the last one
    sees the others' writes (to be loaded past L1, `.cg`: other SMs wrote them); it sets the count back to zero for
    the next launch, so that no launch needs a memset before it (one launch fewer, in a CUDA graph too)."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == n - 1
    if last:
        tl.store(count_ptr, 0)
    return last
