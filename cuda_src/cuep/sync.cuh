// Bounded waits on flags written by peers, and the status record a timed-out wait leaves behind.
#pragma once

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

// Spin until *flag >= target (flags and counters here only grow; 32- or 64-bit) or until the global
// timer passes deadline_ns, pausing `sleep_ns` between polls. Returns whether the target was reached.
template <typename Flag>
__device__ __forceinline__ bool wait_at_least_until(const Flag* flag, Flag target, uint64_t deadline_ns,
                                                    uint32_t sleep_ns = 0) {
    while (ld_acquire_sys_global(flag) < target) {
        if (globaltimer_ns() > deadline_ns)
            return false;
        if (sleep_ns > 0)
            __nanosleep(sleep_ns);
    }
    return true;
}

// First timed-out wait of a launch wins the record; later ones keep the first culprit. Returns
// whether this call won.
__device__ __forceinline__ bool record_timeout(int32_t* status, int32_t peer, int32_t phase) {
    if (atomicCAS(status + kStatusTimedOut, 0, 1) != 0)
        return false;
    status[kStatusPeer] = peer;
    status[kStatusPhase] = phase;
    __threadfence_system();
    return true;
}

}  // namespace cuep
