// Device code the recurrence kernels share (rnn_fwd.cu, rnn_bwd.cu): the
// tensor-core fragments, a block's matmul over one chunk of batch rows,
// L2 prefetches and the cell's nonlinearities.
//
// The matmul a step, in both directions: C [M, N] = A [M, K] W_slice^T,
// A row-major in a global exchange buffer (written by every block the step
// before, so read with ld.global.cg: L1 is not coherent across SMs), the
// block's weight slice W_slice [N, K] with K contiguous (shared memory, or
// the streamed variant's global copy: a generic pointer either way), which
// is the col-major B operand of mma.sync. Both are read in 16-byte vectors
// (see ChunkMatmul), so K and the rows' pitches are multiples of 64 bytes.
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
  __device__ __forceinline__ static uint32_t Operand(uint32_t word) { return word; }
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
  __device__ __forceinline__ static uint32_t Operand(uint32_t word) {
    return ToTf32(__uint_as_float(word));
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

// Elements of T in 64 bytes: the K granule of the matmul (a pair of
// k-steps, see ChunkMatmul), to which K and the row pitches are padded.
template <typename T>
constexpr int PairElems() {
  return 64 / static_cast<int>(sizeof(T));
}

// A block's matmul over one chunk of rows: partial sums of A[rows, K]
// W_slice^T for the NT * 8 columns into red [ksplit, mtiles * 16, ldr]
// (fp32), to be added over the ksplit slices by RedSum. A's rows and K
// are padded with zeros (the exchange buffers and the weight slices are
// zeroed there), so no bounds checks.
//
// K goes in pairs of k-steps, 64 bytes of a row, of which lane q (= lane %
// 4) loads the 16 bytes at 16 q as one vector: rows g and g + 8 of A
// (ld.global.cg.v4) and row g of the weight slice. Its 4 words are the
// fragments' k-slots of both k-steps (words 0, 1 of the first, 2, 3 of the
// second), so the k-steps see the columns in another order than the
// fragment layout's, the same for A and B: the dot products are unchanged.
// The vectors use whole 32-byte sectors, where the layout's own 4-byte
// reads use half of each (two reads a sector, L2 serving both).
// Each block starts its warps' K slices at a different pair (blockIdx
// rotates them), so that the ~100 blocks reading one exchange buffer at
// once spread over L2's slices instead of queueing on the same lines.
template <typename T, int NT>
__device__ __forceinline__ void ChunkMatmul(const T* a, int64_t lda, int mtiles, const T* w,
                                            int64_t ldw, int64_t k_pairs, float* red, int ldr) {
  constexpr int kPair = PairElems<T>(), kVec = kPair / 4;  // elements a pair, a vector
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ksplit = KSplit(mtiles);
  if (warp >= mtiles * ksplit) return;
  const int mt = warp % mtiles, part = warp / mtiles;
  const int64_t per = (k_pairs + ksplit - 1) / ksplit;
  const int64_t k0 = part * per;
  const int64_t n = (k0 + per < k_pairs ? k0 + per : k_pairs) - k0;  // pairs of this warp
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  const int g = lane >> 2, q = lane & 3;
  const T* a_lo = a + (int64_t{mt} * 16 + g) * lda + q * kVec;
  const T* a_hi = a_lo + 8 * lda;
  const T* w_q = w + int64_t{g} * ldw + q * kVec;
  const int64_t rot = n > 0 ? blockIdx.x % n : 0;
  // Pairs whose A vectors load together (several L2 round trips in
  // flight), fewer where more column tiles keep more accumulators live.
  constexpr int kBatch = NT <= 2 ? 6 : NT <= 4 ? 4 : 2;
  for (int64_t j0 = 0; j0 < n; j0 += kBatch) {
    uint4 lo[kBatch], hi[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j >= n) break;
      int64_t kp = j0 + j + rot;
      kp = k0 + (kp >= n ? kp - n : kp);
      lo[j] = __ldcg(reinterpret_cast<const uint4*>(a_lo + kp * kPair));
      hi[j] = __ldcg(reinterpret_cast<const uint4*>(a_hi + kp * kPair));
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j >= n) break;
      int64_t kp = j0 + j + rot;
      kp = k0 + (kp >= n ? kp - n : kp);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w_q + int64_t{nt} * 8 * ldw + kp * kPair);
        const uint32_t a0[4] = {Mma<T>::Operand(lo[j].x), Mma<T>::Operand(hi[j].x),
                                Mma<T>::Operand(lo[j].y), Mma<T>::Operand(hi[j].y)};
        const uint32_t b0[2] = {Mma<T>::Operand(wv.x), Mma<T>::Operand(wv.y)};
        Mma<T>::Run(acc[nt], a0, b0);
        const uint32_t a1[4] = {Mma<T>::Operand(lo[j].z), Mma<T>::Operand(hi[j].z),
                                Mma<T>::Operand(lo[j].w), Mma<T>::Operand(hi[j].w)};
        const uint32_t b1[2] = {Mma<T>::Operand(wv.z), Mma<T>::Operand(wv.w)};
        Mma<T>::Run(acc[nt], a1, b1);
      }
    }
  }
  const int row = part * mtiles * 16 + mt * 16 + g;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int col = nt * 8 + q * 2;
    *reinterpret_cast<float2*>(red + row * ldr + col) = make_float2(acc[nt][0], acc[nt][1]);
    *reinterpret_cast<float2*>(red + (row + 8) * ldr + col) = make_float2(acc[nt][2], acc[nt][3]);
  }
}

