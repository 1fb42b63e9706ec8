// Group norm kernels, forward and backward. See group_norm.h for the math and
// group_norm_plan.h for the block shape.
//
// Layout: x [n, spatial, channels], channels innermost. Every kernel's thread
// (tx, ty) holds channels [tx * V, (tx + 1) * V) of a position (V: 16 bytes,
// or one element where C is no multiple of 16 bytes) for the whole of its
// block's positions, so its per-channel constants (group statistics, scale,
// bias) are loaded once a sample and its sums stay in registers; the block's
// ty rows visit positions ty, ty + threads_y, ... Each thread issues 64
// bytes of loads before it uses any (kUnroll), to cover the memory latency
// with 2 blocks an SM.
//
// Statistics (forward): `splits` blocks a sample (group_norm_plan.h: N * G
// may be far fewer than the SMs) each sum d = x - shift and d^2 for each
// channel of its positions, shift the group's first value (x[s, 0, g * C/G]):
// the sums about a value of the group keep the variance exact where the
// mean is large against the standard deviation (E[x^2] - E[x]^2 would
// cancel). The block adds its threads' sums per channel, then a warp a group
// adds the group's channels, and writes one fp32 (sum d, sum d^2) per
// (sample, split, group); GroupNormFinalizeKernel adds the splits in a fixed
// order (a warp a pair).
//
// Backward: dz = dy * act'(z), z = xhat * scale + bias recomputed from the
// saved (mean, rstd). Blocks of the same shape sum dz and dz * xhat per
// channel (the parameter gradients' terms, and, times scale and added over
// a group's channels, the group's dx coefficients); one block a sample adds
// the splits and forms the coefficients; column_sum adds the samples of each
// parameter set; the dx kernel applies
//   dx = rstd * (g - mean_group(g) - xhat * mean_group(g * xhat)),  g = dz * scale.
//
// Traffic: the forward reads x twice (statistics, apply) and writes y; the
// backward reads x and dy twice and writes dx, each pass over the whole
// batch (group_norm_plan.h's chunk_samples says why).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ffi/activation/activation_math.cuh"
#include "ffi/common/column_sum.h"
#include "ffi/common/device.cuh"
#include "ffi/group_norm/group_norm.h"

