// Flash attention forward for Hopper with 192-row work tiles: three
// consumer warpgroups of 64 rows share each K and V tile. The launcher
// takes it on the lean path where every query tile sees every key
// (FwdUniformKeys, not FwdNeedsGeneral) at head dims 128 from 2048 keys and
// queries, and at head dims 64 from 512 (FwdWideTakes, attention_plan.cc); all else goes to
// AttentionFwdKernel (attention_fwd.cuh), whose schedule (FwdSchedule:
// persistent grid, split tail, clusters of two CTAs sharing K/V loads) and
// tile indices (FwdTileInfo) it shares.
//
// Why: AttentionFwdKernel's 128-row tiles at 176 keys and this kernel's
// 192 x 128 both keep the tensor cores ~83% busy (H200: ~3420 cycles a
// key-tile step for 2816 of tensor work there, ~3690 for 3072 here), but
// here the per-step costs (barrier waits, the max shuffles, the O rescale)
// spread over more rows, key tiles of 128 waste less at the end of a
// sequence, and every K/V tile serves 192 rows. At head dim 128, from 2048
// keys: 0.945 of the 128-row kernel's time at S = 2048, 0.878 at 3072,
// 0.972 at 4096 (H200, T = S, B = 16384 / S, 16 heads); at 1024, 0.996,
// left to the 128-row kernel. At head dim 64 a tile's softmax takes longer
// than one consumer's two GEMMs (its exponentials alone as long: the SFU's
// 16 a clock an SM against 2048 FMAs, a score costing D + Dv = 128 FMAs),
// so the GEMMs of one other consumer cannot hide it, two can: 0.89-0.98 of
// the 128-row kernel's time at S = 512-4096, 0.81-0.89 at 4608-6000 and
// 0.965-0.974 at 8192-16384 (H100).
//
// Registers: 512 threads leave 160 a consumer thread, which hold O (64
// floats at head dim 128) and S (64) of a 128-key tile but not also the
// previous tile's P fragments (32), so a consumer does not overlap its own
// two GEMMs (AttentionFwdKernel's in-warpgroup overlap); the third consumer
// fills the tensor cores instead: while one runs its softmax, the other
// two's GEMMs run. (P in shared memory with the overlap takes the same
// cycles and 1-2% more time.)
//
// Roles: warpgroup 0 (producer) -- one thread issues the TMA loads of each
// consumer's 64 rows of Q (a slot each, loaded for the next tile once its
// consumer's last scores of this one are done, after the next tile's first
// K, consumers in order) and of K and V tiles through a 2-stage ring, and
// works out each work tile's indices (a ring of 3);
// warpgroups 1-3 (consumers) -- per key tile S = Q K^T (SS wgmma), the
// online softmax, O += P V (RS wgmma). Named barriers pass the turn to issue
// the scores round the three consumers.
#pragma once

#include "ffi/attention/attention_fwd.cuh"

