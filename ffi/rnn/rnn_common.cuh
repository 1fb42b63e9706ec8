// Device code the recurrence kernels share (rnn_fwd.cu, rnn_bwd.cu): the
// tensor-core fragments, a block's matmul over one chunk of batch rows,
// L2 prefetches and the cell's nonlinearities.
//
// The matmul a step, in both directions: C [M, N] = A [M, K] W_slice^T,
// A row-major in a global exchange buffer (written by every block the step
// before, so read with ld.global.cg: L1 is not coherent across SMs), the
// block's weight slice W_slice [N, K] with K contiguous (shared memory, or
// the streamed variant's global copy: a generic pointer either way), which
// is the col-major B operand of mma.sync.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ffi/common/device.cuh"
#include "ffi/rnn/rnn_plan.h"

namespace jax_dnn {
namespace rnn {

// mma.sync fragments (PTX ISA, "Matrix fragments for mma.m16n8k16" and
// "mma.m16n8k8" .tf32). g = lane / 4, q = lane % 4:
//   A 16 x K row-major: reg 0 (row g), 1 (row g + 8), 2 (row g, k + K/2),
//     3 (row g + 8, k + K/2); 16-bit: elements k = 2q, 2q + 1 packed;
//     tf32: k = q.
//   B K x 8 col-major: reg 0 (col g), 1 (col g, k + K/2), k as for A.
//   C 16 x 8 fp32: c0, c1 (row g, cols 2q, 2q + 1), c2, c3 (row g + 8).
template <typename T>
struct Mma;

template <typename T>
struct Mma16 {  // bf16 / f16: m16n8k16
  static constexpr int kK = 16;
  __device__ __forceinline__ static void LoadA(const T* a, int64_t lda, uint32_t (&f)[4]) {
    const int lane = threadIdx.x & 31;
    const T* p = a + (lane >> 2) * lda + (lane & 3) * 2;
    f[0] = __ldcg(reinterpret_cast<const unsigned*>(p));
    f[1] = __ldcg(reinterpret_cast<const unsigned*>(p + 8 * lda));
    f[2] = __ldcg(reinterpret_cast<const unsigned*>(p + 8));
    f[3] = __ldcg(reinterpret_cast<const unsigned*>(p + 8 * lda + 8));
  }
  __device__ __forceinline__ static void LoadB(const T* w, int64_t ldw, uint32_t (&f)[2]) {
    const int lane = threadIdx.x & 31;
    const T* p = w + (lane >> 2) * ldw + (lane & 3) * 2;
    f[0] = *reinterpret_cast<const uint32_t*>(p);
    f[1] = *reinterpret_cast<const uint32_t*>(p + 8);
  }
};

template <>
struct Mma<__nv_bfloat16> : Mma16<__nv_bfloat16> {
  __device__ __forceinline__ static void Run(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct Mma<__half> : Mma16<__half> {
  __device__ __forceinline__ static void Run(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// fp32 inputs: TF32 tensor cores (m16n8k8), round-to-nearest conversion;
// JAX's default precision for an fp32 matmul on Hopper is TF32 as well.
__device__ __forceinline__ uint32_t ToTf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

template <>
struct Mma<float> {
  static constexpr int kK = 8;
  __device__ __forceinline__ static void LoadA(const float* a, int64_t lda, uint32_t (&f)[4]) {
    const int lane = threadIdx.x & 31;
    const float* p = a + (lane >> 2) * lda + (lane & 3);
    f[0] = ToTf32(__ldcg(p));
    f[1] = ToTf32(__ldcg(p + 8 * lda));
    f[2] = ToTf32(__ldcg(p + 4));
    f[3] = ToTf32(__ldcg(p + 8 * lda + 4));
  }
  __device__ __forceinline__ static void LoadB(const float* w, int64_t ldw, uint32_t (&f)[2]) {
    const int lane = threadIdx.x & 31;
    const float* p = w + (lane >> 2) * ldw + (lane & 3);
    f[0] = ToTf32(p[0]);
    f[1] = ToTf32(p[4]);
  }
  __device__ __forceinline__ static void Run(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// How a chunk of `mtiles` 16-row tiles (1..8) splits over the 8 warps: each
// warp takes one (tile, K slice) item, ksplit slices of K a tile.
__device__ __forceinline__ int KSplit(int mtiles) { return kRnnWarps / mtiles; }

// A block's matmul over one chunk of rows: partial sums of A[rows, K]
// W_slice^T for the NT * 8 columns into red [ksplit, mtiles * 16, ldr]
// (fp32), to be added over the ksplit slices by RedSum. A's rows and K
// are padded with zeros to 16 (the exchange buffers and the weight slices
// are zeroed there), so no bounds checks.
template <typename T, int NT>
__device__ __forceinline__ void ChunkMatmul(const T* a, int64_t lda, int mtiles, const T* w,
                                            int64_t ldw, int64_t k_steps, float* red, int ldr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ksplit = KSplit(mtiles);
  if (warp >= mtiles * ksplit) return;
  const int mt = warp % mtiles, part = warp / mtiles;
  const int64_t per = (k_steps + ksplit - 1) / ksplit;
  const int64_t k0 = part * per;
  const int64_t k1 = k0 + per < k_steps ? k0 + per : k_steps;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  const T* arow = a + int64_t{mt} * 16 * lda;
  // Unrolled so that several A loads (L2 round trips) are in flight: a
  // warp's K slice is often 6 k-steps (H = 768 over 8 warps), so up to 8 at
  // once; fewer where 8+ column tiles keep 32+ accumulators and B fragments
  // live (255 registers and spills at N = 128 unrolled by 4).
  constexpr int kUnroll = NT <= 4 ? 8 : NT < 8 ? 4 : 2;
#pragma unroll kUnroll
  for (int64_t ks = k0; ks < k1; ++ks) {
    const int64_t k = ks * Mma<T>::kK;
    uint32_t fa[4];
    Mma<T>::LoadA(arow + k, lda, fa);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      uint32_t fb[2];
      Mma<T>::LoadB(w + int64_t{nt} * 8 * ldw + k, ldw, fb);
      Mma<T>::Run(acc[nt], fa, fb);
    }
  }
  const int row = part * mtiles * 16 + mt * 16 + (lane >> 2);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = nt * 8 + (lane & 3) * 2;
    *reinterpret_cast<float2*>(red + row * ldr + col) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(red + (row + 8) * ldr + col) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// Row `row` (0 .. mtiles * 16), column `col` of a chunk's matmul: the sum of
// its K slices in a fixed order (deterministic).
__device__ __forceinline__ float RedSum(const float* red, int ldr, int mtiles, int row, int col) {
  const int ksplit = KSplit(mtiles);
  float s = 0.f;
  for (int part = 0; part < ksplit; ++part) s += red[(part * mtiles * 16 + row) * ldr + col];
  return s;
}

// Brings a line into L2 ahead of its use (no registers held, no wait).
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Accurate (not fast-math) nonlinearities, as the fp32 reference computes them.
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Row b's valid length, clamped to [0, T].
__device__ __forceinline__ int64_t RowLength(const int32_t* seq_lengths, int64_t b, int64_t t) {
  const int64_t len = seq_lengths[b];
  return len < 0 ? 0 : len > t ? t : len;
}

// The time index row b visits at processing step s (s < len).
__device__ __forceinline__ int64_t StepTime(int64_t s, int64_t len, bool reverse) {
  return reverse ? len - 1 - s : s;
}

// Loads / stores of one element of the input dtype, widened to fp32.
template <typename T>
__device__ __forceinline__ float LoadF(const T* p) {
  return ToFloat(*p);
}
template <typename T>
__device__ __forceinline__ float LoadCgF(const T* p);
template <>
__device__ __forceinline__ float LoadCgF<float>(const float* p) { return __ldcg(p); }
template <>
__device__ __forceinline__ float LoadCgF<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(__ldcg(p));
}
template <>
__device__ __forceinline__ float LoadCgF<__half>(const __half* p) {
  return __half2float(__ldcg(p));
}

// One cooperative launch of KernelOf<T, G, U>::Get() (all blocks
// co-resident: the plan keeps them <= SMs, else
// cudaErrorCooperativeLaunchTooLarge rather than a hang), dispatched over
// the dtype, the gates of p.kind and the variant's units a block. The
// kernels take (Params, RnnLayout, RnnVariant) by value.
template <template <typename, int, int> class KernelOf, typename Params>
cudaError_t LaunchCooperative(const Params& p, const RnnLayout& l, RnnVariant v,
                              int64_t smem_bytes, cudaStream_t stream) {
  auto launch = [&](auto kernel) -> cudaError_t {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
    if (e != cudaSuccess) return e;
    void* args[] = {const_cast<Params*>(&p), const_cast<RnnLayout*>(&l), &v};
    e = cudaLaunchCooperativeKernel(reinterpret_cast<void*>(kernel),
                                    dim3(static_cast<unsigned>(l.blocks)), dim3(kRnnThreads),
                                    args, static_cast<size_t>(smem_bytes), stream);
    return e != cudaSuccess ? e : cudaGetLastError();
  };
  return DispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    auto units = [&](auto gates) -> cudaError_t {
      constexpr int G = decltype(gates)::value;
      switch (v.units) {
        case 8:
          return launch(KernelOf<T, G, 8>::Get());
        case 16:
          return launch(KernelOf<T, G, 16>::Get());
        case 32:
          return launch(KernelOf<T, G, 32>::Get());
        default:
          return cudaErrorInvalidValue;
      }
    };
    switch (RnnGates(p.kind)) {
      case 4:
        return units(std::integral_constant<int, 4>{});
      case 3:
        return units(std::integral_constant<int, 3>{});
      default:
        return units(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace rnn
}  // namespace jax_dnn
