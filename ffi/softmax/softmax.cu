// Softmax / log-softmax forward and backward kernels. See softmax.h.
//
// Row kernels (softmax over the last axis): one row per row team
// (ffi/common/row_team.cuh), the row cached in registers when it fits
// (kCacheElems per thread, up to 512 * kCacheElems elements); then x is read
// once and y written once. Longer rows (up to any length) take an online
// max/sum pass (each thread rescales its running sum when its max grows) and
// a second pass that re-reads the uncached tail, usually from L2.
//
// Strided kernels (any other axis): one thread per V consecutive inner
// positions walks down the axis; an online pass then a writing pass.
//
// Each row takes one team reduction of mergeable (max, sum[, t]) states.
// The backward recomputes softmax(x) from x (see softmax.h); its row kernel
// caches x and dy.
//
// NaN: padding lanes never enter a sum; a row whose max is -inf (all -inf)
// gives NaN exactly as jax.nn.softmax does.
#include <algorithm>
#include <cmath>

#include "ffi/common/device_info.h"
#include "ffi/common/row_pipeline.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/softmax/softmax.h"

namespace jax_dnn {
namespace {

constexpr int kFwdCacheElems = 32;
constexpr int kBwdCacheElems = 16;  // two tensors (x, dy) are cached
// Row groups in flight per block in the pipelined kernels, and the most
// shared memory one block's stages may take (so several blocks fit an SM).
constexpr int kPipeStages = 4;
constexpr size_t kPipeSmemBudget = 96 * 1024;

// exp(x) as one multiply and one MUFU.EX2 (ex2.approx.ftz: ~2 ulp). Inputs
// are x - max <= 0, so flushing denormal results to zero loses nothing that
// matters after normalization; the multiply's rounding costs |x| * 2^-24.
__device__ __forceinline__ float Exp(float x) { return FastExp2(x * 1.4426950408889634f); }

// exp(a - b) where b is a running max, safe when both are -inf.
__device__ __forceinline__ float ExpDiff(float a, float b) {
  return b == -INFINITY ? 0.f : Exp(a - b);
}

// Backward row state: MaxSum plus t, the sum of dy * exp(x - m) (softmax;
// rescaled with m) or of dy (log_softmax; not rescaled).
template <bool kLog>
struct BwdState {
  float m, s, t;
  __device__ static BwdState Merge(const BwdState& a, const BwdState& b) {
    const float m = fmaxf(a.m, b.m);
    const float ra = MaxSum::Rescale(a.m, m), rb = MaxSum::Rescale(b.m, m);
    return {m, a.s * ra + b.s * rb, kLog ? a.t + b.t : a.t * ra + b.t * rb};
  }
};

template <int kTeam>
__device__ __forceinline__ int64_t ColOf(int64_t c, int lane, int V) {
  return (c * kTeam + lane) * V;
}

// Row groups of one iteration: kTeamsPerBlock consecutive rows, one per team.
// kPipe: rows arrive in shared memory through BulkRowPipeline (see
// row_pipeline.cuh); then the whole row is cached (no uncached tail).
template <typename T, int kTeam, int V, bool kLog, bool kPipe>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock) SoftmaxRowFwdKernel(SoftmaxFwdParams p) {
  using Team = RowTeam<kTeam>;
  using Pipe = BulkRowPipeline<kPipeStages, 1>;
  constexpr int kCache = kFwdCacheElems / V;
  __shared__ typename Team::Scratch scratch;
  extern __shared__ __align__(128) char smem[];
  const int lane = Team::Lane();
  const int64_t n = p.n;
  const int64_t chunks = (n + int64_t{kTeam} * V - 1) / (int64_t{kTeam} * V);
  const int64_t group_stride = int64_t{gridDim.x} * Team::kTeamsPerBlock;

  Pipe pipe(smem, static_cast<uint32_t>(Team::kTeamsPerBlock * n * sizeof(T)));
  const T* arrays[1] = {static_cast<const T*>(p.x)};
  auto issue = [&](int k) {
    const int64_t first = int64_t{blockIdx.x} * Team::kTeamsPerBlock + k * group_stride;
    if (first >= p.outer) return;
    const int64_t count = p.outer - first < Team::kTeamsPerBlock ? p.outer - first : Team::kTeamsPerBlock;
    pipe.IssueRows(k, arrays, first, count, n);
  };
  if constexpr (kPipe) pipe.Start(issue);

  int k = 0;
  for (int64_t base = int64_t{blockIdx.x} * Team::kTeamsPerBlock; base < p.outer;
       base += group_stride, ++k) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.outer;
    const T* x = static_cast<const T*>(p.x) + row * n;
    if constexpr (kPipe) {
      pipe.Wait(k);
      x = pipe.template Row<T>(k, 0, Team::Team(), n);
    }
    T* y = static_cast<T*>(p.y) + row * n;

    // Pass 1: running max and sum of exp(x - max), per thread. buf keeps
    // exp(x - m) so that the write pass needs no second exp.
    float buf[kCache][V];
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = ColOf<kTeam>(c, lane, V);
      if (valid && col < n) {
        LoadVec<T, V>(x + col, buf[c]);
#pragma unroll
        for (int i = 0; i < V; ++i) m = fmaxf(m, buf[c][i]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) buf[c][i] = -INFINITY;
      }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        buf[c][i] = kLog ? buf[c][i] : ExpDiff(buf[c][i], m);  // padding: exp(-inf) = 0
        s += kLog ? ExpDiff(buf[c][i], m) : buf[c][i];
      }
    }
    if constexpr (!kPipe) {
      for (int64_t c = kCache; c < chunks; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (!valid || col >= n) continue;
        float v[V];
        LoadVec<T, V>(x + col, v);
        float cm = m;
#pragma unroll
        for (int i = 0; i < V; ++i) cm = fmaxf(cm, v[i]);
        s *= ExpDiff(m, cm);
#pragma unroll
        for (int i = 0; i < V; ++i) s += ExpDiff(v[i], cm);
        // The cached exp(x - m) values are rescaled to the new max below.
        if (cm != m && !kLog) {
#pragma unroll
          for (int c2 = 0; c2 < kCache; ++c2)
#pragma unroll
            for (int i = 0; i < V; ++i) buf[c2][i] *= ExpDiff(m, cm);
        }
        m = cm;
      }
    }
    // One team reduction merges the threads' (max, sum) pairs.
    const MaxSum stats = Team::Reduce(MaxSum{m, s}, scratch);
    if (valid) {
      // softmax: y = exp(x - m) * exp(m - row_max) / sum; log: x - row_max - log(sum).
      const float scale = ExpDiff(m, stats.m) / stats.s;
      const float shift = stats.m + logf(stats.s);
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (col >= n) continue;
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = kLog ? buf[c][i] - shift : buf[c][i] * scale;
        StoreVec<T, V>(y + col, out);
      }
      if constexpr (!kPipe) {
        const float inv_sum = 1.f / stats.s;
        for (int64_t c = kCache; c < chunks; ++c) {
          const int64_t col = ColOf<kTeam>(c, lane, V);
          if (col >= n) continue;
          float v[V];
          LoadVec<T, V>(x + col, v);
#pragma unroll
          for (int i = 0; i < V; ++i) v[i] = kLog ? v[i] - shift : Exp(v[i] - stats.m) * inv_sum;
          StoreVec<T, V>(y + col, v);
        }
      }
    }
    if constexpr (kPipe) {
      pipe.Advance(k, issue);
    }
  }
}