namespace jax_dnn {
namespace attention {

template <int kD, int kDv>
struct FwdWideTiles {
  static constexpr int kBM = 192, kBN = 128, kStages = 2, kConsumers = 3;
  static constexpr int kQPartBytes = 64 * kD * 2;  // one consumer's rows
  static constexpr int kKBytes = kBN * kD * 2, kVBytes = kBN * kDv * 2;
  // Q: [kD / 64 slabs][3 consumers][64 rows][64].
  static constexpr int kQSlab = kConsumers * 64 * 128;
  static constexpr int kSmem = 1024 /*alignment slack*/ + kConsumers * kQPartBytes +
                               kStages * (kKBytes + kVBytes) + 8 * (2 * kConsumers + 4 * kStages) +
                               3 * 52 /*FwdTileInfo ring*/;
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
  // setmaxnreg: the producer's registers a thread and the consumers', within
  // the SM's 64K.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 160;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "register file");
};

template <typename T, int kD, int kDv, bool kSplit, int kCluster>
__global__ void __launch_bounds__(512, 1)
    AttentionFwdWideKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                           const __grid_constant__ CUtensorMap tv, const AttentionFwdParams p,
                           const FwdSchedule sched) {
  using Tiles = FwdWideTiles<kD, kDv>;
  constexpr int kBM = Tiles::kBM, kBN = Tiles::kBN, kStages = Tiles::kStages, kC = Tiles::kConsumers;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = hopper::AlignSmem1024(smem_raw);
  uint8_t* sq = base;
  uint8_t* sk = sq + kC * Tiles::kQPartBytes;
  uint8_t* sv = sk + kStages * Tiles::kKBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kStages * Tiles::kVBytes);  // [kC]
  uint64_t* q_empty = q_full + kC;                                                // [kC]
  uint64_t* k_full = q_empty + kC;
  uint64_t* v_full = k_full + kStages;
  uint64_t* k_empty = v_full + kStages;
  uint64_t* v_empty = k_empty + kStages;
  FwdTileInfo* info = reinterpret_cast<FwdTileInfo*>(v_empty + kStages);  // [3]

  const AttentionShape& sh = p.shape;
  const int m_tiles = static_cast<int>((sh.t + kBM - 1) / kBM);
  const int heads = static_cast<int>(sh.n);
  const int key_tiles = static_cast<int>((sh.s + kBN - 1) / kBN);

  const int tid = threadIdx.x;
  // A K/V stage is released by each consumer warp of each CTA of the
  // cluster: one lane, after the warp-wide wgmma wait.
  constexpr int kReleases = 4 * kC * kCluster;
  if (tid == 0) {
    for (int w = 0; w < kC; ++w) {
      hopper::BarrierInit(&q_full[w], 1);
      hopper::BarrierInit(&q_empty[w], 128);
    }
    for (int s = 0; s < kStages; ++s) {
      hopper::BarrierInit(&k_full[s], 1);
      hopper::BarrierInit(&v_full[s], 1);
      hopper::BarrierInit(&k_empty[s], kReleases);
      hopper::BarrierInit(&v_empty[s], kReleases);
    }
    hopper::FenceBarrierInit();
  }
  if constexpr (kCluster > 1)
    hopper::ClusterSync();
  else
    __syncthreads();

