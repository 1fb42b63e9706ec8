// Batch norm's one kernel template, in four modes (see batch_norm.h), and its
// launcher; batch_norm_fwd.cu and batch_norm_bwd.cu instantiate them.
//
// Layout: a block is kBatchNormThreads threads, `cols` across a tile of
// channels (V adjacent channels a thread: 16-byte loads where C allows) by
// `lanes` rows (BatchNormTileFor); the grid is (channel tiles, row parts,
// parameter sets). A thread keeps its channels' per-channel coefficients in
// registers and walks the rows of its part with a stride of `lanes`, four
// rows' loads in flight before it uses any (memory-bound: every mode moves
// one to three x-sized tensors and does a few flops an element). The reductions add
// each thread's rows in fp32 registers, then the block's lanes in index order
// through shared memory, into one row of partials [G, parts, 2, C]; column_sum
// adds the parts in a fixed order. No atomics: deterministic.
//
// Offsets are 64-bit (rows * C may pass 2^31).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ffi/activation/activation_math.cuh"
#include "ffi/batch_norm/batch_norm.h"
#include "ffi/common/column_sum.h"
#include "ffi/common/device.cuh"
#include "ffi/common/device_info.h"

namespace jax_dnn {

enum class BatchNormMode { kStats, kFwd, kBwdStats, kBwd };

template <int kAct>
__device__ __forceinline__ float BatchNormAct(float z) {
  if constexpr (kAct == kBatchNormNoActivation) {
    return z;
  } else {
    return Act<static_cast<Activation>(kAct)>(z);
  }
}

template <int kAct>
__device__ __forceinline__ float BatchNormActGrad(float z) {
  if constexpr (kAct == kBatchNormNoActivation) {
    return 1.f;
  } else {
    return ActGrad<static_cast<Activation>(kAct)>(z);
  }
}

// Rows a thread loads before it uses any: four for the statistics (one
// tensor), two where two or three tensors are loaded a row (register
// budget: BatchNormMinBlocks).
template <BatchNormMode kMode>
constexpr int BatchNormUnroll() {
  return kMode == BatchNormMode::kStats ? 4 : 2;
}

// Bytes a thread's vector: 16 in the forward; 8 in the backward, whose six
// per-channel coefficients a channel would otherwise take 48 registers.
template <BatchNormMode kMode>
constexpr int BatchNormVectorBytes() {
  return kMode == BatchNormMode::kStats || kMode == BatchNormMode::kFwd ? 16 : 8;
}

// Blocks an SM the register budget leaves room for: four (64 registers) in
// the forward (where only the bf16 exact GELU spills, 16 bytes); three (85)
// in the backward, whose exact GELU spilled at 64.
template <BatchNormMode kMode>
constexpr int BatchNormMinBlocks() {
  return kMode == BatchNormMode::kStats || kMode == BatchNormMode::kFwd ? 4 : 3;
}

template <typename T, int V>
__device__ __forceinline__ void Widen(const Packed<T, V>& pack, float (&out)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = ToFloat(pack.v[i]);
}

template <typename T, int V, BatchNormMode kMode, int kAct>
__global__ void __launch_bounds__(kBatchNormThreads, BatchNormMinBlocks<kMode>())
    BatchNormKernel(BatchNormParams p, int cols) {
  using Pack = Packed<T, V>;
  constexpr bool kBwd = kMode == BatchNormMode::kBwdStats || kMode == BatchNormMode::kBwd;
  constexpr bool kReduce = kMode == BatchNormMode::kStats || kMode == BatchNormMode::kBwdStats;
  constexpr int kUnroll = BatchNormUnroll<kMode>();
  const int col = threadIdx.x % cols;
  const int lane = threadIdx.x / cols;
  const int lanes = kBatchNormThreads / cols;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * cols + col) * V;
  const int64_t g = blockIdx.z;
  // The elementwise modes take the row parts in reverse: the reduction that
  // runs before each (stats before fwd, bwd_stats before bwd) read them in
  // order, so the parts it read last are the ones still in L2.
  const int64_t part = kReduce ? blockIdx.y : gridDim.y - 1 - blockIdx.y;
  const int64_t set_rows = p.rows / p.param_sets;
  const int64_t chunk = (set_rows + p.parts - 1) / p.parts;
  const int64_t first = g * set_rows + part * chunk;
  const int64_t end = min((g + 1) * set_rows, first + chunk);
  const bool active = c0 < p.width;  // width % V == 0 where V > 1
  const bool has_res = kMode != BatchNormMode::kStats && p.residual != nullptr;