// Row `row` (0 .. mtiles * 16), column `col` of a chunk's matmul: the sum of
// its K slices in a fixed order (deterministic). Unrolled over the most
// slices there can be, so that the loads issue together instead of one
// shared-memory round trip after another (a runtime-bounded loop: ~35
// cycles a slice, on the critical path of every step).
__device__ __forceinline__ float RedSum(const float* red, int ldr, int mtiles, int row, int col) {
  const int ksplit = KSplit(mtiles);
  float v[kRnnWarps];
#pragma unroll
  for (int part = 0; part < kRnnWarps; ++part)
    v[part] = part < ksplit ? red[(part * mtiles * 16 + row) * ldr + col] : 0.f;
  float s = 0.f;
#pragma unroll
  for (int part = 0; part < kRnnWarps; ++part) s += v[part];
  return s;
}

// Brings a line into L2 ahead of its use (no registers held, no wait).
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The cell's nonlinearities from one MUFU.EX2 and one MUFU.RCP each
// (device.cuh), as the activations' sigmoid: absolute error ~1e-7, far
// below the inputs' rounding (TF32 at best), where expf, IEEE division
// and tanhf made a chain of ~60 dependent instructions on each step's
// critical path (one (row, unit) a thread at B * U <= 256).
// Large |x|: exp2 overflows to inf or flushes to 0, giving 0 or 1 (-1, 1).
__device__ __forceinline__ float Sigmoid(float x) {
  return FastRcp(1.f + FastExp2(-1.4426950408889634f * x));
}
__device__ __forceinline__ float Tanh(float x) { return 2.f * Sigmoid(2.f * x) - 1.f; }

// The rows' valid lengths, clamped to [0, T]: a copy in shared memory
// [B], read every step, where the global array's line left L1 within a few
// steps and cost an L2 round trip (~700 cycles) at the head of each step's
// chain of dependent loads; the variants with the per-row state in the
// workspace (large batches, where B ints may not fit) read the global one.
struct Lengths {
  const int* smem;  // nullptr: read `global`
  const int32_t* global;
  int64_t t;

  // Fills the shared copy (the whole block; a barrier before first use).
  __device__ __forceinline__ void Load(int64_t batch, int* dst) {
    smem = dst;
    if (dst == nullptr) return;
    for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) dst[b] = static_cast<int>(Clamp(b));
  }
  __device__ __forceinline__ int64_t Clamp(int64_t b) const {
    const int64_t len = global[b];
    return len < 0 ? 0 : len > t ? t : len;
  }
  __device__ __forceinline__ int64_t operator[](int64_t b) const {
    return smem != nullptr ? smem[b] : Clamp(b);
  }
};

// A block's direction in a launch over `directions` (rnn.h): blocks
// [d nb, (d + 1) nb) run direction d (nb = l.blocks), direction 1 in
// reverse; `block` is the block's index within its direction, which owns
// hidden units [block U, (block + 1) U).
struct Direction {
  int d;
  int64_t block;
  bool reverse;
};
__device__ __forceinline__ Direction ThisDirection(const RnnLayout& l, bool reverse) {
  const int d = static_cast<int>(blockIdx.x / l.blocks);
  return {d, int64_t{blockIdx.x} - d * l.blocks, reverse || d == 1};
}

// The time index row b visits at processing step s (s < len).
__device__ __forceinline__ int64_t StepTime(int64_t s, int64_t len, bool reverse) {
  return reverse ? len - 1 - s : s;
}

// One read-only element (the kernel's inputs), widened to fp32, as an
// asm volatile load: the compiler keeps it where it is written, ahead of
// the step's matmul (mma.sync is asm volatile too), instead of sinking it
// to its use after the matmul, which exposed its whole latency (an L2 or
// HBM round trip, ~1000 cycles) in every step.
template <typename T>
__device__ __forceinline__ float LoadNc(const T* p) {
  if constexpr (sizeof(T) == 4) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
  } else {
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return ToFloat(*reinterpret_cast<const T*>(&v));
  }
}

// A grid barrier a step, split in two. The caller has just passed a
// __syncthreads() (so the block's exchange writes precede thread 0's
// release); GridArrive publishes them and counts the block in with one
// release reduction (as CUTLASS's generic barrier: no separate fence, no
// returned value; timed equal to fence + atomicAdd, outputs bit-identical);
// GridWait returns once every block of the direction has arrived `target`
// times in all (each direction counts on its own counter, in its slice of
// the workspace, so two directions never wait on each other). Between the two a block
// does what depends on no other block: the stores of its own outputs of the
// step and the next step's input loads, which cg::grid_group::sync() would
// put in series with the barrier's fence and polling (LSTM B = 16, H = 768
// bf16 on an H200: the barrier ~2100 cycles a step, the stores and loads
// ~1000 more). The counter (the workspace's, 64-bit: it only grows) is zeroed
// before the kernel's one cooperative grid.sync().
__device__ __forceinline__ void GridArrive(unsigned long long* counter) {
  if (threadIdx.x == 0)  // release: cumulative over what the block's barrier ordered before it
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ void GridWait(const unsigned long long* counter,
                                         unsigned long long target) {
  if (threadIdx.x == 0) {
    unsigned long long v;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
    } while (v < target);
  }
  __syncthreads();
}

// One cooperative launch of KernelOf<T, G, U>::Get() over p.directions x
// l.blocks blocks (all co-resident: the plan keeps them <= SMs, else
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
                                    dim3(static_cast<unsigned>(l.blocks * p.directions)),
                                    dim3(kRnnThreads),
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
