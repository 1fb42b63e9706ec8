// Layer norm / RMS norm backward of aligned rows (read as 16-byte vectors)
// wider than 4096 bf16/fp16 or 2048 fp32, up to 131072 bf16/fp16 or 65536
// fp32: the math of layer_norm_bwd.cu, x and dy streamed through shared
// memory.
//
// A block is one team holding one row (RegRow, ffi/common/row_regs.cuh: 256
// or 512 threads x 4 vectors of x and of dy), or, for rows wider than 512 x 4
// vectors, an equal share of a row split over the blocks of a cluster
// (RowSplit), the blocks' team sums added over distributed shared memory, one
// exchange a row (ClusterExchange). Blocks (clusters) are persistent within a
// param_set of rows, so each thread keeps the same columns in every row it
// visits:
//   - the next two rows' x and dy stream into shared memory with the bulk
//     copy engine (RowFeed) while this one is reduced and written;
//   - the dscale/dbias partial sums of its 32 (bf16) or 16 (fp32) columns
//     accumulate in registers, and each block writes (its share of) one row
//     of partials at the end (column_sum.cu adds them in a fixed order);
//   - the param_set's scale is staged in shared memory once.
// Why, for rows of one block: against the register-row kernel of
// layer_norm_bwd.cu (the next row loaded into registers, the partial sums in
// shared memory) this takes 0.76-0.95 of the time from 8192 to 16384 wide
// (H200, bf16 layer norm; RMS norm 0.95-0.99). Narrower rows keep the
// register-row kernel: streamed with several teams a block they take
// 1.007-1.12 of its time at 1024-4096 wide.
// Why, for cluster rows: with the partial sums and scale in shared memory
// (192 KiB at 131072 bf16) and the next row loaded into registers, a cluster
// form runs at 39% (layer norm) and 55% (RMS norm) of copy bandwidth at 4096
// x 131072 bf16; with the partials in registers, the shared memory holds two
// streamed rows and the exchange is pushed (ClusterExchange): 1113 us against
// 2003 for the layer norm, 818 against 1409 for the RMS norm (H200, bwd).
#include <type_traits>

#include "ffi/common/device_info.h"
#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_bwd_row.cuh"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

// 512 threads an SM under the 128-register bound: a share of x and dy (32
// registers at 16 bits) and the partial sums (64 for layer norm). Blocks of
// 256 threads (rows up to 8192 bf16) run two an SM.
constexpr int kThreadsPerSM = 512;

template <typename T>
using ClusterRow = RegRow<T, 512, kNormBwdVecs>;

// x and dy, two rows ahead.
template <typename T, typename Row>
using Feed = RowFeed<T, Row, /*kStreamed=*/true, 2, 2>;

// Dynamic shared memory: the feed's row buffers, then the block's columns of
// scale (ScaleSlice). 128 + 64 KiB for a 512-thread block at 16 bits; a
// 256-thread block takes half, so two fit an SM.
template <typename T, typename Row>
constexpr size_t ScaleOffset() {
  return Feed<T, Row>::kSmemBytes;
}
template <typename T, typename Row>
constexpr size_t SmemBytes() {
  return ScaleOffset<T, Row>() + sizeof(float) * RowSplit<Row, true>::kSegment;
}
// Within sm_90's 227 KiB a block, with room for the static shared memory;
// two 256-thread blocks an SM (__launch_bounds__ below) within its 228 KiB,
// 1 KiB of it reserved a block.
static_assert(SmemBytes<__nv_bfloat16, ClusterRow<__nv_bfloat16>>() <= 226 * 1024 &&
              SmemBytes<float, ClusterRow<float>>() <= 226 * 1024);
static_assert(SmemBytes<__nv_bfloat16, RegRow<__nv_bfloat16, 256, kNormBwdVecs, 256>>() <= 112 * 1024 &&
              SmemBytes<float, RegRow<float, 256, kNormBwdVecs, 256>>() <= 112 * 1024);