template <typename T, int kTeam, int V, bool kLog, bool kPipe>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock) SoftmaxRowBwdKernel(SoftmaxBwdParams p) {
  using Team = RowTeam<kTeam>;
  using Pipe = BulkRowPipeline<kPipeStages, 2>;
  constexpr int kCache = kBwdCacheElems / V;
  __shared__ typename Team::Scratch scratch;
  extern __shared__ __align__(128) char smem[];
  const int lane = Team::Lane();
  const int64_t n = p.n;
  const int64_t chunks = (n + int64_t{kTeam} * V - 1) / (int64_t{kTeam} * V);
  const int64_t group_stride = int64_t{gridDim.x} * Team::kTeamsPerBlock;

  Pipe pipe(smem, static_cast<uint32_t>(Team::kTeamsPerBlock * n * sizeof(T)));
  const T* arrays[2] = {static_cast<const T*>(p.x), static_cast<const T*>(p.dy)};
  auto issue = [&](int k) {
    const int64_t first = int64_t{blockIdx.x} * Team::kTeamsPerBlock + k * group_stride;
    if (first >= p.outer) return;
    const int64_t count = p.outer - first < Team::kTeamsPerBlock ? p.outer - first : Team::kTeamsPerBlock;
    pipe.IssueRows(k, arrays, first, count, n);
  };
  if constexpr (kPipe) pipe.Start(issue);

  int k = 0;
  for (int64_t base = int64_t{blockIdx.x} * Team::kTeamsPerBlock; base < p.outer;
       base += group_stride, ++k) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.outer;
    const T* x = static_cast<const T*>(p.x) + row * n;
    const T* dy = static_cast<const T*>(p.dy) + row * n;
    if constexpr (kPipe) {
      pipe.Wait(k);
      x = pipe.template Row<T>(k, 0, Team::Team(), n);
      dy = pipe.template Row<T>(k, 1, Team::Team(), n);
    }
    T* dx = static_cast<T*>(p.dx) + row * n;
    // Calls fn(col, x, dy) for each chunk of the uncached tail (long rows).
    auto for_tail = [&](auto fn) {
      if constexpr (!kPipe) {
        for (int64_t c = kCache; c < chunks; ++c) {
          const int64_t col = ColOf<kTeam>(c, lane, V);
          if (!valid || col >= n) continue;
          float xv[V], dv[V];
          LoadVec<T, V>(x + col, xv);
          LoadVec<T, V>(dy + col, dv);
          fn(col, xv, dv);
        }
      }
    };

    // Recompute the forward (row max, sum of exp(x - max)) and, in the same
    // team reduction, t = sum(dy * exp(x - max)) (softmax) or sum(dy) (log).
    float xb[kCache][V], db[kCache][V];
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = ColOf<kTeam>(c, lane, V);
      if (valid && col < n) {
        LoadVec<T, V>(x + col, xb[c]);
        LoadVec<T, V>(dy + col, db[c]);
#pragma unroll
        for (int i = 0; i < V; ++i) m = fmaxf(m, xb[c][i]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) xb[c][i] = -INFINITY, db[c][i] = 0.f;
      }
    }
    BwdState<kLog> st{m, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        xb[c][i] = ExpDiff(xb[c][i], m);  // now exp(x - m); padding: 0
        st.s += xb[c][i];
        st.t += kLog ? db[c][i] : db[c][i] * xb[c][i];
      }
    }
    for_tail([&](int64_t, const float(&v)[V], const float(&d)[V]) {
      BwdState<kLog> chunk{-INFINITY, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < V; ++i) chunk.m = fmaxf(chunk.m, v[i]);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float e = ExpDiff(v[i], chunk.m);
        chunk.s += e;
        chunk.t += kLog ? d[i] : d[i] * e;
      }
      st = BwdState<kLog>::Merge(st, chunk);
    });
    // The cached values are relative to this thread's max at the cached
    // chunks (m), the merged state to the row max.
    const BwdState<kLog> row_st = Team::Reduce(st, scratch);
    const float inv_sum = 1.f / row_st.s;
    const float t = kLog ? row_st.t : row_st.t * inv_sum;  // sum(dy) or sum(dy * y)
    const float y_scale = ExpDiff(m, row_st.m) * inv_sum;   // y = exp(x - m) * y_scale
    if (valid) {
      auto grad = [&](float y, float d) { return kLog ? d - y * t : y * (d - t); };
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (col >= n) continue;
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = grad(xb[c][i] * y_scale, db[c][i]);
        StoreVec<T, V>(dx + col, out);
      }
      for_tail([&](int64_t col, const float(&v)[V], const float(&d)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = grad(Exp(v[i] - row_st.m) * inv_sum, d[i]);
        StoreVec<T, V>(dx + col, out);
      });
    }
    if constexpr (kPipe) {
      pipe.Advance(k, issue);
    }
  }
}

