// Softmax / log-softmax forward and backward kernels. See softmax.h.
//
// Row kernels (softmax over the last axis):
// - Rows read as 16-byte vectors and no wider than the register layout
//   (ffi/common/row_regs.cuh: 512 threads x 8 vectors) take the Reg kernels:
//   one team a row, held in registers as packed elements; x (and dy) read once,
//   the output written once.
// - Aligned rows up to 8 times wider (the backward's from 1.2 times: below):
//   split over the blocks of a cluster (ffi/common/row_cluster.cuh), each
//   block a share of the row in registers, streamed in through shared memory
//   (RowFeed) while the previous rows are reduced, the states merged over
//   distributed shared memory: the forward's own kernel two rows a pass
//   (SoftmaxPairFwdKernel), the backward's Reg kernel one.
// - Rows not read as vectors (a width not a multiple of 16 bytes) up to
//   16384 wide take the Reg kernels on rows of single elements (ScalarRow,
//   below); their speed is set by the bytes in flight, one register an
//   element (H200, bf16 16384 x 4097 forward: 0.21 ms, XLA 0.09). The
//   forward in 16-byte aligned tensors takes ShiftedRow instead, up to the
//   register layout's width less a vector: the aligned vectors that cover
//   each row, its neighbours' elements -inf, 16-byte loads as the aligned
//   rows (H200, bf16 forward against ScalarRow: 16384 x 4097 0.091 ms
//   against 0.207, XLA 0.090; 8192 x 12289 0.137 against 0.206).
// - Other rows take the fallback row kernels (ffi/common/row_team.cuh): the
//   first kCacheElems values a thread cached, and for longer rows (any length)
//   an online max/sum pass (each thread rescales its running sum when its max
//   grows) and a second pass that re-reads the uncached tail, usually from L2.
//
// Strided kernels (any other axis): one thread per V consecutive inner
// positions walks down the axis; an online pass then a writing pass.
//
// Each row takes one team reduction of mergeable (max, sum[, t]) states.
// The backward recomputes softmax(x) from x (see softmax.h); its row kernel
// caches x and dy.
//
// NaN: padding lanes never enter a sum; a row whose max is -inf (all -inf)
// gives NaN exactly as jax.nn.softmax does.
#include <algorithm>
#include <cmath>

#include "ffi/common/row_cluster.cuh"
#include "ffi/common/row_regs.cuh"
#include "ffi/common/row_team.cuh"
#include "ffi/softmax/softmax.h"

