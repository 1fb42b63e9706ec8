// Layer norm / RMS norm backward. See layer_norm.h for the layout.
//
//   mean, rstd: the forward's (stats)   (RMS norm: rstd recomputed from x)
//   xhat = (x - mean) * rstd         (RMS norm: x * rstd)
//   g    = dy * scale
//   dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMS norm: no mean(g) term)
//   dscale = sum over rows of dy * xhat,  dbias = sum over rows of dy
//
// The two row sums come from one team reduction a row: RMS norm's sum x^2
// and sum g x (SumSqGrad), layer norm's sum g and sum g (x - mean) about the
// forward's mean (GradSums, layer_norm_stats.cuh).
//
// Stage 1 (this file): blocks are persistent within one param_set of rows; each
// thread owns the same columns in every row it visits, so it accumulates the
// dscale/dbias partial sums of those columns across rows; at the end each
// block writes one row of partials. Stage 2 (ffi/common/column_sum.cu) sums
// the partials of each param_set in a fixed order. No atomics: deterministic.
// Traffic: x and dy read once, dx written once, layer norm's stats (8 bytes a
// row), plus the partials (param_sets * parts * sums * width fp32, a few percent of
// the rest).
//
// Rows that can be read as 16-byte vectors and are at most 4096 bf16/fp16
// (2048 fp32) wide take LayerNormRegBwdKernel: a team of 32-128 threads a
// row, two or more teams a 256-thread block, each thread holding up to 4
// vectors of x and of dy as packed elements (ffi/common/row_regs.cuh), the
// next row's loads issued before the current row is used, scale and the
// partial sums in shared memory. Why: at 16384 x 4096 bf16 (H200) this beats
// partial sums in registers (which spill under the 128-register bound),
// wider teams with fewer vectors, a bulk-copy pipeline (194 us under ncu,
// against 112-114 us), and a streamed form with several teams a block
// (1.007-1.12 of its time at 1024-4096 wide).
// Teams of 128 threads (rows of 2049-4096 bf16/fp16, 1025-2048 fp32) also
// prefetch the row after next into L2 with one bulk request a row and
// operand (PrefetchL2): a third row in flight that holds no registers. H200,
// bwd: layer norm 16384 x 4096 bf16 0.949 of the time without it (RMS norm
// 0.945-1.006); narrower teams lose with it (1.00-1.07: many small requests,
// one a 32- or 64-thread team).
// Wider aligned rows, up to 32 times (131072 bf16/fp16, 65536 fp32), take the
// streamed kernel (layer_norm_bwd_stream.cu): one block a row, or a cluster
// for rows wider than one block's layout.
// Rows not read as vectors (a width not a multiple of 16 bytes) up to 8192
// wide take LayerNormScalarBwdKernel, the register-row kernel's scheme on
// rows of single elements (ScalarRow). Other rows take LayerNormBwdKernel, a
// row team caching kCacheElems fp32 a thread that re-reads the uncached tail
// of a wide row (4096 x 131072 bf16: 7% of copy; 1024 x 65537 bf16: 0.32 of
// XLA's speed, H200).
#include <type_traits>

#include "ffi/common/column_sum.h"
#include "ffi/common/device_info.h"
#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_bwd_row.cuh"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

// The register-row kernel: blocks of 256 threads (several teams when the team
// is narrower) under a 128-register bound, so two blocks fit an SM.
constexpr int kRegMinBlock = 256;
constexpr int kRegThreadsPerSM = 512;

// Shared memory of LayerNormRegBwdKernel, in float4 "slices" of one team's
// columns laid out [vector][quad][lane] (consecutive lanes touch consecutive
// 16 bytes: no bank conflicts): the param_set's scale, then per team kSums slices
// of partial sums.
template <typename Row, int kSums>
constexpr size_t RegBwdSmemBytes() {
  return sizeof(float4) * Row::kVecs * (Row::V / 4) * Row::kTeam * (1 + Row::kTeams * kSums);
}