namespace jax_dnn {
namespace {

// Positions whose loads a thread issues together: 4 of x alone, 2 of x and
// dy (the same 64 bytes in flight). 4 of x and dy spilled every 16-bit
// backward at 16-byte vectors (a 512-thread block leaves 128 registers a
// thread); at 2, only the backwards of exact GELU (and fp32 GELU-tanh and
// tanh) spill, 24-64 bytes.
template <bool kTwo>
constexpr int kUnroll = kTwo ? 2 : 4;
constexpr int kFinalizeThreads = 256;

// --- the fused activation: activation_math.cuh's formulas, by bias_act's id
// (enum Activation's numbering); kGroupNormNoActivation: none.

constexpr int kRelu = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3, kSigmoid = 4, kTanh = 5;

template <int kAct>
__device__ __forceinline__ float GnAct(float x) {
  if constexpr (kAct == kGroupNormNoActivation) {
    return x;
  } else {
    return Act<static_cast<Activation>(kAct)>(x);
  }
}

template <int kAct>
__device__ __forceinline__ float GnActGrad(float x) {
  if constexpr (kAct == kGroupNormNoActivation) {
    return 1.f;
  } else {
    return ActGrad<static_cast<Activation>(kAct)>(x);
  }
}

// A block's positions: [begin, end) of `rows` a block (blockIdx.x-th).
struct Rows {
  int64_t begin, end;
  __device__ __forceinline__ Rows(int64_t per_block, int64_t spatial)
      : begin(static_cast<int64_t>(blockIdx.x) * per_block),
        end(min(spatial, static_cast<int64_t>(blockIdx.x) * per_block + per_block)) {}
};

// Calls fn(position, values of a, values of b) for the thread's positions
// of `rows` (b read only where kTwo): kUnroll positions' loads issued before
// their uses.
template <typename T, int V, bool kTwo, typename Fn>
__device__ __forceinline__ void ForRows(const T* a, const T* b, int64_t channels, int c0,
                                        const Rows& rows, Fn&& fn) {
  constexpr int kU = kUnroll<kTwo>;
  const int ny = blockDim.y;
  int64_t r = rows.begin + threadIdx.y;
  for (; r + (kU - 1) * ny < rows.end; r += kU * ny) {
    float va[kU][V], vb[kU][V];
#pragma unroll
    for (int k = 0; k < kU; ++k) {
      LoadVec<T, V>(a + (r + k * ny) * channels + c0, va[k]);
      if constexpr (kTwo) LoadVec<T, V>(b + (r + k * ny) * channels + c0, vb[k]);
    }
#pragma unroll
    for (int k = 0; k < kU; ++k) fn(r + k * ny, va[k], vb[k]);
  }
  for (; r < rows.end; r += ny) {
    float va[V], vb[V];
    LoadVec<T, V>(a + r * channels + c0, va);
    if constexpr (kTwo) LoadVec<T, V>(b + r * channels + c0, vb);
    fn(r, va, vb);
  }
}

// Adds the block's per-thread sums sh[2][threads_y][C] over threads_y, per
// channel, into row 0 (each channel's column read and written by one thread).
__device__ __forceinline__ void SumRowsOfBlock(float* sh, int64_t channels) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int threads = blockDim.x * blockDim.y;
  const int ny = blockDim.y;
  for (int64_t c = tid; c < 2 * channels; c += threads) {
    float* col = sh + (c / channels) * ny * channels + c % channels;
    float a = 0.f;
    for (int y = 0; y < ny; ++y) a += col[y * channels];
    col[0] = a;
  }
}

// --- forward ------------------------------------------------------------------------

// Partial sums of d = x - shift and d^2 for each (sample, split, group).
// Dynamic shared memory: 2 x threads_y x C floats.
template <typename T, int V>
__global__ void __launch_bounds__(kGroupNormMaxThreadsX)
    GroupNormStatsKernel(GroupNormFwdParams p, int64_t rows_per_split) {
  extern __shared__ float sh[];
  const int64_t channels = p.channels;
  const int cg = static_cast<int>(channels / p.groups);
  const int c0 = threadIdx.x * V;
  const int ny = blockDim.y;
  const Rows rows(rows_per_split, p.spatial);
  const T* x = static_cast<const T*>(p.x);
  for (int64_t s = p.sample_begin + blockIdx.y; s < p.sample_end; s += gridDim.y) {
    const T* xs = x + s * p.spatial * channels;
    float shift[V], s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      shift[j] = p.spatial > 0 ? ToFloat(xs[((c0 + j) / cg) * cg]) : 0.f;
      s1[j] = s2[j] = 0.f;
    }
    ForRows<T, V, false>(xs, xs, channels, c0, rows,
                  [&](int64_t, const float (&v)[V], const float (&)[V]) {
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                      const float d = v[j] - shift[j];
                      s1[j] += d;
                      s2[j] = fmaf(d, d, s2[j]);
                    }
                  });
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sh[threadIdx.y * channels + c0 + j] = s1[j];
      sh[(ny + threadIdx.y) * channels + c0 + j] = s2[j];
    }
    __syncthreads();
    SumRowsOfBlock(sh, channels);
    __syncthreads();
    // A warp a group (whole warps only: the shuffles take every lane).
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int warps = (blockDim.x * blockDim.y) / 32;
    if (warp < warps) {
      for (int64_t g = warp; g < p.groups; g += warps) {
        float a = 0.f, b = 0.f;
        for (int c = lane; c < cg; c += 32) {
          a += sh[g * cg + c];
          b += sh[ny * channels + g * cg + c];
        }
        a = WarpSum(a);
        b = WarpSum(b);
        if (lane == 0) {
          float* out = p.partials + ((s * p.splits + blockIdx.x) * p.groups + g) * 2;
          out[0] = a;
          out[1] = b;
        }
      }
    }
    __syncthreads();  // sh is reused by the next sample
  }
}