namespace jax_dnn {
namespace {

constexpr int kFwdCacheElems = 32;
constexpr int kBwdCacheElems = 16;  // two tensors (x, dy) are cached

// Rows not read as vectors (their width is not a multiple of 16 bytes) and up
// to 512 threads x kFwdScalarElems (backward: kBwdScalarElems, x and dy)
// elements take the Reg kernels with one element a "vector" (ScalarRow,
// ffi/common/row_regs.cuh): teams widen to 512 threads at kScalarStepElems
// elements a thread before a thread takes more.
constexpr int kScalarStepElems = 16;
constexpr int kFwdScalarElems = 32;
constexpr int kBwdScalarElems = 32;

// The cluster splits: 512-thread blocks of 8 vectors a thread, up to 8 a
// cluster (rows up to 262144 bf16/fp16, 131072 fp32), streaming their rows
// through shared memory (RowFeed). Forward: 1 block an SM, two rows a pass
// (SoftmaxPairFwdKernel).
// Backward: x and dy, 8 vectors of each, 1 block an SM (128 registers, 128
// KiB of shared memory), for rows over 1.2 times the register layout.
// H200, bwd: against the fallback that re-reads from L2, 4096 x 131072 bf16
// 989 us against 1305, but 4096 x 32776 bf16 (two half-filled blocks) 317
// against 261, so rows up to 1.2 times the layout keep the fallback. 4
// vectors a thread and 2 blocks an SM take 1.08-1.14 of the time; loaded
// straight into registers, not streamed, the backward runs at 55-57% of copy
// at 4096 x 131072 bf16, below the fallback (60%).
constexpr int kClusterVecs = 8;
template <typename T>
constexpr int64_t kBwdMinClusterWidth = RegRowMaxWidth<T>() * 6 / 5;

// exp(x) as one multiply and one MUFU.EX2 (ex2.approx.ftz: ~2 ulp). Inputs
// are x - max <= 0, so flushing denormal results to zero loses nothing that
// matters after normalization; the multiply's rounding costs |x| * 2^-24.
__device__ __forceinline__ float Exp(float x) { return FastExp2(x * 1.4426950408889634f); }

// exp(a - b) where b is a running max, safe when both are -inf.
__device__ __forceinline__ float ExpDiff(float a, float b) {
  return b == -INFINITY ? 0.f : Exp(a - b);
}

// Backward row state: MaxSum plus t, the sum of dy * exp(x - m) (softmax;
// rescaled with m) or of dy (log_softmax; not rescaled).
template <bool kLog>
struct BwdState {
  float m, s, t;
  __device__ static BwdState Merge(const BwdState& a, const BwdState& b) {
    const float m = MaxNan(a.m, b.m);
    const float ra = MaxSum::Rescale(a.m, m), rb = MaxSum::Rescale(b.m, m);
    return {m, a.s * ra + b.s * rb, kLog ? a.t + b.t : a.t * ra + b.t * rb};
  }
};

template <int kTeam>
__device__ __forceinline__ int64_t ColOf(int64_t c, int lane, int V) {
  return (c * kTeam + lane) * V;
}

// The fallback row kernel: long rows (wider than the register layout) and
// rows that cannot be read as 16-byte vectors. Row groups of one iteration:
// kTeamsPerBlock consecutive rows, one per team, the first kFwdCacheElems
// values a thread cached in registers, the rest streamed twice.
template <typename T, int kTeam, int V, bool kLog>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock) SoftmaxRowFwdKernel(SoftmaxFwdParams p) {
  using Team = RowTeam<kTeam>;
  constexpr int kCache = kFwdCacheElems / V;
  __shared__ typename Team::Scratch scratch;
  const int lane = Team::Lane();
  const int64_t n = p.n;
  const int64_t chunks = (n + int64_t{kTeam} * V - 1) / (int64_t{kTeam} * V);
  const int64_t group_stride = int64_t{gridDim.x} * Team::kTeamsPerBlock;

  for (int64_t base = int64_t{blockIdx.x} * Team::kTeamsPerBlock; base < p.outer;
       base += group_stride) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.outer;
    const T* x = static_cast<const T*>(p.x) + row * n;
    T* y = static_cast<T*>(p.y) + row * n;

    // Pass 1: running max and sum of exp(x - max), per thread. buf keeps
    // exp(x - m) so that the write pass needs no second exp.
    float buf[kCache][V];
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = ColOf<kTeam>(c, lane, V);
      if (valid && col < n) {
        LoadVec<T, V>(x + col, buf[c]);
#pragma unroll
        for (int i = 0; i < V; ++i) m = MaxNan(m, buf[c][i]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) buf[c][i] = -INFINITY;
      }
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        buf[c][i] = kLog ? buf[c][i] : ExpDiff(buf[c][i], m);  // padding: exp(-inf) = 0
        s += kLog ? ExpDiff(buf[c][i], m) : buf[c][i];
      }
    }
    {
      for (int64_t c = kCache; c < chunks; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (!valid || col >= n) continue;
        float v[V];
        LoadVec<T, V>(x + col, v);
        float cm = m;
#pragma unroll
        for (int i = 0; i < V; ++i) cm = MaxNan(cm, v[i]);
        s *= ExpDiff(m, cm);
#pragma unroll
        for (int i = 0; i < V; ++i) s += ExpDiff(v[i], cm);
        // The cached exp(x - m) values are rescaled to the new max below.
        if (cm != m && !kLog) {
#pragma unroll
          for (int c2 = 0; c2 < kCache; ++c2)
#pragma unroll
            for (int i = 0; i < V; ++i) buf[c2][i] *= ExpDiff(m, cm);
        }
        m = cm;
      }
    }
    // One team reduction merges the threads' (max, sum) pairs.
    const MaxSum stats = Team::Reduce(MaxSum{m, s}, scratch);
    if (valid) {
      // softmax: y = exp(x - m) * exp(m - row_max) / sum; log: x - row_max - log(sum).
      const float scale = ExpDiff(m, stats.m) / stats.s;
      const float shift = stats.m + logf(stats.s);
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (col >= n) continue;
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = kLog ? buf[c][i] - shift : buf[c][i] * scale;
        StoreVec<T, V>(y + col, out);
      }
      {
        const float inv_sum = 1.f / stats.s;
        for (int64_t c = kCache; c < chunks; ++c) {
          const int64_t col = ColOf<kTeam>(c, lane, V);
          if (col >= n) continue;
          float v[V];
          LoadVec<T, V>(x + col, v);
#pragma unroll
          for (int i = 0; i < V; ++i) v[i] = kLog ? v[i] - shift : Exp(v[i] - stats.m) * inv_sum;
          StoreVec<T, V>(y + col, v);
        }
      }
    }
  }
}