template <typename T, typename Row, bool kRms>
__global__ void __launch_bounds__(Row::kBlock, kRegThreadsPerSM / Row::kBlock)
    LayerNormRegBwdKernel(LayerNormBwdParams p) {
  constexpr int V = Row::V;
  constexpr int kQuads = V / 4;  // float4s a vector
  constexpr int kTeam = Row::kTeam;
  constexpr int kSums = kRms ? 1 : 2;
  constexpr int kSlice = Row::kVecs * kQuads * kTeam;
  // One reduction a row, its slots double-buffered by the row's parity.
  using State = std::conditional_t<kRms, SumSqGrad, GradSums>;
  __shared__ typename Row::template Slots<State> slots;
  extern __shared__ float4 smem[];
  const int lane = Row::Lane();
  const int team = Row::Team();
  auto at = [&](int slice, int v, int q) -> float4& {
    return smem[slice * kSlice + (v * kQuads + q) * kTeam + lane];
  };
  const int acc0 = 1 + team * kSums;  // this team's first accumulator slice

  // A block is a (param_set, part) and covers the whole row.
  const int64_t n = p.width;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const int64_t unit = blockIdx.x;
  const int64_t param_set = unit / p.parts;
  const int64_t part = unit % p.parts;
  const float inv_n = 1.f / static_cast<float>(n);
  // The first row's loads go out before the scale is staged: their latency
  // overlaps the staging's.
  const int64_t first_row = param_set * rows_per_set;
  const T* x_base = static_cast<const T*>(p.x) + first_row * n;
  const T* dy_base = static_cast<const T*>(p.dy) + first_row * n;
  T* dx_base = static_cast<T*>(p.dx) + first_row * n;
  const int64_t step = p.parts * Row::kTeams;
  int64_t local = part * Row::kTeams + team;
  Row x, dy;
  if (local < rows_per_set) {
    x.Load(x_base + local * n, n);
    dy.Load(dy_base + local * n, n);
  }
  // Layer norm: the rows' (mean, rstd) (unused by RMS norm: no loads).
  StatsFeed stats_feed(kRms ? nullptr : p.stats + 2 * first_row, local, step,
                       kRms ? 0 : rows_per_set);
  // Stage the param_set's scale (slice 0) and zero this thread's accumulators.
  const ScaleSlice<Row> scale{smem};
  scale.Stage(p.scale + param_set * n, n);
#pragma unroll
  for (int s = 0; s < kSums; ++s)
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v)
#pragma unroll
      for (int q = 0; q < kQuads; ++q) at(acc0 + s, v, q) = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
  int parity = 0;
  // Teams of 128 threads or more also ask L2 for the row after next, one
  // bulk request a row and operand (see the file comment).
  constexpr bool kPrefetch = Row::kTeam >= 128;
  for (; local < rows_per_set; local += step, parity ^= 1) {
    // The next row's loads go out before this row is used: its latency
    // overlaps this row's reduction and stores.
    if (kPrefetch && lane == 0 && local + 2 * step < rows_per_set) {
      PrefetchL2(x_base + (local + 2 * step) * n, static_cast<uint32_t>(n * sizeof(T)));
      PrefetchL2(dy_base + (local + 2 * step) * n, static_cast<uint32_t>(n * sizeof(T)));
    }
    Row x_next, dy_next;
    if (local + step < rows_per_set) {
      x_next.Load(x_base + (local + step) * n, n);
      dy_next.Load(dy_base + (local + step) * n, n);
    }
    float2 stats = {0.f, 0.f};
    if constexpr (!kRms) stats = stats_feed.Get();
    // This thread's share of the two row sums, then the row's, and the dx
    // coefficients (RMS norm: rstd from the sum of squares; layer norm: the
    // forward's mean and rstd).
    const float mean = stats.x;  // layer norm
    NormBwdCoeffs c;
    if constexpr (kRms) {
      c = BwdCoeffs(Row::Reduce(ThreadSumSqGrad(x, dy, scale, n), slots, parity), inv_n,
                    p.epsilon);
    } else {
      c = BwdCoeffs(Row::Reduce(ThreadGradSums(x, dy, scale, n, mean), slots, parity), inv_n,
                    /*rstd=*/stats.y);
    }
    // Plain copies: a lambda may not capture structured bindings in C++17.
    const float rstd = c.rstd, mean_g = c.mean_g, mean_gx = c.mean_gx;
    // dx, and the partial sums of dy * xhat (and dy) in shared memory.
    T* dx = dx_base + local * n + lane * V;
    ForEachVec(x, dy, scale, n, [&](int v, auto& f, const auto& d, const auto& g) {
      float out[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        f[i] = (f[i] - mean) * rstd;  // xhat
        out[i] = rstd * (d[i] * g[i] - mean_g - f[i] * mean_gx);
      }
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        float4& a = at(acc0, v, q);
        a.x += d[4 * q] * f[4 * q], a.y += d[4 * q + 1] * f[4 * q + 1];
        a.z += d[4 * q + 2] * f[4 * q + 2], a.w += d[4 * q + 3] * f[4 * q + 3];
        if constexpr (!kRms) {
          float4& b = at(acc0 + 1, v, q);
          b.x += d[4 * q], b.y += d[4 * q + 1], b.z += d[4 * q + 2], b.w += d[4 * q + 3];
        }
      }
      StoreOrdered16<T>(dx + v * kTeam * V, out);
    });
    x = x_next;
    dy = dy_next;
  }

  // The block's row of partials: team 0 adds the other teams' sums in team
  // order (fixed: deterministic).
  if constexpr (Row::kTeams > 1) __syncthreads();
  if (team != 0) return;
  float* partial = p.partials + unit * kSums * n;