  if (tid < 128) {  // producer
    hopper::RegDealloc<Tiles::kProducerRegs>();
    if (tid == 0) {
      hopper::TmaPrefetchDescriptor(&tq);
      hopper::TmaPrefetchDescriptor(&tk);
      hopper::TmaPrefetchDescriptor(&tv);
      int k = 0;
      auto next_work = [&](FwdWork* w) {
        bool skip;
        for (; FwdTileAt<kSplit, kCluster>(k, sched, m_tiles, heads, kBM, w, &skip); ++k)
          if (!skip) {
            ++k;
            return true;
          }
        return false;
      };
      // Tile t's info into slot t % 3, or `done`. Slot t % 3 was tile t - 3's:
      // its readers read it before releasing their Q of tile t - 3, which the
      // producer waited for when it loaded tile t - 2's Q.
      auto publish_next = [&](int t) {
        FwdWork w;
        FwdTileInfo* f = &info[t % 3];
        if (!next_work(&w)) {
          f->done = 1;
          return false;
        }
        const int j_begin = max(0, w.j_lo), j_end = min(key_tiles, w.j_hi);
        f->m0 = static_cast<int>(w.m0), f->n = w.n, f->b = w.b;
        f->j_begin = j_begin, f->n_tiles = max(j_end - j_begin, 0);
        f->q_limit = static_cast<int>(sh.t), f->kv_limit = static_cast<int>(sh.s);
        f->slot = w.slot, f->done = 0;
        return true;
      };
      // Each consumer's Q rows of tile t, once its rows of tile t - 1 are
      // free; arming the barrier also releases the tile's info. With no
      // tile t, a phase with nothing loaded.
      auto load_q = [&](int t) {
        const FwdTileInfo& f = info[t % 3];
        for (int w = 0; w < kC; ++w) {
          if (t >= 1) hopper::BarrierWait(&q_empty[w], (t - 1) & 1);
          if (f.done) {
            hopper::BarrierArrive(&q_full[w]);
            continue;
          }
          hopper::BarrierExpectTx(&q_full[w], Tiles::kQPartBytes);
          for (int d = 0; d < kD / 64; ++d)
            hopper::TmaLoad4d(sq + d * Tiles::kQSlab + w * 64 * 128, &tq, &q_full[w], d * 64, f.n,
                              f.m0 + 64 * w, f.b);
        }
      };
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
      int tile = 0;
      bool have = publish_next(0);
      for (; have; ++tile) {
        const bool have_next = publish_next(tile + 1);
        const FwdTileInfo& f = info[tile % 3];
        const FwdTileInfo& fn = info[(tile + 1) % 3];
        if (have_next)  // the next tile's Q into L2
          for (int d = 0; d < kD / 64; ++d)
            for (int w = 0; w < kC; ++w) hopper::TmaPrefetchL2(&tq, d * 64, fn.n, fn.m0 + 64 * w, fn.b);
        const int kvh = f.n / static_cast<int>(sh.n / sh.kh);
        const int j_begin = f.j_begin, j_end = f.j_begin + f.n_tiles;
        if (j_begin == j_end) load_q(tile);
        for (int j = j_begin; j < j_end; ++j, ++g) {
          const int s = g % kStages;
          const uint32_t parity = ((g / kStages) - 1) & 1;
          if (g >= kStages) hopper::BarrierWait(&k_empty[s], parity);
          uint8_t* k_dst = sk + s * Tiles::kKBytes;
          hopper::BarrierExpectTx(&k_full[s], Tiles::kKBytes);
          for (int d = 0; d < kD / 64; ++d)
            load_kv(k_dst + d * kBN * 128, &tk, &k_full[s], d * 64, kvh, j * kBN, f.b);
          // The tile's Q after its first K: the consumers free their rows of
          // the previous tile only after its last scores.
          if (j == j_begin) load_q(tile);
          if (g >= kStages) hopper::BarrierWait(&v_empty[s], parity);
          uint8_t* v_dst = sv + s * Tiles::kVBytes;
          hopper::BarrierExpectTx(&v_full[s], Tiles::kVBytes);
          for (int d = 0; d < kDv / 64; ++d)
            load_kv(v_dst + d * kBN * 128, &tv, &v_full[s], d * 64, kvh, j * kBN, f.b);
        }
        have = have_next;
      }
      load_q(tile);  // the consumers' `done`
    }
    return;
  }

  // --- consumers ---
  hopper::RegAlloc<Tiles::kConsumerRegs>();
  const int wg = hopper::WarpUniform(tid / 128) - 1, t = tid % 128, warp = t / 32, lane = t % 32;
  // The turn to issue the scores goes round the consumers 0, 1, 2, 0, ...
  auto my_turn = [&] { hopper::NamedBarrierSync(kPingPong + wg, 256); };
  auto pass_turn = [&] { hopper::NamedBarrierArrive(kPingPong + (wg + 1) % kC, 256); };
  if (wg == kC - 1) hopper::NamedBarrierArrive(kPingPong, 256);

  auto release = [&](uint64_t* bar) {
    if constexpr (kCluster == 1) {
      if (lane == 0) hopper::BarrierArrive(bar);
    } else if (lane < kCluster) {
      hopper::BarrierArriveCluster(bar, lane);
    }
  };

  float o[kDv / 2];
  float m_run[2], l_run[2];
  float sc[kBN / 2], corr[2];
  uint32_t pa[kBN / 16][4];
  const uint32_t q_addr = hopper::SmemAddr(sq) + wg * 64 * 128;

