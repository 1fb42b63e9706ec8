// Rows wider than one team's registers, split over the blocks of a thread
// block cluster (sm_90): block rank r of a cluster holds columns
// [r * S, r * S + S) of the row in registers, S = kTeam * kVecs * V (the
// register-row layout of ffi/common/row_regs.cuh, one team a block), and the
// row sums add the blocks' team sums over distributed shared memory. Each
// element is still read once and written once; the fallback row kernels
// instead re-read what their registers cannot hold (35-41% of copy
// bandwidth for 131072-wide bf16 forwards, the backward's 7%).
//
// Used by the layer/RMS-norm forward and backward and the softmax forward
// (the softmax backward was slower this way: ffi/softmax/softmax.cu). The
// forwards bound their cluster kernels to 2 blocks of 512 an SM (64
// registers: 1024 threads of 16-byte loads in flight) and write
// `__launch_bounds__(kBlock, kCluster ? 1024 / kBlock : 0)`: a minimum of 0
// is ptxas's default, while 1 let the register-row kernels grow (softmax
// backward 128 -> 154 registers, 90% -> 75% of copy). The norm backward
// takes RowSplit's columns and RowTotal but orders its rows itself (its
// blocks are persistent within a group of rows: layer_norm_bwd.cu).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dnn {

// The widest cluster the split takes: 8 blocks, the portable cluster size.
constexpr int kMaxClusterBlocks = 8;

// Blocks of a cluster for a row of `width` elements, `segment` a block.
inline int ClusterBlocks(int64_t width, int64_t segment) {
  return static_cast<int>((width + segment - 1) / segment);
}

// Which rows and columns a block handles. Without a cluster: the rows of its
// team (one team a row, several teams a block) and all their columns. With
// one: the rows of its cluster (one cluster a row) and its rank's segment.
template <typename Row, bool kCluster>
struct RowSplit {
  static constexpr int64_t kSegment = int64_t{Row::kTeam} * Row::kVecs * Row::V;
  int64_t row0, row_step;  // this team's first row, and the step to its next
  int64_t col0, width;     // its columns [col0, col0 + width) of each row

  __device__ explicit RowSplit(int64_t n) {
    if constexpr (kCluster) {
      static_assert(Row::kTeams == 1, "a cluster block is one team");
      const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      const int64_t blocks = cluster.num_blocks();
      row0 = blockIdx.x / blocks;  // 1-D clusters are runs of consecutive blocks
      row_step = gridDim.x / blocks;
      col0 = cluster.block_rank() * kSegment;
      width = n - col0 < kSegment ? n - col0 : kSegment;  // > 0: blocks = ceil(n / S)
    } else {
      row0 = int64_t{blockIdx.x} * Row::kTeams + Row::Team();
      row_step = int64_t{gridDim.x} * Row::kTeams;
      col0 = 0;
      width = n;
    }
  }
};

// Sums a State over the blocks of the cluster, in block-rank order (the same
// bits in every block). `slot` is this block's shared copy. A slot is
// rewritten only after a later cluster barrier, which every block reaches
// after reading it: callers alternate two slots (by row parity, or by round
// when a row takes two sums) and pass a last ClusterSync before exiting.
template <typename State>
__device__ State ClusterSum(const State& st, State* slot) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) *slot = st;
  cluster.sync();
  State total = *cluster.map_shared_rank(slot, 0);
  for (unsigned r = 1; r < cluster.num_blocks(); ++r)
    total = State::Merge(total, *cluster.map_shared_rank(slot, r));
  return total;
}

// Peers may read a block's slots until every block has passed this barrier.
__device__ __forceinline__ void ClusterSync() { cooperative_groups::this_cluster().sync(); }

// The team's total of a State for its row: Row::Reduce, then, for a cluster,
// ClusterSum over the blocks with cluster slot `cslot`.
template <bool kCluster, typename Row, typename State, typename Slots>
__device__ __forceinline__ State RowTotal(State st, Slots& slots, int parity, State* cslot) {
  st = Row::Reduce(st, slots, parity);
  if constexpr (kCluster) st = ClusterSum(st, cslot);
  return st;
}

// A launch configuration with a 1-D cluster of `blocks` blocks; gridDim is
// set by the caller (a multiple of `blocks`). Not copyable: cfg points at attr.
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t cfg{};
  ClusterLaunch(int blocks, int block_threads, size_t smem, cudaStream_t stream) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = blocks;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(block_threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// One cluster of `blocks` blocks a row (capped; the kernels stride over the
// rest): for the non-persistent row kernels (the forwards).
// Tried on an H200 (4096 x 131072 and x 65536 bf16): 256-thread blocks (8 a
// cluster at 131072) ran the same, 62-69% of copy; persistent clusters that
// load the next row while reducing this one (512 x 4 vectors, as many
// clusters as fit) were faster for RMS norm (68-74%) but slower for layer
// norm and softmax (47-55%), which have more work between the loads.
template <typename Kernel, typename Params>
cudaError_t LaunchRowClusters(Kernel kernel, int blocks, int block_threads, int64_t rows,
                              const Params& p, cudaStream_t stream) {
  if (blocks < 1 || blocks > kMaxClusterBlocks) return cudaErrorInvalidValue;
  ClusterLaunch launch(blocks, block_threads, 0, stream);
  const int64_t max_clusters = (int64_t{1} << 30) / blocks;
  const int64_t clusters = rows < max_clusters ? rows : max_clusters;
  launch.cfg.gridDim = dim3(static_cast<unsigned>(clusters * blocks));
  const cudaError_t e = cudaLaunchKernelEx(&launch.cfg, kernel, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace jax_dnn
