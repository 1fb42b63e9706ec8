// Rows wider than one team's registers, split over the blocks of a thread
// block cluster (sm_90): the row's columns are shared equally (in whole
// 16-byte vectors) among ceil(width / S) blocks, each holding its share in
// registers, S = kTeam * kVecs * V (the register-row layout of
// ffi/common/row_regs.cuh, one team a block), and the row sums add the
// blocks' team sums over distributed shared memory. Each element is still
// read once and written once; the fallback row kernels instead re-read what
// their registers cannot hold (35-41% of copy bandwidth for 131072-wide bf16
// forwards, the norm backward's 7%).
//
// Used by the row ops past their register widths (aligned rows; the softmax
// backward from 1.2 times its width, the fallback below that). Streaming
// their rows through shared memory (RowFeed below), persistent clusters: the
// softmax forward and backward, and the layer/RMS-norm forward and backward
// up to 131072 bf16/fp16 (their own kernels, layer_norm_fwd_stream.cu and
// layer_norm_bwd_stream.cu: clusters persistent within a param_set of rows, each
// part taking rows part, part + parts, ..., so that a block stages its
// columns of the param_set's parameters once and, in the backward, keeps their
// gradient sums in registers). Loading straight into registers: the norm
// forwards wider than that (one cluster a row; the 16-bit layer norm,
// persistent clusters taking two rows a pass, or one where a param_set has an
// odd number of rows). The forwards' streamed kernels and the register
// two-row forward take two rows a pass and the backwards hold x and dy, all
// bound to 1 block of 512 an SM and 128 registers (the norm backward's
// one-block rows of 256 threads run two an SM); the one-row register
// forwards to 2 blocks (64 registers: 1024 threads of 16-byte loads in
// flight). The softmax backward writes `__launch_bounds__(kBlock, kCluster ?
// 1 : 0)`: a minimum of 0 is ptxas's default, while 1 let its register-row
// kernels grow (128 -> 154 registers, 90% -> 75% of copy).

#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/hopper.cuh"
#include "ffi/common/row_team.cuh"

namespace jax_dnn {

// The widest cluster the split takes: 8 blocks, the portable cluster size.
constexpr int kMaxClusterBlocks = 8;

// Blocks of a cluster for a row of `width` elements, `segment` a block.
inline int ClusterBlocks(int64_t width, int64_t segment) {
  return static_cast<int>((width + segment - 1) / segment);
}

// Which rows and columns a block handles. Without a cluster: the rows of its
// team (one team a row, several teams a block) and all their columns. With
// one: the rows of its cluster (cluster, cluster + clusters, ...) and its
// rank's share of the columns.
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
      // Equal shares of whole vectors (<= kSegment: blocks = ceil(n / S)), not
      // full segments and a remainder: at 40000 bf16 a 7232-column third
      // block left its SMs idle and the softmax backward ran 11% slower than
      // the fallback. The last share is positive and at most 7 vectors short.
      const int64_t share = ((n + blocks - 1) / blocks + Row::V - 1) / Row::V * Row::V;
      col0 = cluster.block_rank() * share;
      width = n - col0 < share ? n - col0 : share;
    } else {
      row0 = int64_t{blockIdx.x} * Row::kTeams + Row::Team();
      row_step = int64_t{gridDim.x} * Row::kTeams;
      col0 = 0;
      width = n;
    }
  }
};

