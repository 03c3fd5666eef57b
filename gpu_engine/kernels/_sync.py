"""How programs of a launch hand work to each other: the last of a group to finish does what needs all of them (sums
split partials, folds attention splits, routes a token), after an atomic count that it resets; and a launch whose
work comes in phases has each program take a ticket that gives its phase, and the programs of a phase wait until
the phase before it has finished."""

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


# Phases in one launch. A launch of N programs whose work comes in phases, each needing the whole of the one before
# (an MoE layer's routing, then its experts' gate_up, then their down products), can run them without a launch
# between: each program takes a ticket (`ticket`), which says its phase and its place in it, so the phases' programs
# start in phase order whatever order the hardware starts them in; a program that needs an earlier phase spins until
# that phase's programs have all said they are done (`arrive`, `wait_for`). A program gets a ticket only once it
# runs, so every program of an earlier phase is running or done when a later one spins: it never waits on a program
# that has no place on the GPU, whatever the grid's size.


@triton.jit
def ticket(count_ptr):
    """This program's place in the launch (0, 1, ... in the order the programs start): an atomic count, which the
    launch's last program sets back to zero."""
    return tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def arrive(count_ptr):
    """This program's phase work is done: every thread's stores come before the count (a barrier, then a release
    atomic at GPU scope), so a program that has waited for the count (`wait_for`, whose acquiring load orders its
    later loads, plain ones included) sees them."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


# Thread 0 of a program polls the count (a volatile load, then a short sleep while it is short), the others wait at
# the barrier after: one poll a program, not one a warp, on an address that every waiting program polls. A count
# still short after 2^22 polls (each a load from L2 and a 128-ns sleep: seconds, where a phase takes microseconds)
# is a phase that will not finish: the program traps, a launch error (a device failure to the engines, which
# restart) instead of a hang.
_POLL = tl.constexpr("""{
.reg .pred %blink_p;
.reg .b32 %blink_v;
.reg .b32 %blink_n;
mov.u32 %blink_v, %tid.x;
setp.ne.u32 %blink_p, %blink_v, 0;
@%blink_p bra BLINK_DONE;
mov.u32 %blink_n, 0;
BLINK_POLL:
ld.volatile.global.b32 %blink_v, [$1];
setp.ge.s32 %blink_p, %blink_v, $2;
@%blink_p bra BLINK_DONE;
add.u32 %blink_n, %blink_n, 1;
setp.gt.u32 %blink_p, %blink_n, 4194304;
@%blink_p trap;
nanosleep.u32 128;
bra BLINK_POLL;
BLINK_DONE:
mov.u32 $0, 0;
}""")


@triton.jit
def wait_for(count_ptr, n, ASM: tl.constexpr):
    """Spin until `n` programs have arrived at `count_ptr` (`arrive`); then this program's loads see what the
    arrivals stored (an acquiring load by every thread: on sm_90 it invalidates the SM's L1, so it is not the poll).
    ASM: on a GPU, thread 0 polls (`_POLL`, PTX) and the others wait at a barrier. Without it (the interpreter, whose
    programs run one after another) the count must be exactly `n` when a program waits, since the phase before has
    just ended and no other adds to it: checked (an interpreter error), so that a phase's count that is off fails
    the tests instead of passing or hanging."""
    if ASM:
        tl.inline_asm_elementwise(_POLL, "=r,l,r", [count_ptr, n], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [count_ptr], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.assume(tl.load(count_ptr, volatile=True) == n)
