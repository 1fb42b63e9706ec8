// Layer norm / RMS norm forward. See layer_norm.h for the math and layout.
//
// One row per "row team" (ffi/common/row_team.cuh): the narrowest team whose
// register cache (kCacheElems fp32 per thread) holds the row. Then x is read
// from memory once and y written once, the minimum traffic (2 * rows * width
// elements). Statistics take one team reduction per row: each thread's exact
// (count, mean, M2) is merged across the team (no E[x^2] - E[x]^2
// cancellation). Rows wider than the widest team's cache (512 * kCacheElems)
// re-read the uncached tail from memory (usually L2): two reads of that tail.
#include <algorithm>

#include "ffi/common/row_pipeline.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

// 32 fp32 per thread: a 4096-wide bf16 row fits a 128-thread team. With
// scale and bias also held in registers (96 values) the pipelined kernel
// keeps several blocks per SM; its rows wait in shared memory, not registers.
constexpr int kCacheElems = 32;
// Row groups in flight per block when pipelined, and the most shared memory a
// block's stages may take (so that several blocks share an SM).
constexpr int kPipeStages = 4;
constexpr size_t kPipeSmemBudget = 96 * 1024;

// kPipe: rows arrive in shared memory through BulkRowPipeline
// (ffi/common/row_pipeline.cuh), kPipeStages row groups ahead; the whole row
// is then cached (no uncached tail).
template <typename T, int kTeam, int V, bool kRms, bool kPipe>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock)
    LayerNormFwdKernel(LayerNormFwdParams p) {
  using Team = RowTeam<kTeam>;
  using Pipe = BulkRowPipeline<kPipeStages, 1>;
  constexpr int kCache = kCacheElems / V;
  __shared__ typename Team::Scratch scratch;
  extern __shared__ __align__(128) char smem[];

  const int lane = Team::Lane();
  const int64_t n = p.width;
  const int64_t stride = static_cast<int64_t>(kTeam) * V;  // columns per chunk
  const int64_t chunks = (n + stride - 1) / stride;
  const int64_t rows_per_group = p.rows / p.groups;
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t group_stride = static_cast<int64_t>(gridDim.x) * Team::kTeamsPerBlock;

  Pipe pipe(smem, static_cast<uint32_t>(Team::kTeamsPerBlock * n * sizeof(T)));
  const T* arrays[1] = {static_cast<const T*>(p.x)};
  auto issue = [&](int k) {
    const int64_t first = static_cast<int64_t>(blockIdx.x) * Team::kTeamsPerBlock + k * group_stride;
    if (first >= p.rows) return;
    const int64_t count = p.rows - first < Team::kTeamsPerBlock ? p.rows - first : Team::kTeamsPerBlock;
    pipe.IssueRows(k, arrays, first, count, n);
  };
  if constexpr (kPipe) pipe.Start(issue);

  // This thread's columns of scale and bias, kept across rows (the persistent
  // pipelined grid walks many rows; re-reading them per row cost as many L1/L2
  // loads as the row itself).
  float gs[kCache][V], bs[kCache][V];
  int64_t param_group = -1;

  // All teams of a block step through rows together so that every thread
  // reaches the team reductions' barriers, including teams past the last row.
  int k = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Team::kTeamsPerBlock; base < p.rows;
       base += group_stride, ++k) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + row * n;
    if constexpr (kPipe) {
      pipe.Wait(k);
      x = pipe.template Row<T>(k, 0, Team::Team(), n);
    }
    T* y = static_cast<T*>(p.y) + row * n;

    float buf[kCache][V];
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
      if (valid && col < n) {
        LoadVec<T, V>(x + col, buf[c]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) buf[c][i] = 0.f;  // padding adds nothing below
      }
    }
    // One team reduction per row. Layer norm: each thread's exact (count,
    // mean, M2) over its values, merged across the team (row_team.cuh).
    // RMS norm: the sum of squares.
    float mean = 0.f, var;
    if constexpr (kRms) {
      float s1 = 0.f;
#pragma unroll
      for (int c = 0; c < kCache; ++c)
#pragma unroll
        for (int i = 0; i < V; ++i) s1 += buf[c][i] * buf[c][i];
      for (int64_t c = kCache; !kPipe && c < chunks; ++c) {
        const int64_t col = (c * kTeam + lane) * V;
        if (!valid || col >= n) continue;
        float v[V];
        LoadVec<T, V>(x + col, v);
#pragma unroll
        for (int i = 0; i < V; ++i) s1 += v[i] * v[i];
      }
      var = Team::Sum(s1, scratch) * inv_n;
    } else {
      MeanM2 st = LocalMeanM2<kTeam, V, kCache>(buf, lane, n);
      for (int64_t c = kCache; !kPipe && c < chunks; ++c) {
        const int64_t col = (c * kTeam + lane) * V;
        if (!valid || col >= n) continue;
        float v[V];
        LoadVec<T, V>(x + col, v);
        st = MeanM2::Merge(st, ChunkMeanM2<V>(v));
      }
      st = Team::Reduce(st, scratch);
      mean = st.mean;
      var = st.m2 * inv_n;
    }
    const float rstd = rsqrtf(var + p.epsilon);
    if (valid) {
      const int64_t group = row / rows_per_group;
      const float* scale = p.scale + group * n;
      const float* bias = kRms ? nullptr : p.bias + group * n;
      if (group != param_group) {  // once per block unless vmap batched the parameters
        param_group = group;
#pragma unroll
        for (int c = 0; c < kCache; ++c) {
          const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
          if (col >= n) continue;
          LoadVec<float, V>(scale + col, gs[c]);
          if constexpr (!kRms) LoadVec<float, V>(bias + col, bs[c]);
        }
      }
      auto write = [&](int64_t col, const float (&v)[V], const float (&g)[V], const float (&b)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          out[i] = (v[i] - mean) * rstd * g[i];
          if constexpr (!kRms) out[i] += b[i];
        }
        StoreVec<T, V>(y + col, out);
      };
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = (c * static_cast<int64_t>(kTeam) + lane) * V;
        if (col < n) write(col, buf[c], gs[c], bs[c]);
      }
      for (int64_t c = kCache; !kPipe && c < chunks; ++c) {
        const int64_t col = (c * kTeam + lane) * V;
        if (col >= n) continue;
        float v[V], g[V], b[V];
        LoadVec<T, V>(x + col, v);
        LoadVec<float, V>(scale + col, g);
        if constexpr (!kRms) LoadVec<float, V>(bias + col, b);
        write(col, v, g, b);
      }
    }
    if constexpr (kPipe) {
      pipe.Advance(k, issue);
    }
  }
}

