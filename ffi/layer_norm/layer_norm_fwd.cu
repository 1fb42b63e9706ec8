// Layer norm / RMS norm forward. See layer_norm.h for the math and layout.
//
// Rows that can be read as 16-byte vectors and fit the register layout
// (ffi/common/row_regs.cuh: up to 512 threads x 8 vectors) take
// LayerNormRegFwdKernel: one team a row, x read from memory once and y
// written once, the minimum traffic. Statistics: RMS norm, one team sum of
// squares a row; layer norm, each thread's exact (count, mean, M2) and two team
// sums (the row sum, then M2_t + count_t (mean_t - mean)^2: no E[x^2] - E[x]^2
// cancellation). Plain sums cost an add a step where merging (count, mean,
// M2) states cost ~10 instructions (that merge remains in the fallback kernel
// below). A plain two-pass about the row mean (x - mean after the first sum)
// took ptxas to 128 registers here, from 80.
//
// Aligned rows wider than that, up to 131072 bf16/fp16 or 65536 fp32, take
// the streamed cluster kernel of layer_norm_fwd_stream.cu (the parameters
// staged in shared memory once, the rows streamed, two a pass). Wider ones, up
// to 262144 bf16/fp16 or 131072 fp32, take the register-row kernel split over
// the blocks of a cluster (ffi/common/row_cluster.cuh): 512 x 8 vectors a
// block, the team sums added over distributed shared memory (layer norm: each
// block's (count, mean, M2), merged in one exchange a row, 2.6% faster than
// two cluster sums at 4096 x 131072 bf16 on an H200, when this kernel ran
// that width). The 16-bit layer norm there, and at the register widths where
// it measured faster (the launcher), takes LayerNormPairFwdKernel, two rows a
// pass, so that each parameter vector is read once for both; at 3585-4096
// wide, one row a 128-thread team of 4 vectors a thread (measured faster
// still).
//
// Rows not read as vectors (a width not a multiple of 16 bytes, or
// misaligned pointers) take the same register-row kernels on rows of single
// elements (ScalarRow, ffi/common/row_regs.cuh): one team a row up to 16384
// wide, the row split over a cluster up to 131072 (LaunchScalar). A thread's
// columns are lane + k * team, so a warp's load reads 32 consecutive
// elements, x is read once and y written once. Their speed is set by the
// bytes in flight, one register an element (H200, bf16 16384 x 4097: 0.24
// ms, XLA 0.086; fp32 at 1024 x 65537 as fast as XLA).
//
// The rest (longer rows) take LayerNormFwdKernel, a row team that caches
// kCacheElems fp32 a thread and re-reads the uncached tail from memory
// (usually L2): two reads of that tail.
#include <algorithm>
#include <type_traits>

#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

// The fallback kernel's register cache: 32 fp32 a thread.
constexpr int kCacheElems = 32;

