// Network puts, written once for the families that send over NVSHMEM (low_latency.cu, internode.cu).
//
// Those families have two builds. Across hosts (CUEP_NETWORK, chosen when a Buffer's ranks span several
// hosts) they compile without NVSHMEM_ENABLE_ALL_DEVICE_INLINING and link NVSHMEM's transfer code from
// libnvshmem_device.a, so NVSHMEM picks IBGDA (GPU-initiated RDMA) or a proxy transport per peer at run
// time, and P2P where a peer is reachable by loads and stores. On one host they inline NVSHMEM's
// device code whole, as before: every peer is a P2P peer there, and a kernel that calls out of line
// keeps its registers across the call on its NVLink path too, which costs that path time. (Inlined
// under NVRTC, NVSHMEM compiles IBGDA out and a remote put goes through the proxy.)
//
// NVSHMEM 3.8's archive does not carry the put-with-signal transfer code
// (nvshmemi_transfer_put_signal_dispatch is undefined at link), so a message and its signal go as a
// put, a fence, then a signal: nvshmem_fence orders the delivery of this PE's operations to one
// destination PE on every transport, so the signal can never land before the data it announces,
// however the network routes the packets (adaptive routing may reorder them; the fence is what keeps
// the order, not the order of issue).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cuep/common.cuh>

namespace cuep {

// Put `bytes` at `src` (this rank's symmetric memory) to `dst` on `pe`, then set `signal` there to
// `value` once they have landed. Called by every lane of one warp (the put is warp-collective); lane
// 0 issues the fence and the signal. The caller makes the source bytes visible first (its team's
// barrier, and a system fence where other warps wrote them). Static, as the relocatable families'
// helpers are (low_latency.cu says why).
static __device__ __forceinline__ void put_then_signal_warp(void* dst, const void* src, size_t bytes,
                                                            uint64_t* signal, uint64_t value, int pe) {
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
    __syncwarp();
    if (threadIdx.x % kWarpSize == 0) {
        nvshmem_fence();
        nvshmemx_signal_op(signal, value, NVSHMEM_SIGNAL_SET, pe);
    }
    __syncwarp();
}

}  // namespace cuep
