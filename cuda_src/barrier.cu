// Barrier across every rank of a Buffer, on the device, over NVSHMEM, with a bounded wait.
//
// Buffer layout: each rank owns `uint64_t signals[num_ranks]` in NVSHMEM symmetric memory;
// signals[src] on rank r holds the newest barrier epoch that src has announced to r.
//
// Protocol for barrier number `epoch` (1, 2, ..., counted on the device in *epoch_counter, which this
// kernel increments, so a CUDA graph that replays it keeps counting; equal on every rank):
//   thread p of the single block (p < num_ranks) first completes this thread's earlier NVSHMEM
//   operations (quiet), then sets signals[rank] on rank p to `epoch` (a signal op: an NVLink store
//   or a network atomic, as NVSHMEM sees fit), then waits until its own signals[p] >= epoch.
// Epochs only grow, so a peer that arrives late still releases the others, and a signal for a
// later epoch also satisfies an earlier wait. A wait that passes the deadline records the peer in
// `status` (see common.cuh; mirrored into pinned host memory) and returns; the host raises
// PeerTimeoutError naming rank and peer.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuep/common.cuh>
#include <cuep/sync.cuh>

namespace cuep {

// cuep::barrier::arrive_and_wait's one argument, passed by value (mirror: BarrierArgs in cuep/kernels/barrier.py).
struct BarrierArgs {
    uint64_t* signals;             // [num_ranks] symmetric: signals[src] = newest epoch src announced here
    int rank, num_ranks;
    uint64_t* epoch_counter;       // this rank's barrier count (device memory, not symmetric)
    uint64_t timeout_ns;
    Status status;
};

__device__ void announce_and_wait(uint64_t* signals, int rank, int peer, uint64_t epoch,
                                  uint64_t deadline_ns, const Status& status) {
    nvshmem_quiet();
    __threadfence_system();
    nvshmemx_signal_op(signals + rank, epoch, NVSHMEM_SIGNAL_SET, peer);
    if (!wait_at_least_until(signals + peer, epoch, deadline_ns))
        status.record_timeout(peer, kPhaseBarrier);
}

}  // namespace cuep

namespace cuep::barrier {

__global__ void arrive_and_wait(const BarrierArgs args) {
    __shared__ uint64_t epoch;
    if (threadIdx.x == 0)
        epoch = ++*args.epoch_counter;  // a single block runs this kernel
    __syncthreads();
    const uint64_t deadline_ns = cuep::globaltimer_ns() + args.timeout_ns;
    for (int peer = threadIdx.x; peer < args.num_ranks; peer += blockDim.x)
        cuep::announce_and_wait(args.signals, args.rank, peer, epoch, deadline_ns, args.status);
}

}  // namespace cuep::barrier
