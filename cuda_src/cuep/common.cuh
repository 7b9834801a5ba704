// Shared by every kernel family: integer types, named constants, and the CUEP_* feature macros
// (set by the JIT, see cuep/jit/spec.py) turned into constexpr bools that the rest reads with
// `if constexpr`. This is the only header that tests __CUDA_ARCH__ or a CUEP_* feature macro.
#pragma once

#include <cuda/std/cstdint>

#if !defined(CUEP_ENABLE_SM90_FEATURES) || !defined(CUEP_AGGRESSIVE_PTX) || !defined(CUEP_SOFTWARE_FP8)
#error "the CUEP_* feature macros are set by cuep's JIT (cuep/jit/spec.py); compile through it"
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

// Hopper path: TMA bulk copies, cluster launch. Off on Ampere and when the fallback is forced.
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

constexpr int kWarpSize = 32;
constexpr uint32_t kFullWarpMask = 0xffffffffu;
// Largest block CUDA allows; sizes per-warp scratch arrays in shared memory.
constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;

// Layout of the int32 status words a kernel fills when a bounded wait gives up; the host reads
// them after the stream completes and raises PeerTimeoutError (cuep/kernels/status.py mirrors it).
constexpr int kStatusTimedOut = 0;  // 0 = fine, 1 = a wait timed out
constexpr int kStatusPeer = 1;      // the rank that never arrived
constexpr int kStatusPhase = 2;     // which wait (kPhase* below)
constexpr int kStatusOverflow = 3;  // rows a dispatch needed beyond the num_worst_tokens it was given
constexpr int kStatusBadExpertIds = 4;  // top-k ids outside [-1, num_experts) that a kernel ignored
constexpr int kStatusLandingRows = 5;   // rows a push dispatch had to land on one rank, beyond its buffer
constexpr int kStatusWords = 6;

// Which wait timed out (status[kStatusPhase]); cuep/kernels/status.py names them.
constexpr int kPhaseBarrier = 1;
constexpr int kPhaseLowLatencyRouting = 2;  // a source's routing table (low-latency dispatch)
constexpr int kPhaseLowLatencyToken = 3;    // a dispatched token
constexpr int kPhaseLowLatencyWeights = 4;  // a source's top-k weights (low-latency combine)
constexpr int kPhaseLowLatencyPartial = 5;  // a combined partial sum
constexpr int kPhaseIntranodeStaged = 6;    // a sender's staged tokens (intranode dispatch)
constexpr int kPhaseIntranodeReuse = 7;     // receivers done with the previous dispatch (intranode)
constexpr int kPhaseIntranodeStarted = 8;   // a peer starting the same call (intranode dispatch or combine)
constexpr int kPhaseIntranodeArrival = 9;   // a combined row's arrival (intranode combine)
constexpr int kPhaseIntranodePushed = 11;   // a pushed row's arrival (intranode dispatch)

}  // namespace cuep
