// Pooling kernels (see pooling.h for layout, windows and numerics).
//
// All three are memory-bound; a thread moves one vector of channels
// (PoolChannelVector: 16 bytes where C allows, else one element), so a
// warp's loads of one spatial position are contiguous, and every offset is
// 64-bit.
//   PoolFwdKernel:        a thread per (output position, channel vector);
//                         reads its window (overlapping windows hit L1/L2:
//                         3x3 stride 2 reads each input 2.25 times from cache,
//                         once from HBM), writes y once.
//   PoolBwdKernel:        a thread per (input position, channel vector); sums
//                         dy over the windows covering it (average: dy /
//                         divisor; max: where it is the window's argmax,
//                         tested against y, see pooling.h), writes dx once.
//                         Traffic: x, y, dy read and dx written once (3x3 s2
//                         bf16: 2.5 bytes per byte of x).
//   PoolGlobalAvgKernel:  output 1 on every axis (a ResNet head): a block of
//                         channel_threads x spatial_threads reduces a channel
//                         strip of one batch over its share of the positions,
//                         the spatial lanes combined in shared memory in a fixed
//                         order; with parts > 1 blocks a column (small N * C),
//                         fp32 partials [N, parts, C] summed in order by
//                         PoolGlobalCombineKernel. Deterministic.
#include <algorithm>
#include <cmath>

#include "ffi/common/device.cuh"
#include "ffi/common/fast_div.h"
#include "ffi/pooling/pooling.h"

namespace jax_dnn {
namespace {

constexpr int kThreads = 256;

// The positions [lo, hi) output o reads along axis a (lo may be < 0 and hi
// > L for pooling windows: padding).
__device__ __forceinline__ void Window(const PoolParams& p, int a, int64_t o, int64_t& lo,
                                       int64_t& hi) {
  if (p.adaptive) {
    lo = o * p.in[a] / p.output[a];
    hi = ((o + 1) * p.in[a] + p.output[a] - 1) / p.output[a];
  } else {
    lo = o * p.stride[a] - p.pad[a];
    hi = lo + p.window[a];
  }
}

// The outputs [lo, hi] whose windows along axis a hold position i (hi < lo:
// none).
__device__ __forceinline__ void Covering(const PoolParams& p, int a, int64_t i, int64_t& lo,
                                         int64_t& hi) {
  if (p.adaptive) {
    // start(o) <= i  <=>  o <= ceil((i + 1) O / L) - 1;  end(o) > i  <=>  o >= floor(i O / L).
    lo = i * p.output[a] / p.in[a];
    hi = ((i + 1) * p.output[a] + p.in[a] - 1) / p.in[a] - 1;
  } else {
    const int64_t t = i + p.pad[a];  // >= 0
    lo = t >= p.window[a] ? (t - p.window[a]) / p.stride[a] + 1 : 0;
    hi = t / p.stride[a];
  }
  hi = hi < p.output[a] - 1 ? hi : p.output[a] - 1;
}

// Average pooling's divisor of the output whose window is [lo, hi) per axis.
__device__ __forceinline__ float Divisor(const PoolParams& p, const int64_t (&lo)[3],
                                         const int64_t (&hi)[3]) {
  if (p.count_include_pad && !p.adaptive)
    return static_cast<float>(p.window[0] * p.window[1] * p.window[2]);
  int64_t count = 1;
#pragma unroll
  for (int a = 0; a < 3; ++a)
    count *= max(int64_t{0}, min(hi[a], p.in[a]) - max(lo[a], int64_t{0}));
  return static_cast<float>(count > 0 ? count : 1);
}

// a is not below b in max pooling's order, where NaN is the largest value.
__device__ __forceinline__ bool Same(float a, float b) { return a == b || (a != a && b != b); }

// Dividers by the three spatial sizes, fixed at launch.
struct FastDiv3 {
  FastDiv div[3];
};

// (batch, d, h, w) of a flat position over [N, S0, S1, S2].
struct Position {
  int64_t b, i[3];
};

__device__ __forceinline__ Position Split(int64_t q, const FastDiv (&div)[3],
                                          const int64_t (&size)[3]) {
  Position s;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    const int64_t r = static_cast<int64_t>(div[a].Div(static_cast<uint64_t>(q)));
    s.i[a] = q - r * size[a];
    q = r;
  }
  s.b = q;
  return s;
}

__device__ __forceinline__ int64_t Offset(int64_t b, int64_t d, int64_t h, int64_t w,
                                          const int64_t (&size)[3], int64_t c) {
  return (((b * size[0] + d) * size[1] + h) * size[2] + w) * c;
}

template <typename T, int V, bool kMax>
__global__ void __launch_bounds__(kThreads)
    PoolFwdKernel(PoolParams p, FastDiv vectors_div, FastDiv3 out_div, int64_t units) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  T* __restrict__ y = static_cast<T*>(p.out);
  const int64_t vectors = p.c / V;
  for (int64_t u = blockIdx.x * int64_t{kThreads} + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t q = static_cast<int64_t>(vectors_div.Div(static_cast<uint64_t>(u)));
    const int64_t cv = u - q * vectors;
    const Position o = Split(q, out_div.div, p.output);
    int64_t lo[3], hi[3];
#pragma unroll
    for (int a = 0; a < 3; ++a) Window(p, a, o.i[a], lo[a], hi[a]);
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = kMax ? -INFINITY : 0.f;
    // Padding never changes a max (-inf) or a sum (0): only positions inside.
    for (int64_t d = max(lo[0], int64_t{0}); d < min(hi[0], p.in[0]); ++d) {
      for (int64_t h = max(lo[1], int64_t{0}); h < min(hi[1], p.in[1]); ++h) {
        for (int64_t w = max(lo[2], int64_t{0}); w < min(hi[2], p.in[2]); ++w) {
          float v[V];
          LoadVec<T, V>(x + Offset(o.b, d, h, w, p.in, p.c) + cv * V, v);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            if constexpr (kMax) {
              // v > acc, or v is NaN: NaN propagates (lax.max); a NaN acc stays.
              if (v[k] > acc[k] || v[k] != v[k]) acc[k] = v[k];
            } else {
              acc[k] += v[k];
            }
          }
        }
      }
    }
    if constexpr (!kMax) {
      const float inv = 1.f / Divisor(p, lo, hi);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] *= inv;
    }
    StoreVec<T, V>(y + Offset(o.b, o.i[0], o.i[1], o.i[2], p.output, p.c) + cv * V, acc);
  }
}