// stats[s, g] = (mean, rstd) from the splits' partial sums: a warp a
// (sample, group), lane l adding splits l, l + 32, ... in order, then a fixed
// shuffle tree (a thread a pair took 264 dependent loads at N = 1).
template <typename T>
__global__ void __launch_bounds__(kFinalizeThreads) GroupNormFinalizeKernel(GroupNormFwdParams p) {
  const int64_t i = p.sample_begin * p.groups +
                    (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= p.sample_end * p.groups) return;  // whole warps: i is uniform across a warp
  const int64_t s = i / p.groups, g = i % p.groups;
  const int64_t cg = p.channels / p.groups;
  float a = 0.f, b = 0.f;
#pragma unroll 4
  for (int64_t k = lane; k < p.splits; k += 32) {
    const float* part = p.partials + ((s * p.splits + k) * p.groups + g) * 2;
    a += part[0];
    b += part[1];
  }
  a = WarpSum(a);
  b = WarpSum(b);
  if (lane != 0) return;
  const T* x = static_cast<const T*>(p.x);
  const float shift = p.spatial > 0 ? ToFloat(x[s * p.spatial * p.channels + g * cg]) : 0.f;
  const float count = static_cast<float>(p.spatial * cg);  // 0: NaN statistics of no values
  const float md = a / count;
  const float var = fmaxf(b / count - md * md, 0.f);
  p.stats[i * 2] = shift + md;
  p.stats[i * 2 + 1] = rsqrtf(var + p.epsilon);
}

// y = act((x - mean) * (rstd * scale) + bias).
template <typename T, int V, int kAct>
__global__ void __launch_bounds__(kGroupNormMaxThreadsX)
    GroupNormApplyKernel(GroupNormFwdParams p, int64_t rows_per_block) {
  const int64_t channels = p.channels;
  const int cg = static_cast<int>(channels / p.groups);
  const int c0 = threadIdx.x * V;
  const Rows rows(rows_per_block, p.spatial);
  const int64_t per_set = p.n / p.param_sets;
  for (int64_t s = p.sample_begin + blockIdx.y; s < p.sample_end; s += gridDim.y) {
    const float* scale = p.scale + (s / per_set) * channels;
    const float* bias = p.bias + (s / per_set) * channels;
    float mean[V], mul[V], add[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = c0 + j;
      const float* st = p.stats + (s * p.groups + c / cg) * 2;
      mean[j] = st[0];
      mul[j] = st[1] * scale[c];
      add[j] = bias[c];
    }
    const T* xs = static_cast<const T*>(p.x) + s * p.spatial * channels;
    T* ys = static_cast<T*>(p.y) + s * p.spatial * channels;
    ForRows<T, V, false>(xs, xs, channels, c0, rows,
                  [&](int64_t r, const float (&v)[V], const float (&)[V]) {
                    float out[V];
#pragma unroll
                    for (int j = 0; j < V; ++j) out[j] = GnAct<kAct>(fmaf(v[j] - mean[j], mul[j], add[j]));
                    StoreVec<T, V>(ys + r * channels + c0, out);
                  });
  }
}

// --- backward -----------------------------------------------------------------------

// The per-channel constants of sample s: mean, rstd, scale, bias.
template <int V>
struct ChannelConsts {
  float mean[V], rstd[V], scale[V], bias[V];
  __device__ __forceinline__ ChannelConsts(const GroupNormBwdParams& p, int64_t s, int c0, int cg) {
    const int64_t set = s / (p.n / p.param_sets);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = c0 + j;
      const float* st = p.stats + (s * p.groups + c / cg) * 2;
      mean[j] = st[0];
      rstd[j] = st[1];
      scale[j] = p.scale[set * p.channels + c];
      bias[j] = p.bias[set * p.channels + c];
    }
  }
  // xhat and dz = dy * act'(xhat * scale + bias) of element j.
  template <int kAct>
  __device__ __forceinline__ void Grads(int j, float x, float dy, float& xhat, float& dz) const {
    xhat = (x - mean[j]) * rstd[j];
    dz = kAct == kGroupNormNoActivation ? dy : dy * GnActGrad<kAct>(fmaf(xhat, scale[j], bias[j]));
  }
};

