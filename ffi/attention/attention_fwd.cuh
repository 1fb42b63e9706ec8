// Flash attention forward for Hopper: o = softmax(logits) v and lse.
// (Without a mask, at head dims 128 from 2048 keys and queries and at head
// dims 64 from 512, the launcher takes AttentionFwdWideKernel instead:
// 192-row tiles, attention_fwd_wide.cuh; FwdWideTakes in attention_plan.cc.)
//
// One CTA computes 128 query rows of one (batch, head) in three warpgroups:
//   warpgroup 0 (producer): one thread issues TMA loads -- each consumer's
//     half of the Q tile (a ring of three halves), then K and V tiles
//     through a 2-stage ring (full/empty mbarriers, K and V released
//     separately: K as soon as its scores are done; in a cluster of two
//     CTAs, half the rows of each into both, kCluster) -- and works out each
//     work tile's indices for the consumers (FwdTileInfo);
//   warpgroups 1, 2 (consumers): 64 rows each; per key tile j
//     S_j = Q K_j^T (wgmma, both operands in shared memory, K-major),
//     online softmax in registers (the S accumulator converts in place into
//     the A fragments of the next wgmma),
//     O += P_j V_j (wgmma, P from registers, V in shared memory MN-major).
// Two overlaps keep the tensor cores busy (FlashAttention-3's schedule):
//   - within a warpgroup, S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued
//     together, and the softmax of S_{j+1} runs while P_j V_j is in flight;
//   - between the two consumers, named barriers alternate their wgmma issue
//     ("ping-pong"), so one's softmax overlaps the other's GEMMs.
// Only key tiles that hold an allowed position for these rows are visited
// (causal / window / lengths), and only tiles that may hold a masked position
// evaluate the mask.
// Shared memory tiles are [64-column slab][rows][64] in TMA's 128-byte swizzle,
// the layout hopper::Descriptor describes.
#pragma once

#include <climits>

#include "ffi/attention/attention_common.cuh"
#include "ffi/common/hopper.cuh"
#include "ffi/attention/wgmma.cuh"

