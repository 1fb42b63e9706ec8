// Flash attention backward for Hopper. Two paths:
// The split (deterministic: no atomics, every gradient written once):
//   AttentionDeltaKernel: delta = rowsum(dO * O) per query row (fp32).
//   AttentionDqKernel:    per 128 query rows: for each key tile, recompute
//       S = Q K^T and P = exp(S - lse), dP = dO V^T, dS = P (dP - delta),
//       dQ += dS K. Also writes dbias = dS when a bias is given.
//   AttentionDkvKernel:   per 128 key rows (of one key/value head): for each
//       query head of its group and each query tile, recompute the transposed
//       scores S^T = K Q^T (so P^T and dS^T land in registers as the A
//       operands of the next wgmmas), dP^T = V dO^T, dV += P^T dO,
//       dK += dS^T Q. A producer warp stages each query tile's lse and delta
//       in shared memory beside its Q and dO.
// The single pass (head dims padding to 64 or 128, on the lean logits path,
// no bias; the default unless
// deterministic_backward): AttentionDkvKernel with kDq also adds dQ = dS K
// into an fp32 accumulator with TMA bulk reduce-adds, and
// AttentionDqConvertKernel writes dq from it: 5 GEMMs per tile pair where
// the split does 7 (S = 8192, D = 128, H100: 5.06 ms against 5.74 ms for
// the split, kernels under ncu; per-element fp32 atomics for dQ: 7.05 ms).
// Both kernels follow the forward's structure (attention_fwd.cuh): a producer
// warpgroup streams tiles through a TMA ring, two consumer warpgroups own 64
// rows each. The dQ kernel pipelines across key tiles (see there; 3 stages).
// The dK/dV kernel does not: pipelined forms of it are slower on H100 at
// S = 8192, D = 128 (3.53-4.16 ms against 3.40 ms for this one): they spill,
// and with deeper wgmma queues the two consumers drift into lockstep, so
// that their elementwise phases stop hiding behind each other's GEMMs.
#pragma once

#include <type_traits>

#include "ffi/attention/attention_common.cuh"
#include "ffi/common/hopper.cuh"
#include "ffi/attention/wgmma.cuh"
#include "ffi/common/device.cuh"

namespace jax_dnn {
namespace attention {

// delta = rowsum(dO * O), one [B, T, N] row per kLanes lanes, kVec elements
// per access (8: 16-byte loads, when rows are 16-byte aligned; else 1).
// Against a warp a row with 2-byte loads (ncu, H200, B * T = 16384,
// N = 2048 / D): D = 128 37 us against 65.5, D = 64 38 against 136 (134 MB
// read: ~28 us at full bandwidth).
template <typename T, int kLanes, int kVec>
__global__ void __launch_bounds__(256)
    AttentionDeltaKernel(const T* __restrict__ o, const T* __restrict__ d_o,
                         float* __restrict__ delta, int64_t rows, int64_t t, int64_t n, int64_t hv) {
  static_assert(32 % kLanes == 0, "a row's lanes sit in one warp");
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = g / kLanes;
  const int sub = static_cast<int>(g % kLanes);
  float acc = 0.f;
  if (row < rows) {
    for (int64_t d = int64_t(sub) * kVec; d < hv; d += kLanes * kVec) {
      float a[kVec], b[kVec];
      LoadVec<T, kVec>(o + row * hv + d, a);
      LoadVec<T, kVec>(d_o + row * hv + d, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc = fmaf(a[i], b[i], acc);
    }
  }
  // Every lane takes part in the shuffles, rows past the end included.
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
  if (row < rows && sub == 0) {
    const int64_t b = row / (t * n), i = (row / n) % t, h = row % n;
    delta[(b * n + h) * t + i] = acc;
  }
}

__device__ __forceinline__ float Log2Lse(float lse) {
  // A fully masked row has lse = -inf; +inf makes every exp2(s - lse) zero.
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// P = exp2(logit - lse2) over one fragment, in place; lse2(e) gives element
// e's row lse in log2 units. The lean path forms logit - lse2 in one FFMA
// (s * scale_log2 - lse2) and only then masks (-inf, which exp2 takes to 0,
// whatever the scale's sign); the general path goes through Logits. The
// lean mask is MaskRowIntervals' (kIntervals) or Logits' per-score test.
template <int kN, bool kTransposed, bool kGeneral, bool kIntervals = true, typename Lse2>
__device__ __forceinline__ void Probabilities(float (&s)[kN / 2], const ScoreCtx& c, int64_t row0,
                                              int64_t col0, bool need_mask, Lse2 lse2) {
  if constexpr (kGeneral) {
    Logits<kN, kTransposed, true>(s, c, row0, col0, need_mask);
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) s[e] = hopper::Exp2(s[e] - lse2(e));
  } else {
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) s[e] = fmaf(s[e], c.scale_log2, -lse2(e));
    if constexpr (kIntervals) {
      if (need_mask) MaskRowIntervals<kN, kTransposed>(s, c, row0, col0);
    } else {
      if (need_mask) Logits<kN, kTransposed, false, false>(s, c, row0, col0, true);
    }
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) s[e] = hopper::Exp2(s[e]);
  }
}

// Element e's entry of a shared per-query row array (lse or delta) in a
// transposed fragment: columns 8 (e / 4) + e % 2 past the thread's own, read
// as one 8-byte pair (LDS.64) per e / 4 (the thread's offset is even).
__device__ __forceinline__ float RowPair(const float* rows, int e) {
  const float2 v = *reinterpret_cast<const float2*>(rows + 8 * (e >> 2));
  return (e & 1) ? v.y : v.x;
}

// Writes one m64nN fp32 accumulator fragment (rows row0, row0 + 8) to a
// [rows, ld] array of T, rows < n_rows and columns < n_cols only (n_cols and
// ld multiples of 8, `out` 16-byte aligned: the launcher checks). As in the
// forward's epilogue, a 4x4 transpose inside each quad gives a thread 8
// adjacent columns, so it stores 16 bytes at a time: a quarter of the store
// instructions of the fragment's 2-column layout, each of which takes the L1
// a line per row (8 a warp). The CTA's tensor cores idle while it stores
// (one CTA an SM), so this is time: the backward alone takes 0.970-0.990
// of the 2-column stores' time at D = 128, S = 1024-8192 (H200).
template <typename T, int kN>
__device__ __forceinline__ void StoreFragment(const float (&acc)[kN / 2], float scale, T* out,
                                              int64_t row0, int64_t n_rows, int64_t ld,
                                              int64_t n_cols, int lane) {
  static_assert(kN % 32 == 0, "whole quads of 8-column groups");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t x[kN / 8];
#pragma unroll
    for (int e = 0; e < kN / 8; ++e)
      x[e] = hopper::PackPair<T>(acc[4 * e + 2 * h] * scale, acc[4 * e + 2 * h + 1] * scale);
#pragma unroll
    for (int g = 0; g < kN / 32; ++g) QuadTranspose(x + 4 * g, lane % 4);  // the whole warp
    const int64_t row = row0 + 8 * h;
    if (row >= n_rows) continue;
#pragma unroll
    for (int g = 0; g < kN / 32; ++g) {
      const int col = 8 * (4 * g + lane % 4);
      if (col < n_cols)
        *reinterpret_cast<uint4*>(out + row * ld + col) = make_uint4(x[4 * g], x[4 * g + 1], x[4 * g + 2], x[4 * g + 3]);
    }
  }
}

