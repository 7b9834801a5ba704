// Shared by every kernel family: integer types, the constants Python shares with the kernels, and
// the CUEP_* feature macros turned into constexpr bools that the rest reads with `if constexpr`.
// This is the only header that tests __CUDA_ARCH__ or a CUEP_* feature macro; a family's source may
// still use `#if CUEP_ENABLE_SM90_FEATURES` to leave out a whole Hopper-only entry (probe.cu).
//
// Shared values are defined once, in Python (cuep/kernels/common.py and each family's launch
// module), and arrive as CUEP_<NAME> macros (KernelSpec.constants); headers and families give each
// a k-prefixed name and static_assert what the code relies on.
#pragma once

#include <cuda/std/cstdint>

#if !defined(CUEP_ENABLE_SM90_FEATURES) || !defined(CUEP_AGGRESSIVE_PTX) || !defined(CUEP_SOFTWARE_FP8)
#error "the CUEP_* feature macros are set by cuep's JIT (cuep/jit/spec.py); compile through it"
#endif

#if !defined(CUEP_WARP_SIZE) || !defined(CUEP_STATUS_WORDS) || !defined(CUEP_PHASE_BARRIER)
#error "the shared CUEP_* constants come from cuep/kernels/common.py (pass common.CONSTANTS in the family's spec)"
#endif

#if defined(__CUDA_ARCH__) && CUEP_ENABLE_SM90_FEATURES && __CUDA_ARCH__ < 900
#error "CUEP_ENABLE_SM90_FEATURES needs sm_90; other archs build the fallback path"
#endif