namespace jax_dnn {
namespace attention {

// kBN keys per tile: 176 (FlashAttention-3's choice for head dims <= 128)
// amortizes each tile's fixed costs -- barrier waits, the max shuffles, the
// output rescale -- over more keys than 128 while Q, two K and two V stages
// still fit in shared memory and the S, P and O fragments in 240 registers.
template <int kD, int kDv, int kBN>
struct FwdTiles {
  static constexpr int kBM = 128, kStages = 2;
  static constexpr int kQBytes = kBM * kD * 2, kKBytes = kBN * kD * 2, kVBytes = kBN * kDv * 2;
  // Q lives in a ring of 3 halves (64 rows each; FwdQSlot): [kD / 64 slabs][3 halves][64][64].
  static constexpr int kQHalfBytes = kQBytes / 2, kQSlab = 3 * 64 * 128;
  static constexpr int kSmem = 1024 /*alignment slack*/ + 3 * kQHalfBytes + kStages * (kKBytes + kVBytes) +
                               8 * (6 + 4 * kStages) + 3 * 52 /*FwdTileInfo ring*/;
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
};

// Named barriers of the consumers' ping-pong: consumer w waits on kPingPong + w.
constexpr int kPingPong = 1;

// Row h's (h = 0, 1) raw score max over the quad that holds it, and the
// exponentials exp2(s * scale - m_safe) in place with their per-thread sum:
// the two halves of a softmax step, shared by SoftmaxStep and SoftmaxStepLazy.
template <int kBN>
__device__ __forceinline__ float RowMax(const float (&s)[kBN / 2], int h) {
  float mx = -INFINITY;
#pragma unroll
  for (int e = 0; e < kBN / 8; ++e) mx = fmaxf(mx, fmaxf(s[4 * e + 2 * h], s[4 * e + 2 * h + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
}
template <int kBN>
__device__ __forceinline__ float RowExp2(float (&s)[kBN / 2], int h, float scale, float m_safe) {
  float sum = 0.f;
#pragma unroll
  for (int e = 0; e < kBN / 8; ++e) {
    s[4 * e + 2 * h] = hopper::Exp2(fmaf(s[4 * e + 2 * h], scale, -m_safe));
    s[4 * e + 2 * h + 1] = hopper::Exp2(fmaf(s[4 * e + 2 * h + 1], scale, -m_safe));
    sum += s[4 * e + 2 * h] + s[4 * e + 2 * h + 1];
  }
  return sum;
}

// One key tile's online-softmax step for the two rows (h = 0, 1) a thread
// holds: s holds scores that become logits (log2 units) when multiplied by
// `scale` (> 0; 1 when they already are logits). Updates the running max
// (in logit units) and sum, turns s into probabilities and returns the
// factor the output accumulator must be rescaled by. The max is taken over
// the raw scores and the scale folded into the exponent's FFMA: one FP32
// instruction less per score, and the FP32 work (with the exponentials) is
// what each tile's softmax must fit into the other consumer's GEMM time.
template <int kBN>
__device__ __forceinline__ void SoftmaxStep(float (&s)[kBN / 2], float scale, float (&m_run)[2],
                                            float (&l_run)[2], float (&corr)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mx = fmaxf(m_run[h], RowMax<kBN>(s, h) * scale);
    // A row with nothing allowed yet keeps max -inf: subtract 0 instead (p = 0).
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    corr[h] = hopper::Exp2(m_run[h] - m_safe);
    m_run[h] = mx;
    const float sum = RowExp2<kBN>(s, h, scale, m_safe);
    l_run[h] = l_run[h] * corr[h] + sum;  // per-thread partial; reduced over the quad at the end
  }
}

// SoftmaxStep with a lazy output rescale (FlashAttention-4's): the running
// max a row subtracts is raised only when some row of the warp sees a new
// max more than kLazySlack (log2 units) above it; otherwise the stale max stays,
// probabilities reach at most 2^kLazySlack (fp32 sums, bf16/fp16 P: no
// overflow) and the step returns false: the output needs no rescale, and
// the caller skips its Dv / 2 FMULs a thread. The vote keeps the skip
// warp-uniform. After a sequence's first key tiles a new max that large is
// rare, so nearly every step skips.
// The cost is accuracy where a few keys dominate a row: under the exact max
// the largest probability is 1, exact in bf16; under a stale one it is
// 2^f, rounded to 8 bits. A small slack keeps that rare. Slack 3: on
// test_forward_rising_logits' data (logits that rise along the keys) the
// output errors are the exact max's (0.00347 / 0.00349 at head dims 128 /
// 256) and dQ's 0.178 (0.156 with the exact max, bound 0.222), at slack 8's
// speed (cycles a work tile within 0.1%, H100); slack 8 takes dQ past the
// bound (0.232).
// Where it runs (against the exact max, H100):
// - AttentionFwdWideKernel, head dims above 64: 0.92-0.96 of the time a
//   call at head dim 128;
// - AttentionFwdKernel, value head dims 192 and 256: 0.91-0.96 of the time.
// Not elsewhere: the 128-row kernel at head dims up to 128 takes 1.00-1.08
// of the time with it, the wide one at head dim 64 1.02 (fewer cycles, but
// the clocks fall).
constexpr int kLazySlack = 3;
template <int kBN>
__device__ __forceinline__ bool SoftmaxStepLazy(float (&s)[kBN / 2], float scale, float (&m_run)[2],
                                                float (&l_run)[2], float (&corr)[2]) {
  float mx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) mx[h] = fmaxf(m_run[h], RowMax<kBN>(s, h) * scale);
  // -inf + kLazySlack is -inf: a row's first allowed scores always raise its max.
  const bool rescale = __any_sync(0xffffffffu, mx[0] > m_run[0] + float(kLazySlack) ||
                                                   mx[1] > m_run[1] + float(kLazySlack));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_use = rescale ? mx[h] : m_run[h];
    const float m_safe = m_use == -INFINITY ? 0.f : m_use;  // nothing allowed yet: p = 0
    corr[h] = rescale ? hopper::Exp2(m_run[h] - m_safe) : 1.f;
    m_run[h] = m_use;
    const float sum = RowExp2<kBN>(s, h, scale, m_safe);
    l_run[h] = l_run[h] * corr[h] + sum;
  }
  return rescale;
}

// Work tiles (128 query rows of one batch and head) come in units, query
// tiles fastest so that the CTAs running at once share one head's K and V in
// L2. A unit is one tile (the heaviest, under a causal mask, first) or, with
// `pairs`, the two tiles p and m_tiles - 1 - p, whose causal work sums to the
// same for every p: a persistent grid then stays balanced (a static schedule
// of single tiles gives some CTAs all the heavy ones: 0.70x cuDNN at S = 16k).
// With clusters of `cl` CTAs (m_tiles a multiple of cl), a unit is cl
// adjacent tiles, one for each CTA of a cluster (`rank`), which share K and V.
// 32-bit index math (the launcher checks that the units fit): 64-bit
// divisions cost ~1000 cycles a work tile on the consumers' critical path.
struct FwdWork {
  int64_t m0;
  int n, b;
  int j_lo = 0, j_hi = INT_MAX;  // a split piece's key tiles (else all of them)
  int slot = -1;                 // a split piece's workspace slot (-1: writes o, lse)
};
__device__ __forceinline__ bool FwdWorkAt(int u, int half, bool pairs, int m_tiles, int heads,
                                          int bm, FwdWork* w, int cl = 1, int rank = 0) {
  const int per = pairs ? (m_tiles + 1) / 2 : m_tiles / cl;  // units per head
  const int pi = u % per, rest = u / per;
  const int mt = half == 0 ? pi * cl + rank : m_tiles - 1 - pi;  // 0 = the heaviest tile
  w->m0 = int64_t(m_tiles - 1 - mt) * bm;
  w->n = rest % heads;
  w->b = rest / heads;
  return half == 0 || mt != pi;  // an odd count leaves the middle tile alone
}
__host__ __device__ __forceinline__ int64_t FwdUnits(int64_t m_tiles, int64_t heads, int64_t batch,
                                                     bool pairs, int cl = 1) {
  return (pairs ? (m_tiles + 1) / 2 : m_tiles / cl) * heads * batch;
}

// What the producer tells the consumers of a work tile (in shared memory, a
// ring of 3, written before the tile's Q load is armed: the consumers read it
// after their wait for Q). Worked out by the producer, whose thread has time
// to spare: on a consumer it costs ~1800 cycles a tile between two issue
// points (32-bit divisions, the sequence lengths' loads).
// (AttentionFwdWideKernel shares it and leaves mask_lo, mask_hi and
// q_limit unused: it takes no mask.)
struct FwdTileInfo {
  int m0, n, b, j_begin, n_tiles;
  int q_limit, kv_limit;
  int mask_lo[2], mask_hi[2];  // per consumer: key tiles [lo, hi) need no mask
  int slot;                    // FwdWork::slot
  int done;                    // no more tiles (nothing loaded)
};
static_assert(sizeof(FwdTileInfo) == 52, "FwdTiles::kSmem counts 52 bytes a FwdTileInfo");

// Q half u = 2 * tile + consumer (the tiles a CTA takes, counted) sits in
// ring slot u % 3, its phase parity (u / 3) & 1. A third slot lets the
// producer load consumer 0's half of the next tile a tile ahead; consumer 1's
// goes where consumer 0's half of this tile was, as soon as it is free.
__device__ __forceinline__ int FwdQSlot(int u) { return u % 3; }
__device__ __forceinline__ uint32_t FwdQParity(int u) { return (u / 3) & 1; }

// How the work tiles are shared out over the CTAs (the launcher decides).
// Without a split, cluster c (a CTA, or `cluster` CTAs that share their K
// and V loads) takes units c, c + clusters, ... With a split tail
// (split_tiles > 0 units, each of key_tiles key tiles, not pairs), it takes
// `rounds` such units, and then a contiguous range of the last split_tiles
// units' key tiles (FwdSplit): a persistent grid's last round would
// otherwise leave SMs idle (2048 work tiles on 132 SMs: 15.5 rounds, of
// which the 16th is half empty, ~3% of the forward). A range covers at most
// two units in part ("pieces"); a CTA's piece that is not a whole tile
// leaves its normalized o and its lse in workspace slot 2 * blockIdx.x +
// (0 or 1), and AttentionFwdCombineKernel merges them.
struct FwdSchedule {
  int units;
  bool pairs;
  int rounds, split_tiles, key_tiles;
  int cluster;  // CTAs a cluster (1 or 2); the kernel's kCluster
  float* ws;    // [2 * gridDim.x slots][kBM * (kDv + 1)]: o [kBM][kDv], then lse [kBM]
};

// The split tail's key tiles, tile after tile, cut into `ctas` ranges:
// CTA c takes [Lo(c), Lo(c + 1)). Fewer tiles than CTAs, so a range is at
// most one tile long and meets at most two tiles. 32-bit (the launcher
// checks tiles * key_tiles * ctas): 64-bit divisions make the producer
// thread spill.
struct FwdSplit {
  int tiles, key_tiles, ctas;
  __host__ __device__ __forceinline__ int Lo(int c) const {
    return static_cast<int>(static_cast<unsigned>(tiles * key_tiles * c) / ctas);
  }
};

// The k-th work tile of this CTA (counting both tiles of a pair): false when
// k is past them; *skip when it is the empty second half of an odd pair.
// The CTAs of a cluster get the same units (their own tiles of them) and the
// same key tiles.
template <bool kSplit, int kCluster>
__device__ __forceinline__ bool FwdTileAt(int k, const FwdSchedule& s, int m_tiles, int heads,
                                          int bm, FwdWork* w, bool* skip) {
  const int cid = blockIdx.x / kCluster, clusters = gridDim.x / kCluster, rank = blockIdx.x % kCluster;
  *skip = false;
  if (!kSplit || k < s.rounds) {
    const int u = cid + (s.pairs ? k / 2 : k) * clusters;
    if (u >= s.units) return false;
    *skip = !FwdWorkAt(u, s.pairs ? k % 2 : 0, s.pairs, m_tiles, heads, bm, w, kCluster, rank);
    w->j_lo = 0, w->j_hi = INT_MAX, w->slot = -1;
    return true;
  }
  const int i = k - s.rounds;  // the range's first or second piece
  if (i > 1) return false;
  const FwdSplit sp{s.split_tiles, s.key_tiles, clusters};
  const int lo = sp.Lo(cid), hi = sp.Lo(cid + 1), n = s.key_tiles;
  const int x = static_cast<int>(static_cast<unsigned>(lo) / n) + i, x0 = x * n;  // piece i's unit, its first key tile
  const int jb = max(lo, x0) - x0, je = min(hi, x0 + n) - x0;
  if (jb >= je) return false;
  FwdWorkAt(s.rounds * clusters + x, 0, false, m_tiles, heads, bm, w, kCluster, rank);
  w->j_lo = jb, w->j_hi = je;
  w->slot = jb == 0 && je == n ? -1 : 2 * static_cast<int>(blockIdx.x) + i;
  return true;
}

// A consumer's epilogue: o / l and lse of the thread's two rows (r0, its
// first row in the work tile, and row0 = m0 + r0 in the sequence; rows past
// T are not written), into the outputs of (batch b, head n) or, for a piece
// of a split tile (kSplit, slot >= 0), into its workspace slot ([kBM][kDv]
// o, then [kBM] lse). Into the outputs, after a 4x4 transpose inside each
// quad a thread holds 8 adjacent columns: a quarter of the store
// instructions of the accumulator layout's 2 columns, each of which costs ~85
// cycles (the L1 takes the 8 rows of a warp's store one line at a time):
// 2700 cycles a work tile at D = 128.
template <typename T, int kBM, int kDv, bool kSplit>
__device__ __forceinline__ void FwdStoreRows(const AttentionFwdParams& p, const FwdSchedule& sched, int slot,
                                             const float (&o)[kDv / 2], const float (&inv)[2],
                                             const float (&lse)[2], int r0, int64_t row0, int b, int n, int lane) {
  const AttentionShape& sh = p.shape;
  if (kSplit && slot >= 0) {
    float* ws = sched.ws + int64_t(slot) * kBM * (kDv + 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;  // row in the tile
      if (row0 + 8 * h >= sh.t) continue;
#pragma unroll
      for (int e = 0; e < kDv / 8; ++e)
        *reinterpret_cast<float2*>(ws + r * kDv + 8 * e + 2 * (lane % 4)) =
            make_float2(o[4 * e + 2 * h] * inv[h], o[4 * e + 2 * h + 1] * inv[h]);
      if (lane % 4 == 0) ws[kBM * kDv + r] = lse[h];
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t x[kDv / 8];
#pragma unroll
    for (int e = 0; e < kDv / 8; ++e) x[e] = hopper::PackPair<T>(o[4 * e + 2 * h] * inv[h], o[4 * e + 2 * h + 1] * inv[h]);
#pragma unroll
    for (int g = 0; g < kDv / 32; ++g) QuadTranspose(x + 4 * g, lane % 4);
    const int64_t row = row0 + 8 * h;
    if (row < sh.t) {
      T* orow = static_cast<T*>(p.o) + ((b * sh.t + row) * sh.n + n) * sh.hv;
#pragma unroll
      for (int g = 0; g < kDv / 32; ++g) {
        const int col = 8 * (4 * g + lane % 4);  // sh.hv is a multiple of 8
        if (col < sh.hv)
          *reinterpret_cast<uint4*>(orow + col) = make_uint4(x[4 * g], x[4 * g + 1], x[4 * g + 2], x[4 * g + 3]);
      }
      if (lane % 4 == 0) p.lse[(int64_t(b) * sh.n + n) * sh.t + row] = lse[h];
    }
  }
}

// A CTA takes its work tiles as FwdSchedule says -- one with a grid of every
// tile, several with a persistent grid (one CTA an SM), the last round
// possibly split along its keys (AttentionFwdCombineKernel merges). In the
// persistent form one work tile follows another with little pause of the
// tensor cores (a pause between tiles would cost ~5000 of ~170000 cycles a
// work tile at D = 128, S = 8192):
//   - Q sits in a ring of three 64-row halves (FwdQSlot), each released as
//     soon as its consumer's last scores are done: consumer 0's half of the
//     next tile loads a tile ahead, consumer 1's as soon as consumer 0 frees
//     this tile's. The producer also prefetches the next tile's Q into L2,
//     and hands the consumers each tile's indices in shared memory.
//   - A consumer issues the next tile's first scores together with this
//     tile's last P V (a key-tile step across the two tiles), then writes
//     this tile's output with 16-byte stores.
//   - The consumers' ping-pong runs on across tiles.
// kSplit: the schedule has a split tail (the launcher instantiates it only for
// the lean logits path). Its own instantiation, since the pieces' epilogue
// changes how ptxas schedules the whole consumer: 1-3% slower work tiles
// with the split's code in the one kernel (H200).
// kCluster = 2: the grid is in clusters of two CTAs that take the two
// halves of one unit (adjacent query tiles of a head, the same keys; the
// lean path without a mask) and share their K and V: each CTA's producer
// loads half the rows of a key tile into both CTAs' shared memory (TMA
// multicast), and a stage is free once the consumers of both CTAs are done
// with it. Half the K/V traffic out of L2: 2-3% less time under the
// H200's power cap (D = 128, S = 16384). FlashAttention-3 does the same for
// head dims >= 128.
template <typename T, int kD, int kDv, int kBN, bool kGeneral, bool kSplit, int kCluster>
__global__ void __launch_bounds__(384, 1)
    AttentionFwdKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                       const __grid_constant__ CUtensorMap tv, const AttentionFwdParams p,
                       const FwdSchedule sched) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  constexpr int kBM = Tiles::kBM, kStages = Tiles::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = hopper::AlignSmem1024(smem_raw);
  uint8_t* sq = base;  // the Q ring: [kD / 64 slabs][3 halves][64 rows][64]
  uint8_t* sk = sq + 3 * Tiles::kQHalfBytes;
  uint8_t* sv = sk + kStages * Tiles::kKBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kStages * Tiles::kVBytes);  // [3]: the Q ring
  uint64_t* q_empty = q_full + 3;                                                 // [3]
  uint64_t* k_full = q_empty + 3;
  uint64_t* v_full = k_full + kStages;
  uint64_t* k_empty = v_full + kStages;
  uint64_t* v_empty = k_empty + kStages;
  FwdTileInfo* info = reinterpret_cast<FwdTileInfo*>(v_empty + kStages);  // [3]

