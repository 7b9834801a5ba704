// NVLink ceiling probe, for the benchmark only (python -m cuep.bench --mode ceiling; no Buffer compiles
// this family): the row copies of an intranode dispatch (pull) or combine (push), spread over peers
// the way those kernels spread them, with nothing else: no staging, no flags, no reduction. What the
// probe reaches is what the copies alone can do on this fabric; the gap to the real kernels is what
// their protocol costs.
//
// Every rank owns one probe buffer (NVSHMEM symmetric memory; `peer_bases[r]` is rank r's as this GPU
// addresses it over NVLink):
//
//   [0, kHeaderBytes)         ProbeFlags (zeroed when allocated)
//   source region             num_ranks * max_rows rows: rows for peer p at [p * max_rows, ...)
//   landing region            the same size: rows from peer p at [p * max_rows, ...)
//
// rank_prefix[num_ranks + 1] counts the rows this rank receives from (pull) or sends back to (push)
// each peer. The rows hold whatever the buffer holds; only bytes are timed.
//
// An awaited push also ends only once every peer's rows have landed here: each block, after a system
// fence, counts itself in every receiver's ProbeFlags::blocks_done[parity][sender], and block 0 waits
// until every peer's blocks have counted here (every rank launches the same grid). That is the least
// any call that pushes must do before it may use what it received: the floor of a combine, with no
// landing handshake and no reduction. A peer that never counts makes the wait give up at the deadline
// and record a timeout in the status words, from which the benchmark raises.
//
// Each entry takes one ProbeArgs by value, mirrored in cuep/kernels/probe.py, which also defines the
// sizes both sides use (CUEP_* macros, read once below).
#include <cuep/common.cuh>
#include <cuep/copy.cuh>
#include <cuep/ptx.cuh>
#include <cuep/rows.cuh>
#include <cuep/sync.cuh>

namespace cuep {

// Defined once in cuep/kernels/probe.py (its CONSTANTS), passed by the JIT as CUEP_* macros.
constexpr int kNumThreads = CUEP_NUM_THREADS;  // the intranode kernels' block
constexpr int kWarpsPerBlock = kNumThreads / kWarpSize;
constexpr int kMaxRanks = CUEP_MAX_RANKS;
constexpr int64_t kHeaderBytes = CUEP_HEADER_BYTES;
static_assert(kNumThreads % kWarpSize == 0 && kMaxRanks + 1 <= kNumThreads, "a thread per rank, whole warps");

// Per-rank state on the device (kStateWords uint64 words, zeroed when allocated): finished awaited
// launches (their parity picks the counters), and the blocks of the running launch that are done.
constexpr int kStateEpoch = 0;
constexpr int kStateBlocksDone = 1;
constexpr int kStateWords = CUEP_STATE_WORDS;
static_assert(kStateBlocksDone < kStateWords, "the host allocates too few state words");

// At the start of every rank's probe buffer.
struct ProbeFlags {
    // blocks_done[parity][sender]: the sender's blocks of an awaited push, with that launch parity, whose
    // rows have landed here. A sender's next launch counts in the other parity, and its launch after
    // that only once this rank's next launch has counted there, so the waiter may clear its parity.
    uint32_t blocks_done[2][kMaxRanks];
};
static_assert(sizeof(ProbeFlags) <= kHeaderBytes, "ProbeFlags outgrew the probe buffer's header");

struct ProbeArgs {
    const uint64_t* peer_bases;   // [num_ranks]: each rank's probe buffer
    const int32_t* rank_prefix;   // [num_ranks + 1]: prefix sum of the rows exchanged with each peer
    int rank, num_ranks;
    int64_t row_bytes;            // a multiple of 16
    int max_rows;                 // rows per peer in each region
    int pull;                     // 1: copy peers' rows here (dispatch); 0: push rows to peers (combine)
    int awaited;                  // push only: end once every peer's rows have landed here
    int copy_warps;               // warps of each block that copy (the rest idle), 1 to kWarpsPerBlock
    int copy_batch;               // warp copies: 16-byte vectors a lane has in flight (COPY_BATCHES in cuep/kernels/probe.py)
    int bulk_chunk_bytes;         // bulk copies: bytes of one bulk load and store, a multiple of 16
    int bulk_stages;              // bulk copies: chunks of shared memory each copying warp cycles through
    uint64_t* state;              // [kStateWords] this rank's
    int32_t* next_row;            // [num_ranks + 1] work counters, zero between launches
    Status status;                // where an awaited launch records a timed-out wait
    uint64_t timeout_ns;          // bound on that wait
};

__device__ __forceinline__ ProbeFlags* flags_of_rank(const uint64_t* peer_bases, int r) {
    return reinterpret_cast<ProbeFlags*>(peer_bases[r]);
}

// Both probes: `copy_row(dst, src, lane)` for each row this rank exchanges, warp by warp over the
// first copy_warps warps of each block, in the walk of the intranode pull dispatch (rows.cuh; no source
// left out, no tapered claims). Every thread calls it; the other warps return at once.
template <typename CopyRow>
__device__ __forceinline__ void probe_rows(const ProbeArgs& args, CopyRow copy_row) {
    __shared__ int32_t prefix[kMaxRanks + 1];
    if (static_cast<int>(threadIdx.x) <= args.num_ranks)
        prefix[threadIdx.x] = args.rank_prefix[threadIdx.x];
    __syncthreads();
    if (static_cast<int>(threadIdx.x / kWarpSize) >= args.copy_warps)
        return;
    const int64_t landing_rows = static_cast<int64_t>(args.num_ranks) * args.max_rows;
    const auto row_at = [&](int owner, int64_t index) {
        return reinterpret_cast<uint8_t*>(args.peer_bases[owner]) + kHeaderBytes + index * args.row_bytes;
    };
    for_each_row_spread_over_sources<kWarpsPerBlock>(args.next_row, prefix, args.rank, args.num_ranks,
                                                     [&](int peer, int, int j, int lane) {
        const int64_t mine = static_cast<int64_t>(args.rank) * args.max_rows + j;
        const int64_t theirs = static_cast<int64_t>(peer) * args.max_rows + j;
        if (args.pull)
            copy_row(row_at(args.rank, landing_rows + theirs), row_at(peer, mine), lane);
        else
            copy_row(row_at(peer, landing_rows + mine), row_at(args.rank, theirs), lane);
        return true;
    });
}

// Thread 0 of each block of an awaited push: count this block's rows as landed at every receiver;
// block 0 then waits until every peer's blocks have counted here, and clears its counts. A peer that
// does not count in time is recorded as timed out.
__device__ void await_peers(const ProbeArgs& args, uint64_t epoch) {
    const int parity = static_cast<int>(epoch % 2);
    __threadfence_system();
    for (int peer = 0; peer < args.num_ranks; ++peer)
        atomicAdd_system(&flags_of_rank(args.peer_bases, peer)->blocks_done[parity][args.rank], 1u);
    if (blockIdx.x != 0)
        return;
    uint32_t* done_here = flags_of_rank(args.peer_bases, args.rank)->blocks_done[parity];
    const uint64_t deadline_ns = globaltimer_ns() + args.timeout_ns;
    for (int peer = 0; peer < args.num_ranks; ++peer) {
        if (!wait_at_least_until(done_here + peer, static_cast<uint32_t>(gridDim.x), deadline_ns)) {
            // The wait a combine's reducers make for landed rows.
            args.status.record_timeout(peer, kPhaseIntranodeArrival);
            break;
        }
    }
    for (int peer = 0; peer < args.num_ranks; ++peer)
        done_here[peer] = 0;
}

// Every thread at the end of a launch: the last block clears the block count and the work counters
// for the next launch, and records `epoch` as finished.
__device__ __forceinline__ void finish_launch(const ProbeArgs& args, uint64_t epoch) {
    if (!last_block_done(args.state, kStateBlocksDone))
        return;
    args.state[kStateBlocksDone] = 0;
    for (int r = 0; r <= args.num_ranks; ++r)
        args.next_row[r] = 0;
    args.state[kStateEpoch] = epoch;
}


}  // namespace cuep

