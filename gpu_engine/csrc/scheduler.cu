// The persistent GPU scheduler's one translation unit: the kernel (sched_kernel.cuh, with the
// state, policy, claims, control and step headers it includes), its host API (sched_host.cuh) and the
// overlap diagnostics (sched_overlap.cuh).
// Built by gpu_engine/gpu/persistent.py with relocatable device code (device graph launch).
#include "sched_host.cuh"
#include "sched_kernel.cuh"
#include "sched_overlap.cuh"