// The max of a register row's values held by this thread (-inf when none;
// a ShiftedRow's elements outside the row are -inf: Load's fill).
template <typename Row>
__device__ __forceinline__ float ThreadMax(const Row& r, int64_t n) {
  float m = -INFINITY;
#pragma unroll
  for (int v = 0; v < Row::kVecs; ++v) {
    if (!r.In(v, n)) continue;
    float f[Row::V];
    r.Get(v, f);
#pragma unroll
    for (int i = 0; i < Row::V; ++i) m = MaxNan(m, f[i]);
  }
  return m;
}

// This thread's (max, sum of exp(x - max)) over its values of a register row
// (the first n columns). exp(x - m) as one FFMA and one EX2; a thread with no
// finite max adds 0.
template <typename Row>
__device__ __forceinline__ MaxSum ThreadMaxSum(const Row& r, int64_t n) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float m = ThreadMax(r, n);
  float s = 0.f;
  if (m != -INFINITY) {
    const float ml = m * kLog2e;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!r.In(v, n)) continue;
      float f[Row::V];
      r.Get(v, f);
#pragma unroll
      for (int i = 0; i < Row::V; ++i) s += FastExp2(fmaf(f[i], kLog2e, -ml));
    }
  }
  return {m, s};
}

// Writes this thread's values of a register row's output from the row's
// (max, sum): softmax exp(x - max) / sum; log_softmax x - max - log(sum). An
// all -inf row gives NaN, as jax.nn.softmax does.
template <typename T, typename Row, bool kLog>
__device__ __forceinline__ void WriteRow(const Row& r, const MaxSum& st, T* y, int64_t n) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float ml = st.m * kLog2e, inv_sum = 1.f / st.s, shift = st.m + logf(st.s);
#pragma unroll
  for (int v = 0; v < Row::kVecs; ++v) {
    if (!r.In(v, n)) continue;
    float f[Row::V];
    r.Get(v, f);
#pragma unroll
    for (int i = 0; i < Row::V; ++i) f[i] = kLog ? f[i] - shift : FastExp2(fmaf(f[i], kLog2e, -ml)) * inv_sum;
    if constexpr (kIsShiftedRow<Row>) {
      r.Store(y, v, f, n);  // the row's elements only
    } else {
      StoreVec<T, Row::V>(y + Row::Col(v), f);
    }
  }
}

// Rows that fit the register layout (ffi/common/row_regs.cuh): one team a row,
// x read once, y written once, one team reduction of (max, sum).
template <typename T, typename Row, bool kLog>
__global__ void __launch_bounds__(Row::kBlock, RowMinBlocks<Row>()) SoftmaxRegFwdKernel(SoftmaxFwdParams p) {
  __shared__ typename Row::template Slots<MaxSum> slots;
  const int64_t n = p.n;
  int parity = 0;
  for (int64_t row = int64_t{blockIdx.x} * Row::kTeams + Row::Team(); row < p.outer;
       row += int64_t{gridDim.x} * Row::kTeams, parity ^= 1) {
    Row r;
    if constexpr (kIsShiftedRow<Row>) {
      r.Load(static_cast<const T*>(p.x) + row * n, n, static_cast<const T*>(p.x) + p.outer * n,
             FromFloat<T>(-INFINITY));
    } else {
      r.Load(static_cast<const T*>(p.x) + row * n, n);
    }
    const MaxSum st = Row::Reduce(ThreadMaxSum(r, n), slots, parity);
    WriteRow<T, Row, kLog>(r, st, static_cast<T*>(p.y) + row * n, n);
  }
}