#pragma unroll
  for (int s = 0; s < kSums; ++s) {
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const int64_t col = Row::Col(v) + 4 * q;
        if (col >= n) continue;
        float4 a = at(1 + s, v, q);
        for (int t = 1; t < Row::kTeams; ++t) {
          const float4 b = smem[(1 + t * kSums + s) * kSlice + (v * kQuads + q) * kTeam + lane];
          a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
        }
        *reinterpret_cast<float4*>(partial + s * n + col) = a;
      }
    }
  }
}

// Rows not read as vectors, up to ScalarBwdMaxWidth: LayerNormRegBwdKernel's
// scheme on ScalarRow (one element a "vector", ffi/common/row_regs.cuh).
// Lane l of a team holds columns l + k * kTeam of every row it visits, so
// the param_set's scale and the team's partial sums sit in shared memory in
// column order (slice 0 the scale, then kSums slices a team; consecutive
// lanes on consecutive floats: no bank conflicts), and the next row's x and
// dy are loaded before this row is used. 16 elements a thread at most: x and
// dy of two rows take 64 registers.
constexpr int kScalarStepElems = 8;
constexpr int kScalarMaxElems = 16;
constexpr int kScalarMaxTeam = 512;
constexpr int64_t ScalarBwdMaxWidth() {
  return ScalarRowMaxWidth<kScalarMaxElems, kScalarMaxTeam>();
}

template <typename Row, int kSums>
constexpr size_t ScalarBwdSmemBytes() {
  return sizeof(float) * Row::kVecs * Row::kTeam * (1 + Row::kTeams * kSums);
}

// The param_set's scale in shared memory in column order (zeros past the row),
// read by a thread at its columns.
template <typename Row>
struct ScalarScaleSlice {
  const float* s;
  int lane = Row::Lane();
  // All the block's threads call it; the caller synchronizes.
  __device__ static void Stage(float* s, const float* scale, int64_t n) {
    for (int i = threadIdx.x; i < Row::kVecs * Row::kTeam; i += Row::kBlock) s[i] = i < n ? scale[i] : 0.f;
  }
  __device__ void Get(int v, float (&g)[1]) const { g[0] = s[v * Row::kTeam + lane]; }
};