  int g0 = 0;
  for (int tile = 0;; ++tile) {
    hopper::BarrierWait(&q_full[wg], tile & 1);
    const FwdTileInfo& f = info[tile % 3];
    if (f.done) break;
    const int m0 = f.m0, n = f.n, b = f.b, j_begin = f.j_begin, n_tiles = f.n_tiles;
    const int slot = kSplit ? f.slot : -1;
    const int kv_limit = f.kv_limit, mask_from = kv_limit / kBN;  // key tiles from mask_from on hold keys past S
    const float scale_log2 = p.scale * kLog2e;
    const int64_t row0 = int64_t(m0) + 64 * wg + 16 * warp + lane / 4;

#pragma unroll
    for (int e = 0; e < kDv / 2; ++e) o[e] = 0.f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;

    for (int it = 0; it < n_tiles; ++it) {
      const int g = g0 + it, s = g % kStages;
      const uint32_t parity = (g / kStages) & 1;
      // S = Q K^T.
      my_turn();
      {
        const uint32_t k_addr = hopper::SmemAddr(sk + s * Tiles::kKBytes);
        hopper::BarrierWait(&k_full[s], parity);
        hopper::WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          const uint32_t off = (kk % 4) * 32;
          WgmmaSS<T, kBN>(sc, hopper::Descriptor(q_addr + (kk / 4) * Tiles::kQSlab + off, 0),
                          hopper::Descriptor(k_addr + (kk / 4) * kBN * 128 + off, 0), kk > 0);
        }
        hopper::WgmmaCommit();
      }
      pass_turn();
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(sc);
      release(&k_empty[s]);
      if (it == n_tiles - 1) hopper::BarrierArrive(&q_empty[wg]);
      // Only the last key tile of a sequence that is not a multiple of kBN
      // holds keys past its end (no other mask on this path).
      const int j = j_begin + it;
      if (j >= mask_from) {
        const int64_t c0 = int64_t(j) * kBN + 2 * (lane % 4);
#pragma unroll
        for (int e = 0; e < kBN / 8; ++e)
#pragma unroll
          for (int x = 0; x < 4; ++x)
            if (c0 + 8 * e + (x & 1) >= kv_limit) sc[4 * e + x] = -INFINITY;
      }
      // The lazy rescale at head dims above 64 (SoftmaxStepLazy says why).
      bool rescale = true;
      if constexpr (kD > 64)
        rescale = SoftmaxStepLazy<kBN>(sc, scale_log2, m_run, l_run, corr);
      else
        SoftmaxStep<kBN>(sc, scale_log2, m_run, l_run, corr);
      if (it > 0 && rescale) {
#pragma unroll
        for (int e = 0; e < kDv / 2; ++e) o[e] *= corr[(e >> 1) & 1];
      }
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
      // O += P V.
      {
        const uint32_t v_addr = hopper::SmemAddr(sv + s * Tiles::kVBytes);
        hopper::BarrierWait(&v_full[s], parity);
        hopper::WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)
          WgmmaRS<T, kDv>(o, pa[kk], hopper::Descriptor(v_addr + kk * 2048, kBN * 128), 1);
        hopper::WgmmaCommit();
      }
      hopper::WgmmaWait<0>();
      hopper::FenceRegisters(o);
      hopper::KeepRegisters(pa);
      release(&v_empty[s]);
    }
    if (n_tiles == 0) hopper::BarrierArrive(&q_empty[wg]);
    g0 += n_tiles;

    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      inv[h] = l > 0.f ? 1.f / l : 0.f;
      lse[h] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
    }
    FwdStoreRows<T, kBM, kDv, kSplit>(p, sched, slot, o, inv, lse, 64 * wg + 16 * warp + lane / 4, row0, b, n,
                                      lane);
  }
  if (wg == 0) my_turn();  // the last consumer's last hand-over
  if constexpr (kCluster > 1) hopper::ClusterSync();
}

}  // namespace attention
}  // namespace jax_dnn
