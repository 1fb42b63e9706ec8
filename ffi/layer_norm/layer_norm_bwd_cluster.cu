// Layer norm / RMS norm backward of rows wider than the register layout
// (16384 < width <= 131072 bf16/fp16, 8192 < width <= 65536 fp32, read as
// 16-byte vectors): the math of layer_norm_bwd.cu, each row split over the
// blocks of a cluster (ffi/common/row_cluster.cuh).
//
// A block is one team of 512 threads holding an equal share of the row
// (RowSplit, at most 512 x 4 vectors of x and of dy); the row sums add the
// blocks' team sums over distributed shared memory, one exchange a row
// (ClusterExchange). Clusters are persistent within a group of rows, so each
// thread keeps the same columns in every row it visits:
//   - the next two rows' x and dy stream into shared memory (RowFeed) while
//     this one is reduced and written;
//   - the dscale/dbias partial sums of its 32 (bf16) or 16 (fp32) columns
//     accumulate in registers, and each block writes its share of one row of
//     partials at the end (column_sum.cu adds them in a fixed order);
//   - the group's scale is staged in shared memory once.
// Why: the earlier form kept the partial sums and scale in shared memory (192
// KiB at 131072 bf16), loaded the next row into registers, and ran at 39%
// (layer norm) and 55% (RMS norm) of copy bandwidth at 4096 x 131072 bf16;
// with the partials in registers, the shared memory holds two streamed rows.
// H200 A/B against that form (us, bwd): 4096 x 131072 bf16 layer norm 2003 ->
// 1757, RMS norm 1409 -> 1103; 2048 x 65536 bf16 471 -> 323, 338 -> 274; 4096
// x 32768 fp32 640 -> 536, 590 -> 476. An earlier form streaming one row
// ahead (not two) was 0.77-0.87 of the old kernel's time for RMS norm on one
// H200 but 0.98-1.04 on two others, the old kernel's time being the same on
// all three.
// Then the exchange became pushes (ClusterExchange, no cluster barrier a
// row), H200 A/B (us, bwd): 4096 x 131072 bf16 layer norm 1752 -> 1113, RMS
// norm 1094 -> 818; 4096 x 40000 436 -> 368, 383 -> 270.
#include <algorithm>
#include <type_traits>

#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_bwd_row.cuh"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

template <typename T>
using ClusterRow = RegRow<T, 512, kNormBwdVecs>;

// x and dy, two rows ahead.
template <typename T>
using Feed = RowFeed<T, ClusterRow<T>, true, 2, 2>;

// Dynamic shared memory: the feed's row buffers (128 KiB), then the block's
// share of scale (64 KiB at 16 bits, 32 KiB at fp32; ScaleSlice).
template <typename T>
constexpr size_t ScaleOffset() {
  return Feed<T>::kSmemBytes;
}
template <typename T>
constexpr size_t SmemBytes() {
  return ScaleOffset<T>() + sizeof(float) * RowSplit<ClusterRow<T>, true>::kSegment;
}
// Within sm_90's 227 KiB a block, with room for the static shared memory.
static_assert(SmemBytes<__nv_bfloat16>() <= 226 * 1024 && SmemBytes<float>() <= 226 * 1024);