  const AttentionShape& sh = p.shape;
  const int m_tiles = static_cast<int>((sh.t + kBM - 1) / kBM);
  const int heads = static_cast<int>(sh.n);
  // Key tiles of work tile w: [j_begin, j_end).
  auto key_tiles = [&](const FwdWork& w, const ScoreCtx& c, int* j_begin, int* j_end) {
    KeyTiles(c, w.m0, min(w.m0 + kBM, sh.t) - 1, kBN, j_begin, j_end);
  };

  // Which key tiles need the mask: the range [mask_lo, mask_hi) needs none
  // (set up once per work tile) -- 1-1.4% faster than TileNeedsMask's 64-bit
  // compares on every tile at D = 128 (ncu, H200). ptxas schedules the
  // D = 64, 176-key instantiation 4% slower with it (S = 8192), so that one
  // keeps the per-tile test.
  constexpr bool kRangeTest = !(kD <= 64 && kBN > 128);
  // The last row of the 64 from r0 that the mask must see. Rows past T are
  // never stored, so they may take the unmasked path: without the clamp, the
  // consumer of a ragged last query tile (T % 128 != 0) would send every key
  // tile through the mask. Rows past a shorter query length (q_lens) stay masked:
  // q_limit is below T there.
  auto last_row = [&](int64_t r0) { return min(r0 + 63, sh.t - 1); };

