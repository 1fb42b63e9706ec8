// Per-thread statistics shared by the layer norm forward and backward kernels.
#pragma once

#include <cstdint>

#include "ffi/common/row_team.cuh"

namespace jax_dnn {

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

// MeanM2 of x plus, for g = dy * scale, G = sum(g) and S = sum(g * (x - mean)):
// the backward's two row sums, mergeable like a covariance, so one team
// reduction gives them all.
struct MeanM2Grad {
  float n, mean, m2, g, s;
  __device__ static MeanM2Grad Merge(const MeanM2Grad& a, const MeanM2Grad& b) {
    const float n = a.n + b.n;
    if (n == 0.f) return a;
    const float delta = b.mean - a.mean;
    const MeanM2 ms = MeanM2::Merge({a.n, a.mean, a.m2}, {b.n, b.mean, b.m2});
    // S about the merged mean: S_a + G_a (m_a - m) + S_b + G_b (m_b - m).
    return {n, ms.mean, ms.m2, a.g + b.g,
            a.s + b.s + delta * (b.g * a.n - a.g * b.n) * __frcp_rn(n)};
  }
};

// RMS norm backward's two row sums (sum x^2, sum g x) as one mergeable state.
struct SumSqGrad {
  float ss, sgx;
  __device__ static SumSqGrad Merge(const SumSqGrad& a, const SumSqGrad& b) {
    return {a.ss + b.ss, a.sgx + b.sgx};
  }
};

// The layer-norm backward's second reduction, about the row mean found by the
// first: M2 = sum (x - mean)^2, G = sum g, S = sum g (x - mean). Plain sums:
// a two-pass over a register-resident row is exact where a merge of
// per-thread (count, mean, M2, G, S) states (MeanM2Grad) costs ~15
// instructions a merge; ncu showed that merge doubling the kernel's
// instructions (LN 177M vs RMS 87M at 16384 x 8192 bf16).
struct CenteredGrad {
  float m2, g, s;
  __device__ static CenteredGrad Merge(const CenteredGrad& a, const CenteredGrad& b) {
    return {a.m2 + b.m2, a.g + b.g, a.s + b.s};
  }
};

}  // namespace jax_dnn
