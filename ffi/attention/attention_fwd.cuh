// Flash attention forward for Hopper: o = softmax(logits) v and lse.
//
// One CTA computes 128 query rows of one (batch, head) in three warpgroups:
//   warpgroup 0 (producer): one thread issues TMA loads -- the Q tile once,
//     then K and V tiles through a 2-stage ring (full/empty mbarriers, K and
//     V released separately: K as soon as its scores are done);
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

#include "ffi/attention/attention_common.cuh"
#include "ffi/attention/hopper.cuh"
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
  static constexpr int kSmem = 1024 /*alignment slack*/ + kQBytes + kStages * (kKBytes + kVBytes) +
                               8 * (2 + 4 * kStages);
};

// Named barriers of the consumers' ping-pong: consumer w waits on kPingPong + w.
constexpr int kPingPong = 1;

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
    float mx = -INFINITY;
#pragma unroll
    for (int e = 0; e < kBN / 8; ++e) mx = fmaxf(mx, fmaxf(s[4 * e + 2 * h], s[4 * e + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    mx = fmaxf(m_run[h], mx * scale);
    // A row with nothing allowed yet keeps max -inf: subtract 0 instead (p = 0).
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    corr[h] = hopper::Exp2(m_run[h] - m_safe);
    m_run[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < kBN / 8; ++e) {
      s[4 * e + 2 * h] = hopper::Exp2(fmaf(s[4 * e + 2 * h], scale, -m_safe));
      s[4 * e + 2 * h + 1] = hopper::Exp2(fmaf(s[4 * e + 2 * h + 1], scale, -m_safe));
      sum += s[4 * e + 2 * h] + s[4 * e + 2 * h + 1];
    }
    l_run[h] = l_run[h] * corr[h] + sum;  // per-thread partial; reduced over the quad at the end
  }
}

// Work tiles (128 query rows of one batch and head) come in units, query
// tiles fastest so that the CTAs running at once share one head's K and V in
// L2. A unit is one tile (the heaviest, under a causal mask, first) or, with
// `pairs`, the two tiles p and m_tiles - 1 - p, whose causal work sums to the
// same for every p: a persistent grid then stays balanced (a static schedule
// of single tiles gave some CTAs all the heavy ones: 0.70x cuDNN at S = 16k).
struct FwdWork {
  int64_t m0, n, b;
};
__device__ __forceinline__ bool FwdWorkAt(int64_t u, int half, bool pairs, int64_t m_tiles,
                                          int64_t heads, int bm, FwdWork* w) {
  const int64_t per = pairs ? (m_tiles + 1) / 2 : m_tiles;  // units per head
  const int64_t pi = u % per, rest = u / per;
  const int64_t mt = half == 0 ? pi : m_tiles - 1 - pi;  // 0 = the heaviest tile
  w->m0 = (m_tiles - 1 - mt) * bm;
  w->n = rest % heads;
  w->b = rest / heads;
  return half == 0 || mt != pi;  // an odd count leaves the middle tile alone
}
__host__ __device__ __forceinline__ int64_t FwdUnits(int64_t m_tiles, int64_t heads, int64_t batch,
                                                     bool pairs) {
  return (pairs ? (m_tiles + 1) / 2 : m_tiles) * heads * batch;
}

// A CTA takes units blockIdx.x, blockIdx.x + gridDim.x, ... -- one with a grid
// of every unit, several with a persistent grid (one CTA an SM). In the
// persistent form the producer loads the next tile's K and Q while the
// consumers finish this tile's last P V and write its output, and the
// consumers' ping-pong runs on across tiles, so one consumer's epilogue hides
// behind the other's GEMMs.
template <typename T, int kD, int kDv, int kBN, bool kGeneral>
__global__ void __launch_bounds__(384, 1)
    AttentionFwdKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                       const __grid_constant__ CUtensorMap tv, const AttentionFwdParams p,
                       const bool pairs) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  constexpr int kBM = Tiles::kBM, kStages = Tiles::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = hopper::AlignSmem1024(smem_raw);
  uint8_t* sq = base;
  uint8_t* sk = sq + Tiles::kQBytes;
  uint8_t* sv = sk + kStages * Tiles::kKBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kStages * Tiles::kVBytes);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* k_empty = v_full + kStages;
  uint64_t* v_empty = k_empty + kStages;

  const AttentionShape& sh = p.shape;
  const int64_t m_tiles = (sh.t + kBM - 1) / kBM;
  const int64_t units = FwdUnits(m_tiles, sh.n, sh.b, pairs);
  // Key tiles of work tile w: [j_begin, j_end).
  auto key_tiles = [&](const FwdWork& w, const ScoreCtx& c, int* j_begin, int* j_end) {
    KeyTiles(c, w.m0, min(w.m0 + kBM, sh.t) - 1, kBN, j_begin, j_end);
  };

  const int tid = threadIdx.x;
  if (tid == 0) {
    hopper::BarrierInit(q_full, 1);
    hopper::BarrierInit(q_empty, 256);
    for (int s = 0; s < kStages; ++s) {
      hopper::BarrierInit(&k_full[s], 1);
      hopper::BarrierInit(&v_full[s], 1);
      hopper::BarrierInit(&k_empty[s], 256);
      hopper::BarrierInit(&v_empty[s], 256);
    }
    hopper::FenceBarrierInit();
  }
  __syncthreads();

  if (tid < 128) {  // producer
    hopper::RegDealloc<24>();
    if (tid == 0) {
      hopper::TmaPrefetchDescriptor(&tq);
      hopper::TmaPrefetchDescriptor(&tk);
      hopper::TmaPrefetchDescriptor(&tv);
      int g = 0;  // K/V ring position, continued across work tiles
      int tile = 0;
      for (int k = 0;; ++k) {  // the k-th tile of this CTA's units
        const int64_t u = blockIdx.x + int64_t(pairs ? k / 2 : k) * gridDim.x;
        if (u >= units) break;
        FwdWork w;
        if (!FwdWorkAt(u, pairs ? k % 2 : 0, pairs, m_tiles, sh.n, kBM, &w)) continue;
        const int64_t kvh = w.n / (sh.n / sh.kh);
        const ScoreCtx c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, w.b, w.n);
        int j_begin, j_end;
        key_tiles(w, c, &j_begin, &j_end);
        // Q goes after the first K: its buffer frees only when the previous
        // tile's last scores are done, and the first K need not wait for that.
        auto load_q = [&] {
          if (tile > 0) hopper::BarrierWait(q_empty, (tile - 1) & 1);
          hopper::BarrierExpectTx(q_full, Tiles::kQBytes);
          for (int d = 0; d < kD / 64; ++d)
            hopper::TmaLoad4d(sq + d * kBM * 128, &tq, q_full, d * 64, w.n, w.m0, w.b);
        };
        if (j_begin == j_end) load_q();
        for (int j = j_begin; j < j_end; ++j, ++g) {
          const int s = g % kStages;
          const uint32_t parity = ((g / kStages) - 1) & 1;
          if (g >= kStages) hopper::BarrierWait(&k_empty[s], parity);
          uint8_t* k_dst = sk + s * Tiles::kKBytes;
          hopper::BarrierExpectTx(&k_full[s], Tiles::kKBytes);
          for (int d = 0; d < kD / 64; ++d)
            hopper::TmaLoad4d(k_dst + d * kBN * 128, &tk, &k_full[s], d * 64, kvh, j * kBN, w.b);
          if (j == j_begin) load_q();
          if (g >= kStages) hopper::BarrierWait(&v_empty[s], parity);
          uint8_t* v_dst = sv + s * Tiles::kVBytes;
          hopper::BarrierExpectTx(&v_full[s], Tiles::kVBytes);
          for (int d = 0; d < kDv / 64; ++d)
            hopper::TmaLoad4d(v_dst + d * kBN * 128, &tv, &v_full[s], d * 64, kvh, j * kBN, w.b);
        }
        ++tile;
      }
    }
    return;
  }

  // --- consumers ---
  hopper::RegAlloc<240>();
  const int wg = tid / 128 - 1, t = tid % 128, warp = t / 32, lane = t % 32;
  const uint32_t q_addr = hopper::SmemAddr(sq) + wg * 64 * 128;

  // Ping-pong: each wgmma issue point waits for this consumer's turn and then
  // hands the turn to the other; consumer 0 goes first. Both consumers visit
  // the same issue points (n_tiles + 1 for each work tile with keys), so the
  // turns alternate strictly; consumer 1's last hand-over is taken by one
  // more wait of consumer 0 after its last tile.
  auto my_turn = [&] { hopper::NamedBarrierSync(kPingPong + wg, 256); };
  auto pass_turn = [&] { hopper::NamedBarrierArrive(kPingPong + 1 - wg, 256); };
  if (wg == 1) hopper::NamedBarrierArrive(kPingPong, 256);

  int g0 = 0;  // K/V ring position of this work tile's first key tile
  int tile = 0;
  for (int k = 0;; ++k) {  // the k-th tile of this CTA's units
    const int64_t u = blockIdx.x + int64_t(pairs ? k / 2 : k) * gridDim.x;
    if (u >= units) break;
    FwdWork w;
    if (!FwdWorkAt(u, pairs ? k % 2 : 0, pairs, m_tiles, sh.n, kBM, &w)) continue;
    const ScoreCtx c = MakeScoreCtx(p.mask, sh, p.scale, p.softcap, w.b, w.n);
    int j_begin, j_end;
    key_tiles(w, c, &j_begin, &j_end);
    const int64_t row0 = w.m0 + 64 * wg + 16 * warp + lane / 4;  // and row0 + 8
    const int64_t wg_r0 = w.m0 + 64 * wg, wg_r1 = wg_r0 + 63;
    // Which key tiles need the mask: the range [mask_lo, mask_hi) needs none
    // (set up once per work tile) -- 1-1.4% faster than TileNeedsMask's
    // 64-bit compares on every tile at D = 128 (ncu, H200, 2026-11-23:
    // S = 2048 456.6 -> 451.4 us, 4096 854.7 -> 842.8, causal 8192
    // 894.0 -> 881.9; D = 64 causal 2048 456.8 -> 450.5). ptxas schedules
    // the D = 64, 176-key instantiation 4% slower with it (2.31 -> 2.41 ms,
    // S = 8192), so that one keeps the per-tile test.
    constexpr bool kRangeTest = !(kD <= 64 && kBN > 128);
    int mask_lo = 0, mask_hi = 0;
    if constexpr (kRangeTest) UnmaskedKeyTiles(c, wg_r0, wg_r1, kBN, &mask_lo, &mask_hi);
    float o[kDv / 2];
#pragma unroll
    for (int e = 0; e < kDv / 2; ++e) o[e] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    const int n_tiles = j_end - j_begin;

    // Key tile `it` of this work tile sits in ring slot (g0 + it) % kStages.
    auto issue_scores = [&](float (&sc)[kBN / 2], int it) {
      const int s = (g0 + it) % kStages;
      const uint32_t k_addr = hopper::SmemAddr(sk + s * Tiles::kKBytes);
      hopper::BarrierWait(&k_full[s], ((g0 + it) / kStages) & 1);
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t off = (kk % 4) * 32;  // 16 columns = 32 bytes inside the swizzle atom
        WgmmaSS<T, kBN>(sc, hopper::Descriptor(q_addr + (kk / 4) * kBM * 128 + off, 0),
                        hopper::Descriptor(k_addr + (kk / 4) * kBN * 128 + off, 0), kk > 0);
      }
      hopper::WgmmaCommit();
    };
    auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int it) {
      const int s = (g0 + it) % kStages;
      const uint32_t v_addr = hopper::SmemAddr(sv + s * Tiles::kVBytes);
      hopper::BarrierWait(&v_full[s], ((g0 + it) / kStages) & 1);
      hopper::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
        WgmmaRS<T, kDv>(o, pa[kk], hopper::Descriptor(v_addr + kk * 2048, kBN * 128), 1);
      hopper::WgmmaCommit();
    };
    // Logits of tile `it` (key tile j_begin + it), then the softmax step.
    auto softmax = [&](float (&sc)[kBN / 2], int it, float (&corr)[2]) {
      const int j = j_begin + it;
      const int64_t j0 = int64_t(j) * kBN;
      const bool need_mask = kRangeTest ? j < mask_lo || j >= mask_hi
                                        : TileNeedsMask(c, wg_r0, wg_r1, j0, j0 + kBN - 1);
      // The lean path leaves the scale to SoftmaxStep's FFMA (the launcher
      // sends scale <= 0 to the general path).
      Logits<kBN, false, kGeneral, false>(sc, c, row0, j0 + 2 * (lane % 4), need_mask);
      SoftmaxStep<kBN>(sc, kGeneral ? 1.f : c.scale_log2, m_run, l_run, corr);
    };
    auto pack = [&](const float (&sc)[kBN / 2], uint32_t (&pa)[kBN / 16][4]) {
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
    };

    hopper::BarrierWait(q_full, tile & 1);
    if (n_tiles > 0) {
      float sc[kBN / 2], corr[2];
      uint32_t pa[kBN / 16][4];
      my_turn();
      issue_scores(sc, 0);
      pass_turn();
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(sc);
      hopper::BarrierArrive(&k_empty[g0 % kStages]);
      softmax(sc, 0, corr);  // o is still 0: no rescale
      pack(sc, pa);
      for (int it = 1; it < n_tiles; ++it) {
        my_turn();
        issue_scores(sc, it);
        issue_pv(pa, it - 1);
        pass_turn();
        hopper::WgmmaWait<1>();  // the scores; P V may still run
        hopper::FenceRegisters(sc);
        hopper::BarrierArrive(&k_empty[(g0 + it) % kStages]);
        softmax(sc, it, corr);
        hopper::FenceRegisters(sc);  // the exponentials before the wait (in the PTX)
        hopper::WgmmaWait<0>();
        hopper::FenceRegisters(o);
        hopper::KeepRegisters(pa);  // read by P V until here
        hopper::BarrierArrive(&v_empty[(g0 + it - 1) % kStages]);
#pragma unroll
        for (int e = 0; e < kDv / 2; ++e) o[e] *= corr[(e >> 1) & 1];
        pack(sc, pa);
      }
      hopper::BarrierArrive(q_empty);  // every Q K^T of this tile is done
      my_turn();
      issue_pv(pa, n_tiles - 1);
      pass_turn();
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(o);
      hopper::KeepRegisters(pa);
      hopper::BarrierArrive(&v_empty[(g0 + n_tiles - 1) % kStages]);
    } else {
      hopper::BarrierArrive(q_empty);
    }
    g0 += n_tiles;

    // Epilogue: o / l and lse; rows past T are not written.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t row = row0 + 8 * h;
      if (row < sh.t) {
        T* orow = static_cast<T*>(p.o) + ((w.b * sh.t + row) * sh.n + w.n) * sh.hv;
#pragma unroll
        for (int e = 0; e < kDv / 8; ++e) {
          const int col = 8 * e + 2 * (lane % 4);
          if (col < sh.hv)
            *reinterpret_cast<uint32_t*>(orow + col) =
                hopper::PackPair<T>(o[4 * e + 2 * h] * inv, o[4 * e + 2 * h + 1] * inv);
        }
        if (lane % 4 == 0)
          p.lse[(w.b * sh.n + w.n) * sh.t + row] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
    ++tile;
  }
  if (wg == 0) my_turn();  // consumer 1's last hand-over (or its opening one)
}

}  // namespace attention
}  // namespace jax_dnn
