// The forward's split tail (FwdSchedule): merges the pieces of each split
// tile that CTAs left in the workspace. A piece holds its rows' o normalized
// by its own sum and its lse; the tile's lse = log sum_i exp(lse_i) and
// o = sum_i exp(lse_i - lse) o_i.
// A CTA takes 16 rows of one split tile (blockIdx.x: unit x / cluster, the
// tile of its CTA rank x % cluster): it lists the tile's pieces and each
// row's weights in shared memory once, then a thread sums 8 columns of a row
// over the pieces (16-byte loads, independent across pieces). A warp a row,
// finding the pieces again for every column, takes ~100 us at D = 128
// (S = 2048: as long as 3 work tiles).
#pragma once

#include "ffi/attention/attention_fwd.cuh"

namespace jax_dnn {
namespace attention {

// The most CTAs a split may have (the launcher checks): the piece list.
constexpr int kFwdCombineMaxCtas = 256;
constexpr int kFwdCombineRows = 16;

// kBM: the work tile's rows (128, or 192 for AttentionFwdWideKernel).
template <typename T, int kDv, int kBM>
__global__ void __launch_bounds__(kFwdCombineRows * kDv / 8)
    AttentionFwdCombineKernel(const AttentionFwdParams p, const FwdSchedule s, const int ctas) {
  constexpr int kSlot = kBM * (kDv + 1), kRows = kFwdCombineRows;
  __shared__ int pieces[kFwdCombineMaxCtas + 1];  // workspace slot of cluster c0 + i (this rank), -1: none
  __shared__ float weight[kFwdCombineMaxCtas + 1][kRows];
  __shared__ int c0s, counts, n_pieces;
  const AttentionShape& sh = p.shape;
  const int cl = s.cluster, clusters = ctas / cl;
  const int x = blockIdx.x / cl, rank = blockIdx.x % cl, r0 = blockIdx.y * kRows, tid = threadIdx.x;
  const FwdSplit sp{s.split_tiles, s.key_tiles, clusters};
  const int k0 = x * s.key_tiles, k1 = k0 + s.key_tiles;  // the unit's key tiles
  if (tid == 0) {
    // Clusters [c0, c1) meet the unit: c0 the last whose range starts at or
    // before k0, c1 the first that starts at or after k1 (Lo is nondecreasing).
    int lo = 0, hi = clusters;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (sp.Lo(mid) <= k0) lo = mid; else hi = mid;
    }
    const int c0 = lo;
    lo = c0, hi = clusters;  // Lo(lo) < k1 <= Lo(hi)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (sp.Lo(mid) < k1) lo = mid; else hi = mid;
    }
    c0s = c0, counts = hi - c0, n_pieces = 0;
  }
  __syncthreads();
  const int c0 = c0s, count = counts;
  for (int i = tid; i < count; i += blockDim.x) {
    const int c = c0 + i, lo = sp.Lo(c);
    const bool has = sp.Lo(c + 1) > lo;  // a range may be empty (fewer keys than clusters)
    pieces[i] = has ? 2 * (c * cl + rank) + (x - lo / s.key_tiles) : -1;  // FwdTileAt's slot
    if (has) atomicAdd(&n_pieces, 1);
  }
  __syncthreads();
  if (n_pieces < 2) return;  // one piece alone held the whole tile and wrote it (slot -1)
  FwdWork w;
  FwdWorkAt(s.rounds * clusters + x, 0, false, static_cast<int>((sh.t + kBM - 1) / kBM),
            static_cast<int>(sh.n), kBM, &w, cl, rank);
  const float* ws = s.ws;
  const int64_t row_of_tid = w.m0 + r0 + tid;
  if (tid < kRows && row_of_tid < sh.t) {  // a row's lse and the pieces' weights
    const int r = r0 + tid;
    float mx = -INFINITY;
    for (int i = 0; i < count; ++i)
      if (pieces[i] >= 0) mx = fmaxf(mx, ws[int64_t(pieces[i]) * kSlot + kBM * kDv + r]);
    float sum = 0.f;
    if (mx > -INFINITY)
      for (int i = 0; i < count; ++i)
        if (pieces[i] >= 0) sum += expf(ws[int64_t(pieces[i]) * kSlot + kBM * kDv + r] - mx);
    const float lse = mx > -INFINITY ? mx + logf(sum) : -INFINITY;  // no key allowed: o 0
    for (int i = 0; i < count; ++i)
      weight[i][tid] = pieces[i] >= 0 && lse > -INFINITY
                           ? expf(ws[int64_t(pieces[i]) * kSlot + kBM * kDv + r] - lse) : 0.f;
    p.lse[(int64_t(w.b) * sh.n + w.n) * sh.t + row_of_tid] = lse;
  }
  __syncthreads();
  const int r = tid / (kDv / 8), col = 8 * (tid % (kDv / 8));
  const int64_t row = w.m0 + r0 + r;
  if (row >= sh.t || col >= sh.hv) return;
  float acc[8] = {};
  for (int i = 0; i < count; ++i) {
    if (pieces[i] < 0) continue;
    const float wt = weight[i][r];
    const float4* o = reinterpret_cast<const float4*>(ws + int64_t(pieces[i]) * kSlot + (r0 + r) * kDv + col);
    const float4 a = o[0], b = o[1];
    acc[0] += wt * a.x, acc[1] += wt * a.y, acc[2] += wt * a.z, acc[3] += wt * a.w;
    acc[4] += wt * b.x, acc[5] += wt * b.y, acc[6] += wt * b.z, acc[7] += wt * b.w;
  }
  uint32_t out[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) out[e] = hopper::PackPair<T>(acc[2 * e], acc[2 * e + 1]);
  T* orow = static_cast<T*>(p.o) + ((w.b * sh.t + row) * sh.n + w.n) * sh.hv;
  *reinterpret_cast<uint4*>(orow + col) = make_uint4(out[0], out[1], out[2], out[3]);  // hv % 8 == 0
}

}  // namespace attention
}  // namespace jax_dnn