// Per-channel sums of dz and dz * xhat for each (sample, split):
// partials [n, splits, 2, C]. Dynamic shared memory: 2 x threads_y x C floats.
template <typename T, int V, int kAct>
__global__ void __launch_bounds__(kGroupNormMaxThreadsX)
    GroupNormBwdSumsKernel(GroupNormBwdParams p, int64_t rows_per_split) {
  extern __shared__ float sh[];
  const int64_t channels = p.channels;
  const int cg = static_cast<int>(channels / p.groups);
  const int c0 = threadIdx.x * V;
  const int ny = blockDim.y;
  const Rows rows(rows_per_split, p.spatial);
  for (int64_t s = p.sample_begin + blockIdx.y; s < p.sample_end; s += gridDim.y) {
    const ChannelConsts<V> k(p, s, c0, cg);
    const int64_t off = s * p.spatial * channels;
    float s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) s1[j] = s2[j] = 0.f;
    ForRows<T, V, true>(static_cast<const T*>(p.x) + off, static_cast<const T*>(p.dy) + off, channels, c0,
                  rows, [&](int64_t, const float (&x)[V], const float (&dy)[V]) {
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                      float xhat, dz;
                      k.template Grads<kAct>(j, x[j], dy[j], xhat, dz);
                      s1[j] += dz;
                      s2[j] = fmaf(dz, xhat, s2[j]);
                    }
                  });
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sh[threadIdx.y * channels + c0 + j] = s1[j];
      sh[(ny + threadIdx.y) * channels + c0 + j] = s2[j];
    }
    __syncthreads();
    SumRowsOfBlock(sh, channels);
    __syncthreads();
    float* out = p.partials + (s * p.splits + blockIdx.x) * 2 * channels;
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int64_t c = tid; c < 2 * channels; c += blockDim.x * blockDim.y)
      out[c] = sh[(c / channels) * ny * channels + c % channels];
    __syncthreads();
  }
}

// One block a sample: sample_sums[s] = the splits' partials added in a
// fixed order (kSplitLanes threads a channel, lane l adding splits l, l +
// kSplitLanes, ..., then a shuffle tree); coefs[s, g] = (mean over the group
// of g, of g * xhat), g = dz * scale. Dynamic shared memory: 2 x C floats.
constexpr int kSplitLanes = 8;

__global__ void __launch_bounds__(kFinalizeThreads) GroupNormBwdFinalizeKernel(GroupNormBwdParams p) {
  extern __shared__ float sh[];
  const int64_t channels = p.channels;
  const int64_t cg = channels / p.groups;
  const float count = static_cast<float>(p.spatial * cg);
  const int lane = threadIdx.x % kSplitLanes;
  const int per_pass = blockDim.x / kSplitLanes;  // channels a pass
  for (int64_t s = p.sample_begin + blockIdx.x; s < p.sample_end; s += gridDim.x) {
    const float* scale = p.scale + (s / (p.n / p.param_sets)) * channels;
    // Every thread runs every pass (the shuffles take whole warps).
    for (int64_t base = 0; base < channels; base += per_pass) {
      const int64_t c = base + threadIdx.x / kSplitLanes;
      float a = 0.f, b = 0.f;
      if (c < channels) {
#pragma unroll 4
        for (int64_t k = lane; k < p.splits; k += kSplitLanes) {
          const float* part = p.partials + (s * p.splits + k) * 2 * channels;
          a += part[c];
          b += part[channels + c];
        }
      }
#pragma unroll
      for (int o = kSplitLanes / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
      }
      if (c < channels && lane == 0) {
        p.sample_sums[s * 2 * channels + c] = a;
        p.sample_sums[s * 2 * channels + channels + c] = b;
        sh[c] = a * scale[c];
        sh[channels + c] = b * scale[c];
      }
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, wlane = threadIdx.x % 32;
    for (int64_t g = warp; g < p.groups; g += blockDim.x / 32) {
      float a = 0.f, b = 0.f;
      for (int64_t c = wlane; c < cg; c += 32) {
        a += sh[g * cg + c];
        b += sh[channels + g * cg + c];
      }
      a = WarpSum(a);
      b = WarpSum(b);
      if (wlane == 0) {
        p.coefs[(s * p.groups + g) * 2] = a / count;
        p.coefs[(s * p.groups + g) * 2 + 1] = b / count;
      }
    }
    __syncthreads();
  }
}

// dx = rstd * (dz * scale - m1 - xhat * m2), (m1, m2) = coefs of the group.
template <typename T, int V, int kAct>
__global__ void __launch_bounds__(kGroupNormMaxThreadsX)
    GroupNormBwdDxKernel(GroupNormBwdParams p, int64_t rows_per_block) {
  const int64_t channels = p.channels;
  const int cg = static_cast<int>(channels / p.groups);
  const int c0 = threadIdx.x * V;
  const Rows rows(rows_per_block, p.spatial);
  for (int64_t s = p.sample_begin + blockIdx.y; s < p.sample_end; s += gridDim.y) {
    const ChannelConsts<V> k(p, s, c0, cg);
    float m1[V], m2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float* cf = p.coefs + (s * p.groups + (c0 + j) / cg) * 2;
      m1[j] = cf[0];
      m2[j] = cf[1];
    }
    const int64_t off = s * p.spatial * channels;
    T* dxs = static_cast<T*>(p.dx) + off;
    ForRows<T, V, true>(static_cast<const T*>(p.x) + off, static_cast<const T*>(p.dy) + off, channels, c0,
                  rows, [&](int64_t r, const float (&x)[V], const float (&dy)[V]) {
                    float out[V];
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                      float xhat, dz;
                      k.template Grads<kAct>(j, x[j], dy[j], xhat, dz);
                      out[j] = k.rstd[j] * (fmaf(dz, k.scale[j], -m1[j]) - xhat * m2[j]);
                    }
                    StoreVec<T, V>(dxs + r * channels + c0, out);
                  });
  }
}