// Sums a State over the blocks of the cluster, in a fixed order over the
// block ranks (the same bits in every block), once a round (Sum). Each block
// pushes its State into every block's inbox (st.async into distributed
// shared memory, completing bytes on the receiver's mbarrier) and waits on
// its own inbox's mbarrier: lane r of each warp then reads block r's State
// locally and the warp merges them through shuffles.
//
// Why: the pull form (each block wrote its slot, a cluster barrier, each read
// its peers' slots) spent its time in the barrier's release, which waits for
// every store the block has outstanding: the rows written before (ncu,
// 4096 x 131072 bf16 layer norm backward on an H200: 32% of the warps' stall
// samples on that barrier). A push needs no fence and no cluster barrier.
//
// Inboxes are double-buffered by round: a block pushes round k + 2 into a
// peer's slot only after the peer's round k + 1 push reached it, which the
// peer issues after reading its round k inbox, provided the callers reach a
// block barrier between consecutive Sums (Row::Reduce has one, and every
// caller reduces over the block before a Sum). Kernels construct their
// exchanges, then call ClusterSyncRelaxed() before the first Sum (the peers'
// mbarriers are initialized) and again before exiting (every push has landed).
// Clusters have at most kMaxClusterBlocks blocks (the launches check).
// Why push: the softmax forward's two-rows-a-pass kernel takes 585 us at 4096
// x 131072 bf16 with it (H200), 700 us with a pull (each block writing its
// State to its own slot, a cluster barrier, each block reading every slot).
template <typename State, bool kCluster = true>
struct ClusterExchange {
  struct Inbox {
    State from[2][kMaxClusterBlocks];
    uint64_t bar[2];
  };
  Inbox& box;
  uint32_t round = 0;

  __device__ explicit ClusterExchange(Inbox& inbox) : box(inbox) {
    if (threadIdx.x == 0) {
      hopper::BarrierInit(&box.bar[0], 1);
      hopper::BarrierInit(&box.bar[1], 1);
      hopper::FenceBarrierInit();
    }
  }

  __device__ State Sum(const State& st) {
    constexpr int kWords = sizeof(State) / sizeof(uint32_t);
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const unsigned blocks = cluster.num_blocks();
    const unsigned lane = threadIdx.x % 32;
    const int slot = round & 1;
    const uint32_t parity = (round >> 1) & 1;
    ++round;
    if (threadIdx.x < 32) {
      if (lane == 0) hopper::BarrierExpectTx(&box.bar[slot], blocks * sizeof(State));
      if (lane < blocks) {  // lane r pushes to block r
        const uint32_t rank = hopper::ClusterCtaRank();
        const uint32_t dst = hopper::MapShared(&box.from[slot][rank], lane);
        const uint32_t bar = hopper::MapShared(&box.bar[slot], lane);
        const float* w = reinterpret_cast<const float*>(&st);
#pragma unroll
        for (int i = 0; i < kWords; ++i) hopper::StoreAsync32(dst + 4 * i, __float_as_uint(w[i]), bar);
      }
    }
    // A CTA-scope acquire. The PTX memory model pairs st.async's completion
    // (a release at cluster scope) with a cluster-scope acquire, as NVIDIA's
    // st.async example waits; this relies instead on the hardware: the pushed
    // bytes are in this CTA's shared memory (not cached in L1) before the
    // barrier's transaction count completes. The cluster-scope wait also
    // invalidated L1 at every wait (CCTL.IVALL: 8% of the softmax forward's
    // stall samples). Untried: a relaxed cluster-scope wait followed by
    // fence.acquire.sync_restrict::shared::cluster.cluster.
    hopper::BarrierWait(&box.bar[slot], parity);
    return Merge(box.from[slot][lane < blocks ? lane : 0], blocks);
  }

 private:
  // Lane r holds block r's State: their merge as a tree over the ranks (the
  // same order, so the same bits, in every block), broadcast to every lane:
  // three merges a lane at 8 blocks, where merging them in rank order took
  // seven and twice the shuffles (see RegRow::Reduce for the measurement;
  // the losses measured with it: the 4096 x 32768 fp32 layer-norm backward,
  // 4 blocks, and the 4096 x 40000 bf16 RMS-norm backward, 3 blocks,
  // 1.04-1.05 of the time).
  __device__ static State Merge(const State& mine, unsigned blocks) {
    const unsigned lane = threadIdx.x % 32;
    State st = mine;
#pragma unroll
    for (unsigned o = kMaxClusterBlocks / 2; o > 0; o >>= 1) {
      if (o >= blocks) continue;  // uniform: no lane has a partner that far
      const State other = ShuffleState(st, o, /*down=*/true);
      if (lane + o < blocks) st = State::Merge(st, other);
    }
    return ShuffleState(st, 0, /*down=*/false);
  }
};

