// Layer norm / RMS norm backward. See layer_norm.h for the layout.
//
//   mean, rstd recomputed from x as in the forward
//   xhat = (x - mean) * rstd         (RMS norm: x * rstd)
//   g    = dy * scale
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMS norm: no mean(g) term)
//   dscale = sum over rows of dy * xhat,  dbias = sum over rows of dy
//
// One team reduction per row gives the statistics and both row sums
// (MeanM2Grad in layer_norm_stats.cuh).
// Stage 1 (this file): each block owns a strided set of rows of one group and
// keeps its dscale/dbias partial sums for its columns in registers; at the end
// the block writes one row of partials. Stage 2 (ffi/common/column_sum.cu) sums
// the partials of each group in a fixed order. No atomics: deterministic.
// Traffic: x and dy read once, dx written once (the statistics are recomputed
// from the row held in registers, so nothing is saved by the forward), plus the partials
// (groups * parts * sums * width fp32, a few percent of the main traffic).
#include <algorithm>

#include "ffi/common/column_sum.h"
#include "ffi/common/row_pipeline.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

// 16 fp32 per thread: x, dy, scale and two accumulators are cached, 80 values
// (~110 registers with ptxas's choice: two 256-thread blocks per SM); more
// would cut occupancy further.
constexpr int kCacheElems = 16;
// Row groups in flight per block when pipelined (x and dy each), and the most
// shared memory a block's stages may take.
constexpr int kPipeStages = 4;
constexpr size_t kPipeSmemBudget = 96 * 1024;