// Two rows' (max, sum) states as one mergeable State.
struct MaxSumPair {
  MaxSum r[2];
  __device__ static MaxSumPair Merge(const MaxSumPair& a, const MaxSumPair& b) {
    return {{MaxSum::Merge(a.r[0], b.r[0]), MaxSum::Merge(a.r[1], b.r[1])}};
  }
};

// Rows wider than the register layout: split over the blocks of a cluster
// (ffi/common/row_cluster.cuh), persistent clusters (one block an SM) taking
// two rows a pass (rows row and row + row_step of the cluster's), streamed in
// through shared memory (RowFeed: the feed holds a pass's two rows, so the
// next pass's stream in while this one is reduced and written), both rows'
// block reductions and cluster exchange (pushed: ClusterExchange) merged into
// one. Why: a one-row form (2 blocks an SM, each streaming one row ahead)
// takes 659 us at 4096 x 131072 bf16 (79% of copy bandwidth), this 585 (H200,
// fwd); three rows a pass (three stages, 192 KiB; 4-8 bytes spilled) take
// 1.01-1.12 of two's time.
template <typename T, typename Row, bool kLog>
__global__ void __launch_bounds__(Row::kBlock, 1) SoftmaxPairFwdKernel(SoftmaxFwdParams p) {
  __shared__ typename Row::template Slots<MaxSumPair> slots;
  __shared__ typename ClusterExchange<MaxSumPair>::Inbox inbox;
  const int64_t n = p.n;
  const RowSplit<Row, true> split(n);
  const int64_t ns = split.width;  // this block's columns of the row
  RowFeed<T, Row, true, 1, 2> feed({static_cast<const T*>(p.x)}, n, split, p.outer);
  ClusterExchange<MaxSumPair> exchange(inbox);
  ClusterSyncRelaxed<true>();
  int parity = 0;
  for (int64_t row = split.row0; row < p.outer; row += 2 * split.row_step, parity ^= 1) {
    const bool second = row + split.row_step < p.outer;  // uniform over the cluster
    Row r[2];
    feed.Get(row, r[0]);
    if (second) {
      feed.Get(row + split.row_step, r[1]);
    } else {
      r[1].LoadShared(nullptr, 0);  // zeros; their state goes unused
    }
    const MaxSumPair st =
        RowTotal<Row>(MaxSumPair{{ThreadMaxSum(r[0], ns), ThreadMaxSum(r[1], ns)}}, slots, parity, exchange);
    T* y = static_cast<T*>(p.y) + row * n + split.col0;
    WriteRow<T, Row, kLog>(r[0], st.r[0], y, ns);
    if (second) WriteRow<T, Row, kLog>(r[1], st.r[1], y + split.row_step * n, ns);
  }
  ClusterSyncRelaxed<true>();  // every push to this block has landed
}