// Whether position `at` (inside the window [lo, hi)) is the first in
// row-major order whose value is `m` (the window's max) for each channel
// where `want` is set; clears `want` where an earlier position holds m.
template <typename T, int V>
__device__ __forceinline__ void FirstMaximal(const PoolParams& p, const T* __restrict__ x,
                                             int64_t b, int64_t cv, const int64_t (&lo)[3],
                                             const int64_t (&hi)[3], const int64_t (&at)[3],
                                             const float (&m)[V], bool (&want)[V]) {
  for (int64_t d = lo[0]; d < hi[0]; ++d) {
    for (int64_t h = lo[1]; h < hi[1]; ++h) {
      for (int64_t w = lo[2]; w < hi[2]; ++w) {
        if (d == at[0] && h == at[1] && w == at[2]) return;
        const bool inside = d >= 0 && d < p.in[0] && h >= 0 && h < p.in[1] && w >= 0 &&
                            w < p.in[2];
        float v[V];
        if (inside) {
          LoadVec<T, V>(x + Offset(b, d, h, w, p.in, p.c) + cv * V, v);
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) v[k] = -INFINITY;  // padding
        }
        bool any = false;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          want[k] = want[k] && !Same(v[k], m[k]);
          any = any || want[k];
        }
        if (!any) return;
      }
    }
  }
}