constexpr int kStridedThreads = 256;

// Thread t handles inner positions [i, i + V) of one outer index.
template <typename T, int V, bool kLog>
__global__ void __launch_bounds__(kStridedThreads) SoftmaxStridedFwdKernel(SoftmaxFwdParams p) {
  const int64_t lanes = p.inner / V;
  const int64_t t = int64_t{blockIdx.x} * kStridedThreads + threadIdx.x;
  if (t >= p.outer * lanes) return;
  const int64_t o = t / lanes;
  const int64_t i = (t % lanes) * V;
  const T* x = static_cast<const T*>(p.x) + o * p.n * p.inner + i;
  T* y = static_cast<T*>(p.y) + o * p.n * p.inner + i;
  float m[V], s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) m[j] = -INFINITY, s[j] = 0.f;
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float cm = fmaxf(m[j], v[j]);
      s[j] = s[j] * ExpDiff(m[j], cm) + ExpDiff(v[j], cm);
      m[j] = cm;
    }
  }
  float shift[V], inv_sum[V];  // log_softmax subtracts max + log(sum)
#pragma unroll
  for (int j = 0; j < V; ++j) shift[j] = m[j] + logf(s[j]), inv_sum[j] = 1.f / s[j];
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = kLog ? v[j] - shift[j] : Exp(v[j] - m[j]) * inv_sum[j];
    StoreVec<T, V>(y + k * p.inner, v);
  }
}