// kCluster: a row wider than the layout is split over the blocks of a
// cluster (ffi/common/row_cluster.cuh), the blocks' sums (layer norm: their
// (count, mean, M2) states) combined over them.
template <typename T, typename Row, bool kRms, bool kCluster = false>
__global__ void __launch_bounds__(Row::kBlock, kCluster ? 1024 / Row::kBlock : RowMinBlocks<Row>())
    LayerNormRegFwdKernel(LayerNormFwdParams p) {
  constexpr int V = Row::V;
  // Layer norm's two reductions alternate between two slot sets, so each set
  // is rewritten only after every thread has passed the other's barrier,
  // which it reaches after reading this one: no double buffering needed. A
  // cluster exchanges one State a row (ClusterExchange).
  using ClusterState = std::conditional_t<kRms, Sum1, MeanM2>;
  __shared__ typename Row::template Slots<Sum1> slots;
  __shared__ typename Row::template Slots<Sum1> slots2;
  __shared__ typename ClusterExchange<ClusterState, kCluster>::Inbox inbox;
  ClusterExchange<ClusterState, kCluster> exchange(inbox);
  ClusterSyncRelaxed<kCluster>();
  const int64_t n = p.width;
  const RowSplit<Row, kCluster> split(n);
  const int64_t ns = split.width;  // this block's columns of the row
  const int64_t rows_per_set = p.rows / p.param_sets;
  const float inv_n = 1.f / static_cast<float>(n);
  int parity = 0;
  for (int64_t row = split.row0; row < p.rows; row += split.row_step, parity ^= 1) {
    Row r;
    r.Load(static_cast<const T*>(p.x) + row * n + split.col0, ns);
    float mean = 0.f, var;
    if constexpr (kRms) {
      float ss = 0.f;
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
        float f[V];
        r.Get(v, f);  // vectors past the row are zeros
#pragma unroll
        for (int i = 0; i < V; ++i) ss += f[i] * f[i];
      }
      var = RowTotal<Row>(Sum1{ss}, slots, parity, exchange).s * inv_n;
    } else {
      // This thread's exact (count, mean, M2), two passes over its registers;
      // then the row's M2 = sum over threads of M2_t + count_t (mean_t - mean)^2.
      float count = 0.f, sum = 0.f;
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
        float f[V];
        r.Get(v, f);
        if (Row::In(v, ns)) count += V;
#pragma unroll
        for (int i = 0; i < V; ++i) sum += f[i];
      }
      const float local_mean = count > 0.f ? sum * __frcp_rn(count) : 0.f;
      float m2 = 0.f;
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
        if (!Row::In(v, ns)) continue;
        float f[V];
        r.Get(v, f);
#pragma unroll
        for (int i = 0; i < V; ++i) m2 += (f[i] - local_mean) * (f[i] - local_mean);
      }
      // The team's sum, its mean and M2 about that mean (with a cluster, the
      // block's); a cluster then merges the blocks' (count, mean, M2) in a
      // fixed order (Chan; ClusterExchange) in one exchange a row, where two
      // cluster-wide sums took two.
      const float team_n = static_cast<float>(ns);
      mean = Row::Reduce(Sum1{sum}, slots, 0).s * (kCluster ? __frcp_rn(team_n) : inv_n);
      const float d = local_mean - mean;
      float row_m2 = Row::Reduce(Sum1{m2 + count * d * d}, slots2, 0).s;
      if constexpr (kCluster) {
        const MeanM2 st = exchange.Sum(MeanM2{team_n, mean, row_m2});
        mean = st.mean;
        row_m2 = st.m2;
      }
      var = row_m2 * inv_n;
    }
    const float rstd = rsqrtf(var + p.epsilon);
    // The backward's residuals: the row's first thread (with a cluster, rank
    // 0's) writes them.
    if (!kRms && split.col0 == 0 && Row::Lane() == 0) StoreStats(p.stats, row, mean, rstd);
    // Parameters are re-read per row: from L1/L2, not memory.
    const int64_t param_set = row / rows_per_set;
    const float* scale = p.scale + param_set * n + split.col0;
    const float* bias = kRms ? nullptr : p.bias + param_set * n + split.col0;
    T* y = static_cast<T*>(p.y) + row * n + split.col0;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      const int64_t col = Row::Col(v);
      float f[V], g[V], b[V];
      r.Get(v, f);
      LoadVec<float, V>(scale + col, g);
      if constexpr (!kRms) LoadVec<float, V>(bias + col, b);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        f[i] = (f[i] - mean) * rstd * g[i];
        if constexpr (!kRms) f[i] += b[i];
      }
      StoreVec<T, V>(y + col, f);
    }
  }
  ClusterSyncRelaxed<kCluster>();
}