template <typename T, int V, bool kMax>
__global__ void __launch_bounds__(kThreads)
    PoolBwdKernel(PoolParams p, FastDiv vectors_div, FastDiv3 in_div, int64_t units) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ y = static_cast<const T*>(p.y);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  T* __restrict__ dx = static_cast<T*>(p.out);
  const int64_t vectors = p.c / V;
  for (int64_t u = blockIdx.x * int64_t{kThreads} + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t q = static_cast<int64_t>(vectors_div.Div(static_cast<uint64_t>(u)));
    const int64_t cv = u - q * vectors;
    const Position s = Split(q, in_div.div, p.in);
    int64_t olo[3], ohi[3];
#pragma unroll
    for (int a = 0; a < 3; ++a) Covering(p, a, s.i[a], olo[a], ohi[a]);
    float mine[V], g[V];
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = 0.f;
    if constexpr (kMax)
      LoadVec<T, V>(x + Offset(s.b, s.i[0], s.i[1], s.i[2], p.in, p.c) + cv * V, mine);
    for (int64_t od = olo[0]; od <= ohi[0]; ++od) {
      for (int64_t oh = olo[1]; oh <= ohi[1]; ++oh) {
        for (int64_t ow = olo[2]; ow <= ohi[2]; ++ow) {
          const int64_t at = Offset(s.b, od, oh, ow, p.output, p.c) + cv * V;
          int64_t lo[3], hi[3];
          Window(p, 0, od, lo[0], hi[0]);
          Window(p, 1, oh, lo[1], hi[1]);
          Window(p, 2, ow, lo[2], hi[2]);
          float grad[V];
          if constexpr (kMax) {
            float m[V];
            LoadVec<T, V>(y + at, m);
            bool want[V], any = false;
#pragma unroll
            for (int k = 0; k < V; ++k) {
              want[k] = Same(mine[k], m[k]);
              any = any || want[k];
            }
            if (!any) continue;  // dy read only where this position may take it
            FirstMaximal<T, V>(p, x, s.b, cv, lo, hi, s.i, m, want);
            LoadVec<T, V>(dy + at, grad);
#pragma unroll
            for (int k = 0; k < V; ++k) g[k] += want[k] ? grad[k] : 0.f;
          } else {
            LoadVec<T, V>(dy + at, grad);
            const float inv = 1.f / Divisor(p, lo, hi);
#pragma unroll
            for (int k = 0; k < V; ++k) g[k] += grad[k] * inv;
          }
        }
      }
    }
    StoreVec<T, V>(dx + Offset(s.b, s.i[0], s.i[1], s.i[2], p.in, p.c) + cv * V, g);
  }
}

// Global average pooling: grid (strips, parts, N); block (channel_threads,
// spatial_threads). Each block sums its strip over positions part, part +
// parts, ... in steps of spatial_threads, then its spatial lanes in a fixed
// order.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    PoolGlobalAvgKernel(PoolParams p, int64_t spatial, float inv_spatial) {
  const T* __restrict__ x = static_cast<const T*>(p.x);
  __shared__ float lanes[kThreads * V];
  const int64_t b = blockIdx.z;
  const int64_t cv = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const bool live = cv * V < p.c;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.f;
  if (live) {
    const int64_t step = int64_t{blockDim.y} * p.parts;
    const T* base = x + b * spatial * p.c + cv * V;
    for (int64_t s = int64_t{blockIdx.y} * blockDim.y + threadIdx.y; s < spatial; s += step) {
      float v[V];
      LoadVec<T, V>(base + s * p.c, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += v[k];
    }
  }
  const int lane = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int k = 0; k < V; ++k) lanes[k * kThreads + lane] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || !live) return;
  for (int r = 1; r < static_cast<int>(blockDim.y); ++r) {
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] += lanes[k * kThreads + r * blockDim.x + threadIdx.x];
  }
  if (p.parts == 1) {
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] *= inv_spatial;
    StoreVec<T, V>(static_cast<T*>(p.out) + b * p.c + cv * V, acc);
  } else {
    float* part = p.partials + (b * p.parts + blockIdx.y) * p.c + cv * V;
#pragma unroll
    for (int k = 0; k < V; ++k) part[k] = acc[k];
  }
}