// The fallback backward row kernel (long or unaligned rows), as the forward's.
template <typename T, int kTeam, int V, bool kLog>
__global__ void __launch_bounds__(RowTeam<kTeam>::kBlock) SoftmaxRowBwdKernel(SoftmaxBwdParams p) {
  using Team = RowTeam<kTeam>;
  constexpr int kCache = kBwdCacheElems / V;
  __shared__ typename Team::Scratch scratch;
  const int lane = Team::Lane();
  const int64_t n = p.n;
  const int64_t chunks = (n + int64_t{kTeam} * V - 1) / (int64_t{kTeam} * V);
  const int64_t group_stride = int64_t{gridDim.x} * Team::kTeamsPerBlock;

  for (int64_t base = int64_t{blockIdx.x} * Team::kTeamsPerBlock; base < p.outer;
       base += group_stride) {
    const int64_t row = base + Team::Team();
    const bool valid = row < p.outer;
    const T* x = static_cast<const T*>(p.x) + row * n;
    const T* dy = static_cast<const T*>(p.dy) + row * n;
    T* dx = static_cast<T*>(p.dx) + row * n;
    // Calls fn(col, x, dy) for each chunk of the uncached tail (long rows).
    auto for_tail = [&](auto fn) {
      {
        for (int64_t c = kCache; c < chunks; ++c) {
          const int64_t col = ColOf<kTeam>(c, lane, V);
          if (!valid || col >= n) continue;
          float xv[V], dv[V];
          LoadVec<T, V>(x + col, xv);
          LoadVec<T, V>(dy + col, dv);
          fn(col, xv, dv);
        }
      }
    };

    // Recompute the forward (row max, sum of exp(x - max)) and, in the same
    // team reduction, t = sum(dy * exp(x - max)) (softmax) or sum(dy) (log).
    float xb[kCache][V], db[kCache][V];
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
      const int64_t col = ColOf<kTeam>(c, lane, V);
      if (valid && col < n) {
        LoadVec<T, V>(x + col, xb[c]);
        LoadVec<T, V>(dy + col, db[c]);
#pragma unroll
        for (int i = 0; i < V; ++i) m = MaxNan(m, xb[c][i]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) xb[c][i] = -INFINITY, db[c][i] = 0.f;
      }
    }
    BwdState<kLog> st{m, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kCache; ++c) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        xb[c][i] = ExpDiff(xb[c][i], m);  // now exp(x - m); padding: 0
        st.s += xb[c][i];
        st.t += kLog ? db[c][i] : db[c][i] * xb[c][i];
      }
    }
    for_tail([&](int64_t, const float(&v)[V], const float(&d)[V]) {
      BwdState<kLog> chunk{-INFINITY, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < V; ++i) chunk.m = MaxNan(chunk.m, v[i]);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float e = ExpDiff(v[i], chunk.m);
        chunk.s += e;
        chunk.t += kLog ? d[i] : d[i] * e;
      }
      st = BwdState<kLog>::Merge(st, chunk);
    });
    // The cached values are relative to this thread's max at the cached
    // chunks (m), the merged state to the row max.
    const BwdState<kLog> row_st = Team::Reduce(st, scratch);
    const float inv_sum = 1.f / row_st.s;
    const float t = kLog ? row_st.t : row_st.t * inv_sum;  // sum(dy) or sum(dy * y)
    const float y_scale = ExpDiff(m, row_st.m) * inv_sum;   // y = exp(x - m) * y_scale
    if (valid) {
      auto grad = [&](float y, float d) { return kLog ? d - y * t : y * (d - t); };
#pragma unroll
      for (int c = 0; c < kCache; ++c) {
        const int64_t col = ColOf<kTeam>(c, lane, V);
        if (col >= n) continue;
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = grad(xb[c][i] * y_scale, db[c][i]);
        StoreVec<T, V>(dx + col, out);
      }
      for_tail([&](int64_t col, const float(&v)[V], const float(&d)[V]) {
        float out[V];
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = grad(Exp(v[i] - row_st.m) * inv_sum, d[i]);
        StoreVec<T, V>(dx + col, out);
      });
    }
  }
}