// One exchange a row: the blocks' team sums (RMS norm: sum x^2 and sum g x;
// layer norm: sum g and sum g (x - mean) about the forward's mean, read with
// its rstd from the saved stats one row ahead). Before the stats were saved,
// the layer norm also found the mean (a block reduction and a pass over the
// registers) and the blocks merged (n, mean, M2, G, S) by Chan's formula.
//
// 1 block an SM: 128 registers for a share of x and dy (32 registers at
// 16 bits) and the partial sums (64 for layer norm).
template <typename T, bool kRms>
__global__ void __launch_bounds__(512, 1) LayerNormClusterBwdKernel(LayerNormBwdParams p) {
  using Row = ClusterRow<T>;
  constexpr int V = Row::V;
  constexpr int kQuads = V / 4;  // float4s a vector
  constexpr int kSums = kRms ? 1 : 2;
  using State = std::conditional_t<kRms, SumSqGrad, GradSums>;
  __shared__ typename Row::template Slots<State> slots;
  __shared__ typename ClusterExchange<State>::Inbox inbox;
  extern __shared__ uint4 dynamic_smem[];
  const ScaleSlice<Row> scale{reinterpret_cast<float4*>(dynamic_smem + ScaleOffset<T>() / 16)};

  const int64_t n = p.width;
  const int64_t rows_per_group = p.rows / p.groups;
  RowSplit<Row, true> split(n);
  const int64_t col0 = split.col0, ns = split.width;
  const int64_t unit = split.row0;  // the cluster: a (group, part)
  const int64_t group = unit / p.parts;
  const int64_t part = unit % p.parts;
  // This part's rows of the group: part, part + parts, ...
  split.row0 = part;
  split.row_step = p.parts;
  const int64_t first_row = group * rows_per_group;
  const int64_t first = first_row * n;
  Feed<T> feed({static_cast<const T*>(p.x) + first, static_cast<const T*>(p.dy) + first}, n,
               split, rows_per_group);

  ClusterExchange<State> exchange(inbox);

  // Stage the group's scale, this block's share of it.
  scale.Stage(p.scale + group * n + col0, ns);
  __syncthreads();
  ClusterSyncRelaxed<true>();  // the peers' inboxes are ready

  float acc[kSums][Row::kVecs][V] = {};
  const float inv_n = 1.f / static_cast<float>(n);
  T* const dx_base = static_cast<T*>(p.dx) + first + col0;
  // Layer norm: the rows' (mean, rstd) (unused by RMS norm: no loads).
  StatsFeed stats_feed(kRms ? nullptr : p.stats + 2 * first_row, split.row0, split.row_step,
                       kRms ? 0 : rows_per_group);
  int parity = 0;
  for (int64_t row = split.row0; row < rows_per_group; row += split.row_step, parity ^= 1) {
    float2 stats = {0.f, 0.f};
    if constexpr (!kRms) stats = stats_feed.Get();
    Row x, dy;
    feed.Get(row, x, dy);
    const float mean = stats.x;  // layer norm
    NormBwdCoeffs c;
    if constexpr (kRms) {
      c = BwdCoeffs(RowTotal<Row>(ThreadSumSqGrad(x, dy, scale, ns), slots, parity, exchange),
                    inv_n, p.epsilon);
    } else {
      c = BwdCoeffs(RowTotal<Row>(ThreadGradSums(x, dy, scale, ns, mean), slots, parity, exchange),
                    inv_n, /*rstd=*/stats.y);
    }
    const float rstd = c.rstd, mean_g = c.mean_g, mean_gx = c.mean_gx;
    T* dx = dx_base + row * n;
    // The loop of ForEachVec written out: as a lambda it compiled to other
    // SASS here (not measured), where the register-row kernel's is the same.
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      float f[V], d[V], g[V], out[V];
      x.Get(v, f);
      dy.Get(v, d);
      scale.Get(v, g);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float xhat = (f[i] - mean) * rstd;
        out[i] = rstd * (d[i] * g[i] - mean_g - xhat * mean_gx);
        acc[0][v][i] += d[i] * xhat;
        if constexpr (!kRms) acc[kSums - 1][v][i] += d[i];
      }
      StoreOrdered16<T>(dx + Row::Col(v), out);
    }
  }
  ClusterSyncRelaxed<true>();  // every push to this block has landed
  float* partial = p.partials + unit * kSums * n + col0;
#pragma unroll
  for (int s = 0; s < kSums; ++s) {
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
#pragma unroll
      for (int q = 0; q < kQuads; ++q)
        *reinterpret_cast<float4*>(partial + s * n + Row::Col(v) + 4 * q) =
            make_float4(acc[s][v][4 * q], acc[s][v][4 * q + 1], acc[s][v][4 * q + 2],
                        acc[s][v][4 * q + 3]);
    }
  }
}

template <typename T, bool kRms>
cudaError_t Launch(LayerNormBwdParams& p, cudaStream_t stream) {
  auto kernel = LayerNormClusterBwdKernel<T, kRms>;
  const int blocks = ClusterBlocks(p.width, RowSplit<ClusterRow<T>, true>::kSegment);
  if (blocks < 2 || blocks > kMaxClusterBlocks) return cudaErrorInvalidValue;
  ClusterLaunch launch(blocks, ClusterRow<T>::kBlock, SmemBytes<T>(), stream);
  int resident = 0;
  cudaError_t e = ResidentClusters(kernel, launch, &resident);
  if (e != cudaSuccess) return e;
  // As many clusters a group as fit at once (at most the workspace's parts),
  // trimmed to the fewest parts that keep the most rows a part.
  const int64_t rows_per_group = p.rows / p.groups;
  int64_t parts = std::max<int64_t>(1, resident / p.groups);
  parts = std::min({parts, p.parts, rows_per_group});
  const int64_t per_part = (rows_per_group + parts - 1) / parts;
  parts = (rows_per_group + per_part - 1) / per_part;
  if (p.groups * parts * blocks > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  p.parts = parts;
  launch.cfg.gridDim = dim3(static_cast<unsigned>(p.groups * parts * blocks));
  e = cudaLaunchKernelEx(&launch.cfg, kernel, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLayerNormClusterBwd(LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return p.rms ? Launch<T, true>(p, stream) : Launch<T, false>(p, stream);
  });
}

}  // namespace jax_dnn