template <typename T, typename Row, bool kRms>
__global__ void __launch_bounds__(Row::kBlock, Row::kBlock < kRegThreadsPerSM ? kRegThreadsPerSM / Row::kBlock : 1)
    LayerNormScalarBwdKernel(LayerNormBwdParams p) {
  constexpr int kTeam = Row::kTeam;
  constexpr int kSums = kRms ? 1 : 2;
  constexpr int kSlice = Row::kVecs * kTeam;
  using State = std::conditional_t<kRms, SumSqGrad, GradSums>;
  __shared__ typename Row::template Slots<State> slots;
  extern __shared__ float smem_f[];
  const int lane = Row::Lane();
  const int team = Row::Team();
  float* acc = smem_f + (1 + team * kSums) * kSlice + lane;  // this thread's first accumulator

  const int64_t n = p.width;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const int64_t unit = blockIdx.x;
  const int64_t param_set = unit / p.parts;
  const int64_t part = unit % p.parts;
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t first_row = param_set * rows_per_set;
  const T* x_base = static_cast<const T*>(p.x) + first_row * n;
  const T* dy_base = static_cast<const T*>(p.dy) + first_row * n;
  T* dx_base = static_cast<T*>(p.dx) + first_row * n;
  const int64_t step = p.parts * Row::kTeams;
  int64_t local = part * Row::kTeams + team;
  Row x, dy;
  if (local < rows_per_set) {
    x.Load(x_base + local * n, n);
    dy.Load(dy_base + local * n, n);
  }
  StatsFeed stats_feed(kRms ? nullptr : p.stats + 2 * first_row, local, step,
                       kRms ? 0 : rows_per_set);
  ScalarScaleSlice<Row>::Stage(smem_f, p.scale + param_set * n, n);
  const ScalarScaleSlice<Row> scale{smem_f};
#pragma unroll
  for (int s = 0; s < kSums; ++s)
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) acc[s * kSlice + v * kTeam] = 0.f;
  __syncthreads();
  int parity = 0;
  for (; local < rows_per_set; local += step, parity ^= 1) {
    Row x_next, dy_next;
    if (local + step < rows_per_set) {
      x_next.Load(x_base + (local + step) * n, n);
      dy_next.Load(dy_base + (local + step) * n, n);
    }
    float2 stats = {0.f, 0.f};
    if constexpr (!kRms) stats = stats_feed.Get();
    const float mean = stats.x;  // layer norm
    NormBwdCoeffs c;
    if constexpr (kRms) {
      c = BwdCoeffs(Row::Reduce(ThreadSumSqGrad(x, dy, scale, n), slots, parity), inv_n,
                    p.epsilon);
    } else {
      c = BwdCoeffs(Row::Reduce(ThreadGradSums(x, dy, scale, n, mean), slots, parity), inv_n,
                    /*rstd=*/stats.y);
    }
    const float rstd = c.rstd, mean_g = c.mean_g, mean_gx = c.mean_gx;
    T* dx = dx_base + local * n + lane;
    ForEachVec(x, dy, scale, n, [&](int v, auto& f, const auto& d, const auto& g) {
      const float xhat = (f[0] - mean) * rstd;
      acc[v * kTeam] += d[0] * xhat;
      if constexpr (!kRms) acc[kSlice + v * kTeam] += d[0];
      // dy * scale rounded as in the row sum (not contracted into an FMA):
      // a row whose values are all equal (width 1) gets exactly 0.
      dx[v * kTeam] = FromFloat<T>(rstd * (__fmul_rn(d[0], g[0]) - mean_g - xhat * mean_gx));
    });
    x = x_next;
    dy = dy_next;
  }

  // The block's row of partials: team 0 adds the other teams' sums in team
  // order (fixed: deterministic).
  if constexpr (Row::kTeams > 1) __syncthreads();
  if (team != 0) return;
  float* partial = p.partials + unit * kSums * n;
