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

// A launch's status words (see common.cuh): updated on the device, and mirrored as they change into
// pinned host memory, which the host reads without a copy enqueued per call. (A device-to-host copy
// after each launch cost 12-14 us per call in CUDA-graph replays of the intranode kernels.)
struct Status {
    int32_t* device;  // the words a launch updates atomically
    int32_t* host;    // pinned host mirror (device-visible), read by the host without a copy

    __device__ bool timed_out() const { return ld_volatile_global(device + kStatusTimedOut) != 0; }

    // The first timed-out wait of a launch is recorded and mirrored; later ones keep its culprit.
    __device__ void record_timeout(int32_t peer, int32_t phase) const {
        if (cuep::record_timeout(device, peer, phase)) {
            host[kStatusPeer] = peer;
            host[kStatusPhase] = phase;
            __threadfence_system();
            *reinterpret_cast<volatile int32_t*>(host + kStatusTimedOut) = 1;
        }
    }

    // One word that is not a timeout (kStatusOverflow, kStatusBadExpertIds, kStatusLandingRows).
    __device__ void record(int word, int32_t value) const {
        device[word] = value;
        *reinterpret_cast<volatile int32_t*>(host + word) = value;
        __threadfence_system();
    }

    __device__ void record_bad_expert_id() const { record(kStatusBadExpertIds, 1); }
};

}  // namespace cuep
