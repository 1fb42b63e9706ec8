// A multi-stage shared-memory pipeline that streams rows into shared memory
// with Hopper's bulk copy engine (cp.async.bulk, completing on an mbarrier).
//
// Why: a row kernel that loads its row into registers holds those registers
// while the load is in flight, so occupancy caps how many bytes are in flight
// (seen: ~50% of DRAM bandwidth at 48% occupancy, ncu on an H200). Bulk copies
// land in shared memory without registers or per-thread instructions, kStages
// row groups ahead, so the memory system stays busy while the block reduces
// and writes the current group.
//
// Use: one block walks iterations k = 0, 1, ...; iteration k reads kArrays
// row groups (e.g. x and dy), each `bytes` long from a global address.
// Start(issue) primes kStages iterations; per iteration every thread calls
// Wait(k), reads the stage (Row), then Advance(k, issue), which refills the
// stage with iteration k + kStages.
// Requirements: bytes % 16 == 0 and 16-byte-aligned global addresses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/device_info.h"
#include "ffi/common/row_team.cuh"

namespace jax_dnn {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kStages, int kArrays>
struct BulkRowPipeline {
  uint64_t* bars;   // [kStages] mbarriers
  char* data;       // [kStages][kArrays][stage_bytes]
  uint32_t stage_bytes;

  // Shared memory the pipeline needs (the barriers, then 128-byte-aligned stages).
  static __host__ __device__ size_t SmemBytes(uint32_t stage_bytes) {
    return 128 + static_cast<size_t>(kStages) * kArrays * Round(stage_bytes);
  }
  static __host__ __device__ uint32_t Round(uint32_t b) { return (b + 127u) & ~127u; }

  __device__ BulkRowPipeline(char* smem, uint32_t max_bytes)
      : bars(reinterpret_cast<uint64_t*>(smem)), data(smem + 128), stage_bytes(Round(max_bytes)) {}

  // Thread 0 only; the caller syncs the block afterwards.
  __device__ void Init() {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(&bars[s])));
    // Make the initialized barriers visible to the async (copy engine) proxy.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }

  __device__ char* Stage(int k, int a) const {
    return data + (static_cast<size_t>(k % kStages) * kArrays + a) * stage_bytes;
  }

  // Thread 0 only: starts iteration k's copies (src[a], `bytes` each).
  __device__ void Issue(int k, const void* const (&src)[kArrays], uint32_t bytes) {
    uint64_t* bar = &bars[k % kStages];
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(SmemAddr(bar)), "r"(bytes * kArrays) : "memory");
    for (int a = 0; a < kArrays; ++a) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(SmemAddr(Stage(k, a))), "l"(src[a]), "r"(bytes), "r"(SmemAddr(bar))
          : "memory");
    }
  }

  // Every thread: blocks until iteration k's copies have landed.
  __device__ void Wait(int k) const {
    const uint32_t bar = SmemAddr(&bars[k % kStages]);
    const uint32_t parity = (k / kStages) & 1;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p;\n"
          "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          "  selp.u32 %0, 1, 0, p; }"
          : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
  }

  // Thread 0 only: starts iteration k's copies of `count` consecutive rows of
  // `width` elements from each array, beginning at row `first`.
  template <typename T>
  __device__ void IssueRows(int k, const T* const (&arrays)[kArrays], int64_t first, int64_t count,
                            int64_t width) {
    const void* src[kArrays];
    for (int a = 0; a < kArrays; ++a) src[a] = arrays[a] + first * width;
    Issue(k, src, static_cast<uint32_t>(count * width * static_cast<int64_t>(sizeof(T))));
  }

  // Row `row` of array a's stage for iteration k (rows of `width` elements).
  template <typename T>
  __device__ const T* Row(int k, int a, int row, int64_t width) const {
    return reinterpret_cast<const T*>(Stage(k, a)) + row * width;
  }

  // Every thread: thread 0 initializes the barriers and starts iterations
  // 0 .. kStages - 1 through issue(k) (which does nothing past the block's
  // last iteration).
  template <typename IssueFn>
  __device__ void Start(IssueFn issue) {
    if (threadIdx.x == 0) {
      Init();
      for (int k = 0; k < kStages; ++k) issue(k);
    }
    __syncthreads();
  }

  // Every thread, after its last read of iteration k's stage: the block
  // syncs, and thread 0 refills the stage with iteration k + kStages. The
  // proxy fence orders the generic-proxy reads before the copy engine's writes.
  template <typename IssueFn>
  __device__ void Advance(int k, IssueFn issue) {
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(k + kStages);
    }
  }
};

// Launches a row kernel over `rows` rows grouped `teams_per_block` to a block.
// The pipelined variant (a persistent grid, rows streamed into shared memory
// kStages groups ahead) runs when `use_pipe` and its stages fit `smem_budget`;
// otherwise the plain variant (one block per row group, rows read straight into
// registers).
template <int kStages, int kArrays, typename Params>
cudaError_t LaunchRowKernel(void (*pipelined)(Params), void (*plain)(Params), bool use_pipe,
                            size_t smem_budget, int block, int teams_per_block, int64_t rows,
                            int64_t row_bytes, const Params& p, cudaStream_t stream) {
  const int64_t groups = (rows + teams_per_block - 1) / teams_per_block;
  const size_t smem = BulkRowPipeline<kStages, kArrays>::SmemBytes(
      static_cast<uint32_t>(teams_per_block * row_bytes));
  if (use_pipe && row_bytes % 16 == 0 && smem <= smem_budget) {
    unsigned grid = 0;
    cudaError_t e = PersistentGrid(pipelined, block, smem, groups, &grid);
    if (e != cudaSuccess) return e;
    pipelined<<<grid, block, smem, stream>>>(p);
  } else {
    plain<<<RowGrid(teams_per_block, rows), block, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace jax_dnn