// --- launchers ------------------------------------------------------------------------

// Calls fn(std::integral_constant<int, act>) for the runtime activation id.
template <typename Fn>
cudaError_t DispatchAct(int activation, Fn&& fn) {
  switch (activation) {
    case kGroupNormNoActivation:
      return fn(std::integral_constant<int, kGroupNormNoActivation>{});
    case kRelu:
      return fn(std::integral_constant<int, kRelu>{});
    case kGelu:
      return fn(std::integral_constant<int, kGelu>{});
    case kGeluTanh:
      return fn(std::integral_constant<int, kGeluTanh>{});
    case kSilu:
      return fn(std::integral_constant<int, kSilu>{});
    case kSigmoid:
      return fn(std::integral_constant<int, kSigmoid>{});
    case kTanh:
      return fn(std::integral_constant<int, kTanh>{});
    default:
      return cudaErrorInvalidValue;
  }
}

unsigned SampleBlocks(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(n, 65535)); }

int DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// The launchers run the passes chunk by chunk of plan.chunk_samples samples
// (group_norm_plan.h).
template <typename T, int V>
cudaError_t LaunchFwdTyped(GroupNormFwdParams p, const GroupNormPlan& plan, cudaStream_t stream) {
  const dim3 block(plan.threads_x, plan.threads_y);
  const size_t smem = 2 * sizeof(float) * plan.threads_y * p.channels;
  const int64_t per_split = std::max<int64_t>((p.spatial + p.splits - 1) / p.splits, 1);
  const int64_t warps = kFinalizeThreads / 32;  // a warp a (sample, group)
  for (int64_t begin = 0; begin < p.n; begin += plan.chunk_samples) {
    p.sample_begin = begin;
    p.sample_end = std::min(p.n, begin + plan.chunk_samples);
    const int64_t samples = p.sample_end - begin;
    GroupNormStatsKernel<T, V><<<dim3(static_cast<unsigned>(p.splits), SampleBlocks(samples)),
                                 block, smem, stream>>>(p, per_split);
    GroupNormFinalizeKernel<T><<<static_cast<unsigned>((samples * p.groups + warps - 1) / warps),
                                 kFinalizeThreads, 0, stream>>>(p);
    if (p.spatial == 0) continue;
    const dim3 grid(static_cast<unsigned>((p.spatial + plan.apply_rows - 1) / plan.apply_rows),
                    SampleBlocks(samples));
    cudaError_t status = DispatchAct(p.activation, [&](auto act) {
      GroupNormApplyKernel<T, V, decltype(act)::value><<<grid, block, 0, stream>>>(p,
                                                                                plan.apply_rows);
      return cudaGetLastError();
    });
    if (status != cudaSuccess) return status;
  }
  return cudaGetLastError();
}

