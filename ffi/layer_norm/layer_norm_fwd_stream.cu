// Layer norm / RMS norm forward of aligned rows wider than the register-row
// kernels (32768 bf16/fp16, 16384 fp32), up to 131072 bf16/fp16 or 65536
// fp32: the math of layer_norm_fwd.cu's LayerNormRegFwdKernel, the rows split
// over the blocks of a cluster and streamed through shared memory, the
// parameters staged in shared memory once. The layout of the streamed norm
// backward (layer_norm_bwd_stream.cu).
//
// A block is one team of 512 threads x 4 vectors (16384 bf16 or 8192 fp32
// columns; the row split in equal shares, RowSplit); the blocks' sums are
// added over distributed shared memory (ClusterExchange). Clusters are
// persistent within a param_set of rows (a unit is a (param_set, part) and takes rows
// part, part + parts, ... of its param_set), so that:
//   - this block's columns of the param_set's scale and bias are staged in shared
//     memory once (ScaleSlice), not re-read for every row;
//   - the unit's next rows stream into shared memory with the bulk copy
//     engine (RowFeed) while it reduces and writes these;
//   - two rows a pass share their block reductions and cluster exchange.
// Why: loading a row only when it starts, and re-reading a block's share of
// the fp32 parameters (256 KiB at 32768 bf16 columns: more than L1) from L2
// for every row, the register-row cluster kernels spend ~40% of their stall
// samples on those loads; against them these take (H200, fwd, 4096 x 131072
// bf16) 597 us against 678 for the layer norm, 578 against 623 for the RMS
// norm. Two rows a pass: one row a pass takes 716 us there.
#include <type_traits>

#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/layer_norm/layer_norm.h"
#include "ffi/layer_norm/layer_norm_bwd_row.cuh"
#include "ffi/layer_norm/layer_norm_stats.cuh"

namespace jax_dnn {
namespace {

template <typename T>
using Row512 = RegRow<T, 512, 4>;

// Two rows a pass (rows row and row + parts of the unit's), their block
// reductions and cluster exchange merged: half the barriers and exchanges a
// row. The feed holds a pass's rows, so the next pass's two stream in while
// this one is reduced and written.
constexpr int kPassRows = 2;
template <typename T, typename Row>
using Feed = RowFeed<T, Row, /*kStreamed=*/true, 1, kPassRows>;

// Dynamic shared memory: the feed's row buffers, then the block's columns of
// scale and (layer norm) bias. Layer norm 64 + 128 KiB at 16 bits, 64 + 64
// KiB at fp32; RMS norm half the parameter bytes.
template <typename T, typename Row>
constexpr size_t ParamOffset() {
  return Feed<T, Row>::kSmemBytes;
}
template <typename T, typename Row, bool kRms>
constexpr size_t SmemBytes() {
  return ParamOffset<T, Row>() + (kRms ? 1 : 2) * sizeof(float) * RowSplit<Row, true>::kSegment;
}
static_assert(SmemBytes<__nv_bfloat16, Row512<__nv_bfloat16>, false>() <= 226 * 1024 &&
              SmemBytes<float, Row512<float>, false>() <= 226 * 1024);

template <typename T, typename Row, bool kRms>
__global__ void __launch_bounds__(Row::kBlock, 1)
    LayerNormStreamFwdKernel(LayerNormFwdParams p, int64_t parts) {
  static_assert(Row::kTeams == 1, "a block is one team");
  constexpr int V = Row::V;
  constexpr int kRows = kPassRows;
  // As in LayerNormRegFwdKernel: the layer norm's two reductions alternate
  // between two slot sets; the cluster exchanges one State a pass.
  using ClusterState = std::conditional_t<kRms, Sums<kRows>, MeanM2s<kRows>>;
  __shared__ typename Row::template Slots<Sums<kRows>> slots;
  __shared__ typename Row::template Slots<Sums<kRows>> slots2;
  __shared__ typename ClusterExchange<ClusterState, true>::Inbox inbox;
  extern __shared__ uint4 dynamic_smem[];
  float4* const params = reinterpret_cast<float4*>(dynamic_smem + ParamOffset<T, Row>() / 16);
  const ScaleSlice<Row> scale{params};
  const ScaleSlice<Row> bias{params + RowSplit<Row, true>::kSegment / 4};

  const int64_t n = p.width;
  const RowSplit<Row, true> split(n);
  const int64_t ns = split.width;  // this block's columns of the row
  const int64_t unit = split.row0;
  const int64_t param_set = unit / parts;
  const int64_t part = unit % parts;
  const int64_t rows_per_set = p.rows / p.param_sets;
  const int64_t first_row = param_set * rows_per_set;
  Feed<T, Row> feed({static_cast<const T*>(p.x) + first_row * n}, n, split.col0, ns, part,
                    parts, rows_per_set);
  ClusterExchange<ClusterState, true> exchange(inbox);
  scale.Stage(p.scale + param_set * n + split.col0, ns);
  if constexpr (!kRms) bias.Stage(p.bias + param_set * n + split.col0, ns);
  __syncthreads();
  ClusterSyncRelaxed<true>();  // the peers' inboxes are ready

  const float inv_n = 1.f / static_cast<float>(n);
  const float team_n = static_cast<float>(ns);
  T* const y_base = static_cast<T*>(p.y) + first_row * n + split.col0;
  int parity = 0;
  for (int64_t row = part; row < rows_per_set; row += kRows * parts, parity ^= 1) {
    // The pass's rows in the feed's order; a missing last one is zeros.
    int rows = 0;
    Row r[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (row + k * parts < rows_per_set) {
        feed.Get(row + k * parts, r[k]);
        ++rows;
      } else {
        r[k].LoadShared(nullptr, 0);
      }
    }
    float mean[kRows], rstd[kRows];
    if constexpr (kRms) {
      Sums<kRows> ss = {};
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          float f[V];
          r[k].Get(v, f);  // vectors past the share are zeros
#pragma unroll
          for (int i = 0; i < V; ++i) ss.s[k] += f[i] * f[i];
        }
      }
      ss = RowTotal<Row>(ss, slots, parity, exchange);
#pragma unroll
      for (int k = 0; k < kRows; ++k) mean[k] = 0.f, rstd[k] = rsqrtf(ss.s[k] * inv_n + p.epsilon);
    } else {
      // Each thread's exact (count, mean, M2); the block's sum, its mean and
      // M2 about that mean; the blocks' merged in a fixed order (Chan).
      float count = 0.f;
      Sums<kRows> sum = {};
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
        if (Row::In(v, ns)) count += V;
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          float f[V];
          r[k].Get(v, f);
#pragma unroll
          for (int i = 0; i < V; ++i) sum.s[k] += f[i];
        }
      }
      const float rc = count > 0.f ? __frcp_rn(count) : 0.f;
      Sums<kRows> m2 = {};
#pragma unroll
      for (int v = 0; v < Row::kVecs; ++v) {
        if (!Row::In(v, ns)) continue;
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          float f[V];
          r[k].Get(v, f);
#pragma unroll
          for (int i = 0; i < V; ++i) m2.s[k] += (f[i] - sum.s[k] * rc) * (f[i] - sum.s[k] * rc);
        }
      }
      const Sums<kRows> block_sum = Row::Reduce(sum, slots, 0);
      MeanM2s<kRows> st;
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        const float d = sum.s[k] * rc - block_sum.s[k] * __frcp_rn(team_n);
        m2.s[k] += count * d * d;
      }
      const Sums<kRows> block_m2 = Row::Reduce(m2, slots2, 0);