// The 16-bit layer norm two rows a pass: each vector of scale and bias is
// loaded once for both rows. Why: over a cluster, a block's share of the
// fp32 parameters (256 KiB at 512 x 8 vectors) does not fit L1, so
// LayerNormRegFwdKernel re-reads it from L2 for every row, 4x the bytes of x
// it reads from memory (~40% of the stall samples on those loads); in narrow
// teams the same reads from L1 set the pace (see the launcher). kCluster: rows split over a
// cluster, one block an SM (128 registers for two rows, so the bytes in
// flight an SM are those of two one-row blocks), clusters persistent; else
// one team a pair, as LayerNormRegFwdKernel takes one team a row. Pair k is
// rows 2k and 2k + 1, and both are in one parameter param_set (the launcher
// checks).
template <typename T, typename Row, bool kCluster = true>
__global__ void __launch_bounds__(Row::kBlock, kCluster ? 1 : 0) LayerNormPairFwdKernel(LayerNormFwdParams p) {
  constexpr int V = Row::V;
  // Both rows' sums (Sums<2>) and the blocks' (count, mean, M2) of both rows
  // (MeanM2s<2>), merged in one exchange.
  __shared__ typename Row::template Slots<Sums<2>> slots;
  __shared__ typename Row::template Slots<Sums<2>> slots2;
  __shared__ typename ClusterExchange<MeanM2s<2>, kCluster>::Inbox inbox;
  ClusterExchange<MeanM2s<2>, kCluster> exchange(inbox);
  ClusterSyncRelaxed<kCluster>();
  const int64_t n = p.width;
  const RowSplit<Row, kCluster> split(n);
  const int64_t ns = split.width;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const float inv_n = 1.f / static_cast<float>(n);
  const float team_n = static_cast<float>(ns);
  const int64_t pairs = (p.rows + 1) / 2;
  for (int64_t pair = split.row0; pair < pairs; pair += split.row_step) {
    const int64_t row0 = 2 * pair;
    const bool second = row0 + 1 < p.rows;  // an odd last row has no partner
    const T* x = static_cast<const T*>(p.x) + row0 * n + split.col0;
    Row r0, r1;
    r0.Load(x, ns);
    r1.Load(x + n, second ? ns : 0);  // zeros past the rows
    // Each thread's exact (count, mean, M2) of both rows, as in
    // LayerNormRegFwdKernel, then the block's and the cluster's.
    float count = 0.f, sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      float f[V], g[V];
      r0.Get(v, f);
      r1.Get(v, g);
      if (Row::In(v, ns)) count += V;
#pragma unroll
      for (int i = 0; i < V; ++i) sum0 += f[i], sum1 += g[i];
    }
    const float rc = count > 0.f ? __frcp_rn(count) : 0.f;
    const float lm0 = sum0 * rc, lm1 = sum1 * rc;
    float m20 = 0.f, m21 = 0.f;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      float f[V], g[V];
      r0.Get(v, f);
      r1.Get(v, g);
#pragma unroll
      for (int i = 0; i < V; ++i) m20 += (f[i] - lm0) * (f[i] - lm0), m21 += (g[i] - lm1) * (g[i] - lm1);
    }
    const Sums<2> s = Row::Reduce(Sums<2>{{sum0, sum1}}, slots, 0);
    const float mean0 = s.s[0] * __frcp_rn(team_n), mean1 = s.s[1] * __frcp_rn(team_n);
    const float d0 = lm0 - mean0, d1 = lm1 - mean1;
    const Sums<2> q = Row::Reduce(Sums<2>{{m20 + count * d0 * d0, m21 + count * d1 * d1}}, slots2, 0);
    const MeanM2s<2> st = exchange.Sum(MeanM2s<2>{{{team_n, mean0, q.s[0]}, {team_n, mean1, q.s[1]}}});
    const float rstd0 = rsqrtf(st.r[0].m2 * inv_n + p.epsilon);
    const float rstd1 = rsqrtf(st.r[1].m2 * inv_n + p.epsilon);
    if (split.col0 == 0 && (kCluster ? threadIdx.x : Row::Lane()) == 0) {  // a cluster block is one team
      StoreStats(p.stats, row0, st.r[0].mean, rstd0);
      if (second) StoreStats(p.stats, row0 + 1, st.r[1].mean, rstd1);
    }
    const int64_t param_set = row0 / rows_per_set;
    const float* scale = p.scale + param_set * n + split.col0;
    const float* bias = p.bias + param_set * n + split.col0;
    T* y = static_cast<T*>(p.y) + row0 * n + split.col0;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      const int64_t col = Row::Col(v);
      float f[V], g[V], b[V];
      LoadVec<float, V>(scale + col, g);
      LoadVec<float, V>(bias + col, b);
      r0.Get(v, f);
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = (f[i] - st.r[0].mean) * rstd0 * g[i] + b[i];
      StoreVec<T, V>(y + col, f);
      if (!second) continue;
      r1.Get(v, f);