// kPipe: x and dy rows arrive in shared memory through BulkRowPipeline
// (ffi/common/row_pipeline.cuh); the whole row is then cached (no tail).
template <typename T, int kTeam, int V, bool kRms, bool kPipe>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock)
    LayerNormBwdKernel(LayerNormBwdParams p) {
  using Team = RowTeam<kTeam>;
  using Pipe = BulkRowPipeline<kPipeStages, 2>;
  extern __shared__ __align__(128) char smem[];
  constexpr int kCache = kCacheElems / V;
  constexpr int kSums = kRms ? 1 : 2;
  __shared__ typename Team::Scratch scratch;

  const int lane = Team::Lane();
  const int64_t n = p.width;
  const int64_t stride = static_cast<int64_t>(kTeam) * V;
  const int64_t chunks = (n + stride - 1) / stride;
  const int64_t rows_per_group = p.rows / p.groups;
  const int64_t group = blockIdx.x / p.parts;
  const int64_t part = blockIdx.x % p.parts;
  const float inv_n = 1.f / static_cast<float>(n);
  const float* scale = p.scale + group * n;
  // This block's row of partials; the uncached tail of a wide row accumulates
  // here directly (only one team per block then, and each column always
  // belongs to the same thread, so no other thread touches it).
  float* partial = p.partials + blockIdx.x * static_cast<int64_t>(kSums) * n;
  for (int64_t c = kCache; c < chunks; ++c) {
    const int64_t col = (c * kTeam + lane) * V;
    if (col >= n) continue;
    for (int s = 0; s < kSums; ++s)
      for (int i = 0; i < V; ++i) partial[s * n + col + i] = 0.f;
  }

  // This thread's columns of scale: a block stays in one group, so they are
  // loaded once (zero on padding columns).
  float scs[kCache][V];
#pragma unroll
  for (int c = 0; c < kCache; ++c) {
    const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
#pragma unroll
    for (int i = 0; i < V; ++i) scs[c][i] = 0.f;
    if (col < n) LoadVec<float, V>(scale + col, scs[c]);
  }
  float acc_scale[kCache][V] = {};
  float acc_bias[kCache][V] = {};
  const int64_t step = p.parts * Team::kTeamsPerBlock;
  Pipe pipe(smem, static_cast<uint32_t>(Team::kTeamsPerBlock * n * sizeof(T)));
  const T* arrays[2] = {static_cast<const T*>(p.x), static_cast<const T*>(p.dy)};
  auto issue = [&](int k) {
    const int64_t first = part * Team::kTeamsPerBlock + k * step;  // within the group
    if (first >= rows_per_group) return;
    const int64_t count =
        rows_per_group - first < Team::kTeamsPerBlock ? rows_per_group - first : Team::kTeamsPerBlock;
    pipe.IssueRows(k, arrays, group * rows_per_group + first, count, n);
  };
  if constexpr (kPipe) pipe.Start(issue);

  int k = 0;
  for (int64_t base = part * Team::kTeamsPerBlock; base < rows_per_group; base += step, ++k) {
    const int64_t local = base + Team::Team();
    const bool valid = local < rows_per_group;
    const int64_t row = group * rows_per_group + local;
    const T* x = static_cast<const T*>(p.x) + row * n;
    const T* dy = static_cast<const T*>(p.dy) + row * n;
    if constexpr (kPipe) {
      pipe.Wait(k);
      x = pipe.template Row<T>(k, 0, Team::Team(), n);
      dy = pipe.template Row<T>(k, 1, Team::Team(), n);
    }
    T* dx = static_cast<T*>(p.dx) + row * n;
    // Calls fn(col, x, dy, scale) for each chunk of the uncached tail (wide
    // rows only), re-reading it from memory.
    auto for_tail = [&](auto fn) {
      for (int64_t c = kCache; !kPipe && c < chunks; ++c) {
        const int64_t col = (c * kTeam + lane) * V;
        if (!valid || col >= n) continue;
        float xv[V], dv[V], sc[V];
        LoadVec<T, V>(x + col, xv);
        LoadVec<T, V>(dy + col, dv);
        LoadVec<float, V>(scale + col, sc);
        fn(col, xv, dv, sc);
      }
    };

    // Load the row (padding is zero).
    float xv[kCache][V], dyv[kCache][V];
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
      if (valid && col < n) {
        LoadVec<T, V>(x + col, xv[c]);
        LoadVec<T, V>(dy + col, dyv[c]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) xv[c][i] = dyv[c][i] = 0.f;
      }
    }
    auto load_scale = [&](int c, float (&sc)[V]) {
#pragma unroll
      for (int i = 0; i < V; ++i) sc[i] = scs[c][i];
    };

    // One team reduction gives the forward statistics and both row sums of
    // the dx formula (sum g and sum g * xhat = rstd * sum g (x - mean)).
    float mean = 0.f, rstd, sum_g = 0.f, sum_gx;
    if constexpr (kRms) {
      float ss = 0.f, sgx = 0.f;
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        float sc[V];
        load_scale(c, sc);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          ss += xv[c][i] * xv[c][i];
          sgx += dyv[c][i] * sc[i] * xv[c][i];
        }
      }
      for_tail([&](int64_t, const float(&v)[V], const float(&d)[V], const float(&g)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) ss += v[i] * v[i], sgx += d[i] * g[i] * v[i];
      });
      Team::Sum2(ss, sgx, scratch);
      rstd = rsqrtf(ss * inv_n + p.epsilon);
      sum_gx = sgx * rstd;
    } else {
      const MeanM2 ms = LocalMeanM2<kTeam, V, kCache>(xv, lane, n);
      MeanM2Grad st{ms.n, ms.mean, ms.m2, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        float sc[V];
        load_scale(c, sc);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float g = dyv[c][i] * sc[i];  // zero on padding
          st.g += g;
          st.s += g * (xv[c][i] - ms.mean);
        }
      }
      for_tail([&](int64_t, const float(&v)[V], const float(&d)[V], const float(&g)[V]) {
        const MeanM2 cm = ChunkMeanM2<V>(v);
        MeanM2Grad chunk{cm.n, cm.mean, cm.m2, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < V; ++i) {
          chunk.g += d[i] * g[i];
          chunk.s += d[i] * g[i] * (v[i] - cm.mean);
        }
        st = MeanM2Grad::Merge(st, chunk);
      });
      st = Team::Reduce(st, scratch);
      mean = st.mean;
      rstd = rsqrtf(st.m2 * inv_n + p.epsilon);
      sum_g = st.g;
      sum_gx = st.s * rstd;
    }
#pragma unroll
    for (int c = 0; c < kCache; ++c)
