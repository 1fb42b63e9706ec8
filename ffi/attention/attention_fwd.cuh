// Flash attention forward for Hopper: o = softmax(logits) v and lse.
//
// One CTA computes 128 query rows of one (batch, head) in three warpgroups:
//   warpgroup 0 (producer): one thread issues TMA loads -- the Q tile once,
//     then K and V tiles through a 2-stage ring (full/empty mbarriers);
//   warpgroups 1, 2 (consumers): 64 rows each; per key tile
//     S = Q K^T (wgmma, both operands in shared memory, K-major),
//     online softmax in registers (the S accumulator converts in place into
//     the A fragments of the next wgmma),
//     O += P V (wgmma, P from registers, V in shared memory MN-major).
// The two consumer warpgroups run independently, so one's softmax overlaps
// the other's tensor-core work. Only key tiles that hold an allowed position
// for these rows are visited (causal / window / lengths), and only tiles that
// may hold a masked position evaluate the mask.
// Shared memory tiles are [64-column slab][rows][64] in TMA's 128-byte swizzle,
// the layout hopper::Descriptor describes.
#pragma once

#include "ffi/attention/attention_common.cuh"
#include "ffi/attention/hopper.cuh"
#include "ffi/attention/wgmma.cuh"

namespace jax_dnn {
namespace attention {

template <int kD, int kDv, int kBN>
struct FwdTiles {
  static constexpr int kBM = 128, kStages = 2;
  static constexpr int kQBytes = kBM * kD * 2, kKBytes = kBN * kD * 2, kVBytes = kBN * kDv * 2;
  static constexpr int kSmem = 1024 /*alignment slack*/ + kQBytes + kStages * (kKBytes + kVBytes) +
                               8 * (1 + 3 * kStages);
};

template <typename T, int kD, int kDv, int kBN, bool kGeneral>
__global__ void __launch_bounds__(384, 1)
    AttentionFwdKernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                       const __grid_constant__ CUtensorMap tv, const AttentionFwdParams p) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  constexpr int kBM = Tiles::kBM, kStages = Tiles::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sq = base;
  uint8_t* sk = sq + Tiles::kQBytes;
  uint8_t* sv = sk + kStages * Tiles::kKBytes;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kStages * Tiles::kVBytes);
  uint64_t* k_full = q_full + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* empty = v_full + kStages;

  const AttentionShape& sh = p.shape;
  const int64_t m_tiles = gridDim.x;
  const int64_t m0 = (m_tiles - 1 - blockIdx.x) * kBM;  // heaviest (causal) tiles first
  const int64_t n = blockIdx.y, b = blockIdx.z;
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
    hopper::RegDealloc<40>();
    if (tid == 0) {
      hopper::TmaPrefetchDescriptor(&tq);
      hopper::TmaPrefetchDescriptor(&tk);
      hopper::TmaPrefetchDescriptor(&tv);
      hopper::BarrierExpectTx(q_full, Tiles::kQBytes);
      for (int d = 0; d < kD / 64; ++d)
        hopper::TmaLoad4d(sq + d * kBM * 128, &tq, q_full, d * 64, n, m0, b);
      for (int j = j_begin, it = 0; j < j_end; ++j, ++it) {
        const int s = it % kStages;
        if (it >= kStages) hopper::BarrierWait(&empty[s], ((it / kStages) - 1) & 1);
        uint8_t* k_dst = sk + s * Tiles::kKBytes;
        hopper::BarrierExpectTx(&k_full[s], Tiles::kKBytes);
        for (int d = 0; d < kD / 64; ++d)
          hopper::TmaLoad4d(k_dst + d * kBN * 128, &tk, &k_full[s], d * 64, kvh, j * kBN, b);
        uint8_t* v_dst = sv + s * Tiles::kVBytes;
        hopper::BarrierExpectTx(&v_full[s], Tiles::kVBytes);
        for (int d = 0; d < kDv / 64; ++d)
          hopper::TmaLoad4d(v_dst + d * kBN * 128, &tv, &v_full[s], d * 64, kvh, j * kBN, b);
      }
    }
    return;
  }

  // --- consumers ---
  hopper::RegAlloc<232>();
  const int wg = tid / 128 - 1, t = tid % 128, warp = t / 32, lane = t % 32;
  const int64_t row0 = m0 + 64 * wg + 16 * warp + lane / 4;  // and row0 + 8
  const int64_t wg_r0 = m0 + 64 * wg, wg_r1 = wg_r0 + 63;
  float o[kDv / 2];