namespace cuep {

using cuda::std::int32_t;
using cuda::std::int64_t;
using cuda::std::uint8_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;

// Hopper (sm_90) path: the bulk-copy (TMA) wrappers of ptx.cuh are compiled in (the intranode
// combine_bulk and the benchmark's NVLink ceiling probe use them) and aggressive_ptx may be set. No
// kernel uses cluster launch. Off on other archs and when the fallback is forced.
constexpr bool kEnableSM90Features = CUEP_ENABLE_SM90_FEATURES != 0;
// Read-once data through the non-coherent L1-bypassing path (see ld_nc_global in ptx.cuh).
constexpr bool kAggressivePtx = CUEP_AGGRESSIVE_PTX != 0;
// FP8 e4m3 conversion in software, for archs without FP8 hardware (before sm_89).
constexpr bool kSoftwareFp8 = CUEP_SOFTWARE_FP8 != 0;
// Phase timestamps per block (trace.cuh); a family's own constant, absent (off) unless asked for.
#ifndef CUEP_TRACE
#define CUEP_TRACE 0
#endif
constexpr bool kTrace = CUEP_TRACE != 0;

constexpr int kWarpSize = CUEP_WARP_SIZE;
static_assert(kWarpSize == 32, "lane masks (kFullWarpMask, __ballot_sync) assume 32 lanes");
constexpr uint32_t kFullWarpMask = 0xffffffffu;
// Largest block CUDA allows; sizes per-warp scratch arrays in shared memory.
constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;
// FP8 channels per float32 scale (per-128-channel scales, as DeepEP's).
constexpr int kScaleBlock = CUEP_SCALE_BLOCK;

// Layout of the int32 status words a kernel fills when something goes wrong on the device (a
// bounded wait gave up, a caller's bad input); the host reads them after the stream completes and
// raises (cuep/kernels/status.py defines and names them).
constexpr int kStatusTimedOut = CUEP_STATUS_TIMED_OUT;          // 0 = fine, 1 = a wait timed out
constexpr int kStatusPeer = CUEP_STATUS_PEER;                   // the rank that never arrived
constexpr int kStatusPhase = CUEP_STATUS_PHASE;                 // which wait (kPhase* below)
constexpr int kStatusOverflow = CUEP_STATUS_OVERFLOW;           // rows beyond num_worst_tokens
constexpr int kStatusBadExpertIds = CUEP_STATUS_BAD_EXPERT_IDS; // the call (kBadIds*) that met an id outside [-1, E)
constexpr int kStatusRoundTokens = CUEP_STATUS_ROUND_TOKENS;    // across nodes: a batch beyond a one-round dispatch
constexpr int kStatusSelfMasked = CUEP_STATUS_SELF_MASKED;      // shrink mode: the peers masked this rank
constexpr int kStatusBadExpertIdLow = CUEP_STATUS_BAD_EXPERT_ID_LOW;    // that id's low 32 bits
constexpr int kStatusBadExpertIdHigh = CUEP_STATUS_BAD_EXPERT_ID_HIGH;  // and its high 32 bits
constexpr int kStatusBadExpertLimit = CUEP_STATUS_BAD_EXPERT_LIMIT;     // that call's num_experts
constexpr int kStatusCallOrder = CUEP_STATUS_CALL_ORDER;                // low latency: the rule (kCallOrder*) broken
constexpr int kStatusCallOrderCall = CUEP_STATUS_CALL_ORDER_CALL;       // the call that broke it
constexpr int kStatusCallOrderPeer = CUEP_STATUS_CALL_ORDER_PEER;       // the peer that overtook it, or -1
constexpr int kStatusWords = CUEP_STATUS_WORDS;
static_assert(kStatusTimedOut < kStatusWords && kStatusPeer < kStatusWords && kStatusPhase < kStatusWords &&
              kStatusOverflow < kStatusWords && kStatusBadExpertIds < kStatusWords &&
              kStatusRoundTokens < kStatusWords && kStatusSelfMasked < kStatusWords &&
              kStatusBadExpertIdLow < kStatusWords && kStatusBadExpertIdHigh < kStatusWords &&
              kStatusBadExpertLimit < kStatusWords && kStatusCallOrder < kStatusWords &&
              kStatusCallOrderCall < kStatusWords && kStatusCallOrderPeer < kStatusWords,
              "a status word outside the status array");
// Which call met an out-of-range expert id (the value of word kStatusBadExpertIds; never 0).
constexpr int kBadIdsLowLatency = CUEP_BAD_IDS_LOW_LATENCY;
constexpr int kBadIdsLayout = CUEP_BAD_IDS_LAYOUT;

// Which wait timed out (status[kStatusPhase]); cuep/kernels/status.py (Phase) names them.
constexpr int kPhaseBarrier = CUEP_PHASE_BARRIER;
constexpr int kPhaseLowLatencyRouting = CUEP_PHASE_LOW_LATENCY_ROUTING;  // a source's routing table
constexpr int kPhaseLowLatencyToken = CUEP_PHASE_LOW_LATENCY_TOKEN;      // a dispatched token
constexpr int kPhaseLowLatencyWeights = CUEP_PHASE_LOW_LATENCY_WEIGHTS;  // a source's top-k weights
constexpr int kPhaseLowLatencyPartial = CUEP_PHASE_LOW_LATENCY_PARTIAL;  // a combined partial sum
constexpr int kPhaseIntranodeStaged = CUEP_PHASE_INTRANODE_STAGED;       // a sender's staged tokens
constexpr int kPhaseIntranodeReuse = CUEP_PHASE_INTRANODE_REUSE;         // receivers done with the last dispatch
constexpr int kPhaseIntranodeStarted = CUEP_PHASE_INTRANODE_STARTED;     // a peer starting the same call
constexpr int kPhaseIntranodeArrival = CUEP_PHASE_INTRANODE_ARRIVAL;     // a combined row's arrival
constexpr int kPhaseIntranodePushed = CUEP_PHASE_INTRANODE_PUSHED;       // a pushed row's arrival
constexpr int kPhaseInternodeCounts = CUEP_PHASE_INTERNODE_COUNTS;       // a source's count message
constexpr int kPhaseInternodeRows = CUEP_PHASE_INTERNODE_ROWS;           // a chunk of rows at a forwarder
constexpr int kPhaseInternodePushed = CUEP_PHASE_INTERNODE_PUSHED;       // a local rank's combine pushes
constexpr int kPhaseInternodePartials = CUEP_PHASE_INTERNODE_PARTIALS;   // a node's partial sums
constexpr int kPhaseInternodeReleased = CUEP_PHASE_INTERNODE_RELEASED;   // a peer done with the last round

}  // namespace cuep