namespace cuep::probe {

// The warps' row copies with kBatch vectors a lane in flight.
template <int kBatch>
__device__ void copy_rows(const ProbeArgs& args) {
    probe_rows(args, [&](uint8_t* dst, const uint8_t* src, int lane) {
        warp_copy<true, kBatch>(dst, src, args.row_bytes, lane);
    });
}

// The copies made by the warps' loads and stores (warp_copy, as the intranode kernels make them, with
// copy_batch vectors a lane in flight: 4, theirs, 8 or 16).
__global__ void __launch_bounds__(kNumThreads, 1) copy(const ProbeArgs args) {
    const uint64_t epoch = ld_volatile_global(args.state + kStateEpoch) + 1;
    if (args.copy_batch == 16)
        copy_rows<16>(args);
    else if (args.copy_batch == 8)
        copy_rows<8>(args);
    else
        copy_rows<4>(args);
    if (args.awaited) {
        __syncthreads();
        if (threadIdx.x == 0)
            await_peers(args, epoch);
    }
    finish_launch(args, epoch);
}

}  // namespace cuep::probe

#if CUEP_ENABLE_SM90_FEATURES
namespace cuep::probe {

// The same copies made by the Hopper bulk-copy unit (TMA): lane 0 of each copying warp drives its rows
// through bulk_stages chunks of bulk_chunk_bytes of dynamic shared memory (BulkRing; the host sizes it,
// cuep/kernels/probe.py). Hopper builds only (cuep/kernels/probe.py refuses it elsewhere); never awaited.
__global__ void __launch_bounds__(kNumThreads, 1) bulk_copy(const ProbeArgs args) {
    extern __shared__ __align__(128) uint8_t bulk_shared[];
    const uint64_t epoch = ld_volatile_global(args.state + kStateEpoch);  // not advanced: nothing waits on it
    const int warp = threadIdx.x / kWarpSize;
    const bool driver = threadIdx.x % kWarpSize == 0 && warp < args.copy_warps;
    const int64_t warp_bytes = static_cast<int64_t>(args.bulk_stages) * args.bulk_chunk_bytes;
    auto* landed = reinterpret_cast<uint64_t*>(bulk_shared + args.copy_warps * warp_bytes) +
                   warp * args.bulk_stages;
    BulkRing<> ring{bulk_shared + warp * warp_bytes, landed, args.bulk_chunk_bytes, args.bulk_stages};
    if (driver)
        ring.init();
    __syncwarp();
    probe_rows(args, [&](uint8_t* dst, const uint8_t* src, int) {
        if (driver)
            ring.copy_row(dst, src, args.row_bytes);
    });
    if (driver)
        ring.complete();
    finish_launch(args, epoch);
}

}  // namespace cuep::probe
#endif