// y[b, c] = sum over parts of partials[b, part, c] (in order) / spatial.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    PoolGlobalCombineKernel(PoolParams p, float inv_spatial) {
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i >= p.n * p.c) return;
  const int64_t b = i / p.c, c = i - b * p.c;
  const float* part = p.partials + b * p.parts * p.c + c;
  float acc = 0.f;
  for (int64_t j = 0; j < p.parts; ++j) acc += part[j * p.c];
  static_cast<T*>(p.out)[i] = FromFloat<T>(acc * inv_spatial);
}

int64_t Blocks(int64_t units) {
  // Grid-stride loops past 2^31 - 1 blocks (far beyond any tensor that fits).
  return std::max<int64_t>(1, std::min<int64_t>((units + kThreads - 1) / kThreads, 0x7fffffff));
}

template <typename T, int V>
cudaError_t LaunchWindows(const PoolParams& p, bool backward, cudaStream_t stream) {
  const int64_t vectors = p.c / V;
  const int64_t* sizes = backward ? p.in : p.output;
  const int64_t units = p.n * sizes[0] * sizes[1] * sizes[2] * vectors;
  if (units == 0) return cudaSuccess;
  FastDiv3 div;
  for (int a = 0; a < 3; ++a) div.div[a] = FastDiv(static_cast<uint64_t>(sizes[a]));
  const FastDiv vdiv(static_cast<uint64_t>(vectors));
  const dim3 grid(static_cast<unsigned>(Blocks(units)));
  if (backward) {
    if (p.max)
      PoolBwdKernel<T, V, true><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
    else
      PoolBwdKernel<T, V, false><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
  } else {
    if (p.max)
      PoolFwdKernel<T, V, true><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
    else
      PoolFwdKernel<T, V, false><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
  }
  return cudaGetLastError();
}

template <typename T, int V>
cudaError_t LaunchGlobal(const PoolParams& p, const PoolGlobalPlan& plan, cudaStream_t stream) {
  const int64_t spatial = p.in[0] * p.in[1] * p.in[2];
  const float inv = 1.f / static_cast<float>(spatial);
  const dim3 grid(static_cast<unsigned>(plan.strips), static_cast<unsigned>(p.parts),
                  static_cast<unsigned>(p.n));
  const dim3 block(plan.channel_threads, plan.spatial_threads);
  PoolGlobalAvgKernel<T, V><<<grid, block, 0, stream>>>(p, spatial, inv);
  if (p.parts > 1) {
    const int64_t total = p.n * p.c;
    PoolGlobalCombineKernel<T><<<static_cast<unsigned>((total + kThreads - 1) / kThreads),
                                 kThreads, 0, stream>>>(p, inv);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchPoolFwd(const PoolParams& p, const DeviceProps& device, cudaStream_t stream) {
  const int vector = PoolChannelVector(p.c, p.dtype);
  const int64_t spatial = p.in[0] * p.in[1] * p.in[2];
  const bool global =
      !p.max && p.adaptive && p.output[0] * p.output[1] * p.output[2] == 1 && spatial > 0;
  return DispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    if (global) {
      if (p.n == 0 || p.c == 0) return cudaSuccess;
      // The block shape from the plan; the parts from the workspace the
      // caller sized (1 where it has none, e.g. a symbolic batch in
      // jax.export: then one block a column, unsplit).
      const PoolGlobalPlan plan = PoolGlobal(p.n, p.c, spatial, p.dtype, device);
      // The grid's y and z axes hold parts and N (at most 65535 each).
      if (p.n <= 65535 && p.parts <= 65535)
        return vector == kVec ? LaunchGlobal<T, kVec>(p, plan, stream)
                              : LaunchGlobal<T, 1>(p, plan, stream);
    }
    return vector == kVec ? LaunchWindows<T, kVec>(p, false, stream)
                          : LaunchWindows<T, 1>(p, false, stream);
  });
}

cudaError_t LaunchPoolBwd(const PoolParams& p, cudaStream_t stream) {
  const int vector = PoolChannelVector(p.c, p.dtype);
  return DispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    return vector == kVec ? LaunchWindows<T, kVec>(p, true, stream)
                          : LaunchWindows<T, 1>(p, true, stream);
  });
}

}  // namespace jax_dnn