// Rows that fit the register layout: x and dy each read once, dx written
// once; one team reduction of (max, sum, t) recomputes the forward. kCluster:
// a wider row split over the blocks of a cluster, streamed (RowFeed), the
// states merged over the blocks (ClusterExchange).
template <typename T, typename Row, bool kLog, bool kCluster = false>
__global__ void __launch_bounds__(Row::kBlock, kCluster ? 1 : 0)
    SoftmaxRegBwdKernel(SoftmaxBwdParams p) {
  constexpr int V = Row::V;
  constexpr float kLog2e = 1.4426950408889634f;
  __shared__ typename Row::template Slots<BwdState<kLog>> slots;
  __shared__ typename ClusterExchange<BwdState<kLog>, kCluster>::Inbox inbox;
  const int64_t n = p.n;
  const RowSplit<Row, kCluster> split(n);
  const int64_t ns = split.width;  // this block's columns of the row
  RowFeed<T, Row, kCluster, 2> feed(
      {static_cast<const T*>(p.x), static_cast<const T*>(p.dy)}, n, split, p.outer);
  ClusterExchange<BwdState<kLog>, kCluster> exchange(inbox);
  ClusterSyncRelaxed<kCluster>();
  int parity = 0;
  for (int64_t row = split.row0; row < p.outer; row += split.row_step, parity ^= 1) {
    Row rx, rd;
    feed.Get(row, rx, rd);
    const float m = ThreadMax(rx, ns);
    // s = sum(exp(x - m)); t = sum(dy * exp(x - m)) (softmax) or sum(dy)
    // (log_softmax; padding vectors are zeros).
    BwdState<kLog> st{m, 0.f, 0.f};
    const float ml = m * kLog2e;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      float f[V], d[V];
      rx.Get(v, f);
      rd.Get(v, d);
      const bool in = Row::In(v, ns) && m != -INFINITY;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float e = in ? FastExp2(fmaf(f[i], kLog2e, -ml)) : 0.f;
        st.s += e;
        st.t += kLog ? d[i] : d[i] * e;
      }
    }
    st = RowTotal<Row>(st, slots, parity, exchange);
    const float inv_sum = 1.f / st.s;
    const float t = kLog ? st.t : st.t * inv_sum;  // sum(dy) or sum(dy * y)
    const float row_ml = st.m * kLog2e;
    T* dx = static_cast<T*>(p.dx) + row * n + split.col0;
#pragma unroll
    for (int v = 0; v < Row::kVecs; ++v) {
      if (!Row::In(v, ns)) continue;
      float f[V], d[V];
      rx.Get(v, f);
      rd.Get(v, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float y = FastExp2(fmaf(f[i], kLog2e, -row_ml)) * inv_sum;
        f[i] = kLog ? d[i] - y * t : y * (d[i] - t);
      }
      StoreVec<T, V>(dx + Row::Col(v), f);
    }
  }
  ClusterSyncRelaxed<kCluster>();
}

constexpr int kStridedThreads = 256;

// Thread t handles inner positions [i, i + V) of one outer index.
template <typename T, int V, bool kLog>
__global__ void __launch_bounds__(kStridedThreads) SoftmaxStridedFwdKernel(SoftmaxFwdParams p) {
  const int64_t lanes = p.inner / V;
  const int64_t t = int64_t{blockIdx.x} * kStridedThreads + threadIdx.x;
  if (t >= p.outer * lanes) return;
  const int64_t o = t / lanes;
  const int64_t i = (t % lanes) * V;
  const T* x = static_cast<const T*>(p.x) + o * p.n * p.inner + i;
  T* y = static_cast<T*>(p.y) + o * p.n * p.inner + i;
  float m[V], s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) m[j] = -INFINITY, s[j] = 0.f;
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float cm = MaxNan(m[j], v[j]);
      s[j] = s[j] * ExpDiff(m[j], cm) + ExpDiff(v[j], cm);
      m[j] = cm;
    }
  }
  float shift[V], inv_sum[V];  // log_softmax subtracts max + log(sum)
#pragma unroll
  for (int j = 0; j < V; ++j) shift[j] = m[j] + logf(s[j]), inv_sum[j] = 1.f / s[j];
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = kLog ? v[j] - shift[j] : Exp(v[j] - m[j]) * inv_sum[j];
    StoreVec<T, V>(y + k * p.inner, v);
  }
}

