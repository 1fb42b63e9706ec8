// One thread's part of the layer/RMS-norm backward on a register row (RegRow,
// ffi/common/row_regs.cuh): the param_set's scale staged in shared memory, the
// per-thread row sums, and the dx coefficients. Shared by the register-row
// kernel (layer_norm_bwd.cu) and the streamed one (layer_norm_bwd_stream.cu),
// which differ in where the rows come from and where the partial parameter
// gradients accumulate.
#pragma once

#include <cstdint>

#include "ffi/common/row_regs.cuh"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {

// One team's columns of the param_set's scale in shared memory, as
// [vector][quad][lane] float4s (consecutive lanes on consecutive 16 bytes: no
// bank conflicts).
template <typename Row>
struct ScaleSlice {
  static constexpr int kQuads = Row::V / 4;  // float4s a vector
  static constexpr int kFloat4s = Row::kVecs * kQuads * Row::kTeam;
  float4* s;
  int lane = Row::Lane();

  // Copies scale[0, ns), zeros past it (ns % V == 0, so a float4 is wholly in
  // or out). All the block's threads call it; the caller synchronizes.
  __device__ void Stage(const float* scale, int64_t ns) const {
    for (int i = threadIdx.x; i < kFloat4s; i += Row::kBlock) {
      const int vq = i / Row::kTeam;
      const int64_t col =
          (int64_t{vq / kQuads} * Row::kTeam + i % Row::kTeam) * Row::V + 4 * (vq % kQuads);
      s[i] = col < ns ? *reinterpret_cast<const float4*>(scale + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // This lane's scale for its vector v.
  __device__ void Get(int v, float (&g)[Row::V]) const {
#pragma unroll
    for (int q = 0; q < kQuads; ++q) {
      const float4 a = s[(v * kQuads + q) * Row::kTeam + lane];
      g[4 * q] = a.x, g[4 * q + 1] = a.y, g[4 * q + 2] = a.z, g[4 * q + 3] = a.w;
    }
  }
};

// Calls fn(v, x, dy, scale) with this thread's values of each of its vectors
// v in the first ns columns, widened to fp32. Vectors past the row are zeros
// and would add nothing to a sum, but skipping them keeps ptxas from hoisting
// every vector's unpacking at once (without it the 16-bit kernels spilled up
// to 88 bytes under the 128-register bound).
template <typename Row, typename Scale, typename Fn>
__device__ __forceinline__ void ForEachVec(const Row& x, const Row& dy, const Scale& scale,
                                           int64_t ns, Fn&& fn) {
  constexpr int V = Row::V;
#pragma unroll
  for (int v = 0; v < Row::kVecs; ++v) {
    if (!Row::In(v, ns)) continue;
    float f[V], d[V], g[V];
    x.Get(v, f);
    dy.Get(v, d);
    scale.Get(v, g);
    fn(v, f, d, g);
  }
}

// RMS norm: this thread's sum x^2 and sum g x (g = dy * scale) over its
// vectors of the first ns columns.
template <typename Row, typename Scale>
__device__ __forceinline__ SumSqGrad ThreadSumSqGrad(const Row& x, const Row& dy,
                                                     const Scale& scale, int64_t ns) {
  float ss = 0.f, sgx = 0.f;
  ForEachVec(x, dy, scale, ns, [&](int, const auto& f, const auto& d, const auto& g) {
#pragma unroll
    for (int i = 0; i < Row::V; ++i) ss += f[i] * f[i], sgx += d[i] * g[i] * f[i];
  });
  return {ss, sgx};
}

// Layer norm: this thread's sums about the row's `mean` (GradSums).
template <typename Row, typename Scale>
__device__ __forceinline__ GradSums ThreadGradSums(const Row& x, const Row& dy, const Scale& scale,
                                                   int64_t ns, float mean) {
  float gsum = 0.f, gx = 0.f;
  ForEachVec(x, dy, scale, ns, [&](int, const auto& f, const auto& d, const auto& g) {
#pragma unroll
    for (int i = 0; i < Row::V; ++i) {
      const float gi = d[i] * g[i];
      gsum += gi, gx += gi * (f[i] - mean);
    }
  });
  return {gsum, gx};
}

// Layer norm's saved (mean, rstd) of the rows a team visits in order (row0,
// row0 + step, ... below end), 32 rows a batch: lane k of each warp holds the
// k-th row's of the batch, a row's are shuffled out, and the next batch is
// loaded when this one starts, 32 rows before it is needed. Why: against
// recomputing the stats the backward takes 0.84 of the time at 4096 x 131072
// bf16 and 0.77 at 4096 x 40000 (H200); loaded one row ahead, as x and dy
// are, 0.90 and 0.92.
struct StatsFeed {
  const float* stats;  // [rows, 2]
  int64_t base, step, end;  // the batch's first row, the stride, the end
  float2 cur, next;
  int k = 0;  // the next row's place in the batch (uniform over the team)

  __device__ StatsFeed(const float* stats_, int64_t row0, int64_t step_, int64_t end_)
      : stats(stats_), base(row0 - 32 * step_), step(step_), end(end_) {
    next = LaneStats(row0);
  }
  // The stats of the next row in order. Every thread of the team calls it.
  __device__ float2 Get() {
    if (k == 0) {
      base += 32 * step;
      cur = next;
      next = LaneStats(base + 32 * step);
    }
    const float2 s = {__shfl_sync(0xffffffffu, cur.x, k), __shfl_sync(0xffffffffu, cur.y, k)};
    k = (k + 1) & 31;
    return s;
  }

 private:
  // This lane's row of the batch starting at `first`.
  __device__ float2 LaneStats(int64_t first) const {
    const int64_t row = first + static_cast<int64_t>(threadIdx.x % 32) * step;
    return row < end ? LoadStats(stats, row) : make_float2(0.f, 0.f);
  }
};

// dx = rstd * (dy * scale - mean_g - xhat * mean_gx), from the row's totals.
struct NormBwdCoeffs {
  float rstd, mean_g, mean_gx;
};
__device__ __forceinline__ NormBwdCoeffs BwdCoeffs(const SumSqGrad& st, float inv_n, float eps) {
  const float rstd = rsqrtf(st.ss * inv_n + eps);
  return {rstd, 0.f, st.sgx * rstd * inv_n};
}
__device__ __forceinline__ NormBwdCoeffs BwdCoeffs(const GradSums& st, float inv_n, float rstd) {
  return {rstd, st.g * inv_n, st.s * rstd * inv_n};
}

}  // namespace jax_dnn
