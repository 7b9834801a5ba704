"""What a GEMM loses when a kernel beside it holds some SMs and does nothing else, or only copies memory: the part of
the overlap's cost that no communication protocol can remove, measured on one GPU with no ranks.

    python benchmarks/gemm_beside_held_sms.py --sms 8,16,24

A *holder* kernel takes ``--sms`` blocks, each alone on its SM (512 threads and all the shared memory a block may
have), for ``--hold-us``, which must outlast the GEMM (the script checks). It is launched in one of three forms:

- ``plain``: one block after another, as cuep's kernels launch;
- ``pairs``: in clusters of two blocks (``__cluster_dims__``), which the GPU places in one GPC, as DeepEP V1 launches
  its normal-mode kernels;
- ``copy``: plain, but the blocks copy a region of ``--copy-mib`` of device memory over and over, a slice each (no
  NVLink, no polling): the HBM and L2 traffic of a kernel that moves data at that SM count.

Beside it, on another stream and enqueued after it, a BF16 GEMM of 8192 x 7168 x 2048 (``torch.matmul``, sized for
the whole GPU, as ``benchmarks/overlap_a2a.py`` runs it; ``cuep.bench --mode overlap`` runs the same shape through
CuPy's cuBLAS handle). For each SM count the
variants (the GEMM alone, then beside each form) are timed in turn, iteration after iteration, after ``--warmup``
rounds; the script prints the medians of ``--iters`` and each one's slowdown against the GEMM alone in the same row,
and, with ``--show-sms``, which SMs each form's blocks landed on.
"""

from __future__ import annotations

import argparse
import statistics

import cupy
import torch

from cuep.bench import OVERLAP_GEMM

THREADS = 512

SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void hold(long long ns, int4* dst, const int4* src, long long num_vectors,
                                     int* sm_of_block) {
    extern __shared__ int4 reserved[];  // unused: it keeps every other block off this SM
    const unsigned long long start = now_ns();
    if (threadIdx.x == 0) {
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        sm_of_block[blockIdx.x] = static_cast<int>(sm);
    }
    if (num_vectors == 0) {
        if (threadIdx.x == 0)
            while (now_ns() - start < static_cast<unsigned long long>(ns))
                __nanosleep(500);
        __syncthreads();
        return;
    }
    // Each block copies its own slice of the region, round and round, and looks at the time every 2 MiB it moves.
    const long long per_block = num_vectors / gridDim.x;
    const int4* from = src + per_block * blockIdx.x;
    int4* to = dst + per_block * blockIdx.x;
    long long i = threadIdx.x;
    while (now_ns() - start < static_cast<unsigned long long>(ns)) {
        for (int step = 0; step < 256; ++step) {
            to[i] = from[i];
            i += blockDim.x;
            if (i >= per_block)
                i = threadIdx.x;
        }
    }
}

extern "C" __global__ void __launch_bounds__(512, 1)
hold_plain(long long ns, int4* dst, const int4* src, long long num_vectors, int* sm_of_block) {
    hold(ns, dst, src, num_vectors, sm_of_block);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512, 1)
hold_pairs(long long ns, int4* dst, const int4* src, long long num_vectors, int* sm_of_block) {
    hold(ns, dst, src, num_vectors, sm_of_block);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", default="8,16,24", help="SM counts the holder takes, comma-separated, each even")
    parser.add_argument("--hold-us", type=float, default=1500.0, help="how long the holder holds its SMs")
    parser.add_argument("--copy-mib", type=int, default=256, help="the region the copy form reads and writes")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--show-sms", action="store_true", help="print the SMs each form's blocks landed on")
    args = parser.parse_args()
    sms_list = [int(s) for s in args.sms.split(",")]
    device = cupy.cuda.Device(torch.cuda.current_device())
    device_sms = device.attributes["MultiProcessorCount"]
    if any(s <= 0 or s % 2 or s >= device_sms for s in sms_list):
        raise ValueError(f"--sms: each count must be positive, even and below this GPU's {device_sms} SMs")
    for name, value, least in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                               ("--copy-mib", args.copy_mib, 1), ("--hold-us", args.hold_us, 1)):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if int(device.compute_capability) < 90:
        raise RuntimeError(f"the pairs form launches in clusters, which need sm_90 or newer; this GPU is "
                           f"sm_{device.compute_capability}")

    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    # All the shared memory a block may have: more than half an SM's, so no other block shares the SM with it.
    shared_bytes = device.attributes["MaxSharedMemoryPerBlockOptin"]
    kernels = {}
    for name in ("hold_plain", "hold_pairs"):
        kernels[name] = module.get_function(name)
        kernels[name].max_dynamic_shared_size_bytes = shared_bytes
    region_vectors = args.copy_mib * 2**20 // 16
    if region_vectors // max(sms_list) < THREADS:
        raise ValueError(f"--copy-mib: {args.copy_mib} MiB leaves each of {max(sms_list)} blocks less than one "
                         f"16-byte vector per thread")
    src = cupy.zeros(region_vectors * 4, dtype=cupy.int32)
    dst = cupy.empty_like(src)
    sm_of_block = cupy.full(max(sms_list), -1, dtype=cupy.int32)
    forms = {"plain": ("hold_plain", 0), "pairs": ("hold_pairs", 0), "copy": ("hold_plain", region_vectors)}

    m, k, n = OVERLAP_GEMM
    a = torch.ones((m, k), dtype=torch.bfloat16, device="cuda")
    b = torch.ones((k, n), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    holder_stream, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    holder_cupy = cupy.cuda.Stream.from_external(holder_stream)

    def timed(form: str | None, sms: int) -> float:
        """The GEMM's time, in us, beside the holder in ``form`` on ``sms`` SMs (alone for None)."""
        torch.cuda.synchronize()
        start, end, held_until = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if form is not None:
            name, vectors = forms[form]
            kernels[name]((sms,), (THREADS,), (cupy.int64(args.hold_us * 1e3), dst, src, cupy.int64(vectors),
                                                sm_of_block), shared_mem=shared_bytes, stream=holder_cupy)
            held_until.record(holder_stream)
        start.record(compute)
        torch.matmul(a, b, out=out)
        end.record(compute)
        torch.cuda.synchronize()
        if form is not None and start.elapsed_time(held_until) < start.elapsed_time(end):
            raise RuntimeError(f"--hold-us: the {form} holder let its SMs go before the GEMM ended; hold them longer")
        return start.elapsed_time(end) * 1e3

    variants = [None, "plain", "pairs", "copy"]
    print(f"GEMM {m}x{k}x{n} BF16 beside a holder of N SMs for {args.hold_us:.0f} us on a {device_sms}-SM GPU; "
          f"medians of {args.iters} (us), slowdown against the GEMM alone in the same row")
    print(f"{'SMs':>4s} {'alone':>8s} " + " ".join(f"{form:>18s}" for form in variants[1:]))
    for sms in sms_list:
        samples = {form: [] for form in variants}
        for i in range(args.warmup + args.iters):
            for form in variants:
                sample = timed(form, sms)
                if i >= args.warmup:
                    samples[form].append(sample)
        medians = {form: statistics.median(samples[form]) for form in variants}
        alone = medians[None]
        print(f"{sms:4d} {alone:8.1f} " + " ".join(f"{medians[f]:9.1f} ({medians[f] / alone - 1:+6.1%})"
                                                   for f in variants[1:]), flush=True)
        if args.show_sms:
            for form in variants[1:]:
                timed(form, sms)
                print(f"     {form}: SMs {sorted(sm_of_block[:sms].get().tolist())}")


if __name__ == "__main__":
    main()