// Without a cluster: no inbox, and the block's total is the row's.
template <typename State>
struct ClusterExchange<State, false> {
  struct Inbox {};
  __device__ explicit ClusterExchange(Inbox&) {}
  __device__ State Sum(const State& st) { return st; }
};

// Both of the cluster barriers that ClusterExchange asks for.
template <bool kCluster>
__device__ __forceinline__ void ClusterSyncRelaxed() {
  if constexpr (kCluster) hopper::ClusterSyncRelaxed();
}

// The team's total of a State for its row: Row::Reduce, then, for a cluster,
// the exchange's Sum over the blocks.
template <typename Row, typename State, typename Slots, typename Exchange>
__device__ __forceinline__ State RowTotal(State st, Slots& slots, int parity, Exchange& exchange) {
  return exchange.Sum(Row::Reduce(st, slots, parity));
}

// Where a row kernel's rows come from: RowFeed<T, Row, kStreamed, kArrays>
// over kArrays arrays of rows (x; or x and dy), then Get(row, r...) for each
// of the team's rows in order, one Row per array.
//
// Not streamed, a team loads its rows straight into registers; the blocks
// are not persistent, and the hardware overlaps one block's loads with
// another's reduction as blocks retire and start.
template <typename T, typename Row, bool kStreamed, int kArrays = 1, int kStages = 1>
struct RowFeed {
  static constexpr size_t kSmemBytes = 0;
  const T* src[kArrays];
  int64_t n;
  __device__ RowFeed(const T* const (&src_)[kArrays], int64_t n_, const RowSplit<Row, false>&,
                     int64_t)
      : n(n_) {
#pragma unroll
    for (int a = 0; a < kArrays; ++a) src[a] = src_[a];
  }
  template <typename... Rows>
  __device__ void Get(int64_t row, Rows&... r) const {
    static_assert(sizeof...(Rows) == kArrays, "one Row an array");
    int a = 0;
    (r.Load(src[a++] + row * n, n), ...);
  }
};

// Streamed (kStreamed): the grid is persistent (LaunchRowClusters with kSmemBytes:
// as many clusters as fit at once; the norm kernels launch their own), and
// each block, one team, streams its columns of the next kStages rows into
// shared memory with the bulk copy engine (one copy an array, one mbarrier a
// stage) while it reduces and writes this one; Get waits for this row's
// stage, moves it to registers and refills the stage with the row kStages
// ahead. Why: a block of a cluster row waits for its own loads and then for
// its peers at the row's exchange; with loads issued only at a row's start
// the softmax forward ran at 71% of copy bandwidth at 4096 x 131072 bf16, 8%
// slower than streamed (benchmarks/RESULTS.md, where the layer/RMS norm
// forwards, which then re-read their fp32 parameters from L2 for every row,
// gained less or lost; with the parameters staged in shared memory they
// stream too). The norm backward streams its one-block rows too.
template <typename T, typename Row, int kArrays, int kStages>
struct RowFeed<T, Row, true, kArrays, kStages> {
  static_assert(Row::kTeams == 1, "a streamed block is one team");
  static constexpr int64_t kSegment = RowSplit<Row, true>::kSegment;
  static constexpr size_t kSmemBytes = kStages * kArrays * kSegment * sizeof(T);
  const T* src[kArrays];  // this block's first column of row 0
  int64_t n, ns, step, rows;
  uint32_t phases = 0;  // bit s: the parity stage s completes next
  int stage = 0;        // the stage of the next Get