  // Per-channel coefficients: the shift (stats), or rows of coefs. Loaded
  // once a thread, element by element (the per-channel arrays carry no
  // alignment beyond a float's).
  float a[V], b[V], m[V], k1[V], k2[V], k3[V];
  auto load = [&](float(&dst)[V], int k) {
    const float* src = p.coefs + (g * p.coef_rows + k) * p.width + c0;
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = active ? src[i] : 0.f;
  };
#pragma unroll
  for (int i = 0; i < V; ++i) a[i] = b[i] = m[i] = k1[i] = k2[i] = k3[i] = 0.f;
  if constexpr (kMode == BatchNormMode::kStats) {
    load(m, 0);
  } else {
    load(a, 0);
    load(b, 1);
    if constexpr (kBwd) load(m, 2);
    if constexpr (kMode == BatchNormMode::kBwd) {
      load(k1, 3);
      load(k2, 4);
      load(k3, 5);
    }
  }
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  const T* res = static_cast<const T*>(p.residual);
  T* out = static_cast<T*>(p.out);
  T* dres = static_cast<T*>(p.dresidual);

  float acc0[V], acc1[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc0[i] = acc1[i] = 0.f;

  // One row's work on its loaded vectors (dy and the residual where used).
  auto row = [&](int64_t off, const Pack& xp, const Pack& dyp, const Pack& rp) {
    float xv[V];
    Widen<T, V>(xp, xv);
    if constexpr (kMode == BatchNormMode::kStats) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = xv[i] - m[i];
        acc0[i] += d;
        acc1[i] = fmaf(d, d, acc1[i]);
      }
    } else {
      float z[V];
#pragma unroll
      for (int i = 0; i < V; ++i) z[i] = fmaf(xv[i], a[i], b[i]);
      if (has_res) {
        float rv[V];
        Widen<T, V>(rp, rv);
#pragma unroll
        for (int i = 0; i < V; ++i) z[i] += rv[i];
      }
      if constexpr (kMode == BatchNormMode::kFwd) {
#pragma unroll
        for (int i = 0; i < V; ++i) z[i] = BatchNormAct<kAct>(z[i]);
        StoreVec<T, V>(out + off, z);
      } else {
        float dz[V];
        Widen<T, V>(dyp, dz);
#pragma unroll
        for (int i = 0; i < V; ++i) dz[i] *= BatchNormActGrad<kAct>(z[i]);
        if constexpr (kMode == BatchNormMode::kBwdStats) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            acc0[i] += dz[i];
            acc1[i] = fmaf(dz[i], xv[i] - m[i], acc1[i]);
          }
        } else {
          float dx[V];
#pragma unroll
          for (int i = 0; i < V; ++i) dx[i] = fmaf(k1[i], dz[i], fmaf(k2[i], xv[i] - m[i], k3[i]));
          StoreVec<T, V>(out + off, dx);
          if (dres != nullptr) StoreVec<T, V>(dres + off, dz);
        }
      }
    }
  };

  if (active) {
    int64_t r = first + lane;
    for (; r + (kUnroll - 1) * lanes < end; r += kUnroll * lanes) {
      Pack xp[kUnroll], dyp[kUnroll], rp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t off = (r + u * lanes) * p.width + c0;
        xp[u] = *reinterpret_cast<const Pack*>(x + off);
        if constexpr (kBwd) dyp[u] = *reinterpret_cast<const Pack*>(dy + off);
        if (has_res) rp[u] = *reinterpret_cast<const Pack*>(res + off);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) row((r + u * lanes) * p.width + c0, xp[u], dyp[u], rp[u]);
    }
    for (; r < end; r += lanes) {
      const int64_t off = r * p.width + c0;
      Pack xp, dyp, rp;
      xp = *reinterpret_cast<const Pack*>(x + off);
      if constexpr (kBwd) dyp = *reinterpret_cast<const Pack*>(dy + off);
      if (has_res) rp = *reinterpret_cast<const Pack*>(res + off);
      row(off, xp, dyp, rp);
    }
  }

  if constexpr (kReduce) {
    // The lanes' sums, added in lane order by lane 0 of each column.
    __shared__ float lane_sums[2][kBatchNormThreads * V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      lane_sums[0][threadIdx.x * V + i] = acc0[i];
      lane_sums[1][threadIdx.x * V + i] = acc1[i];
    }
    __syncthreads();
    if (lane == 0 && active) {
      float* dst = p.partials + ((g * p.parts + part) * 2) * p.width + c0;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float s0 = 0.f, s1 = 0.f;
        for (int l = 0; l < lanes; ++l) {
          s0 += lane_sums[0][(l * cols + col) * V + i];
          s1 += lane_sums[1][(l * cols + col) * V + i];
        }
        dst[i] = s0;
        dst[p.width + i] = s1;
      }
    }
  }
}