// The (tile, y, z) a backward CTA takes in its grid (tiles, heads, batch).
// With a causal mask a tile's work is linear in its index: the dQ kernel
// walks its tiles from the last query tile, the dK/dV kernel from the first
// key tile, so each head's tiles run longest first. The hardware starts CTAs
// in linear order (x fastest), a head's tiles after the previous head's, so
// the grid's last CTAs include the last head's longest tiles, which run on
// while the other SMs idle. So the grid's last p.tail_slices (head, batch)
// slices are taken tile-major instead: every one of their longest tiles,
// then all their second-longest, ... (0: the plain order). The launcher's
// tail is ceil(2 SMs / tiles) slices (CausalTail). Not the whole grid: its
// running CTAs would then span many heads and lose the sharing of each
// head's K/V (dQ) or Q/dO (dK/dV) streams and dQ accumulator in L2.
// In a simulation of greedy dispatch (132 SMs, 4-256 tiles, 1-256 slices)
// this tail is never worse than the plain order and within 1% of the whole
// grid longest first on average. The causal backward alone against the plain
// order (H200, B * S = 16384): D = 256 0.894-1.003 of the time at
// S = 2048-16384, D = 128 0.960-0.982, D = 64 0.981-0.992; the whole grid
// tile-major loses at D = 128 (1.03-1.07) and D = 64 (1.09) to L2.
__device__ __forceinline__ uint3 BwdGridTile(unsigned tail_slices) {
  if (tail_slices == 0) return blockIdx;  // (any grid size: nothing below runs)
  const unsigned tiles = gridDim.x, slices = gridDim.y * gridDim.z;
  const unsigned linear = blockIdx.x + tiles * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned first = (slices - tail_slices) * tiles;  // the CTAs before the tail
  if (linear < first) return blockIdx;
  const unsigned r = linear - first, slice = slices - tail_slices + r % tail_slices;
  return make_uint3(r / tail_slices, slice % gridDim.y, slice / gridDim.y);
}

template <int kD, int kDv, int kBN>
struct DqTiles {
  static constexpr int kBM = 128, kStages = 3;  // see the pipeline in AttentionDqKernel
  static constexpr int kQBytes = kBM * kD * 2, kOBytes = kBM * kDv * 2;
  static constexpr int kKBytes = kBN * kD * 2, kVBytes = kBN * kDv * 2;
  static constexpr int kSmem =
      1024 + kQBytes + kOBytes + kStages * (kKBytes + kVBytes) + 8 * (1 + 3 * kStages);
};