  const int tid = threadIdx.x;
  // A K/V stage is released by every consumer thread; in a cluster, by each
  // consumer warp of each CTA (one lane, after the warp-wide wgmma wait).
  constexpr int kReleases = kCluster == 1 ? 256 : 8 * kCluster;
  if (tid == 0) {
    for (int h = 0; h < 3; ++h) {
      hopper::BarrierInit(&q_full[h], 1);
      hopper::BarrierInit(&q_empty[h], 128);
    }
    for (int s = 0; s < kStages; ++s) {
      hopper::BarrierInit(&k_full[s], 1);
      hopper::BarrierInit(&v_full[s], 1);
      hopper::BarrierInit(&k_empty[s], kReleases);
      hopper::BarrierInit(&v_empty[s], kReleases);
    }
    hopper::FenceBarrierInit();
  }
  // In a cluster the other CTA's loads and releases reach these barriers.
  if constexpr (kCluster > 1)
    hopper::ClusterSync();
  else
    __syncthreads();

  if (tid < 128) {  // producer
    hopper::RegDealloc<24>();
    if (tid == 0) {
      hopper::TmaPrefetchDescriptor(&tq);
      hopper::TmaPrefetchDescriptor(&tk);
      hopper::TmaPrefetchDescriptor(&tv);
      int k = 0;  // the CTA's next work tile to look at
      // The CTA's next work tile (false: none left).
      auto next_work = [&](FwdWork* w) {
        bool skip;
        for (; FwdTileAt<kSplit, kCluster>(k, sched, m_tiles, heads, kBM, w, &skip); ++k)
          if (!skip) {
            ++k;
            return true;
          }
        return false;
      };
      // Writes tile t's info (work w) for the consumers. The producer reads
      // its own loads back from there too, so that no work tile stays in
      // registers across the key loop (at 24 registers a thread, it spills).
      // Written a tile ahead: slot t % 3 was tile t - 3's, whose readers
      // have released their Q halves (load_half of tiles t - 2 and t - 1).
      auto publish = [&](int t, const FwdWork& w) {
        const ScoreCtx c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, w.b, w.n);
        int j_begin, j_end;
        key_tiles(w, c, &j_begin, &j_end);
        j_begin = max(j_begin, w.j_lo), j_end = min(j_end, w.j_hi);
        FwdTileInfo* f = &info[t % 3];
        f->m0 = static_cast<int>(w.m0), f->n = w.n, f->b = w.b;
        f->j_begin = j_begin, f->n_tiles = max(j_end - j_begin, 0);
        f->q_limit = static_cast<int>(c.q_limit), f->kv_limit = static_cast<int>(c.kv_limit);
        f->slot = w.slot, f->done = 0;
        for (int h = 0; h < 2; ++h) {
          f->mask_lo[h] = f->mask_hi[h] = 0;
          if constexpr (kRangeTest)
            UnmaskedKeyTiles(c, w.m0 + 64 * h, last_row(w.m0 + 64 * h), kBN, &f->mask_lo[h], &f->mask_hi[h]);
        }
      };
      // Q half u (FwdQSlot) of tile t (u / 2), once the slot's last use is
      // done; arming the barrier also releases the tile's info. With no tile
      // t (`done`), a phase with nothing loaded.
      auto load_half = [&](int u) {
        const int s = FwdQSlot(u);
        const FwdTileInfo& f = info[(u / 2) % 3];
        if (u >= 3) hopper::BarrierWait(&q_empty[s], FwdQParity(u - 3));
        if (f.done) {
          hopper::BarrierArrive(&q_full[s]);
          return;
        }
        hopper::BarrierExpectTx(&q_full[s], Tiles::kQHalfBytes);
        for (int d = 0; d < kD / 64; ++d)
          hopper::TmaLoad4d(sq + d * Tiles::kQSlab + s * 64 * 128, &tq, &q_full[s], d * 64, f.n,
                            f.m0 + 64 * (u % 2), f.b);
      };
      // Tile t's info, or `done` when the CTA has no tile t.
      auto publish_next = [&](int t) {
        FwdWork w;
        if (!next_work(&w)) {
          info[t % 3].done = 1;
          return false;
        }
        publish(t, w);
        return true;
      };

      // One 64-column slab of a K or V tile (rows j0...). In a cluster, this
      // CTA's share of its rows (the tensor maps' boxes are kBN / kCluster
      // rows), into every CTA of the cluster.
      const int rank = static_cast<int>(kCluster > 1 ? hopper::ClusterCtaRank() : 0);
      auto load_kv = [&](uint8_t* dst, const CUtensorMap* map, uint64_t* bar, int col, int kvh, int j0,
                         int b) {
        if constexpr (kCluster == 1) {
          hopper::TmaLoad4d(dst, map, bar, col, kvh, j0, b);
        } else {
          constexpr int kRows = kBN / kCluster;
          hopper::TmaLoad4dMulticast(dst + rank * kRows * 128, map, bar, col, kvh, j0 + rank * kRows, b,
                                     (1u << kCluster) - 1);
        }
      };

      int g = 0;  // K/V ring position, continued across work tiles
      bool have = publish_next(0);
      load_half(0);
      if (!have) load_half(1);
      for (int tile = 0; have; ++tile) {
        const bool have_next = publish_next(tile + 1);
        const FwdTileInfo& f = info[tile % 3];
        const FwdTileInfo& fn = info[(tile + 1) % 3];
        if (have_next)  // the next tile's Q into L2: its loads then wait on L2, not on HBM
          for (int d = 0; d < kD / 64; ++d)
            for (int h = 0; h < 2; ++h) hopper::TmaPrefetchL2(&tq, d * 64, fn.n, fn.m0 + 64 * h, fn.b);
        const int kvh = f.n / static_cast<int>(sh.n / sh.kh);
        const int j_begin = f.j_begin, j_end = f.j_begin + f.n_tiles;
        // Consumer 1's half goes after the first K: its slot frees only when
        // consumer 0 is done with the previous tile's scores.
        if (j_begin == j_end) load_half(2 * tile + 1);
        for (int j = j_begin; j < j_end; ++j, ++g) {
          const int s = g % kStages;
          const uint32_t parity = ((g / kStages) - 1) & 1;
          if (g >= kStages) hopper::BarrierWait(&k_empty[s], parity);
          uint8_t* k_dst = sk + s * Tiles::kKBytes;
          hopper::BarrierExpectTx(&k_full[s], Tiles::kKBytes);  // in a cluster: both CTAs' rows
          for (int d = 0; d < kD / 64; ++d)
            load_kv(k_dst + d * kBN * 128, &tk, &k_full[s], d * 64, kvh, j * kBN, f.b);
          if (j == j_begin) {
            load_half(2 * tile + 1);
          }
          if (g >= kStages) hopper::BarrierWait(&v_empty[s], parity);
          uint8_t* v_dst = sv + s * Tiles::kVBytes;
          hopper::BarrierExpectTx(&v_full[s], Tiles::kVBytes);
          for (int d = 0; d < kDv / 64; ++d)
            load_kv(v_dst + d * kBN * 128, &tv, &v_full[s], d * 64, kvh, j * kBN, f.b);
        }
        // Consumer 0's half of the next tile (or its `done`), a tile ahead of
        // its use.
        load_half(2 * tile + 2);
        if (!have_next) load_half(2 * tile + 3);  // consumer 1's `done`
        have = have_next;
      }
    }
    return;  // an exited thread counts as arrived at the consumers' final ClusterSync
  }

  // --- consumers ---
  hopper::RegAlloc<240>();
  const int wg = hopper::WarpUniform(tid / 128) - 1, t = tid % 128, warp = t / 32, lane = t % 32;

  // Ping-pong: each wgmma issue point waits for this consumer's turn and then
  // hands the turn to the other; consumer 0 goes first. Both consumers visit
  // the same work tiles and hence the same issue points, so the turns
  // alternate strictly; consumer 1's last hand-over is taken by one more wait
  // of consumer 0 after its last tile.
  auto my_turn = [&] { hopper::NamedBarrierSync(kPingPong + wg, 256); };
  auto pass_turn = [&] { hopper::NamedBarrierArrive(kPingPong + 1 - wg, 256); };
  if (wg == 1) hopper::NamedBarrierArrive(kPingPong, 256);

  // What a consumer keeps of one work tile.
  struct Tile {
    FwdWork w;
    ScoreCtx c;
    int j_begin, n_tiles;
    int mask_lo, mask_hi;  // key tiles [mask_lo, mask_hi) need no mask
    int64_t row0;          // this thread's first row (and row0 + 8)
    int q_slot;            // this consumer's Q half
  };
  // Tile `tile`'s info, once its Q half has arrived (false: no more tiles).
  auto read_tile = [&](int tile, Tile* tl) {
    const FwdTileInfo& f = info[tile % 3];
    if (f.done) return false;
    tl->w.m0 = f.m0, tl->w.n = f.n, tl->w.b = f.b;
    if constexpr (kSplit) tl->w.slot = f.slot;
    tl->j_begin = f.j_begin, tl->n_tiles = f.n_tiles;
    tl->mask_lo = f.mask_lo[wg], tl->mask_hi = f.mask_hi[wg];
    tl->c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, f.b, f.n, f.q_limit, f.kv_limit);
    tl->row0 = int64_t(f.m0) + 64 * wg + 16 * warp + lane / 4;
    tl->q_slot = FwdQSlot(2 * tile + wg);
    return true;
  };

  float o[kDv / 2];
  float m_run[2], l_run[2];
  float sc[kBN / 2], corr[2];
  bool rescale = true;  // the last softmax step moved the max (always, without the lazy rescale)
  uint32_t pa[kBN / 16][4];
  auto reset = [&] {
#pragma unroll
    for (int e = 0; e < kDv / 2; ++e) o[e] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
  };

  // The scores of the key tile at ring position g.
  auto issue_scores = [&](int g, int q_slot) {
    const uint32_t q_addr = hopper::SmemAddr(sq) + q_slot * 64 * 128;
    const int s = g % kStages;
    const uint32_t k_addr = hopper::SmemAddr(sk + s * Tiles::kKBytes);
    hopper::BarrierWait(&k_full[s], (g / kStages) & 1);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;  // 16 columns = 32 bytes inside the swizzle atom
      WgmmaSS<T, kBN>(sc, hopper::Descriptor(q_addr + (kk / 4) * Tiles::kQSlab + off, 0),
                      hopper::Descriptor(k_addr + (kk / 4) * kBN * 128 + off, 0), kk > 0);
    }
    hopper::WgmmaCommit();
  };
  // O += P V with the values at ring position g.
  auto issue_pv = [&](int g) {
    const int s = g % kStages;
    const uint32_t v_addr = hopper::SmemAddr(sv + s * Tiles::kVBytes);
    hopper::BarrierWait(&v_full[s], (g / kStages) & 1);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      WgmmaRS<T, kDv>(o, pa[kk], hopper::Descriptor(v_addr + kk * 2048, kBN * 128), 1);
    hopper::WgmmaCommit();
  };
  // Logits of key tile j_begin + it of tile tl, then the softmax step.
  auto softmax = [&](const Tile& tl, int it) {
    const int j = tl.j_begin + it;
    const int64_t j0 = int64_t(j) * kBN;
    const int64_t wg_r0 = tl.w.m0 + 64 * wg;
    const bool need_mask = kRangeTest ? j < tl.mask_lo || j >= tl.mask_hi
                                      : TileNeedsMask(tl.c, wg_r0, last_row(wg_r0), j0, j0 + kBN - 1);
    // The lean path leaves the scale to SoftmaxStep's FFMA (the launcher
    // sends scale <= 0 to the general path).
    if constexpr (kGeneral)
      Logits<kBN, false, true>(sc, tl.c, tl.row0, j0 + 2 * (lane % 4), need_mask);
    else if (need_mask)
      MaskRowIntervals<kBN>(sc, tl.c, tl.row0, j0 + 2 * (lane % 4));
    // The lazy rescale at value head dims 192 and 256 (SoftmaxStepLazy says why).
    if constexpr (kDv >= 192)
      rescale = SoftmaxStepLazy<kBN>(sc, kGeneral ? 1.f : tl.c.scale_log2, m_run, l_run, corr);
    else
      SoftmaxStep<kBN>(sc, kGeneral ? 1.f : tl.c.scale_log2, m_run, l_run, corr);
  };
  auto pack = [&] {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
  };
  // Waits for O += P V with the values at ring position g (the last wgmma in
  // flight) and frees its V slot; P's registers stay untouched until here.
  // Releases a K or V stage (kReleases).
  auto release = [&](uint64_t* bar) {
    if constexpr (kCluster == 1) {
      hopper::BarrierArrive(bar);
    } else if (lane < kCluster) {
      hopper::BarrierArriveCluster(bar, lane);  // lane c on CTA c
    }
  };
  auto pv_done = [&](int g) {
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(o);
    hopper::KeepRegisters(pa);
    release(&v_empty[g % kStages]);
  };
  // After the wait for the scores at ring position g, key tile `it` of tl:
  // frees the K slot (and this consumer's Q half after its last scores) and
  // runs the softmax.
  auto scores_done = [&](const Tile& tl, int g, int it) {
    hopper::FenceRegisters(sc);
    release(&k_empty[g % kStages]);
    if (it == tl.n_tiles - 1) hopper::BarrierArrive(&q_empty[tl.q_slot]);
    softmax(tl, it);
  };

  // Waits until this consumer's Q half u (u = 2 * tile + wg) has landed. A
  // slot serves both consumers in turn, and a parity wait also passes while
  // the barrier is one phase short -- the other consumer's use u - 3 not yet
  // loaded (it can lag by more than a tile when it skips key-less tiles).
  // So first wait until use u - 3 was released: that parity of q_empty is
  // unambiguous, since use u - 6 was this consumer's own and is released.
  // (In the common case it is long released and the wait returns at once.)
  auto wait_q = [&](int u) {
    if (u >= 3) hopper::BarrierWait(&q_empty[FwdQSlot(u)], FwdQParity(u - 3));
    hopper::BarrierWait(&q_full[FwdQSlot(u)], FwdQParity(u));
  };

  Tile cur;
  int tile = 0;
  wait_q(wg);
  bool have = read_tile(0, &cur);
  bool primed = false;  // cur's first scores already issued and through the softmax
  int g0 = 0;           // K/V ring position of cur's first key tile
  while (have) {
    const int n_tiles = cur.n_tiles;
    if (!primed) {
      reset();
      if (n_tiles > 0) {
        my_turn();
        issue_scores(g0, cur.q_slot);
        pass_turn();
        hopper::WgmmaWait<0>();
        scores_done(cur, g0, 0);  // o is still 0: no rescale
        pack();
      }
    }
    for (int it = 1; it < n_tiles; ++it) {
      my_turn();
      issue_scores(g0 + it, cur.q_slot);
      issue_pv(g0 + it - 1);
      pass_turn();
      hopper::WgmmaWait<1>();  // the scores; P V may still run
      scores_done(cur, g0 + it, it);
      hopper::FenceRegisters(sc);  // the exponentials before the wait (in the PTX)
      pv_done(g0 + it - 1);
      if (rescale) {
#pragma unroll
        for (int e = 0; e < kDv / 2; ++e) o[e] *= corr[(e >> 1) & 1];
      }
      pack();
    }
    if (n_tiles == 0) hopper::BarrierArrive(&q_empty[cur.q_slot]);  // no scores, no Q read

    // This tile's output scale and logsumexp (the sums and maxima are final).
    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      inv[h] = l > 0.f ? 1.f / l : 0.f;
      lse[h] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
    }
    auto store_output = [&] {
      FwdStoreRows<T, kBM, kDv, kSplit>(p, sched, cur.w.slot, o, inv, lse, 64 * wg + 16 * warp + lane / 4,
                                        cur.row0, cur.w.b, cur.w.n, lane);
    };

    // The next tile's Q half (and info), wanted now by the merged step.
    wait_q(2 * tile + 2 + wg);
    Tile nxt;
    const bool have_next = read_tile(tile + 1, &nxt);
    // The next tile's first scores go out with this tile's last P V, and the
    // output is written while they run. Each path has its own epilogue so
    // that every wgmma wait count is a constant where the paths join.
    const bool merge = n_tiles > 0 && have_next && nxt.n_tiles > 0;
    if (merge) {
      // As a key-tile step: the scores first, then P V, the softmax of the
      // scores while P V runs; the output rescale becomes the epilogue.
      my_turn();
      issue_scores(g0 + n_tiles, nxt.q_slot);
      issue_pv(g0 + n_tiles - 1);
      pass_turn();
      m_run[0] = m_run[1] = -INFINITY;
      l_run[0] = l_run[1] = 0.f;
      hopper::WgmmaWait<1>();  // the scores; P V may still run
      scores_done(nxt, g0 + n_tiles, 0);
      hopper::FenceRegisters(sc);
      pv_done(g0 + n_tiles - 1);
      store_output();
#pragma unroll
      for (int e = 0; e < kDv / 2; ++e) o[e] = 0.f;
      pack();
      g0 += n_tiles;
    } else {
      if (n_tiles > 0) {
        my_turn();
        issue_pv(g0 + n_tiles - 1);
        pass_turn();
        pv_done(g0 + n_tiles - 1);
      }
      store_output();
      g0 += n_tiles;
    }
    ++tile;
    cur = nxt;
    have = have_next;
    primed = merge;
  }
  if (wg == 0) my_turn();  // consumer 1's last hand-over (or its opening one)
  // A CTA of a cluster stays until the other has made its last releases on
  // this CTA's barriers (its loads into this CTA were waited for above).
  if constexpr (kCluster > 1) hopper::ClusterSync();
}

}  // namespace attention
}  // namespace jax_dnn