template <typename T, int V, bool kRms>
cudaError_t Launch(const LayerNormFwdParams& p, cudaStream_t stream) {
  return DispatchTeam(p.width, kCacheElems, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    using Team = RowTeam<kTeam>;
    // Pipelined only when aligned (V > 1) and the row fits the register cache.
    return LaunchRowKernel<kPipeStages, 1>(
        LayerNormFwdKernel<T, kTeam, V, kRms, true>, LayerNormFwdKernel<T, kTeam, V, kRms, false>,
        V > 1 && p.width <= int64_t{kTeam} * kCacheElems, kPipeSmemBudget, Team::kBlock,
        Team::kTeamsPerBlock, p.rows, p.width * int64_t{sizeof(T)}, p, stream);
  });
}

}  // namespace

cudaError_t LaunchLayerNormFwd(const LayerNormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    // Vector access needs every row start and parameter row 16-byte aligned.
    const bool vec = p.width % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16) &&
                     IsAligned(p.scale, sizeof(float) * kVec) &&
                     (p.rms || IsAligned(p.bias, sizeof(float) * kVec));
    if (p.rms) return vec ? Launch<T, kVec, true>(p, stream) : Launch<T, 1, true>(p, stream);
    return vec ? Launch<T, kVec, false>(p, stream) : Launch<T, 1, false>(p, stream);
  });
}

}  // namespace jax_dnn
