// Per-thread statistics shared by the layer norm forward and backward kernels.
#pragma once

#include <cstdint>

#include "ffi/common/row_team.cuh"

namespace jax_dnn {

// Layer norm's residuals: (mean, rstd) of `row` at stats[2 * row].
__device__ __forceinline__ void StoreStats(float* stats, int64_t row, float mean, float rstd) {
  *reinterpret_cast<float2*>(stats + 2 * row) = make_float2(mean, rstd);
}
__device__ __forceinline__ float2 LoadStats(const float* stats, int64_t row) {
  return *reinterpret_cast<const float2*>(stats + 2 * row);
}

// Exact (count, mean, M2) of one thread's cached values: buf[c] holds the V
// values at column (c * kTeam + lane) * V when that column is < n.
template <int kTeam, int V, int kCache>
__device__ __forceinline__ MeanM2 LocalMeanM2(const float (&buf)[kCache][V], int lane, int64_t n) {
  float count = 0.f, sum = 0.f;
#pragma unroll
  for (int c = 0; c < kCache; ++c) {
    if ((c * static_cast<int64_t>(kTeam) + lane) * V < n) {
      count += V;
#pragma unroll
      for (int i = 0; i < V; ++i) sum += buf[c][i];
    }
  }
  const float mean = count > 0.f ? sum * __frcp_rn(count) : 0.f;
  float m2 = 0.f;
#pragma unroll
  for (int c = 0; c < kCache; ++c) {
    if ((c * static_cast<int64_t>(kTeam) + lane) * V < n) {
#pragma unroll
      for (int i = 0; i < V; ++i) m2 += (buf[c][i] - mean) * (buf[c][i] - mean);
    }
  }
  return {count, mean, m2};
}

template <int V>
__device__ __forceinline__ MeanM2 ChunkMeanM2(const float (&v)[V]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) sum += v[i];
  const float mean = sum * (1.f / V);
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) m2 += (v[i] - mean) * (v[i] - mean);
  return {static_cast<float>(V), mean, m2};
}

// K rows' plain sums, and K rows' (count, mean, M2), as mergeable States:
// the forwards that take several rows a pass merge them in one reduction.
template <int K>
struct Sums {
  float s[K];
  __device__ static Sums Merge(const Sums& a, const Sums& b) {
    Sums c;
#pragma unroll
    for (int k = 0; k < K; ++k) c.s[k] = a.s[k] + b.s[k];
    return c;
  }
};
template <int K>
struct MeanM2s {
  MeanM2 r[K];
  __device__ static MeanM2s Merge(const MeanM2s& a, const MeanM2s& b) {
    MeanM2s c;
#pragma unroll
    for (int k = 0; k < K; ++k) c.r[k] = MeanM2::Merge(a.r[k], b.r[k]);
    return c;
  }
};

// RMS norm backward's two row sums (sum x^2, sum g x) as one mergeable state.
struct SumSqGrad {
  float ss, sgx;
  __device__ static SumSqGrad Merge(const SumSqGrad& a, const SumSqGrad& b) {
    return {a.ss + b.ss, a.sgx + b.sgx};
  }
};

// The layer-norm backward's row sums about the forward's mean (its saved
// stats), g = dy * scale: G = sum g, S = sum g (x - mean): one team
// reduction a row.
struct GradSums {
  float g, s;
  __device__ static GradSums Merge(const GradSums& a, const GradSums& b) {
    return {a.g + b.g, a.s + b.s};
  }
};

}  // namespace jax_dnn