// Calls fn(std::integral_constant<int, kAct>) for the runtime activation.
template <typename Fn>
cudaError_t DispatchBatchNormActivation(int activation, Fn&& fn) {
  switch (activation) {
    case kBatchNormNoActivation:
      return fn(std::integral_constant<int, kBatchNormNoActivation>{});
    case static_cast<int>(Activation::kRelu):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kRelu)>{});
    case static_cast<int>(Activation::kGelu):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kGelu)>{});
    case static_cast<int>(Activation::kGeluTanh):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kGeluTanh)>{});
    case static_cast<int>(Activation::kSilu):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kSilu)>{});
    case static_cast<int>(Activation::kSigmoid):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kSigmoid)>{});
    case static_cast<int>(Activation::kTanh):
      return fn(std::integral_constant<int, static_cast<int>(Activation::kTanh)>{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <BatchNormMode kMode>
cudaError_t LaunchBatchNorm(const BatchNormParams& p, cudaStream_t stream) {
  constexpr bool kReduce = kMode == BatchNormMode::kStats || kMode == BatchNormMode::kBwdStats;
  if (p.rows == 0 || p.width == 0 || p.param_sets == 0) return cudaSuccess;
  if (p.param_sets > 65535) return cudaErrorInvalidValue;  // gridDim.z
  constexpr int kVecBytes = BatchNormVectorBytes<kMode>();
  const int bytes = p.dtype == DType::kF32 ? 4 : 2;
  const void* ptrs[] = {p.dy, p.x, p.residual, p.out, p.dresidual};
  bool vectorized = p.width % (kVecBytes / bytes) == 0;
  for (const void* q : ptrs) vectorized = vectorized && (q == nullptr || IsAligned(q, kVecBytes));
  const BatchNormTile tile = BatchNormTileFor(p.width, p.dtype, vectorized, kVecBytes);
  BatchNormParams q = p;
  // The reductions split rows as their workspace says; the elementwise modes
  // as the plan does for this device.
  if (!kReduce) {
    q.parts = BatchNormParts(p.rows, p.param_sets, p.width, p.dtype, CurrentDeviceProps());
  }
  if (q.parts < 1 || q.parts > 65535) return cudaErrorInvalidValue;  // gridDim.y
  const dim3 grid(static_cast<unsigned>(tile.tiles), static_cast<unsigned>(q.parts),
                  static_cast<unsigned>(p.param_sets));
  const int act = kMode == BatchNormMode::kStats ? kBatchNormNoActivation : p.activation;
  cudaError_t status = DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = kVecBytes / sizeof(T);
    return DispatchBatchNormActivation(act, [&](auto act_tag) {
      constexpr int kAct = decltype(act_tag)::value;
      if constexpr (kMode == BatchNormMode::kStats && kAct != kBatchNormNoActivation) {
        return cudaErrorInvalidValue;
      } else {
        if (tile.vec > 1) {
          BatchNormKernel<T, kVec, kMode, kAct><<<grid, kBatchNormThreads, 0, stream>>>(q, tile.cols);
        } else {
          BatchNormKernel<T, 1, kMode, kAct><<<grid, kBatchNormThreads, 0, stream>>>(q, tile.cols);
        }
        return cudaGetLastError();
      }
    });
  });
  if (status != cudaSuccess || !kReduce) return status;
  ColumnSumParams cs{};
  cs.partials = q.partials;
  cs.out[0] = q.sums[0];
  cs.out[1] = q.sums[1];
  cs.param_sets = q.param_sets;
  cs.parts = q.parts;
  cs.sums = 2;
  cs.width = q.width;
  return LaunchColumnSum(cs, stream);
}

}  // namespace jax_dnn
