// Pooling kernels (see pooling.h for layout, windows and numerics).
//
// All are memory-bound; a thread moves vectors of channels
// (PoolChannelVector: 16 bytes where C allows, else one element), so a
// warp's loads of one spatial position are contiguous; per-axis arithmetic
// is 32-bit, divisions by FastDiv, offsets 64-bit.
//   PoolFwdKernel:        a thread per (batch, od, oh, run of R outputs along
//                         w, channel vector): the run's windows share rows, so
//                         each position is loaded once a thread and folded
//                         into every window of the run holding it; max can
//                         also write each window's argmax offset (uint8).
//   PoolBwdIdxKernel:     max pooling's backward from those offsets: a thread
//                         per (input position, channel vector) gathers dy
//                         from the windows covering it whose offset names it.
//                         Traffic: dy, idx read, dx written once (3x3 s2
//                         bf16: 1.19 bytes per byte of x).
//   PoolBwdKernel:        a thread per (input position, channel vector); sums
//                         dy over the windows covering it (average: dy /
//                         divisor; max without offsets: where it is the
//                         window's argmax, tested against y, see pooling.h),
//                         writes dx once.
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

// A window's start and end [lo, hi) along axis a in 32 bits (spatial sizes
// are < 2^31, pooling_ffi.cc): the product of adaptive's o * L in 64.
__device__ __forceinline__ void Window32(const PoolParams& p, int a, int o, int& lo, int& hi) {
  if (p.adaptive) {
    const int64_t l = p.in[a], n = p.output[a];
    lo = static_cast<int>(o * l / n);
    hi = static_cast<int>(((o + 1) * l + n - 1) / n);
  } else {
    lo = o * static_cast<int>(p.stride[a]) - static_cast<int>(p.pad[a]);
    hi = lo + static_cast<int>(p.window[a]);
  }
}

// V window-local argmax indices (one byte each) as one access.
template <int V>
__device__ __forceinline__ void StoreIdx(uint8_t* p, const uint32_t (&b)[V]) {
  if constexpr (V == 8) {
    uint2 w;
    w.x = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24);
    w.y = b[4] | (b[5] << 8) | (b[6] << 16) | (b[7] << 24);
    *reinterpret_cast<uint2*>(p) = w;
  } else if constexpr (V == 4) {
    *reinterpret_cast<uint32_t*>(p) = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24);
  } else {
    static_assert(V == 1, "index vectors of 1, 4 or 8 bytes");
    *p = static_cast<uint8_t>(b[0]);
  }
}

template <int V>
__device__ __forceinline__ void LoadIdx(const uint8_t* p, uint32_t (&b)[V]) {
  if constexpr (V == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      b[k] = (w.x >> (8 * k)) & 0xff;
      b[k + 4] = (w.y >> (8 * k)) & 0xff;
    }
  } else if constexpr (V == 4) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) b[k] = (w >> (8 * k)) & 0xff;
  } else {
    static_assert(V == 1, "index vectors of 1, 4 or 8 bytes");
    b[0] = *p;
  }
}