template <typename T, int V, bool kLog>
__global__ void __launch_bounds__(kStridedThreads) SoftmaxStridedBwdKernel(SoftmaxBwdParams p) {
  const int64_t lanes = p.inner / V;
  const int64_t t = int64_t{blockIdx.x} * kStridedThreads + threadIdx.x;
  if (t >= p.outer * lanes) return;
  const int64_t o = t / lanes;
  const int64_t i = (t % lanes) * V;
  const int64_t offset = o * p.n * p.inner + i;
  const T* x = static_cast<const T*>(p.x) + offset;
  const T* dy = static_cast<const T*>(p.dy) + offset;
  T* dx = static_cast<T*>(p.dx) + offset;
  // Pass 1 recomputes the forward's max and sum; pass 2 the sum of the dx
  // formula; pass 3 writes dx.
  float m[V], s[V], acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) m[j] = -INFINITY, s[j] = 0.f, acc[j] = 0.f;
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V];
    LoadVec<T, V>(x + k * p.inner, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float cm = MaxNan(m[j], v[j]);
      s[j] = s[j] * ExpDiff(m[j], cm) + ExpDiff(v[j], cm);
      m[j] = cm;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) s[j] = 1.f / s[j];
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V], d[V];
    LoadVec<T, V>(x + k * p.inner, v);
    LoadVec<T, V>(dy + k * p.inner, d);
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] += kLog ? d[j] : d[j] * Exp(v[j] - m[j]) * s[j];
  }
  for (int64_t k = 0; k < p.n; ++k) {
    float v[V], d[V], out[V];
    LoadVec<T, V>(x + k * p.inner, v);
    LoadVec<T, V>(dy + k * p.inner, d);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float y = Exp(v[j] - m[j]) * s[j];
      out[j] = kLog ? d[j] - y * acc[j] : y * (d[j] - acc[j]);
    }
    StoreVec<T, V>(dx + k * p.inner, out);
  }
}

template <int N>
using Int = std::integral_constant<int, N>;

// Picks one direction's kernel: strided when the axis is not the last; the
// register layout for rows read as 16-byte vectors that fit it; for wider
// ones, from min_cluster_width up to kMaxClusterBlocks blocks of
// kClusterVecs vectors a thread, the same kernel over a cluster of them
// (cluster(Row{}, blocks)); the fallback row kernel otherwise (widest team
// for aligned long rows).
template <typename T, int kCacheElems, int kScalarMaxElems, typename Params, typename Reg,
          typename Cluster, typename Row, typename Strided>
cudaError_t LaunchAny(const Params& p, bool vec, int64_t min_cluster_width, Reg reg,
                      Cluster cluster, Row row, Strided strided) {
  constexpr int kVec = 16 / sizeof(T);
  if (p.inner != 1) return vec ? strided(Int<kVec>{}) : strided(Int<1>{});
  if (vec && p.n <= RegRowMaxWidth<T>()) return DispatchRegRow<T>(p.n, reg);
  if (!vec && p.n <= ScalarRowMaxWidth<kScalarMaxElems>())
    return DispatchScalarRow<T, kScalarStepElems, kScalarMaxElems>(p.n, reg);
  using ClusterRow = RegRow<T, 512, kClusterVecs>;
  constexpr int64_t kSegment = RowSplit<ClusterRow, true>::kSegment;
  if (vec && p.n >= min_cluster_width && p.n <= kMaxClusterBlocks * kSegment)
    return cluster(ClusterRow{}, ClusterBlocks(p.n, kSegment));
  if (vec) return row(Int<512>{}, Int<kVec>{});
  return DispatchTeam(p.n, kCacheElems, [&](auto team) { return row(team, Int<1>{}); });
}