// One reduction a row (with a cluster, one exchange): RMS norm's sum x^2 and
// sum g x; layer norm's sum g and sum g (x - mean) about the forward's mean,
// read with its rstd from the saved stats (StatsFeed).
template <typename T, typename Row, bool kRms, bool kCluster>
__global__ void __launch_bounds__(Row::kBlock, kThreadsPerSM / Row::kBlock)
    LayerNormStreamBwdKernel(LayerNormBwdParams p) {
  static_assert(Row::kTeams == 1, "a block is one team");
  constexpr int V = Row::V;
  constexpr int kQuads = V / 4;  // float4s a vector
  constexpr int kSums = kRms ? 1 : 2;
  using State = std::conditional_t<kRms, SumSqGrad, GradSums>;
  __shared__ typename Row::template Slots<State> slots;
  __shared__ typename ClusterExchange<State, kCluster>::Inbox inbox;
  extern __shared__ uint4 dynamic_smem[];
  const ScaleSlice<Row> scale{reinterpret_cast<float4*>(dynamic_smem + ScaleOffset<T, Row>() / 16)};

  const int64_t n = p.width;
  const int64_t rows_per_set = p.rows / p.param_sets;
  // A unit (a block, or a cluster) is a (param_set, part); its columns: with a
  // cluster this block's share, else the whole row.
  int64_t unit = blockIdx.x, col0 = 0, ns = n;
  if constexpr (kCluster) {
    const RowSplit<Row, true> split(n);
    unit = split.row0;
    col0 = split.col0;
    ns = split.width;
  }
  const int64_t param_set = unit / p.parts;
  const int64_t part = unit % p.parts;
  // This unit's rows of the param_set: part, part + parts, ...
  const int64_t step = p.parts;
  const int64_t first_row = param_set * rows_per_set;
  const int64_t first = first_row * n;
  Feed<T, Row> feed({static_cast<const T*>(p.x) + first, static_cast<const T*>(p.dy) + first}, n,
                    col0, ns, part, step, rows_per_set);

  ClusterExchange<State, kCluster> exchange(inbox);

  // Stage the param_set's scale, this block's columns of it.
  scale.Stage(p.scale + param_set * n + col0, ns);
  __syncthreads();
  ClusterSyncRelaxed<kCluster>();  // the peers' inboxes are ready

  float acc[kSums][Row::kVecs][V] = {};
  const float inv_n = 1.f / static_cast<float>(n);
  T* const dx_base = static_cast<T*>(p.dx) + first + col0;
  // Layer norm: the rows' (mean, rstd) (unused by RMS norm: no loads).
  StatsFeed stats_feed(kRms ? nullptr : p.stats + 2 * first_row, part, step,
                       kRms ? 0 : rows_per_set);
  int parity = 0;
  for (int64_t row = part; row < rows_per_set; row += step, parity ^= 1) {
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
    // SASS in the cluster kernel (not measured).
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
  ClusterSyncRelaxed<kCluster>();  // every push to this block has landed

  float* partial = p.partials + unit * kSums * n + col0;
#pragma unroll
  for (int s = 0; s < kSums; ++s) {
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        *reinterpret_cast<float4*>(partial + s * n + Row::Col(v) + 4 * q) =
            make_float4(acc[s][v][4 * q], acc[s][v][4 * q + 1], acc[s][v][4 * q + 2],
                        acc[s][v][4 * q + 3]);
      }
    }
  }
}

// Rows of one block: 256 threads up to 8192 bf16 (4096 fp32), else 512.
template <typename T, typename Row, bool kRms>
cudaError_t LaunchRows(LayerNormBwdParams& p, cudaStream_t stream) {
  auto kernel = LayerNormStreamBwdKernel<T, Row, kRms, false>;
  const size_t smem = SmemBytes<T, Row>();
  unsigned resident = 0;
  cudaError_t e = PersistentGrid(kernel, Row::kBlock, smem, 1LL << 30, &resident);
  if (e != cudaSuccess) return e;
  p.parts = BwdParts(p, resident);
  if (p.param_sets * p.parts > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(p.param_sets * p.parts), Row::kBlock, smem, stream>>>(p);
  return cudaGetLastError();
}

// Wider rows: clusters of ceil(width / segment) blocks.
template <typename T, bool kRms>
cudaError_t LaunchClusters(LayerNormBwdParams& p, cudaStream_t stream) {
  using Row = ClusterRow<T>;
  auto kernel = LayerNormStreamBwdKernel<T, Row, kRms, true>;
  const int blocks = ClusterBlocks(p.width, RowSplit<Row, true>::kSegment);
  if (blocks < 2 || blocks > kMaxClusterBlocks) return cudaErrorInvalidValue;
  ClusterLaunch launch(blocks, Row::kBlock, SmemBytes<T, Row>(), stream);
  int resident = 0;
  cudaError_t e = ResidentClusters(kernel, launch, &resident);
  if (e != cudaSuccess) return e;
  p.parts = BwdParts(p, resident);
  if (p.param_sets * p.parts * blocks > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  launch.cfg.gridDim = dim3(static_cast<unsigned>(p.param_sets * p.parts * blocks));
  e = cudaLaunchKernelEx(&launch.cfg, kernel, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace

int64_t LayerNormStreamBwdMaxWidth(int dtype_bytes) {
  return kMaxClusterBlocks * int64_t{512} * kNormBwdVecs * (16 / dtype_bytes);
}

cudaError_t LaunchLayerNormStreamBwd(LayerNormBwdParams& p, cudaStream_t stream) {
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Half = RegRow<T, 256, kNormBwdVecs, 256>;
    using Full = ClusterRow<T>;
    if (p.width <= RegRowMaxWidth<T, kNormBwdVecs, 256>())
      return p.rms ? LaunchRows<T, Half, true>(p, stream) : LaunchRows<T, Half, false>(p, stream);
    if (p.width <= RegRowMaxWidth<T, kNormBwdVecs, 512>())
      return p.rms ? LaunchRows<T, Full, true>(p, stream) : LaunchRows<T, Full, false>(p, stream);
    return p.rms ? LaunchClusters<T, true>(p, stream) : LaunchClusters<T, false>(p, stream);
  });
}

}  // namespace jax_dnn