template <typename T, int kD, int kDv, int kBN, bool kGeneral>
__global__ void __launch_bounds__(384, 1)
    AttentionDqKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                      const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                      const AttentionBwdParams p) {
  using Tiles = DqTiles<kD, kDv, kBN>;
  constexpr int kBM = Tiles::kBM, kStages = Tiles::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = hopper::AlignSmem1024(smem_raw);
  uint8_t* sq = base;
  uint8_t* sdo = sq + Tiles::kQBytes;
  uint8_t* sk = sdo + Tiles::kOBytes;
  uint8_t* sv = sk + kStages * Tiles::kKBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kStages * Tiles::kVBytes);
  uint64_t* k_full = q_full + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* empty = v_full + kStages;

  const AttentionShape& sh = p.shape;
  const uint3 g = BwdGridTile(p.tail_slices);
  const int64_t m0 = (int64_t(gridDim.x) - 1 - g.x) * kBM;  // the longest (causal) first
  const int64_t n = g.y, b = g.z;
  const int64_t kvh = n / (sh.n / sh.kh);
  const ScoreCtx c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, b, n);
  int j_begin, j_end;
  KeyTiles(c, m0, min(m0 + kBM, sh.t) - 1, kBN, &j_begin, &j_end);

  const int tid = threadIdx.x;
  if (tid == 0) {
    hopper::BarrierInit(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      hopper::BarrierInit(&k_full[s], 1);
      hopper::BarrierInit(&v_full[s], 1);
      hopper::BarrierInit(&empty[s], 256);
    }
    hopper::FenceBarrierInit();
  }
  __syncthreads();

  if (tid < 128) {  // producer
    hopper::RegDealloc<24>();
    if (tid == 0) {
      hopper::BarrierExpectTx(q_full, Tiles::kQBytes + Tiles::kOBytes);
      for (int d = 0; d < kD / 64; ++d)
        hopper::TmaLoad4d(sq + d * kBM * 128, &tq, q_full, d * 64, n, m0, b);
      for (int d = 0; d < kDv / 64; ++d)
        hopper::TmaLoad4d(sdo + d * kBM * 128, &tdo, q_full, d * 64, n, m0, b);
      for (int j = j_begin, it = 0; j < j_end; ++j, ++it) {
        const int s = it % kStages;
        if (it >= kStages) hopper::BarrierWait(&empty[s], ((it / kStages) - 1) & 1);
        hopper::BarrierExpectTx(&k_full[s], Tiles::kKBytes);
        for (int d = 0; d < kD / 64; ++d)
          hopper::TmaLoad4d(sk + s * Tiles::kKBytes + d * kBN * 128, &tk, &k_full[s], d * 64, kvh,
                            j * kBN, b);
        hopper::BarrierExpectTx(&v_full[s], Tiles::kVBytes);
        for (int d = 0; d < kDv / 64; ++d)
          hopper::TmaLoad4d(sv + s * Tiles::kVBytes + d * kBN * 128, &tv, &v_full[s], d * 64, kvh,
                            j * kBN, b);
      }
    }
    return;
  }

  hopper::RegAlloc<240>();
  const int wg = tid / 128 - 1, t = tid % 128, warp = t / 32, lane = t % 32;
  const int64_t row0 = m0 + 64 * wg + 16 * warp + lane / 4;
  const int64_t wg_r0 = m0 + 64 * wg, wg_r1 = wg_r0 + 63;
  float lse2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + 8 * h;
    const bool in = row < sh.t;
    lse2[h] = in ? Log2Lse(p.lse[(b * sh.n + n) * sh.t + row]) : INFINITY;
    delta[h] = in ? p.delta[(b * sh.n + n) * sh.t + row] : 0.f;
  }
  float dq[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dq[e] = 0.f;
  const uint32_t q_addr = hopper::SmemAddr(sq) + wg * 64 * 128;
  const uint32_t do_addr = hopper::SmemAddr(sdo) + wg * 64 * 128;
  hopper::BarrierWait(q_full, 0);

  uint32_t da[kBN / 16][4];  // dS of the previous tile: the A fragments of its dQ wgmma
  float sc[kBN / 2], dp[kBN / 2];
  // S = Q K^T and dP = dO V^T of tile `it`: two commit groups.
  auto issue_sdp = [&](int it) {
    const int s = it % kStages;
    const uint32_t phase = (it / kStages) & 1;
    const uint32_t k_addr = hopper::SmemAddr(sk + s * Tiles::kKBytes);
    const uint32_t v_addr = hopper::SmemAddr(sv + s * Tiles::kVBytes);
    hopper::BarrierWait(&k_full[s], phase);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      WgmmaSS<T, kBN>(sc, hopper::Descriptor(q_addr + (kk / 4) * kBM * 128 + (kk % 4) * 32, 0),
                      hopper::Descriptor(k_addr + (kk / 4) * kBN * 128 + (kk % 4) * 32, 0), kk > 0);
    hopper::WgmmaCommit();
    hopper::BarrierWait(&v_full[s], phase);
#pragma unroll
    for (int kk = 0; kk < kDv / 16; ++kk)
      WgmmaSS<T, kBN>(dp, hopper::Descriptor(do_addr + (kk / 4) * kBM * 128 + (kk % 4) * 32, 0),
                      hopper::Descriptor(v_addr + (kk / 4) * kBN * 128 + (kk % 4) * 32, 0), kk > 0);
    hopper::WgmmaCommit();
  };
  // dQ += dS K for tile `it` (dS in da): one commit group.
  auto issue_dq = [&](int it) {
    const uint32_t k_addr = hopper::SmemAddr(sk + (it % kStages) * Tiles::kKBytes);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      WgmmaRS<T, kD>(dq, da[kk], hopper::Descriptor(k_addr + kk * 2048, kBN * 128), 1);
    hopper::WgmmaCommit();
  };
  // P = exp2(logits - lse), in sc (needs S only: runs while dP is in flight).
  auto probabilities = [&](int it) {
    const int64_t j0 = int64_t(j_begin + it) * kBN;
    const bool need_mask = TileNeedsMask(c, wg_r0, wg_r1, j0, j0 + kBN - 1);
    Probabilities<kBN, false, kGeneral>(sc, c, row0, j0 + 2 * (lane % 4), need_mask,
                                        [&](int e) { return lse2[(e >> 1) & 1]; });
  };
  // dS = P (dP - delta) into sc (= dbias, written when asked) and, times the
  // soft-cap's derivative and the scale, into dp. (The lean path needs only
  // the latter: P (scale dP - scale delta), one FFMA and one multiply.)
  auto scores_grad = [&](int it) {
    if constexpr (!kGeneral) {
#pragma unroll
      for (int e = 0; e < kBN / 2; ++e) dp[e] = sc[e] * fmaf(dp[e], p.scale, -delta[(e >> 1) & 1] * p.scale);
      return;
    }
    const int64_t col0 = int64_t(j_begin + it) * kBN + 2 * (lane % 4);
#pragma unroll
    for (int e = 0; e < kBN / 2; ++e) {
      const int h = (e >> 1) & 1;
      const float pr = sc[e];
      const float ds = pr * (dp[e] - delta[h]);
      sc[e] = ds;
      const int64_t row = row0 + 8 * h, col = col0 + 8 * (e >> 2) + (e & 1);
      dp[e] = ds * SoftcapGrad<kGeneral>(c, pr, lse2[h], row, col) * p.scale;  // d (q.k)
    }
    if (kGeneral && p.dbias != nullptr) {
      float* db = p.dbias + (b * sh.n + n) * sh.t * sh.s;
#pragma unroll
      for (int e = 0; e < kBN / 2; e += 2) {
        const int64_t row = row0 + 8 * ((e >> 1) & 1), col = col0 + 8 * (e >> 2);
        if (row < sh.t && col < sh.s) {
          db[row * sh.s + col] = sc[e];
          if (col + 1 < sh.s) db[row * sh.s + col + 1] = sc[e + 1];
        }
      }
    }
  };
  auto pack_ds = [&] {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) da[kk][r] = hopper::PackPair<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
  };

  // Software pipeline across key tiles: tile it's S and dP are issued, then
  // tile it-1's dQ (its dS fragments kept from the last iteration), so that
  // the exponentials run while dP is in flight and the dS arithmetic while dQ
  // is. A stage is released when its dQ wgmma is done, one tile late -- hence
  // three stages, so that the next tile's loads are not held up. The first
  // tile is peeled: every wgmma wait count is then a constant, which ptxas
  // needs to keep the wgmmas asynchronous (with waits chosen at run time it
  // serializes them -- ptxas info C7514).
  const int n_tiles = j_end - j_begin;
  if (n_tiles > 0) {
    issue_sdp(0);
    hopper::WgmmaWait<1>();
    hopper::FenceRegisters(sc);
    probabilities(0);
    hopper::FenceRegisters(sc);  // P before the wait (see kDq's loop)
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(dp);
    scores_grad(0);
    pack_ds();
  }
  for (int it = 1; it < n_tiles; ++it) {
    issue_sdp(it);
    issue_dq(it - 1);
    hopper::WgmmaWait<2>();
    hopper::FenceRegisters(sc);
    probabilities(it);
    hopper::FenceRegisters(sc);
    hopper::WgmmaWait<1>();
    hopper::FenceRegisters(dp);
    scores_grad(it);
    hopper::WgmmaWait<0>();  // the previous tile's dQ: done with its fragments and its stage
    hopper::FenceRegisters(dq);
    hopper::KeepRegisters(da);
    hopper::BarrierArrive(&empty[(it - 1) % kStages]);
    pack_ds();
  }
  if (n_tiles > 0) {
    issue_dq(n_tiles - 1);
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(dq);
    hopper::KeepRegisters(da);
    hopper::BarrierArrive(&empty[(n_tiles - 1) % kStages]);
  }
  StoreFragment<T, kD>(dq, 1.f, static_cast<T*>(p.dq) + (b * sh.t * sh.n + n) * sh.h, row0, sh.t,
                       sh.n * sh.h, sh.h, lane);
}