unsigned StridedGrid(int64_t threads) {
  const int64_t blocks = (threads + kStridedThreads - 1) / kStridedThreads;
  return blocks < (int64_t{1} << 31) ? static_cast<unsigned>(blocks) : 0;
}

}  // namespace

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream) {
  if (p.outer == 0 || p.n == 0 || p.inner == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const int64_t span = p.inner == 1 ? p.n : p.inner;
    const bool vec = span % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.y, 16);
    auto run = [&](auto log) {
      constexpr bool kLog = decltype(log)::value;
      // Last-axis rows not read as vectors, up to the register layout (less
      // a vector), in 16-byte aligned tensors: the aligned vectors that
      // cover each row (ShiftedRow).
      if (!vec && p.inner == 1 && p.n <= ShiftedRowMaxWidth<T>() &&
          IsAligned(p.x, 16) && IsAligned(p.y, 16)) {
        return DispatchShiftedRow<T>(p.n, [&](auto row) {
          using Row = decltype(row);
          SoftmaxRegFwdKernel<T, Row, kLog><<<RowGrid(Row::kTeams, p.outer), Row::kBlock, 0, stream>>>(p);
          return cudaGetLastError();
        });
      }
      return LaunchAny<T, kFwdCacheElems, kFwdScalarElems>(
          p, vec, /*min_cluster_width=*/0,
          [&](auto row) {
            using Row = decltype(row);
            SoftmaxRegFwdKernel<T, Row, kLog><<<RowGrid(Row::kTeams, p.outer), Row::kBlock, 0, stream>>>(p);
            return cudaGetLastError();
          },
          [&](auto row, int blocks) {
            using Row = decltype(row);
            return LaunchRowClusters(SoftmaxPairFwdKernel<T, Row, kLog>, blocks, Row::kBlock,
                                     RowFeed<T, Row, true, 1, 2>::kSmemBytes, p.outer, p, stream);
          },
          [&](auto team, auto v) {
            constexpr int kTeam = decltype(team)::value;
            using Team = RowTeam<kTeam>;
            SoftmaxRowFwdKernel<T, kTeam, decltype(v)::value, kLog>
                <<<RowGrid(Team::kTeamsPerBlock, p.outer), Team::kBlock, 0, stream>>>(p);
            return cudaGetLastError();
          },
          [&](auto v) {
            const unsigned grid = StridedGrid(p.outer * (p.inner / decltype(v)::value));
            if (grid == 0) return cudaErrorInvalidValue;
            SoftmaxStridedFwdKernel<T, decltype(v)::value, kLog><<<grid, kStridedThreads, 0, stream>>>(p);
            return cudaGetLastError();
          });
    };
    return p.log ? run(std::true_type{}) : run(std::false_type{});
  });
}

cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream) {
  if (p.outer == 0 || p.n == 0 || p.inner == 0) return cudaSuccess;
  return DispatchDType(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const int64_t span = p.inner == 1 ? p.n : p.inner;
    const bool vec = span % kVec == 0 && IsAligned(p.x, 16) && IsAligned(p.dy, 16) &&
                     IsAligned(p.dx, 16);
    auto run = [&](auto log) {
      constexpr bool kLog = decltype(log)::value;
      return LaunchAny<T, kBwdCacheElems, kBwdScalarElems>(
          p, vec, kBwdMinClusterWidth<T>,
          [&](auto row) {
            using Row = decltype(row);
            SoftmaxRegBwdKernel<T, Row, kLog><<<RowGrid(Row::kTeams, p.outer), Row::kBlock, 0, stream>>>(p);
            return cudaGetLastError();
          },
          [&](auto row, int blocks) {
            using Row = decltype(row);
            return LaunchRowClusters(SoftmaxRegBwdKernel<T, Row, kLog, true>, blocks, Row::kBlock,
                                     RowFeed<T, Row, true, 2>::kSmemBytes, p.outer, p, stream);
          },
          [&](auto team, auto v) {
            constexpr int kTeam = decltype(team)::value;
            using Team = RowTeam<kTeam>;
            SoftmaxRowBwdKernel<T, kTeam, decltype(v)::value, kLog>
                <<<RowGrid(Team::kTeamsPerBlock, p.outer), Team::kBlock, 0, stream>>>(p);
            return cudaGetLastError();
          },
          [&](auto v) {
            const unsigned grid = StridedGrid(p.outer * (p.inner / decltype(v)::value));
            if (grid == 0) return cudaErrorInvalidValue;
            SoftmaxStridedBwdKernel<T, decltype(v)::value, kLog><<<grid, kStridedThreads, 0, stream>>>(p);
            return cudaGetLastError();
          });
    };
    return p.log ? run(std::true_type{}) : run(std::false_type{});
  });
}

}  // namespace jax_dnn