#pragma unroll
      for (int i = 0; i < V; ++i) f[i] = (f[i] - st.r[1].mean) * rstd1 * g[i] + b[i];
      StoreVec<T, V>(y + n + col, f);
    }
  }
  ClusterSyncRelaxed<kCluster>();
}

template <typename T, int kTeam, int V, bool kRms>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock)
    LayerNormFwdKernel(LayerNormFwdParams p) {
  using Team = RowTeam<kTeam>;
  constexpr int kCache = kCacheElems / V;
  __shared__ typename Team::Scratch scratch;

  const int lane = Team::Lane();
  const int64_t n = p.width;
  const int64_t stride = static_cast<int64_t>(kTeam) * V;  // columns per chunk
  const int64_t chunks = (n + stride - 1) / stride;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t group_stride = static_cast<int64_t>(gridDim.x) * Team::kTeamsPerBlock;

  // This thread's columns of scale and bias, kept across rows of a param_set.
  float gs[kCache][V], bs[kCache][V];
  int64_t loaded_set = -1;

  // All teams of a block step through rows together so that every thread
  // reaches the team reductions' barriers, including teams past the last row.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Team::kTeamsPerBlock; base < p.rows;
       base += group_stride) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + row * n;
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
      for (int64_t c = kCache; c < chunks; ++c) {
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
      for (int64_t c = kCache; c < chunks; ++c) {
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
    if (!kRms && valid && lane == 0) StoreStats(p.stats, row, mean, rstd);
    if (valid) {
      const int64_t param_set = row / rows_per_set;
      const float* scale = p.scale + param_set * n;
      const float* bias = kRms ? nullptr : p.bias + param_set * n;
      if (param_set != loaded_set) {  // once per block unless vmap batched the parameters
        loaded_set = param_set;
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
      for (int64_t c = kCache; c < chunks; ++c) {
        const int64_t col = (c * kTeam + lane) * V;
        if (col >= n) continue;
        float v[V], g[V], b[V];
        LoadVec<T, V>(x + col, v);
        LoadVec<float, V>(scale + col, g);
        if constexpr (!kRms) LoadVec<float, V>(bias + col, b);
        write(col, v, g, b);
      }
    }
  }
}

// Rows of any width up to 16384 (ScalarRow: 512 threads x 32 elements) that
// are not read as vectors take LayerNormRegFwdKernel with one element a
// "vector"; up to 8 times 16384 (512 x 32 a block), the same over a cluster.
// The rest take the fallback.
constexpr int kScalarStepElems = 16;
constexpr int kScalarMaxElems = 32;
constexpr int kScalarClusterElems = 32;

template <typename T, bool kRms>
cudaError_t LaunchScalar(const LayerNormFwdParams& p, cudaStream_t stream) {
  if (p.width <= ScalarRowMaxWidth<kScalarMaxElems>()) {
    return DispatchScalarRow<T, kScalarStepElems, kScalarMaxElems>(p.width, [&](auto row) {
      using Row = decltype(row);
      LayerNormRegFwdKernel<T, Row, kRms><<<RowGrid(Row::kTeams, p.rows), Row::kBlock, 0, stream>>>(p);
      return cudaGetLastError();
    });
  }
  using Row = ScalarRow<T, 512, kScalarClusterElems>;
  return LaunchRowClusters(LayerNormRegFwdKernel<T, Row, kRms, true>,
                           ClusterBlocks(p.width, RowSplit<Row, true>::kSegment), Row::kBlock,
                           /*smem=*/0, p.rows, p, stream);
}

template <typename T, int V, bool kRms>
cudaError_t Launch(const LayerNormFwdParams& p, cudaStream_t stream) {
  if constexpr (V == 1) {
    if (p.width <= kMaxClusterBlocks * ScalarRowMaxWidth<kScalarClusterElems>())
      return LaunchScalar<T, kRms>(p, stream);
  }
  if (V > 1 && p.width <= RegRowMaxWidth<T>()) {
    // A non-persistent grid of `units` (rows or pairs of rows), one a team of R.
    auto launch = [&](auto kernel, auto r, int64_t units) {
      using R = decltype(r);
      kernel<<<RowGrid(R::kTeams, units), R::kBlock, 0, stream>>>(p);
      return cudaGetLastError();
    };
    return DispatchRegRow<T>(p.width, [&](auto row) {
      using Row = decltype(row);
      // The 16-bit layer norm takes two rows a pass where that measured
      // faster: the one-row kernel reads 8 bytes of fp32 scale and bias for
      // every 2 bytes of x, from L1 in narrow teams (ncu at 4096 wide: L1
      // wavefronts 68% of peak, against 44% for the RMS norm) and from L2 in
      // 512-thread teams (past 16384 the block's share outgrows L1). H200,
      // fwd, time of pairs over one row: 16384 x 2048 0.947, x 3072 0.936,
      // 4096 x 20480 0.743; elsewhere (1024, 8192, 12288, 16384 wide) they
      // tie or lose (1.000-1.021).
      //
      // Past 3584 wide (up to 4096) one row a 128-thread team of 4 vectors a
      // thread (52 registers) beats both: 0.972 of the two-row kernel's time
      // at 16384 x 4096 bf16 (1.001 at 3584, 1.037 at 3072).
      constexpr bool kPairs =
          !kRms && sizeof(T) == 2 && Row::kVecs == 8 && (Row::kTeam <= 64 || Row::kTeam == 512);
      if constexpr (kPairs) {
        if (Row::kTeam == 64 && p.width > 3584)
          return launch(LayerNormRegFwdKernel<T, RegRow<T, 128, 4>, kRms>, RegRow<T, 128, 4>{}, p.rows);
        if (p.param_sets == 1 || (p.rows / p.param_sets) % 2 == 0)
          return launch(LayerNormPairFwdKernel<T, Row, false>, row, (p.rows + 1) / 2);
      }
      return launch(LayerNormRegFwdKernel<T, Row, kRms>, row, p.rows);
    });
  }
  // Wider rows up to 131072 (fp32: 65536): streamed clusters
  // (layer_norm_fwd_stream.cu).
  if (V > 1 && p.width <= LayerNormStreamFwdMaxWidth(sizeof(T))) return LaunchLayerNormStreamFwd(p, stream);
  // Wider still (up to 8 blocks of 512 x 8 vectors: 262144, fp32 131072): the
  // register-row kernels over a cluster.
  if (V > 1 && p.width <= kMaxClusterBlocks * RegRowMaxWidth<T>()) {
    using Row = RegRow<T, 512, 8>;
    // Layer norm at 16 bits: persistent clusters (as many as fit at once, each
    // striding over rows) rather than one a row: 1024 x 262144 bf16 384 us
    // against 427 (H200, fwd). Not for the RMS norm, which they slow at 4096
    // x 131072 (659 us against 615), nor fp32 (even).
    constexpr bool kPersistent = !kRms && sizeof(T) == 2;
    const int blocks = ClusterBlocks(p.width, RowSplit<Row, true>::kSegment);
    if constexpr (kPersistent) {
      // Two rows a pass where both rows of every pair share their parameters
      // (4096 x 131072 bf16: 674 us against 704 one row a pass, H200).
      if (p.param_sets == 1 || (p.rows / p.param_sets) % 2 == 0)
        return LaunchRowClusters(LayerNormPairFwdKernel<T, Row>, blocks, Row::kBlock, /*smem=*/0,
                                 (p.rows + 1) / 2, p, stream, /*persistent=*/true);
    }
    return LaunchRowClusters(LayerNormRegFwdKernel<T, Row, kRms, true>,
                             blocks, Row::kBlock, /*smem=*/0, p.rows, p, stream, kPersistent);
  }
  auto fallback = [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    using Team = RowTeam<kTeam>;
    LayerNormFwdKernel<T, kTeam, V, kRms>
        <<<RowGrid(Team::kTeamsPerBlock, p.rows), Team::kBlock, 0, stream>>>(p);
    return cudaGetLastError();
  };
  // Aligned rows reach the fallback only when longer than the cluster split:
  // the widest team.
  if constexpr (V > 1) {
    return fallback(std::integral_constant<int, 512>{});
  } else {
    return DispatchTeam(p.width, kCacheElems, fallback);
  }
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