// Forward: a thread per (batch, od, oh, run of R outputs along w, channel
// vector). The R windows of a run share their rows (same od, oh), so the
// thread walks the union of their columns once, loading each position once
// and folding it into every window of the run that holds it: R x V
// accumulators, R independent stores, and the index arithmetic (one
// division per axis, by FastDiv) paid once per R outputs. kIdx (max only)
// also writes each window's argmax as its row-major offset in the window
// [kd, kh, kw] = p.window (pooling.h), kPoolNoArgmax where a padded
// position wins.
template <typename T, int V, bool kMax, bool kIdx, int R>
__global__ void __launch_bounds__(kThreads)
    PoolFwdKernel(PoolParams p, FastDiv vectors_div, FastDiv3 out_div, int64_t units,
                  int64_t runs) {
  static_assert(kMax || !kIdx, "argmax indices are max pooling's");
  const T* __restrict__ x = static_cast<const T*>(p.x);
  T* __restrict__ y = static_cast<T*>(p.out);
  uint8_t* __restrict__ idx = static_cast<uint8_t*>(p.idx);
  const int64_t vectors = p.c / V;
  const int64_t grid[3] = {p.output[0], p.output[1], runs};
  const int in0 = static_cast<int>(p.in[0]), in1 = static_cast<int>(p.in[1]),
            in2 = static_cast<int>(p.in[2]), out2 = static_cast<int>(p.output[2]);
  const int kh = static_cast<int>(p.window[1]), kw = static_cast<int>(p.window[2]);
  for (int64_t u = blockIdx.x * int64_t{kThreads} + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t q = static_cast<int64_t>(vectors_div.Div(static_cast<uint64_t>(u)));
    const int64_t cv = u - q * vectors;
    const Position o = Split(q, out_div.div, grid);
    const int od = static_cast<int>(o.i[0]), oh = static_cast<int>(o.i[1]);
    const int ow0 = static_cast<int>(o.i[2]) * R;
    int lo_d, hi_d, lo_h, hi_h, lo_w[R], hi_w[R];
    Window32(p, 0, od, lo_d, hi_d);
    Window32(p, 1, oh, lo_h, hi_h);
#pragma unroll
    for (int r = 0; r < R; ++r)  // a run's tail past OW repeats the last window, unstored
      Window32(p, 2, min(ow0 + r, out2 - 1), lo_w[r], hi_w[r]);
    float acc[R][V];
    uint32_t arg[R][V];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      // XLA's rule (pooling.h): the window's first position wins a tie of
      // -inf only where it is inside the input; a padded first position
      // takes the gradient (none) until a larger value comes.
      const bool corner = lo_d >= 0 && lo_d < in0 && lo_h >= 0 && lo_h < in1 && lo_w[r] >= 0 &&
                          lo_w[r] < in2;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc[r][k] = kMax ? -INFINITY : 0.f;
        arg[r][k] = corner ? 0u : uint32_t{kPoolNoArgmax};
      }
    }
    // Padding never changes a max (-inf) or a sum (0): only positions inside.
    const int d0 = max(lo_d, 0), d1 = min(hi_d, in0), h0 = max(lo_h, 0), h1 = min(hi_h, in1);
    const int w0 = max(lo_w[0], 0), w1 = min(hi_w[R - 1], in2);
    for (int d = d0; d < d1; ++d) {
      for (int h = h0; h < h1; ++h) {
        const T* row = x + Offset(o.b, d, h, 0, p.in, p.c) + cv * V;
        const uint32_t row_at = static_cast<uint32_t>(((d - lo_d) * kh + (h - lo_h)) * kw);
        for (int w = w0; w < w1; ++w) {
          bool used = false;
#pragma unroll
          for (int r = 0; r < R; ++r) used = used || (w >= lo_w[r] && w < hi_w[r]);
          if (!used) continue;  // a gap between windows (stride > window)
          float v[V];
          LoadVec<T, V>(row + static_cast<int64_t>(w) * p.c, v);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (w < lo_w[r] || w >= hi_w[r]) continue;
#pragma unroll
            for (int k = 0; k < V; ++k) {
              if constexpr (kMax) {
                // Larger, or the first NaN (NaN is the largest; lax.max
                // propagates it): ties keep the earlier position.
                const bool take = v[k] > acc[r][k] || (v[k] != v[k] && acc[r][k] == acc[r][k]);
                if (take) {
                  acc[r][k] = v[k];
                  if constexpr (kIdx) arg[r][k] = row_at + static_cast<uint32_t>(w - lo_w[r]);
                }
              } else {
                acc[r][k] += v[k];
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (ow0 + r >= out2) break;
      if constexpr (!kMax) {
        int64_t lo[3] = {lo_d, lo_h, lo_w[r]}, hi[3] = {hi_d, hi_h, hi_w[r]};
        const float inv = 1.f / Divisor(p, lo, hi);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[r][k] *= inv;
      }
      const int64_t at = Offset(o.b, od, oh, ow0 + r, p.output, p.c) + cv * V;
      StoreVec<T, V>(y + at, acc[r]);
      if constexpr (kIdx) StoreIdx<V>(idx + at, arg[r]);
    }
  }
}

// Max pooling's backward from the forward's argmax indices: a thread per
// (input position, channel vector) gathers over the windows that cover it
// (ranges from one FastDiv per axis, outside the loop), reading each
// window's V index bytes and, only where one of them names this position,
// its dy vector. Reads dy and the indices, writes dx once: no x, no y, no
// rescans of windows.
struct PoolBwdIdxDivs {
  FastDiv cover[3];  // pooling: by stride; adaptive: by L (covering bins)
  FastDiv bin[3];    // adaptive: by O (a bin's start); unused for pooling
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    PoolBwdIdxKernel(PoolParams p, FastDiv vectors_div, FastDiv3 in_div, PoolBwdIdxDivs divs,
                     int64_t units) {
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const uint8_t* __restrict__ idx = static_cast<const uint8_t*>(p.idx);
  T* __restrict__ dx = static_cast<T*>(p.out);
  const int64_t vectors = p.c / V;
  const int kh = static_cast<int>(p.window[1]), kw = static_cast<int>(p.window[2]);
  for (int64_t u = blockIdx.x * int64_t{kThreads} + threadIdx.x; u < units;
       u += int64_t{gridDim.x} * kThreads) {
    const int64_t q = static_cast<int64_t>(vectors_div.Div(static_cast<uint64_t>(u)));
    const int64_t cv = u - q * vectors;
    const Position s = Split(q, in_div.div, p.in);
    int olo[3], ohi[3];
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      const uint64_t i = static_cast<uint64_t>(s.i[a]);
      int64_t lo, hi;
      if (p.adaptive) {
        // start(o) <= i <=> o <= ceil((i + 1) O / L) - 1; end(o) > i <=> o >= floor(i O / L).
        lo = static_cast<int64_t>(divs.cover[a].Div(i * p.output[a]));
        hi = static_cast<int64_t>(divs.cover[a].Div((i + 1) * p.output[a] + p.in[a] - 1)) - 1;
      } else {
        const uint64_t t = i + p.pad[a];
        lo = t >= static_cast<uint64_t>(p.window[a])
                 ? static_cast<int64_t>(divs.cover[a].Div(t - p.window[a])) + 1
                 : 0;
        hi = static_cast<int64_t>(divs.cover[a].Div(t));
      }
      olo[a] = static_cast<int>(lo);
      ohi[a] = static_cast<int>(min(hi, p.output[a] - 1));
    }
    // A window's start along axis a.
    auto start = [&](int a, int o) -> int {
      return p.adaptive
                 ? static_cast<int>(divs.bin[a].Div(static_cast<uint64_t>(o) * p.in[a]))
                 : o * static_cast<int>(p.stride[a]) - static_cast<int>(p.pad[a]);
    };
    float g[V];
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = 0.f;
    const int i0 = static_cast<int>(s.i[0]), i1 = static_cast<int>(s.i[1]),
              i2 = static_cast<int>(s.i[2]);
    for (int od = olo[0]; od <= ohi[0]; ++od) {
      const int jd = i0 - start(0, od);
      for (int oh = olo[1]; oh <= ohi[1]; ++oh) {
        const uint32_t jdh = static_cast<uint32_t>((jd * kh + i1 - start(1, oh)) * kw);
        for (int ow = olo[2]; ow <= ohi[2]; ++ow) {
          const uint32_t mine = jdh + static_cast<uint32_t>(i2 - start(2, ow));
          const int64_t at = Offset(s.b, od, oh, ow, p.output, p.c) + cv * V;
          uint32_t b[V];
          LoadIdx<V>(idx + at, b);
          bool any = false;
#pragma unroll
          for (int k = 0; k < V; ++k) any = any || b[k] == mine;
          if (!any) continue;  // dy read only where this position is an argmax
          float grad[V];
          LoadVec<T, V>(dy + at, grad);
#pragma unroll
          for (int k = 0; k < V; ++k) g[k] += b[k] == mine ? grad[k] : 0.f;
        }
      }
    }
    StoreVec<T, V>(dx + Offset(s.b, s.i[0], s.i[1], s.i[2], p.in, p.c) + cv * V, g);
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

// Outputs a forward thread takes along w: 4 (R x V accumulators, 32 fp32
// for 16-bit types at V 8), 2 with argmax indices (another R x V
// registers).
template <bool kIdx>
constexpr int kFwdRun = kIdx ? 2 : 4;

template <typename T, int V, bool kMax, bool kIdx>
cudaError_t LaunchFwd(const PoolParams& p, cudaStream_t stream) {
  constexpr int R = kFwdRun<kIdx>;
  const int64_t vectors = p.c / V;
  const int64_t runs = (p.output[2] + R - 1) / R;
  const int64_t units = p.n * p.output[0] * p.output[1] * runs * vectors;
  if (units == 0) return cudaSuccess;
  FastDiv3 div;
  div.div[0] = FastDiv(static_cast<uint64_t>(p.output[0]));
  div.div[1] = FastDiv(static_cast<uint64_t>(p.output[1]));
  div.div[2] = FastDiv(static_cast<uint64_t>(runs));
  PoolFwdKernel<T, V, kMax, kIdx, R>
      <<<static_cast<unsigned>(Blocks(units)), kThreads, 0, stream>>>(
          p, FastDiv(static_cast<uint64_t>(vectors)), div, units, runs);
  return cudaGetLastError();
}

template <typename T, int V>
cudaError_t LaunchBwd(const PoolParams& p, cudaStream_t stream) {
  const int64_t vectors = p.c / V;
  const int64_t units = p.n * p.in[0] * p.in[1] * p.in[2] * vectors;
  if (units == 0) return cudaSuccess;
  FastDiv3 div;
  for (int a = 0; a < 3; ++a) div.div[a] = FastDiv(static_cast<uint64_t>(p.in[a]));
  const FastDiv vdiv(static_cast<uint64_t>(vectors));
  const dim3 grid(static_cast<unsigned>(Blocks(units)));
  if (p.idx != nullptr) {
    PoolBwdIdxDivs divs;
    for (int a = 0; a < 3; ++a) {
      divs.cover[a] = FastDiv(static_cast<uint64_t>(p.adaptive ? p.in[a] : p.stride[a]));
      divs.bin[a] = FastDiv(static_cast<uint64_t>(std::max<int64_t>(p.output[a], 1)));
    }
    PoolBwdIdxKernel<T, V><<<grid, kThreads, 0, stream>>>(p, vdiv, div, divs, units);
  } else if (p.max) {
    PoolBwdKernel<T, V, true><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
  } else {
    PoolBwdKernel<T, V, false><<<grid, kThreads, 0, stream>>>(p, vdiv, div, units);
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
    if (!p.max)
      return vector == kVec ? LaunchFwd<T, kVec, false, false>(p, stream)
                            : LaunchFwd<T, 1, false, false>(p, stream);
    if (p.idx != nullptr)
      return vector == kVec ? LaunchFwd<T, kVec, true, true>(p, stream)
                            : LaunchFwd<T, 1, true, true>(p, stream);
    return vector == kVec ? LaunchFwd<T, kVec, true, false>(p, stream)
                          : LaunchFwd<T, 1, true, false>(p, stream);
  });
}

cudaError_t LaunchPoolBwd(const PoolParams& p, cudaStream_t stream) {
  const int vector = PoolChannelVector(p.c, p.dtype);
  return DispatchDType(p.dtype, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    return vector == kVec ? LaunchBwd<T, kVec>(p, stream) : LaunchBwd<T, 1>(p, stream);
  });
}

}  // namespace jax_dnn
