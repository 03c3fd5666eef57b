// Persistent scheduler: its limits, host structs and extern "C" API (called through ctypes by
// gpu_engine/gpu/persistent.py). Plain C, so that a C compiler can check the structs' layout.
//
// blink_sched_config and blink_sched_stats are generated (sched_structs.h, from
// schema/sched_structs.py) together with their ctypes mirror, gpu_engine/gpu/sched_structs.py.
#ifndef BLINK_SCHED_H_
#define BLINK_SCHED_H_

#include <stddef.h>
#include <stdint.h>

#include "sched_structs.h"

#define BLINK_SCHED_THREADS 256
#define BLINK_WINDOW_LIMIT 120  // device graph launches per parent execution (CUDA limit)

#ifdef __cplusplus
extern "C" {
#endif

// The message of the last failed call (file, line, CUDA error).
const char *blink_last_error(void);
// sizeof of each struct as the library was built, checked against the ctypes mirror.
int blink_sched_config_size(void);
int blink_sched_stats_size(void);

// Pin and map a host range (the ring) for the GPU; returns its device address.
int blink_register_host(void *ptr, size_t size, void **dev_ptr);
int blink_unregister_host(void *ptr);
// CLOCK_REALTIME minus globaltimer, so device timestamps in the ring share the host's clock.
int blink_clock_offset(int64_t *offset);

// The scheduler's state and its device-launchable graph; -1 (before any CUDA call) for a
// configuration it cannot serve, else 0 or a CUDA error code.
int blink_sched_create(const blink_sched_config *cfg, void **handle, blink_sched_stats **host_stats);
int blink_sched_start(void *handle);
// 0 while running, 1 once finished, a CUDA error code otherwise. No device-wide sync.
int blink_sched_query(void *handle);
int blink_sched_wait(void *handle);
// After the scheduler stopped: the overwritten byte ranges of its guard bands and configuration.
int blink_sched_guard_report(void *handle, char *out, size_t out_size);
int blink_sched_destroy(void *handle);

// Hold one SM the way the scheduler does, until released (the model graphs' co-residency check).
int blink_probe_hold(void **probe);
int blink_probe_release(void *probe);
// Diagnostics: launch a device-launch executable once from the host or from the device.
int blink_launch_once(uint64_t exec, int device, int *launch_err);
// Diagnostics (sched_overlap.cuh): two executables launched from the device, together or the second as the
// parent's tail launch, `reps` timed launches (ms each); and the SMs split into two green contexts.
int blink_launch_pair(uint64_t first, uint64_t second, int sequential, int reps, double timeout_s, float *ms,
                      int *launch_err);
int blink_green_split(int device, unsigned first_sms, void **handle, uint64_t *streams, unsigned *sms);
int blink_green_enter(void *handle, int which);
int blink_green_leave(void);
int blink_green_destroy(void *handle);

#ifdef __cplusplus
}
#endif

#endif  // BLINK_SCHED_H_
