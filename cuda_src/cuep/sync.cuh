// The protocol's synchronisation, written once for every family: the bounded waits on peers, the
// status record a timed-out wait leaves behind, and the count by which the last block of a launch
// learns that it finishes the call.
//
// Two waits, because two policies: wait_at_least_until leaves the timeout to its caller (which may
// blame another peer than the flag's writer, and may sleep between polls); wait_until records the
// timeout itself and gives up at once once another wait of the launch has timed out.
//
// Call numbers are not here: both NVSHMEM families number calls on the device (a counter in this
// rank's device memory, read at launch and advanced by the last block: last_block_done, or
// last_block_counted where only later launches on this GPU read it), but what they count differs.
// The low-latency family numbers every send launch, and a receive-only launch (a hook) reads its
// call's number from the call's own record, because other calls may have been sent since
// (low_latency.cu, "Call order"). The intranode family counts dispatches on their own, because a
// sender's header is reused per dispatch (done[] holds dispatch epochs), and derives the call number,
// which picks the region, as dispatches plus combines (intranode.cu, next_call).
#pragma once

#include <cuep/common.cuh>
#include <cuep/ptx.cuh>

namespace cuep {

// Spin until *flag >= target (32- or 64-bit, acquire; flags and counters here only grow) or until
// the global timer passes deadline_ns, pausing `sleep_ns` between polls. Returns whether the target
// was reached. The caller records a timeout: it may blame another peer than the flag's writer
// (intranode's wait_chunk_count does). Waits that record their own timeout use wait_until below.
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

    // The policy of wait_until: a wait stops at once once another wait of the launch timed out (the
    // call is void then, and one dead peer must cost one timeout, not one per token), and a wait past
    // its deadline records the timeout.
    __device__ bool gives_up_on(int) const { return timed_out(); }
    __device__ void time_out(int32_t peer, int32_t phase) const { record_timeout(peer, phase); }

    // The first timed-out wait of a launch is recorded and mirrored; later ones keep its culprit.
    __device__ void record_timeout(int32_t peer, int32_t phase) const {
        if (cuep::record_timeout(device, peer, phase)) {
            host[kStatusPeer] = peer;
            host[kStatusPhase] = phase;
            __threadfence_system();
            *reinterpret_cast<volatile int32_t*>(host + kStatusTimedOut) = 1;
        }
    }

    // One word that is not a timeout (kStatusOverflow, kStatusRoundTokens, kStatusSelfMasked).
    __device__ void record(int word, int32_t value) const {
        device[word] = value;
        *reinterpret_cast<volatile int32_t*>(host + word) = value;
        __threadfence_system();
    }

    // A top-k id outside [-1, num_experts), which the caller treats as -1. The first one recorded (until
    // the host raises it) keeps the record: the call that met it (kBadIds*), the id and num_experts. The
    // host acts on the call's word, so it is written last, behind a fence (as record_timeout's flag).
    __device__ void record_bad_expert_id(int64_t id, int num_experts, int32_t call) const {
        if (atomicCAS(device + kStatusBadExpertIds, 0, call) != 0)
            return;
        const auto bits = static_cast<uint64_t>(id);
        const auto low = static_cast<int32_t>(bits & 0xffffffffu), high = static_cast<int32_t>(bits >> 32);
        device[kStatusBadExpertIdLow] = host[kStatusBadExpertIdLow] = low;
        device[kStatusBadExpertIdHigh] = host[kStatusBadExpertIdHigh] = high;
        device[kStatusBadExpertLimit] = host[kStatusBadExpertLimit] = num_experts;
        __threadfence_system();
        *reinterpret_cast<volatile int32_t*>(host + kStatusBadExpertIds) = call;
        __threadfence_system();
    }
};

// The bounded wait that records its own timeout: until `arrived()` holds, poll again with `poll()`
// (nothing, when `arrived` loads; the next load, when it tests a value loaded before). Gives up at
// once when status.gives_up_on(peer), or at the deadline, recording `peer` and `phase` (Status; the
// low-latency family's MaskedStatus masks the peer in shrink mode). Returns whether it arrived.
template <typename Arrived, typename Poll, typename AnyStatus>
__device__ __forceinline__ bool wait_until(const Arrived& arrived, const Poll& poll, uint64_t deadline_ns,
                                           const AnyStatus& status, int peer, int phase) {
    while (!arrived()) {
        if (status.gives_up_on(peer))
            return false;
        if (globaltimer_ns() > deadline_ns) {
            status.time_out(peer, phase);
            return false;
        }
        poll();
    }
    return true;
}

// Wait until *flag >= target (acquire, system scope), as wait_until.
template <typename AnyStatus>
__device__ __forceinline__ bool wait_at_least(const uint64_t* flag, uint64_t target, uint64_t deadline_ns,
                                              const AnyStatus& status, int peer, int phase) {
    return wait_until([&] { return ld_acquire_sys_global(flag) >= target; }, [] {}, deadline_ns, status, peer,
                      phase);
}

// Called by every thread of every block at the end of a launch (with the same arguments), whose
// blocks count themselves in counters[index]: true only for thread 0 of the block that finishes
// last, which then finishes the call and resets the count (zero between launches) for the next
// launch. Each block's thread 0 fences (system scope) before counting itself, so what the last block
// writes next, which tells peers that this rank's writes into their memory are done, follows every
// block's writes. The count's address is formed after the fence, as the families did before sharing it.
__device__ __forceinline__ bool last_block_done(uint64_t* counters, int index) {
    __syncthreads();
    if (threadIdx.x != 0)
        return false;
    __threadfence_system();
    return atomicAdd(reinterpret_cast<unsigned long long*>(counters + index), 1ull) == gridDim.x - 1;
}

// last_block_done for a launch whose last block only rewrites state that its blocks read at their start
// and that only this GPU reads: by each block's thread 0 once its own part is done (true for the last
// block's), which fenced right after those reads (fence_acq_rel_gpu, while none of the launch's writes
// was in flight yet): that fence and this count make a release pattern, the counts are one chain of
// read-modify-writes, and the last block's count is an acquire, so every block's reads precede the
// last block's writes. The count waits for no write of the block, where a fence here would wait for
// them all.
__device__ __forceinline__ bool last_block_counted(uint64_t* counters, int index) {
    return threadIdx.x == 0 && atom_add_acquire_gpu(counters + index, 1) == gridDim.x - 1;
}

}  // namespace cuep