template <typename T, int V>
cudaError_t LaunchBwdTyped(GroupNormBwdParams p, const GroupNormPlan& plan, cudaStream_t stream) {
  const dim3 block(plan.threads_x, plan.threads_y);
  const size_t smem = 2 * sizeof(float) * plan.threads_y * p.channels;
  const int64_t per_split = std::max<int64_t>((p.spatial + p.splits - 1) / p.splits, 1);
  for (int64_t begin = 0; begin < p.n; begin += plan.chunk_samples) {
    p.sample_begin = begin;
    p.sample_end = std::min(p.n, begin + plan.chunk_samples);
    const int64_t samples = p.sample_end - begin;
    cudaError_t status = DispatchAct(p.activation, [&](auto act) {
      GroupNormBwdSumsKernel<T, V, decltype(act)::value>
          <<<dim3(static_cast<unsigned>(p.splits), SampleBlocks(samples)), block, smem, stream>>>(
              p, per_split);
      return cudaGetLastError();
    });
    if (status != cudaSuccess) return status;
    GroupNormBwdFinalizeKernel<<<SampleBlocks(samples), kFinalizeThreads,
                                 2 * sizeof(float) * p.channels, stream>>>(p);
    if (p.spatial == 0) continue;
    const dim3 grid(static_cast<unsigned>((p.spatial + plan.apply_rows - 1) / plan.apply_rows),
                    SampleBlocks(samples));
    status = DispatchAct(p.activation, [&](auto act) {
      GroupNormBwdDxKernel<T, V, decltype(act)::value><<<grid, block, 0, stream>>>(p,
                                                                                plan.apply_rows);
      return cudaGetLastError();
    });
    if (status != cudaSuccess) return status;
  }
  // The parameter gradients: every sample's sums, added over each set's samples.
  ColumnSumParams cs{};
  cs.partials = p.sample_sums;
  cs.out[0] = p.dbias;   // sums of dz
  cs.out[1] = p.dscale;  // sums of dz * xhat
  cs.param_sets = p.param_sets;
  cs.parts = p.n / p.param_sets;
  cs.sums = 2;
  cs.width = p.channels;
  return LaunchColumnSum(cs, stream);
}

// Calls fn(TypeTag<T>, integral_constant<V>) for the plan's vector width.
template <typename Fn>
cudaError_t DispatchTypeVec(DType dtype, int vec, Fn&& fn) {
  return DispatchDType(dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    if (vec == kVec) return fn(tag, std::integral_constant<int, kVec>{});
    if (vec == 1) return fn(tag, std::integral_constant<int, 1>{});
    return cudaErrorInvalidValue;
  });
}

GroupNormPlan KernelPlan(DType dtype, int64_t n, int64_t spatial, int64_t channels, int64_t groups) {
  // The block shape depends on C and the dtype alone; the splits come from
  // the workspace the caller sized (p.splits).
  return PlanGroupNorm(n, spatial, channels, groups, dtype, DeviceProps{});
}

}  // namespace

cudaError_t LaunchGroupNormFwd(const GroupNormFwdParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const GroupNormPlan plan = KernelPlan(p.dtype, p.n, p.spatial, p.channels, p.groups);
  if (!plan.supported || p.splits < 1) return cudaErrorInvalidValue;
  const int align = plan.vec * DTypeBytes(p.dtype);  // XLA's buffers are 16-byte aligned or more
  if (!IsAligned(p.x, align) || !IsAligned(p.y, align)) return cudaErrorMisalignedAddress;
  return DispatchTypeVec(p.dtype, plan.vec, [&](auto tag, auto vec) {
    return LaunchFwdTyped<typename decltype(tag)::type, decltype(vec)::value>(p, plan, stream);
  });
}

cudaError_t LaunchGroupNormBwd(const GroupNormBwdParams& p, cudaStream_t stream) {
  if (p.n == 0) {  // no samples: zero parameter gradients
    cudaError_t status = cudaMemsetAsync(p.dscale, 0, sizeof(float) * p.param_sets * p.channels,
                                         stream);
    if (status != cudaSuccess) return status;
    return cudaMemsetAsync(p.dbias, 0, sizeof(float) * p.param_sets * p.channels, stream);
  }
  const GroupNormPlan plan = KernelPlan(p.dtype, p.n, p.spatial, p.channels, p.groups);
  if (!plan.supported || p.splits < 1) return cudaErrorInvalidValue;
  const int align = plan.vec * DTypeBytes(p.dtype);
  if (!IsAligned(p.x, align) || !IsAligned(p.dy, align) || !IsAligned(p.dx, align))
    return cudaErrorMisalignedAddress;
  return DispatchTypeVec(p.dtype, plan.vec, [&](auto tag, auto vec) {
    return LaunchBwdTyped<typename decltype(tag)::type, decltype(vec)::value>(p, plan, stream);
  });
}

}  // namespace jax_dnn