// kV: V is loaded (the launches that compute dP^T, i.e. dK; a dV-only launch
// needs only P^T, and the room V would take holds a wider query tile).
// kDkOnly: the dK launch past head dim 128, whose dO serves dP^T alone.
template <int kD, int kDv, int kBQ, bool kDq = false, bool kV = true, bool kDkOnly = false>
struct DkvTiles {
  static constexpr int kBN = 128;
  static constexpr int kKBytes = kBN * kD * 2, kVBytes = kV ? kBN * kDv * 2 : 0;
  static constexpr int kQBytes = kBQ * kD * 2, kOBytes = kBQ * kDv * 2;
  static constexpr int kRowBytes = 2 * kBQ * 4;  // per stage: the tile's lse (log2) and delta
  // With the fused dQ: dS of two query tiles (double-buffered, see the
  // kernel), and each warpgroup's fp32 half of the dQ tile, for two tiles at
  // 64 queries; at 128 (head dim 64) for one: two would leave 40 bytes too
  // few for two Q/dO stages.
  static constexpr int kDsBytes = kDq ? kBN * kBQ * 2 : 0;
  static constexpr int kDqHalfBytes = kDq ? kBQ * kD / 2 * 4 : 0;
  static constexpr int kDqBufs = kBQ == 64 ? 2 : 1;
  static constexpr int SmemFor(int stages, int o_stages) {
    return 1024 + kKBytes + kVBytes + stages * (kQBytes + kRowBytes) + o_stages * kOBytes +
           2 * kDsBytes + 2 * kDqBufs * kDqHalfBytes + 8 * (1 + 2 * stages) +
           (o_stages != stages ? 16 : 0);  // the lone dO buffer's full / empty barriers
  }
  static constexpr int SmemFor(int stages) { return SmemFor(stages, stages); }
  // Q/dO ring depth: as many stages (up to 4) as shared memory holds (2 with
  // the fused dQ's buffers). Against 2 stages (ncu, H200, S = 8192): D = 64
  // (4 stages) 4.91 ms against 4.98, D = 128 split (4) 3.46 against 3.47;
  // D = 256 (3) 0-3% faster (within the benchmark's noise).
  static constexpr int kMaxSmem = 227 * 1024;
  static constexpr int kStages = SmemFor(4) <= kMaxSmem ? 4 : SmemFor(3) <= kMaxSmem ? 3 : 2;
  // Where two Q/dO stages do not fit (the dK launch at head dims 256 / 256
  // with 64-query tiles: K and V take 128 KB), a dK launch keeps two Q
  // stages and one dO buffer: dO is read by dP^T only, the step's second
  // wgmma, so the next tile's dO loads while this one's P^T, dS^T and dK
  // wgmmas run (Q, read again by dK at the step's end, keeps its ring).
  static constexpr bool kOneDo = kDkOnly && SmemFor(2) > kMaxSmem;
  static constexpr int kOStages = kOneDo ? 1 : kStages;
  static constexpr int kSmem = SmemFor(kStages, kOStages);
  static_assert(kSmem <= kMaxSmem, "the dK/dV kernel's tiles fit in shared memory");
};

// The fused dQ's query tile (DqTileRows, attention_plan.h): 128 queries
// at head dim 64, 64 at 128 (where a 128-query tile's S^T and dP^T fragments
// would not fit in registers beside dK's and dV's). At head dim 64 the
// 128-query tile makes the S^T and dP^T wgmmas twice as wide as 64 queries
// would (m64n128), as in the split's dK/dV kernel there, and halves the
// number of dQ reduce-adds.
// The fused dQ's fp32 accumulator p.dq_acc: per (batch, head, query tile of
// kRows = DqTileRows(kD)), kRows x kD floats as two halves, one per consumer
// warpgroup: column halves (64 rows x kD / 2) at 64 rows, row halves (64 rows
// x kD) at 128. Each half is in the warpgroup's wgmma fragment order: float4
// number q * 128 + t holds thread t's accumulators 4q .. 4q + 3 (rows R, R,
// R + 8, R + 8 of the half with R = 16 (t / 32) + (t % 32) / 4; its columns
// 8q + 2 (t % 4) + 0, 1, 0, 1). Every reduce-add is then one contiguous
// 16-byte-aligned block, and the smem stores that stage it are conflict-free.
//
// dq = dq_acc in T, from that order: one block of 256 threads per tile
// (grid: query tiles, N, B); thread t of half w reads its own fragment
// (coalesced float4s), and the tile goes out through shared memory as whole
// rows (16-byte stores).
template <typename T, int kD, int kRows>
__global__ void __launch_bounds__(256)
    AttentionDqConvertKernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t t_len,
                             int64_t n_heads, int64_t h) {
  constexpr bool kRowHalves = kRows == 128;
  constexpr int kW = kRowHalves ? kD : kD / 2;  // a half's columns
  constexpr int kLd = kD + 8;                   // +8: rows start on different banks
  __shared__ __align__(16) uint16_t tile[kRows * kLd];  // T bits
  const int64_t tiles = (t_len + kRows - 1) / kRows;
  const int64_t i = blockIdx.x, n = blockIdx.y, b = blockIdx.z;
  const int w = threadIdx.x / 128, t = threadIdx.x % 128;
  const float4* src = reinterpret_cast<const float4*>(
      acc + ((b * n_heads + n) * tiles + i) * kRows * kD + w * 64 * kW);
  const int row = (kRowHalves ? 64 * w : 0) + 16 * (t / 32) + (t % 32) / 4;
#pragma unroll
  for (int q = 0; q < kW / 8; ++q) {
    const float4 v = src[q * 128 + t];
    const int col = (kRowHalves ? 0 : w * kW) + 8 * q + 2 * (t % 4);
    *reinterpret_cast<uint32_t*>(&tile[row * kLd + col]) = hopper::PackPair<T>(v.x, v.y);
    *reinterpret_cast<uint32_t*>(&tile[(row + 8) * kLd + col]) = hopper::PackPair<T>(v.z, v.w);
  }
  __syncthreads();
  T* out = dq + (b * t_len * n_heads + n) * h;
  constexpr int kChunks = kD / 8;  // 16-byte pieces per row
  for (int c = threadIdx.x; c < kRows * kChunks; c += 256) {
    const int r = c / kChunks, col = 8 * (c % kChunks);
    const int64_t grow = i * kRows + r;
    if (grow < t_len && col < h)
      *reinterpret_cast<uint4*>(out + grow * n_heads * h + col) =
          *reinterpret_cast<const uint4*>(&tile[r * kLd + col]);
  }
}