template <typename T, int V, bool kLog>
__global__ void __launch_bounds__(kStridedThreads) SoftmaxStridedBwdKernel(SoftmaxBwdParams p) {
  const int64_t lanes = p.inner / V;
  const int64_t t = int64_t{blockIdx.x} * kStridedThreads + threadIdx.x;
  if (t >= p.outer * lanes) return;
  const int64_t o = t / lanes;
  const int64_t i = (t % lanes) * V;
  const int64_t offset = o * p.n * p.inner + i;
  const T* x = static_cast<const T*>(p.x) + offset;
  const T* dy = static_cast<const T*>(p.dy) + offset;
  T* dx = static_cast<T*>(p.dx) + offset;
  // Pass 1 recomputes the forward's max and sum; pass 2 the sum of the dx
  // formula; pass 3 writes dx.
  float m[V], s[V], acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) m[j] = -INFINITY, s[j] = 0.f, acc[j] = 0.f;
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float cm = fmaxf(m[j], v[j]);
      s[j] = s[j] * ExpDiff(m[j], cm) + ExpDiff(v[j], cm);
      m[j] = cm;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = 1.f / s[j];
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V], d[V];
    LoadVec<T, V>(x + k * p.inner, v);
    LoadVec<T, V>(dy + k * p.inner, d);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += kLog ? d[j] : d[j] * Exp(v[j] - m[j]) * s[j];
  }
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V], d[V], out[V];
    LoadVec<T, V>(x + k * p.inner, v);
    LoadVec<T, V>(dy + k * p.inner, d);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float y = Exp(v[j] - m[j]) * s[j];
      out[j] = kLog ? d[j] - y * acc[j] : y * (d[j] - acc[j]);
    }
    StoreVec<T, V>(dx + k * p.inner, out);
  }
}