#pragma unroll
      for (int k = 0; k < kRows; ++k) st.r[k] = {team_n, block_sum.s[k] * __frcp_rn(team_n), block_m2.s[k]};
      st = exchange.Sum(st);
#pragma unroll
      for (int k = 0; k < kRows; ++k) mean[k] = st.r[k].mean, rstd[k] = rsqrtf(st.r[k].m2 * inv_n + p.epsilon);
    }
    if (!kRms && split.col0 == 0 && threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < kRows; ++k)
        if (k < rows) StoreStats(p.stats, first_row + row + k * parts, mean[k], rstd[k]);
    }
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      float g[V], b[V];
      scale.Get(v, g);
      if constexpr (!kRms) bias.Get(v, b);
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        if (k >= rows) continue;
        float f[V];
        r[k].Get(v, f);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          f[i] = (f[i] - mean[k]) * rstd[k] * g[i];
          if constexpr (!kRms) f[i] += b[i];
        }
        StoreVec<T, V>(y_base + (row + k * parts) * n + Row::Col(v), f);
      }
    }
  }
  ClusterSyncRelaxed<true>();  // every push to this block has landed
}

// Clusters of ceil(width / segment) blocks; as many as fit at once, shared
// among the param_sets (at least one a param_set), each taking an equal share of its
// param_set's rows.
template <typename T, bool kRms>
cudaError_t LaunchClusters(const LayerNormFwdParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return cudaSuccess;
  using Row = Row512<T>;
  auto kernel = LayerNormStreamFwdKernel<T, Row, kRms>;
  const int blocks = ClusterBlocks(p.width, RowSplit<Row, true>::kSegment);
  if (blocks < 2 || blocks > kMaxClusterBlocks) return cudaErrorInvalidValue;
  ClusterLaunch launch(blocks, Row::kBlock, SmemBytes<T, Row, kRms>(), stream);
  int resident = 0;
  cudaError_t e = ResidentClusters(kernel, launch, &resident);
  if (e != cudaSuccess) return e;
  const int64_t parts = GroupParts(p.rows / p.param_sets, p.param_sets, resident, p.rows);
  if (p.param_sets * parts * blocks > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  launch.cfg.gridDim = dim3(static_cast<unsigned>(p.param_sets * parts * blocks));
  e = cudaLaunchKernelEx(&launch.cfg, kernel, p, parts);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace

int64_t LayerNormStreamFwdMaxWidth(int dtype_bytes) {
  return kMaxClusterBlocks * RowSplit<Row512<float>, true>::kSegment * (4 / dtype_bytes);
}

cudaError_t LaunchLayerNormStreamFwd(const LayerNormFwdParams& p, cudaStream_t stream) {
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return p.rms ? LaunchClusters<T, true>(p, stream) : LaunchClusters<T, false>(p, stream);
  });
}

}  // namespace jax_dnn