// kDoDK / kDoDV: which gradients this launch computes (large head dims split
// them over two launches to keep both accumulators within the register file).
// kDq (the single pass; head dim 64 or 128, lean logits path): also dQ,
// added into the fp32 p.dq_acc. Per query tile, each consumer stores its dS^T
// fragment to shared memory as dS with queries contiguous (an MN-major wgmma
// operand); once the other consumer's half is there too, warpgroup w
// computes its half of the dQ tile -- at head dim 128 (64 queries) its half
// of the columns, dS (64 queries x 128 keys) times K (128 keys x 64 of the
// columns); at 64 (128 queries) its half of the queries, dS (64 of the
// queries x 128 keys) times K (128 keys x 64) -- stages it in shared memory
// and adds it to global memory with one TMA bulk reduce-add (so the adds are
// done in L2, one instruction per 16 KB, not per element).
// Five GEMMs per tile instead of the split's seven; not deterministic (the
// order of the adds varies), so the split stays for the deterministic option.
template <typename T, int kD, int kDv, int kBQ, bool kDoDK, bool kDoDV, bool kGeneral, bool kDq = false>
__global__ void __launch_bounds__(384, 1)
    AttentionDkvKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                       const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                       const AttentionBwdParams p) {
  constexpr bool kNeedDp = kDoDK;  // dV needs only P: V is loaded for dK only
  using Tiles = DkvTiles<kD, kDv, kBQ, kDq, kNeedDp, kDoDK && !kDoDV>;
  constexpr int kBN = Tiles::kBN, kStages = Tiles::kStages;
  constexpr bool kOneDo = Tiles::kOneDo;  // one dO buffer (see DkvTiles), with its own barriers
  static_assert(!kOneDo || (!kDoDV && !kDq), "the lone dO buffer is read by dP^T only");
  static_assert(!kDq || (kDoDK && kDoDV && kBQ == DqTileRows(kD) && (kD == 64 || kD == 128)),
                "the fused dQ takes head dims 64 or 128 and DqTileRows queries");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = hopper::AlignSmem1024(smem_raw);
  uint8_t* sk = base;
  uint8_t* sv = sk + Tiles::kKBytes;
  uint8_t* sq = sv + Tiles::kVBytes;
  uint8_t* sdo = sq + kStages * Tiles::kQBytes;
  // dS: [2 tiles][kBQ / 64 query blocks][kBN keys][64 queries], 128B-swizzled
  uint8_t* sds = sdo + Tiles::kOStages * Tiles::kOBytes;
  float* sdq = reinterpret_cast<float*>(sds + 2 * Tiles::kDsBytes);  // [kDqBufs][2 warpgroups][kBQ x kD / 2]
  float* srows = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(sdq) +
                                          2 * Tiles::kDqBufs * Tiles::kDqHalfBytes);  // [stage][lse2 | delta][kBQ]
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(srows + kStages * 2 * kBQ);
  uint64_t* full = kv_full + 1;
  uint64_t* empty = full + kStages;
  uint64_t* do_full = empty + kStages;  // kOneDo only
  uint64_t* do_empty = do_full + 1;

  const AttentionShape& sh = p.shape;
  const uint3 g = BwdGridTile(p.tail_slices);
  const int64_t n0 = int64_t(g.x) * kBN;
  const int64_t kvh = g.y, b = g.z;
  const int64_t group = sh.n / sh.kh;
  // The query tiles are the same for every head of the group, except with
  // per-head masks, whose ranges do not depend on the head either.
  int i_begin, i_end;
  {
    const ScoreCtx c0 = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, b, kvh * group);
    QueryTiles(c0, n0, min(n0 + kBN, sh.s) - 1, kBQ, &i_begin, &i_end);
  }
  const int per_head = i_end - i_begin;
  auto query_tile = [&](int it) { return i_begin + it % per_head; };

  const int tid = threadIdx.x;
  if (tid == 0) {
    hopper::BarrierInit(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      hopper::BarrierInit(&full[s], 1 + 32);  // the TMA thread and the row warp
      hopper::BarrierInit(&empty[s], 256);
    }
    if constexpr (kOneDo) {
      hopper::BarrierInit(do_full, 1);
      hopper::BarrierInit(do_empty, 256);
    }
    hopper::FenceBarrierInit();
  }
  __syncthreads();

  if (tid < 128) {  // producer
    hopper::RegDealloc<24>();
    if (tid / 32 == 1) {
      // The row warp: each stage's lse (in log2 units) and delta times the
      // scale into shared memory, so that consumers read them with no global
      // latency and no bounds checks (queries past T get lse2 = +inf: p = 0,
      // and delta 0); dS^T = P^T (scale dP^T - scale delta) is then one FFMA
      // and one multiply.
      // (Few live values: this warp runs with the producer's 24 registers.)
      const int lane = tid % 32, t_len = static_cast<int>(sh.t), iters = group * per_head;
      const int64_t head0 = (b * sh.n + kvh * group) * sh.t;
      for (int it = 0; it < iters; ++it) {
        const int s = it % kStages;
        if (it >= kStages) hopper::BarrierWait(&empty[s], ((it / kStages) - 1) & 1);
        const int q0 = query_tile(it) * kBQ;
        const int64_t row = head0 + int64_t(it / per_head) * t_len;
        float* rows = srows + s * 2 * kBQ;
#pragma unroll
        for (int c = lane; c < kBQ; c += 32) {
          const bool in = q0 + c < t_len;
          rows[c] = in ? Log2Lse(p.lse[row + q0 + c]) : INFINITY;
          rows[kBQ + c] = in ? p.delta[row + q0 + c] * p.scale : 0.f;
        }
        hopper::BarrierArrive(&full[s]);  // release: the stores above are visible to waiters
      }
    } else if (tid == 0) {
      hopper::BarrierExpectTx(kv_full, Tiles::kKBytes + Tiles::kVBytes);
      for (int d = 0; d < kD / 64; ++d)
        hopper::TmaLoad4d(sk + d * kBN * 128, &tk, kv_full, d * 64, kvh, n0, b);
      if constexpr (kNeedDp)
        for (int d = 0; d < kDv / 64; ++d)
          hopper::TmaLoad4d(sv + d * kBN * 128, &tv, kv_full, d * 64, kvh, n0, b);
      for (int it = 0; it < group * per_head; ++it) {
        const int64_t n = kvh * group + it / per_head;
        const int i = query_tile(it);
        const int s = it % kStages;
        if (it >= kStages) hopper::BarrierWait(&empty[s], ((it / kStages) - 1) & 1);
        hopper::BarrierExpectTx(&full[s], Tiles::kQBytes + (kOneDo ? 0 : Tiles::kOBytes));
        for (int d = 0; d < kD / 64; ++d)
          hopper::TmaLoad4d(sq + s * Tiles::kQBytes + d * kBQ * 128, &tq, &full[s], d * 64, n,
                            i * kBQ, b);
        if constexpr (kOneDo) {  // dO(it) once every consumer's dP^T(it - 1) is done
          if (it >= 1) hopper::BarrierWait(do_empty, (it - 1) & 1);
          hopper::BarrierExpectTx(do_full, Tiles::kOBytes);
        }
        uint64_t* o_full = kOneDo ? do_full : &full[s];
        for (int d = 0; d < kDv / 64; ++d)
          hopper::TmaLoad4d(sdo + (kOneDo ? 0 : s) * Tiles::kOBytes + d * kBQ * 128, &tdo, o_full,
                            d * 64, n, i * kBQ, b);
      }
    }
    return;
  }

  hopper::RegAlloc<240>();
  const int wg = hopper::WarpUniform(tid / 128) - 1, t = tid % 128, warp = t / 32, lane = t % 32;
  const int64_t row0 = n0 + 64 * wg + 16 * warp + lane / 4;  // key rows
  const int64_t wg_r0 = n0 + 64 * wg, wg_r1 = wg_r0 + 63;
  float dk[kDoDK ? kD / 2 : 1], dv[kDoDV ? kDv / 2 : 1];