  // A cluster's block: its share of its cluster's rows.
  __device__ RowFeed(const T* const (&src_)[kArrays], int64_t n_, const RowSplit<Row, true>& split,
                     int64_t rows_)
      : RowFeed(src_, n_, split.col0, split.width, split.row0, split.row_step, rows_) {}
  // Columns [col0, col0 + ns) of the rows first, first + step, ... below rows.
  __device__ RowFeed(const T* const (&src_)[kArrays], int64_t n_, int64_t col0, int64_t ns_,
                     int64_t first, int64_t step_, int64_t rows_)
      : n(n_), ns(ns_), step(step_), rows(rows_) {
#pragma unroll
    for (int a = 0; a < kArrays; ++a) src[a] = src_[a] + col0;
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) hopper::BarrierInit(Bar(s), 1);
      hopper::FenceBarrierInit();
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages; ++s) Fetch(first + s * step, s);
  }
  template <typename... Rows>
  __device__ void Get(int64_t row, Rows&... r) {
    static_assert(sizeof...(Rows) == kArrays, "one Row an array");
    hopper::BarrierWait(Bar(stage), (phases >> stage) & 1);
    phases ^= 1u << stage;
    int a = 0;
    (r.LoadShared(Buffer(stage, a++), ns), ...);
    // Every thread has its vectors before the buffers are refilled.
    __syncthreads();
    Fetch(row + kStages * step, stage);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }

 private:
  __device__ static uint64_t* Bar(int s) {
    __shared__ uint64_t bar[kStages];
    return &bar[s];
  }
  // Stage s's segment of array a in the dynamic shared memory.
  __device__ static uint4* Buffer(int s, int a) {
    extern __shared__ uint4 row_feed_buffer[];
    return row_feed_buffer + (s * kArrays + a) * (kSegment * sizeof(T) / 16);
  }
  // ns % V == 0: whole 16-byte vectors; row starts are 16-byte aligned.
  __device__ void Fetch(int64_t row, int s) const {
    if (threadIdx.x != 0 || row >= rows) return;
    const uint32_t bytes = static_cast<uint32_t>(ns * sizeof(T));
    hopper::BarrierExpectTx(Bar(s), kArrays * bytes);
#pragma unroll
    for (int a = 0; a < kArrays; ++a)
      hopper::BulkLoad(Buffer(s, a), src[a] + row * n, bytes, Bar(s));
  }
};

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

// How many clusters of `launch`'s shape fit on the device at once (at least
// one, else an error), after raising the kernel's dynamic shared memory limit
// to the launch's.
template <typename Kernel>
cudaError_t ResidentClusters(Kernel kernel, const ClusterLaunch& launch, int* resident) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(launch.cfg.dynamicSmemBytes));
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveClusters(resident, kernel, &launch.cfg);
  if (e != cudaSuccess) return e;
  return *resident < 1 ? cudaErrorInvalidConfiguration : cudaSuccess;
}

// Clusters of `blocks` blocks for the cluster row kernels. A kernel that
// streams its rows (RowFeed, smem = its kSmemBytes > 0), or is launched with
// `persistent`, is persistent: as many clusters as fit at once. One that loads
// its rows directly (smem = 0) otherwise gets one cluster a row (capped; it
// strides over the rest), the hardware overlapping clusters as they retire
// and start. Why the direct form is not persistent (H200, 4096 x 131072 bf16):
// persistent clusters that load the next row into registers while reducing
// this one (512 x 4 vectors) run the layer norm and softmax at 47-55% of copy
// bandwidth, against 62-69% for these (256- and 512-thread blocks alike).
// At least 2 blocks: a one-block cluster's ClusterExchange would push to
// itself with st.async, which PTX leaves undefined (every caller has rows
// wider than one block's layout).
template <typename Kernel, typename Params>
cudaError_t LaunchRowClusters(Kernel kernel, int blocks, int block_threads, size_t smem,
                              int64_t rows, const Params& p, cudaStream_t stream,
                              bool persistent = false) {
  if (blocks < 2 || blocks > kMaxClusterBlocks) return cudaErrorInvalidValue;
  ClusterLaunch launch(blocks, block_threads, smem, stream);
  int64_t max_clusters = (int64_t{1} << 30) / blocks;
  if (smem > 0 || persistent) {
    int resident = 0;
    const cudaError_t e = ResidentClusters(kernel, launch, &resident);
    if (e != cudaSuccess) return e;
    max_clusters = resident;
  }
  const int64_t clusters = rows < max_clusters ? rows : max_clusters;
  launch.cfg.gridDim = dim3(static_cast<unsigned>(clusters * blocks));
  const cudaError_t e = cudaLaunchKernelEx(&launch.cfg, kernel, p);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace jax_dnn