#pragma unroll
  for (int e = 0; e < kDv / 2; ++e) o[e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  const uint32_t q_addr = hopper::SmemAddr(sq) + wg * 64 * 128;
  hopper::BarrierWait(q_full, 0);

  for (int j = j_begin, it = 0; j < j_end; ++j, ++it) {
    const int s = it % kStages;
    const uint32_t phase = (it / kStages) & 1;
    const uint32_t k_addr = hopper::SmemAddr(sk + s * Tiles::kKBytes);
    const uint32_t v_addr = hopper::SmemAddr(sv + s * Tiles::kVBytes);

    // S = Q K^T
    float sc[kBN / 2];
    hopper::BarrierWait(&k_full[s], phase);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t off = (kk % 4) * 32;  // 16 columns = 32 bytes inside the swizzle atom
      WgmmaSS<T, kBN>(sc, hopper::Descriptor(q_addr + (kk / 4) * kBM * 128 + off, 0),
                      hopper::Descriptor(k_addr + (kk / 4) * kBN * 128 + off, 0), kk > 0);
    }
    hopper::WgmmaCommit();
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(sc);

    // Online softmax over this tile (log2 units).
    const int64_t col0 = int64_t(j) * kBN + 2 * (lane % 4);
    const bool need_mask = TileNeedsMask(c, wg_r0, wg_r1, int64_t(j) * kBN, int64_t(j) * kBN + kBN - 1);
    Logits<kBN, false, kGeneral>(sc, c, row0, col0, need_mask);
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_run[h];
#pragma unroll
      for (int e = 0; e < kBN / 8; ++e) mx = fmaxf(mx, fmaxf(sc[4 * e + 2 * h], sc[4 * e + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      // A row with nothing allowed yet keeps max -inf: subtract 0 instead (p = 0).
      const float m_safe = mx == -INFINITY ? 0.f : mx;
      corr[h] = hopper::Exp2(m_run[h] - m_safe);
      m_run[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int e = 0; e < kBN / 8; ++e) {
        sc[4 * e + 2 * h] = hopper::Exp2(sc[4 * e + 2 * h] - m_safe);
        sc[4 * e + 2 * h + 1] = hopper::Exp2(sc[4 * e + 2 * h + 1] - m_safe);
        sum += sc[4 * e + 2 * h] + sc[4 * e + 2 * h + 1];
      }
      l_run[h] = l_run[h] * corr[h] + sum;  // per-thread partial; reduced over the quad at the end
    }
#pragma unroll
    for (int e = 0; e < kDv / 2; ++e) o[e] *= corr[(e >> 1) & 1];
    uint32_t pa[kBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = hopper::PackPair<T>(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);

    // O += P V
    hopper::BarrierWait(&v_full[s], phase);
    hopper::WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      WgmmaRS<T, kDv>(o, pa[kk], hopper::Descriptor(v_addr + kk * 2048, kBN * 128), 1);
    hopper::WgmmaCommit();
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(o);
    hopper::BarrierArrive(&empty[s]);
  }

  // Epilogue: o / l and lse; rows past T are not written.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t row = row0 + 8 * h;
    if (row < sh.t) {
      T* orow = static_cast<T*>(p.o) + ((b * sh.t + row) * sh.n + n) * sh.hv;
#pragma unroll
      for (int e = 0; e < kDv / 8; ++e) {
        const int col = 8 * e + 2 * (lane % 4);
        if (col < sh.hv)
          *reinterpret_cast<uint32_t*>(orow + col) =
              hopper::PackPair<T>(o[4 * e + 2 * h] * inv, o[4 * e + 2 * h + 1] * inv);
      }
      if (lane % 4 == 0)
        p.lse[(b * sh.n + n) * sh.t + row] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
    }
  }
}

}  // namespace attention
}  // namespace jax_dnn