#pragma unroll
      for (int i = 0; i < V; ++i) xv[c][i] = (xv[c][i] - mean) * rstd;  // now xhat
    const float mean_g = kRms ? 0.f : sum_g * inv_n;
    const float mean_gx = sum_gx * inv_n;
    if (valid) {
      // dx and the parameter-gradient partials.
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
        if (col >= n) continue;
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          out[i] = rstd * (dyv[c][i] * scs[c][i] - mean_g - xv[c][i] * mean_gx);
          acc_scale[c][i] += dyv[c][i] * xv[c][i];
          acc_bias[c][i] += dyv[c][i];
        }
        StoreVec<T, V>(dx + col, out);
      }
      for_tail([&](int64_t col, const float(&v)[V], const float(&d)[V], const float(&g)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (v[i] - mean) * rstd;
          out[i] = rstd * (d[i] * g[i] - mean_g - xh * mean_gx);
          partial[col + i] += d[i] * xh;
          if constexpr (!kRms) partial[n + col + i] += d[i];
        }
        StoreVec<T, V>(dx + col, out);
      });
    }
    if constexpr (kPipe) {
      pipe.Advance(k, issue);
    }
  }

  // Combine the teams of this block in a fixed order (team 0 first), then
  // team 0 writes the block's partials for the cached columns.
#pragma unroll
  for (int c = 0; c < kCache; ++c) {
    const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
    if constexpr (Team::kTeamsPerBlock > 1) {
      __shared__ float share[Team::kTeamsPerBlock][kTeam][2][V];
      __syncthreads();
#pragma unroll
      for (int i = 0; i < V; ++i) {
        share[Team::Team()][lane][0][i] = acc_scale[c][i];
        share[Team::Team()][lane][1][i] = acc_bias[c][i];
      }
      __syncthreads();
      if (Team::Team() == 0) {
        for (int t = 1; t < Team::kTeamsPerBlock; ++t) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            acc_scale[c][i] += share[t][lane][0][i];
            acc_bias[c][i] += share[t][lane][1][i];
          }
        }
      }
    }
    if (Team::Team() == 0 && col < n) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        partial[col + i] = acc_scale[c][i];
        if constexpr (!kRms) partial[n + col + i] = acc_bias[c][i];
      }
    }
  }
}

template <typename T, int V, bool kRms>
cudaError_t Launch(const LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchTeam(p.width, kCacheElems, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    using Team = RowTeam<kTeam>;
    using Pipe = BulkRowPipeline<kPipeStages, 2>;
    const int64_t blocks = p.groups * p.parts;
    if (blocks > (int64_t{1} << 30)) return cudaErrorInvalidValue;
    // One block per (group, part): the grid is fixed by the partials buffer.
    const size_t smem = Pipe::SmemBytes(
        static_cast<uint32_t>(Team::kTeamsPerBlock * p.width * int64_t{sizeof(T)}));
    if (V > 1 && p.width <= int64_t{kTeam} * kCacheElems && smem <= kPipeSmemBudget) {
      auto kernel = LayerNormBwdKernel<T, kTeam, V, kRms, true>;
      if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        if (e != cudaSuccess) return e;
      }
      kernel<<<static_cast<unsigned>(blocks), Team::kBlock, smem, stream>>>(p);
    } else {
      LayerNormBwdKernel<T, kTeam, V, kRms, false>
          <<<static_cast<unsigned>(blocks), Team::kBlock, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchLayerNormBwd(const LayerNormBwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) {
    // Empty rows: the parameter gradients are zeros.
    if (p.width == 0) return cudaSuccess;
    cudaError_t e = cudaMemsetAsync(p.dscale, 0, p.groups * p.width * sizeof(float), stream);
    if (e == cudaSuccess && !p.rms)
      e = cudaMemsetAsync(p.dbias, 0, p.groups * p.width * sizeof(float), stream);
    return e;
  }
  cudaError_t status = DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.width % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.dy, 16) &&
                     IsAligned(p.dx, 16) && IsAligned(p.scale, sizeof(float) * kVec);
    if (p.rms) return vec ? Launch<T, kVec, true>(p, stream) : Launch<T, 1, true>(p, stream);
    return vec ? Launch<T, kVec, false>(p, stream) : Launch<T, 1, false>(p, stream);
  });
  if (status != cudaSuccess) return status;
  ColumnSumParams cs{};
  cs.partials = p.partials;
  cs.out[0] = p.dscale;
  cs.out[1] = p.dbias;
  cs.groups = p.groups;
  cs.parts = p.parts;
  cs.sums = p.rms ? 1 : 2;
  cs.width = p.width;
  return LaunchColumnSum(cs, stream);
}

}  // namespace jax_dnn