// Launches the row (inner == 1) or strided kernel of one direction; V is 16
// bytes when alignment allows.
template <typename T, bool kLog, int kCacheElems, typename Params, typename RowLaunch,
          typename StridedLaunch>
cudaError_t LaunchAny(const Params& p, bool vec, RowLaunch row, StridedLaunch strided) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.inner == 1) {
    return DispatchTeam(p.n, kCacheElems, [&](auto team) {
      return vec ? row(team, std::integral_constant<int, kVec>{})
                 : row(team, std::integral_constant<int, 1>{});
    });
  }
  return vec ? strided(std::integral_constant<int, kVec>{}) : strided(std::integral_constant<int, 1>{});
}

}  // namespace

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream) {
  if (p.outer == 0 || p.n == 0 || p.inner == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const int64_t span = p.inner == 1 ? p.n : p.inner;
    const bool vec = span % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16);
    auto run = [&](auto log) {
      constexpr bool kLog = decltype(log)::value;
      return LaunchAny<T, kLog, kFwdCacheElems>(
          p, vec,
          [&](auto team, auto v) {
            constexpr int kTeam = decltype(team)::value;
            constexpr int kV = decltype(v)::value;
            using Team = RowTeam<kTeam>;
            // Pipelined only when aligned (kV > 1) and the row fits the cache.
            return LaunchRowKernel<kPipeStages, 1>(
                SoftmaxRowFwdKernel<T, kTeam, kV, kLog, true>,
                SoftmaxRowFwdKernel<T, kTeam, kV, kLog, false>,
                kV > 1 && p.n <= int64_t{kTeam} * kFwdCacheElems, kPipeSmemBudget, Team::kBlock,
                Team::kTeamsPerBlock, p.outer, p.n * int64_t{sizeof(T)}, p, stream);
          },
          [&](auto v) {
            const int64_t threads = p.outer * (p.inner / decltype(v)::value);
            const int64_t blocks = (threads + kStridedThreads - 1) / kStridedThreads;
            if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
            SoftmaxStridedFwdKernel<T, decltype(v)::value, kLog>
                <<<static_cast<unsigned>(blocks), kStridedThreads, 0, stream>>>(p);
            return cudaGetLastError();
          });
    };
    return p.log ? run(std::true_type{}) : run(std::false_type{});
  });
}

cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream) {
  if (p.outer == 0 || p.n == 0 || p.inner == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const int64_t span = p.inner == 1 ? p.n : p.inner;
    const bool vec = span % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.dy, 16) &&
                     IsAligned(p.dx, 16);
    auto run = [&](auto log) {
      constexpr bool kLog = decltype(log)::value;
      return LaunchAny<T, kLog, kBwdCacheElems>(
          p, vec,
          [&](auto team, auto v) {
            constexpr int kTeam = decltype(team)::value;
            constexpr int kV = decltype(v)::value;
            using Team = RowTeam<kTeam>;
            return LaunchRowKernel<kPipeStages, 2>(
                SoftmaxRowBwdKernel<T, kTeam, kV, kLog, true>,
                SoftmaxRowBwdKernel<T, kTeam, kV, kLog, false>,
                kV > 1 && p.n <= int64_t{kTeam} * kBwdCacheElems, kPipeSmemBudget, Team::kBlock,
                Team::kTeamsPerBlock, p.outer, p.n * int64_t{sizeof(T)}, p, stream);
          },
          [&](auto v) {
            const int64_t threads = p.outer * (p.inner / decltype(v)::value);
            const int64_t blocks = (threads + kStridedThreads - 1) / kStridedThreads;
            if (blocks >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
            SoftmaxStridedBwdKernel<T, decltype(v)::value, kLog>
                <<<static_cast<unsigned>(blocks), kStridedThreads, 0, stream>>>(p);
            return cudaGetLastError();
          });
    };
    return p.log ? run(std::true_type{}) : run(std::false_type{});
  });
}

}  // namespace jax_dnn