#pragma unroll
  for (int s = 0; s < kSums; ++s) {
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      const int64_t col = Row::Col(v);
      if (col >= n) continue;
      float a = acc[s * kSlice + v * kTeam];
      for (int t = 1; t < Row::kTeams; ++t) a += smem_f[(1 + t * kSums + s) * kSlice + v * kTeam + lane];
      partial[s * n + col] = a;
    }
  }
}

// 16 fp32 per thread: x, dy, scale and two accumulators are cached, 80 values
// (~110 registers with ptxas's choice: two 256-thread blocks per SM); more
// would cut occupancy further.
constexpr int kCacheElems = 16;

template <typename T, int kTeam, int V, bool kRms>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock)
    LayerNormBwdKernel(LayerNormBwdParams p) {
  using Team = RowTeam<kTeam>;
  constexpr int kCache = kCacheElems / V;
  constexpr int kSums = kRms ? 1 : 2;
  __shared__ typename Team::Scratch scratch;

  const int lane = Team::Lane();
  const int64_t n = p.width;
  const int64_t stride = static_cast<int64_t>(kTeam) * V;
  const int64_t chunks = (n + stride - 1) / stride;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const int64_t param_set = blockIdx.x / p.parts;
  const int64_t part = blockIdx.x % p.parts;
  const float inv_n = 1.f / static_cast<float>(n);
  const float* scale = p.scale + param_set * n;
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

  // This thread's columns of scale: a block stays in one param_set, so they are
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
  for (int64_t base = part * Team::kTeamsPerBlock; base < rows_per_set; base += step) {
    const int64_t local = base + Team::Team();
    const bool valid = local < rows_per_set;
    const int64_t row = param_set * rows_per_set + local;
    const T* x = static_cast<const T*>(p.x) + row * n;
    const T* dy = static_cast<const T*>(p.dy) + row * n;
    T* dx = static_cast<T*>(p.dx) + row * n;
    // Calls fn(col, x, dy, scale) for each chunk of the uncached tail (wide
    // rows only), re-reading it from memory.
    auto for_tail = [&](auto fn) {
      for (int64_t c = kCache; c < chunks; ++c) {
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

    // One team reduction gives both row sums of the dx formula (sum g and
    // sum g * xhat = rstd * sum g (x - mean)); RMS norm's also gives rstd,
    // layer norm's mean and rstd are the forward's.
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
      const float2 ms = valid ? LoadStats(p.stats, row) : make_float2(0.f, 0.f);
      mean = ms.x;
      rstd = ms.y;
      float sg = 0.f, sgx = 0.f;
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        float sc[V];
        load_scale(c, sc);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float g = dyv[c][i] * sc[i];  // zero on padding
          sg += g;
          sgx += g * (xv[c][i] - mean);
        }
      }
      for_tail([&](int64_t, const float(&v)[V], const float(&d)[V], const float(&g)[V]) {
#pragma unroll
        for (int i = 0; i < V; ++i) sg += d[i] * g[i], sgx += d[i] * g[i] * (v[i] - mean);
      });
      Team::Sum2(sg, sgx, scratch);
      sum_g = sg;
      sum_gx = sgx * rstd;
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

// The register-row kernel's teams: up to 128 threads (several a block).
constexpr int kRegMaxTeam = 128;
template <typename T>
constexpr int64_t RegBwdMaxWidth() {
  return RegRowMaxWidth<T, kNormBwdVecs, kRegMaxTeam>();
}

// Launches the register-row kernel, persistent (BwdParts); sets p.parts to
// the blocks a param_set used.
template <typename T, bool kRms>
cudaError_t LaunchReg(LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchRegRow<T, kNormBwdVecs, kRegMinBlock, kRegMaxTeam>(p.width, [&](auto row) {
    using Row = decltype(row);
    auto kernel = LayerNormRegBwdKernel<T, Row, kRms>;
    const size_t smem = RegBwdSmemBytes<Row, kRms ? 1 : 2>();
    unsigned resident = 0;
    cudaError_t e = PersistentGrid(kernel, Row::kBlock, smem, 1LL << 30, &resident);
    if (e != cudaSuccess) return e;
    p.parts = BwdParts(p, resident, Row::kTeams);
    if (p.param_sets * p.parts > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
    kernel<<<static_cast<unsigned>(p.param_sets * p.parts), Row::kBlock, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

// Launches the scalar register-row kernel, persistent; sets p.parts as
// LaunchReg does.
template <typename T, bool kRms>
cudaError_t LaunchScalar(LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchScalarRow<T, kScalarStepElems, kScalarMaxElems, kRegMinBlock, kScalarMaxTeam>(
      p.width, [&](auto row) {
        using Row = decltype(row);
        auto kernel = LayerNormScalarBwdKernel<T, Row, kRms>;
        const size_t smem = ScalarBwdSmemBytes<Row, kRms ? 1 : 2>();
        unsigned resident = 0;
        cudaError_t e = PersistentGrid(kernel, Row::kBlock, smem, 1LL << 30, &resident);
        if (e != cudaSuccess) return e;
        p.parts = BwdParts(p, resident, Row::kTeams);
        if (p.param_sets * p.parts > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
        kernel<<<static_cast<unsigned>(p.param_sets * p.parts), Row::kBlock, smem, stream>>>(p);
        return cudaGetLastError();
      });
}

// The fallback: one block per (param_set, part) of the workspace.
template <typename T, int V, bool kRms>
cudaError_t Launch(const LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchTeam(p.width, kCacheElems, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    const int64_t blocks = p.param_sets * p.parts;
    if (blocks > (int64_t{1} << 30)) return cudaErrorInvalidValue;
    LayerNormBwdKernel<T, kTeam, V, kRms>
        <<<static_cast<unsigned>(blocks), RowTeam<kTeam>::kBlock, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchLayerNormBwd(const LayerNormBwdParams& params, cudaStream_t stream) {
  LayerNormBwdParams p = params;  // the register-row launch lowers p.parts
  if (p.rows == 0 || p.width == 0) {
    // Empty rows: the parameter gradients are zeros.
    if (p.width == 0) return cudaSuccess;
    cudaError_t e = cudaMemsetAsync(p.dscale, 0, p.param_sets * p.width * sizeof(float), stream);
    if (e == cudaSuccess && !p.rms)
      e = cudaMemsetAsync(p.dbias, 0, p.param_sets * p.width * sizeof(float), stream);
    return e;
  }
  cudaError_t status = DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.width % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.dy, 16) &&
                     IsAligned(p.dx, 16) && IsAligned(p.scale, sizeof(float) * kVec);
    if (vec && p.width <= RegBwdMaxWidth<T>())
      return p.rms ? LaunchReg<T, true>(p, stream) : LaunchReg<T, false>(p, stream);
    if (vec && p.width <= LayerNormStreamBwdMaxWidth(sizeof(T))) return LaunchLayerNormStreamBwd(p, stream);
    if (!vec && p.width <= ScalarBwdMaxWidth())
      return p.rms ? LaunchScalar<T, true>(p, stream) : LaunchScalar<T, false>(p, stream);
    if (p.rms) return vec ? Launch<T, kVec, true>(p, stream) : Launch<T, 1, true>(p, stream);
    return vec ? Launch<T, kVec, false>(p, stream) : Launch<T, 1, false>(p, stream);
  });
  if (status != cudaSuccess) return status;
  ColumnSumParams cs{};
  cs.partials = p.partials;
  cs.out[0] = p.dscale;
  cs.out[1] = p.dbias;
  cs.param_sets = p.param_sets;
  cs.parts = p.parts;
  cs.sums = p.rms ? 1 : 2;
  cs.width = p.width;
  return LaunchColumnSum(cs, stream);
}

}  // namespace jax_dnn