#pragma unroll
  for (int e = 0; e < (kDoDK ? kD / 2 : 1); ++e) dk[e] = 0.f;
#pragma unroll
  for (int e = 0; e < (kDoDV ? kDv / 2 : 1); ++e) dv[e] = 0.f;
  const uint32_t k_addr = hopper::SmemAddr(sk) + wg * 64 * 128;
  const uint32_t v_addr = hopper::SmemAddr(sv) + wg * 64 * 128;
  hopper::BarrierWait(kv_full, 0);

  if constexpr (kDq) {
    // (This loop repeats the split's loop below with the dQ steps added. One
    // loop with the dQ steps under `if constexpr` compiles to the same spill
    // counts but runs 5.59 ms against 4.93 for this form: ncu, S = 8192,
    // D = 128, H100. So the two stay apart.)
    // The single pass. Per query tile `it` a warpgroup first issues dQ of the
    // previous tile (once the other warpgroup's half of that dS is in shared
    // memory) and S^T back to back, stages and reduce-adds dQ while S^T
    // runs, then issues dP^T; then P^T, dS^T (also stored for the dQ
    // wgmmas), dV and dK as in the split. The
    // warpgroups hand dS over with arrive/sync pairs on named barriers
    // (4 + 2 * writer + parity), not a barrier both wait at, so that they
    // stay out of phase and one's elementwise work runs while the other's
    // GEMMs do (a barrier both wait at: 5.51 ms against 3.40 for the
    // dK/dV kernel alone, S = 8192, D = 128, H100). A warpgroup writes dS(it + 2)
    // into a buffer only after the other's arrival with dS(it + 1), which that
    // one makes after its dQ(it) wgmma is done. dQ(it - 1) and S^T are issued
    // together so that the tensor cores have both warpgroups' work while dQ
    // is staged: 4.42 ms against 4.92 for waiting for dQ, staging it and only
    // then issuing S^T (ncu, S = 8192, H200). dP^T is issued after the staging
    // so that dQ's accumulators (32 at D = 128) and dP^T's are never live
    // together (with dQ, S^T and dP^T all in flight it spills 212 bytes).
    // A warpgroup's dQ: 64 queries x kDqCols columns, from its query block
    // of dS (kRowHalves) or with its half of K's columns.
    constexpr bool kRowHalves = kBQ == 128;
    constexpr int kDqCols = kRowHalves ? kD : kD / 2;
    const int64_t q_tiles = (sh.t + kBQ - 1) / kBQ;
    const uint32_t ds_base = hopper::SmemAddr(sds);
    // This thread's first dS row (key0 = its fragment row) and column pair,
    // chunk 0 swizzled (key0 % 8 = lane / 4); see the stores in step().
    const uint32_t ds_thread = (64 * wg + 16 * warp + lane / 4) * 128 + (lane / 4) * 16 + 4 * (lane % 4);
    const int col_off = kRowHalves ? 0 : wg * kDqCols;
    const uint32_t kcol_addr = hopper::SmemAddr(sk) + (col_off / 64) * kBN * 128 + (col_off % 64) * 2;
    const int n_iters = group * per_head;
    // dQ's accumulator is declared where it is used, from its wgmmas to its
    // staging: a kernel-wide array stays live through S^T / dP^T (the
    // wgmma's "+f" operands read it), 32 registers the exponentials need.
    using DqFrag = float[kDqCols / 2];

    auto issue_dq = [&](DqFrag& dq, int it) {  // dQ(it): this warpgroup's part, dS(it) K
      hopper::NamedBarrierSync(4 + 2 * (1 - wg) + (it & 1), 256);
      const uint32_t ds_addr = ds_base + (it & 1) * Tiles::kDsBytes + (kRowHalves ? wg * kBN * 128 : 0);
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
        WgmmaSSmn<T, kDqCols>(dq, hopper::Descriptor(ds_addr, 0, kk * 2048),
                              hopper::Descriptor(kcol_addr, 0, kk * 2048), kk > 0);
      hopper::WgmmaCommit();
    };
    // dQ(it) (done) -> shared memory in fragment order -> one bulk reduce-add
    // into p.dq_acc. Double-buffered (kDqBufs = 2): before the warpgroup
    // barrier, the issuing thread waits until the previous reduce-add has
    // read its buffer, which the next tile's stores reuse. One buffer: the
    // wait and a barrier come before the stores (the previous reduce-add was
    // issued a tile earlier, so the wait seldom stalls).
    auto reduce_dq = [&](DqFrag& dq, int it) {
      hopper::FenceRegisters(dq);
      const int buf = Tiles::kDqBufs == 2 ? (it & 1) : 0;
      float4* half = reinterpret_cast<float4*>(sdq) + (buf * 2 + wg) * (kBQ * kD / 8);
      if constexpr (Tiles::kDqBufs == 1) {
        if (t == 0) hopper::BulkWaitRead<0>();
        hopper::NamedBarrierSync(2 + wg, 128);
      }
#pragma unroll
      for (int q = 0; q < kDqCols / 8; ++q)
        half[q * 128 + t] = make_float4(dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
      hopper::FenceProxyAsync();
      if (Tiles::kDqBufs == 2 && t == 0) hopper::BulkWaitRead<0>();
      hopper::NamedBarrierSync(2 + wg, 128);
      if (t == 0) {
        const int64_t n = kvh * group + it / per_head;
        float* dst = p.dq_acc + ((b * sh.n + n) * q_tiles + query_tile(it)) * (kBQ * kD) +
                     wg * (kBQ * kD / 2);
        hopper::BulkReduceAddF32(dst, half, kBQ * kD / 2 * 4);
        hopper::BulkCommit();
      }
    };
    // One query tile; has_dq (std::true_type from the second tile on) says
    // whether there is a previous tile's dQ to compute. It must be a
    // compile-time constant: with a run-time `it > 0` around the dQ wgmmas
    // and their wait, ptxas spills 136 bytes and serializes the wgmmas
    // (C7514), since the wait count then depends on the path taken.
    ScoreCtx c{};
    auto step = [&](int it, auto has_dq) {
      const int64_t n = kvh * group + it / per_head;
      const int i = query_tile(it);
      if (it % per_head == 0) c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, b, n);
      const int s = it % kStages;
      const uint32_t q_addr = hopper::SmemAddr(sq + s * Tiles::kQBytes);
      const uint32_t do_addr = hopper::SmemAddr(sdo + s * Tiles::kOBytes);
      const int64_t q0 = int64_t(i) * kBQ;
      const int64_t col0 = q0 + 2 * (lane % 4);
      const float* lse_s = srows + s * 2 * kBQ + 2 * (lane % 4);  // + 8 (e / 4) + e % 2
      const float* delta_s = lse_s + kBQ;
      float st[kBQ / 2], dpt[kBQ / 2];
      uint32_t pa[kBQ / 16][4], da[kBQ / 16][4];

      // dQ(it - 1) and S^T go to the tensor cores back to back; dQ is staged
      // and reduce-added while S^T runs, and only then is dP^T issued (ptxas
      // puts a warpgroup.arrive before it: C7519).
      DqFrag dq;
      if constexpr (decltype(has_dq)::value) issue_dq(dq, it - 1);
      hopper::BarrierWait(&full[s], (it / kStages) & 1);
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        WgmmaSS<T, kBQ>(st, hopper::Descriptor(k_addr, 0, (kk / 4) * kBN * 128 + (kk % 4) * 32),
                        hopper::Descriptor(q_addr, 0, (kk / 4) * kBQ * 128 + (kk % 4) * 32), kk > 0);
      hopper::WgmmaCommit();
      if constexpr (decltype(has_dq)::value) {
        hopper::WgmmaWait<1>();  // dQ(it - 1)
        reduce_dq(dq, it - 1);
      }
#pragma unroll
      for (int kk = 0; kk < kDv / 16; ++kk)
        WgmmaSS<T, kBQ>(dpt, hopper::Descriptor(v_addr, 0, (kk / 4) * kBN * 128 + (kk % 4) * 32),
                        hopper::Descriptor(do_addr, 0, (kk / 4) * kBQ * 128 + (kk % 4) * 32), kk > 0);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<1>();
      hopper::FenceRegisters(st);
      const bool need_mask = TileNeedsMask(c, q0, q0 + kBQ - 1, wg_r0, wg_r1);
      // Logits' mask here: with MaskRowIntervals this pass is 2-3% slower
      // fwd+bwd at D = 64 causal, S = 4096 / 8192.
      Probabilities<kBQ, true, kGeneral, false>(st, c, row0, col0, need_mask,
                                                [&](int e) { return RowPair(lse_s, e); });  // P^T
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
      // In the PTX, P^T and its fragments come before the wait (these empty
      // fences keep them there); ptxas still places the wait above the
      // exponentials (SASS). Forcing them above it -- a block of their own,
      // behind an always-true branch -- makes this kernel slower: 5.44 ms
      // against 5.09 (ncu, S = 8192, H200).
      hopper::FenceRegisters(st), hopper::KeepRegisters(pa);
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(dpt);
#pragma unroll
      for (int e = 0; e < kBQ / 2; ++e) {
        const int off = 8 * (e >> 2) + (e & 1);
        const float cap = SoftcapGrad<kGeneral>(c, st[e], RowPair(lse_s, e), col0 + off, row0 + 8 * ((e >> 1) & 1));
        dpt[e] = st[e] * fmaf(dpt[e], p.scale, -RowPair(delta_s, e)) * cap;  // dS^T w.r.t. q.k
      }
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) da[kk][r] = hopper::PackPair<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
      // dS^T fragment -> rows of 64 queries (128 bytes) per key, one block of
      // kBN rows per 64 queries, with the 128-byte swizzle TMA would apply
      // (16-byte chunk c of row r at c ^ (r % 8)): conflict-free stores, and
      // dS read MN-major by issue_dq. The thread's rows (key0, key0 + 8)
      // share r % 8, and the buffer is 1024-aligned, so chunk c (8 queries)
      // is at (ds_row ^ ((c % 8) << 4)) + its query block's offset: one XOR
      // a chunk, the offset an immediate.
      const uint32_t ds_row = ds_base + (it & 1) * Tiles::kDsBytes + ds_thread;
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // fragment registers r = 2 h (key0) and 2 h + 1 (key0 + 8)
          constexpr int kBlock = kBN * 128;  // one query block's bytes
          const int c = 2 * kk + h;
          const uint32_t chunk = ds_row ^ ((c % 8) << 4);
          if (c / 8 == 0) {
            hopper::StoreShared32<0>(chunk, da[kk][2 * h]);
            hopper::StoreShared32<8 * 128>(chunk, da[kk][2 * h + 1]);
          } else {
            hopper::StoreShared32<kBlock>(chunk, da[kk][2 * h]);
            hopper::StoreShared32<kBlock + 8 * 128>(chunk, da[kk][2 * h + 1]);
          }
        }
      hopper::FenceProxyAsync();
      hopper::NamedBarrierArrive(4 + 2 * wg + (it & 1), 256);
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
        WgmmaRS<T, kDv>(dv, pa[kk], hopper::Descriptor(do_addr, kBQ * 128, kk * 2048), 1);
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
        WgmmaRS<T, kD>(dk, da[kk], hopper::Descriptor(q_addr, kBQ * 128, kk * 2048), 1);
      hopper::WgmmaCommit();
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(dk), hopper::KeepRegisters(da);
      hopper::FenceRegisters(dv), hopper::KeepRegisters(pa);
      hopper::BarrierArrive(&empty[s]);
    };
    if (n_iters > 0) {
      step(0, std::false_type{});
      for (int it = 1; it < n_iters; ++it) step(it, std::true_type{});
      DqFrag dq;
      issue_dq(dq, n_iters - 1);
      hopper::WgmmaWait<0>();
      reduce_dq(dq, n_iters - 1);
      if (t == 0) hopper::BulkWaitAll();  // shared memory must outlive the last reads
    }
  } else {
    // The 64-query instantiations (lean head dims 96 and 128 -- at 128 the
    // deterministic option -- general 64, and past head dim 128 the dV
    // launches, lean and general, and the lean dK launches) keep these forms
    // of the warpgroup offsets, wgmma descriptors and row loads: with the
    // forms above, ptxas schedules the head-dim-128 loop into a kernel 10%
    // slower (S = 8192, ncu, H200: 3.57 ms against 3.23), while they make the
    // head-dim-64 one (128 queries) 6% faster (3.83 ms against 4.07).
    constexpr bool kPlain = kBQ == 64;
    const uint32_t k_base = kPlain ? hopper::SmemAddr(sk) + (tid / 128 - 1) * 64 * 128 : k_addr;
    const uint32_t v_base = kPlain ? hopper::SmemAddr(sv) + (tid / 128 - 1) * 64 * 128 : v_addr;
    auto desc = [](uint32_t addr, uint32_t lbo, uint32_t off) {
      return kPlain ? hopper::Descriptor(addr + off, lbo) : hopper::Descriptor(addr, lbo, off);
    };
    auto row = [](const float* rows, int e) {
      return kPlain ? rows[8 * (e >> 2) + (e & 1)] : RowPair(rows, e);
    };
    ScoreCtx c{};
    for (int it = 0; it < group * per_head; ++it) {
      const int64_t n = kvh * group + it / per_head;
      const int i = query_tile(it);
      if (it % per_head == 0) c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, b, n);
      const int s = it % kStages;
      const uint32_t phase = (it / kStages) & 1;
      const uint32_t q_addr = hopper::SmemAddr(sq + s * Tiles::kQBytes);
      const uint32_t do_addr = hopper::SmemAddr(sdo + (kOneDo ? 0 : s) * Tiles::kOBytes);
      // Columns are query rows q0 + ...; their lse and delta come from the row warp.
      const int64_t q0 = int64_t(i) * kBQ;
      const int64_t col0 = q0 + 2 * (lane % 4);
      const float* lse_s = srows + s * 2 * kBQ + 2 * (lane % 4);  // + 8 (e / 4) + e % 2
      const float* delta_s = lse_s + kBQ;
      float st[kBQ / 2], dpt[kNeedDp ? kBQ / 2 : 1];

      hopper::BarrierWait(&full[s], phase);
      hopper::WgmmaFence();
  #pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk)
        WgmmaSS<T, kBQ>(st, desc(k_base, 0, (kk / 4) * kBN * 128 + (kk % 4) * 32),
                        desc(q_addr, 0, (kk / 4) * kBQ * 128 + (kk % 4) * 32), kk > 0);
      hopper::WgmmaCommit();
      if constexpr (kNeedDp) {
        if constexpr (kOneDo) hopper::BarrierWait(do_full, it & 1);
  #pragma unroll
        for (int kk = 0; kk < kDv / 16; ++kk)
          WgmmaSS<T, kBQ>(dpt, desc(v_base, 0, (kk / 4) * kBN * 128 + (kk % 4) * 32),
                          desc(do_addr, 0, (kk / 4) * kBQ * 128 + (kk % 4) * 32), kk > 0);
        hopper::WgmmaCommit();
      }
      // P^T is computed while dP^T still runs. P^T and dS^T are packed into A
      // fragments before the dV / dK wgmmas are issued, so that only the
      // accumulators and the fragments stay live while those run.
      hopper::WgmmaWait<kNeedDp ? 1 : 0>();
      hopper::FenceRegisters(st);
      const bool need_mask = TileNeedsMask(c, q0, q0 + kBQ - 1, wg_r0, wg_r1);
      Probabilities<kBQ, true, kGeneral>(st, c, row0, col0, need_mask,
                                         [&](int e) { return row(lse_s, e); });  // P^T
      uint32_t pa[kBQ / 16][4];
      if constexpr (kDoDV) {
  #pragma unroll
        for (int kk = 0; kk < kBQ / 16; ++kk)
  #pragma unroll
          for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
      }
      hopper::FenceRegisters(st);  // P^T before the wait in the PTX (see kDq's loop)
      if constexpr (kDoDV) hopper::KeepRegisters(pa);
      uint32_t da[kBQ / 16][4];
      if constexpr (kDoDK) {
        hopper::WgmmaWait<0>();  // dP^T
        hopper::FenceRegisters(dpt);
        if constexpr (kOneDo) hopper::BarrierArrive(do_empty);  // dO is read by dP^T only
  #pragma unroll
        for (int e = 0; e < kBQ / 2; ++e) {
          const int off = 8 * (e >> 2) + (e & 1);
          const float cap = SoftcapGrad<kGeneral>(c, st[e], row(lse_s, e), col0 + off, row0 + 8 * ((e >> 1) & 1));
          dpt[e] = st[e] * fmaf(dpt[e], p.scale, -row(delta_s, e)) * cap;  // dS^T w.r.t. q.k
        }
  #pragma unroll
        for (int kk = 0; kk < kBQ / 16; ++kk)
  #pragma unroll
          for (int r = 0; r < 4; ++r) da[kk][r] = hopper::PackPair<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
      }
      hopper::WgmmaFence();
      if constexpr (kDoDV) {
  #pragma unroll
        for (int kk = 0; kk < kBQ / 16; ++kk)
          WgmmaRS<T, kDv>(dv, pa[kk], desc(do_addr, kBQ * 128, kk * 2048), 1);
      }
      if constexpr (kDoDK) {
  #pragma unroll
        for (int kk = 0; kk < kBQ / 16; ++kk)
          WgmmaRS<T, kD>(dk, da[kk], desc(q_addr, kBQ * 128, kk * 2048), 1);
      }
      hopper::WgmmaCommit();
      hopper::WgmmaWait<0>();
      if constexpr (kDoDK) hopper::FenceRegisters(dk), hopper::KeepRegisters(da);
      if constexpr (kDoDV) hopper::FenceRegisters(dv), hopper::KeepRegisters(pa);
      hopper::BarrierArrive(&empty[s]);
    }
  }
  const int64_t ld = sh.kh * sh.h, ldv = sh.kh * sh.hv;
  if constexpr (kDoDK)
    StoreFragment<T, kD>(dk, 1.f, static_cast<T*>(p.dk) + b * sh.s * ld + kvh * sh.h, row0, sh.s,
                         ld, sh.h, lane);
  if constexpr (kDoDV)
    StoreFragment<T, kDv>(dv, 1.f, static_cast<T*>(p.dv) + b * sh.s * ldv + kvh * sh.hv, row0,
                          sh.s, ldv, sh.hv, lane);
}

}  // namespace attention
}  // namespace jax_dnn
