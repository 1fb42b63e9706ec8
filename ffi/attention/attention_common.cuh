// Device code shared by the attention kernels: the logits of one wgmma
// accumulator fragment (scale, soft-cap, bias, masks) and the ranges of tiles
// that can hold an allowed position (so fully masked tiles are never loaded).
#pragma once

#include <cstdint>

#include "ffi/attention/attention.h"

namespace jax_dnn {
namespace attention {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// What decides the logits of query row i and key column j for one (batch, head).
struct ScoreCtx {
  float scale, scale_log2, softcap, inv_softcap;
  bool plain;                  // no soft-cap and no bias: logit = scale * qk
  int64_t t, s;                // sequence lengths (row stride of bias/mask is s)
  int64_t q_limit, kv_limit;   // rows >= q_limit / columns >= kv_limit are masked
  bool causal;
  int64_t wl, wr;
  const int32_t* q_seg;        // this batch's rows (nullptr: no segments)
  const int32_t* kv_seg;
  const bool* mask;            // this (batch, head)'s [T, S] (nullptr: none)
  const float* bias;           // likewise
};

// The sequence lengths batch b attends within (q_lens / kv_lens, else T / S).
__device__ __forceinline__ int64_t QueryLimit(const AttentionMask& m, const AttentionShape& sh, int64_t b) {
  return m.q_lens ? min(sh.t, static_cast<int64_t>(m.q_lens[b])) : sh.t;
}
__device__ __forceinline__ int64_t KeyLimit(const AttentionMask& m, const AttentionShape& sh, int64_t b) {
  return m.kv_lens ? min(sh.s, static_cast<int64_t>(m.kv_lens[b])) : sh.s;
}

// The context of (batch b, head n), with the limits given (QueryLimit,
// KeyLimit: the forward's producer reads them once for its consumers).
__device__ __forceinline__ ScoreCtx MakeScoreCtx(const AttentionMask& m, const AttentionShape& sh,
                                                 float scale, float softcap, int64_t b, int64_t n,
                                                 int64_t q_limit, int64_t kv_limit) {
  ScoreCtx c;
  c.scale = scale;
  c.scale_log2 = scale * kLog2e;
  c.softcap = softcap;
  c.inv_softcap = softcap == 0.f ? 0.f : 1.f / softcap;
  c.plain = softcap == 0.f && m.bias == nullptr;
  c.t = sh.t;
  c.s = sh.s;
  c.q_limit = q_limit;
  c.kv_limit = kv_limit;
  c.causal = m.causal;
  c.wl = m.window_left;
  c.wr = m.window_right;
  c.q_seg = m.q_seg ? m.q_seg + b * sh.t : nullptr;
  c.kv_seg = m.kv_seg ? m.kv_seg + b * sh.s : nullptr;
  // bias / mask are [G, N|1, T, S]; batch b uses set b / (B / G). Only
  // when present, and in 32 bits: the forward sets a context up for every
  // work tile, and 64-bit divisions cost ~1000 cycles there.
  auto plane = [&](int64_t param_sets, bool per_head) {
    const int g = static_cast<int>(b) / (static_cast<int>(sh.b) / static_cast<int>(param_sets));
    return (per_head ? g * sh.n + n : int64_t(g)) * sh.t * sh.s;
  };
  c.mask = nullptr;
  c.bias = nullptr;
  if (m.mask) c.mask = m.mask + plane(m.mask_sets, m.mask_per_head);
  if (m.bias) c.bias = m.bias + plane(m.bias_sets, m.bias_per_head);
  return c;
}
__device__ __forceinline__ ScoreCtx MakeScoreCtx(const AttentionMask& m, const AttentionShape& sh,
                                                 float scale, float softcap, int64_t b, int64_t n) {
  return MakeScoreCtx(m, sh, scale, softcap, b, n, QueryLimit(m, sh, b), KeyLimit(m, sh, b));
}

// The masks decided by indices alone (no memory reads).
__device__ __forceinline__ bool AllowedByIndex(const ScoreCtx& c, int64_t i, int64_t j) {
  return i < c.q_limit && j < c.kv_limit && !(c.causal && j > i) && !(c.wl >= 0 && i - j > c.wl) &&
         !(c.wr >= 0 && j - i > c.wr);
}

__device__ __forceinline__ bool Allowed(const ScoreCtx& c, int64_t i, int64_t j) {
  if (!AllowedByIndex(c, i, j)) return false;
  if (c.q_seg && c.q_seg[i] != c.kv_seg[j]) return false;
  if (c.mask && !c.mask[i * c.s + j]) return false;
  return true;
}

// Whether any position of rows [r0, r1] x columns [c0, c1] may be masked.
__device__ __forceinline__ bool TileNeedsMask(const ScoreCtx& c, int64_t r0, int64_t r1, int64_t c0,
                                              int64_t c1) {
  return r1 >= c.q_limit || c1 >= c.kv_limit || (c.causal && c1 > r0) ||
         (c.wl >= 0 && r1 - c0 > c.wl) || (c.wr >= 0 && c1 - r0 > c.wr) || c.q_seg != nullptr ||
         c.mask != nullptr;
}

// Key tiles j in [*lo, *hi) of `tile` keys hold no position of rows [r0, r1]
// that TileNeedsMask would flag; every other tile may (an empty range: all
// may). Computed once per row tile, so that the per-key-tile test is two
// 32-bit compares instead of TileNeedsMask's 64-bit ones.
__device__ __forceinline__ void UnmaskedKeyTiles(const ScoreCtx& c, int64_t r0, int64_t r1, int tile,
                                                 int* lo, int* hi) {
  *lo = *hi = 0;
  if (r1 >= c.q_limit || c.q_seg != nullptr || c.mask != nullptr) return;
  // A tile is unmasked when its last column c1 <= c1_max and its first
  // column c0 >= c0_min.
  int64_t c1_max = c.kv_limit - 1;
  if (c.causal) c1_max = min(c1_max, r0);
  if (c.wr >= 0) c1_max = min(c1_max, r0 + c.wr);
  const int64_t c0_min = c.wl >= 0 ? r1 - c.wl : 0;
  const int64_t h = c1_max + 1 <= 0 ? 0 : (c1_max + 1) / tile;       // j * tile + tile - 1 <= c1_max
  const int64_t l = c0_min <= 0 ? 0 : (c0_min + tile - 1) / tile;   // j * tile >= c0_min
  if (l < h) *lo = static_cast<int>(l), *hi = static_cast<int>(h);
}

// Tiles [*begin, *end) of `tile` keys that rows [r0, r1] can attend to.
__device__ __forceinline__ void KeyTiles(const ScoreCtx& c, int64_t r0, int64_t r1, int tile,
                                         int* begin, int* end) {
  int64_t lo = 0, hi = c.kv_limit - 1;
  if (c.causal) hi = min(hi, r1);
  if (c.wl >= 0) lo = max(lo, r0 - c.wl);
  if (c.wr >= 0) hi = min(hi, r1 + c.wr);
  if (r0 >= c.q_limit || hi < lo) {
    *begin = *end = 0;
    return;
  }
  *begin = static_cast<int>(lo / tile);
  *end = static_cast<int>(hi / tile + 1);
}

// Tiles [*begin, *end) of `tile` queries that can attend to keys [c0, c1].
__device__ __forceinline__ void QueryTiles(const ScoreCtx& c, int64_t c0, int64_t c1, int tile,
                                           int* begin, int* end) {
  int64_t lo = 0, hi = c.q_limit - 1;
  if (c.causal) lo = max(lo, c0);
  if (c.wl >= 0) hi = min(hi, c1 + c.wl);
  if (c.wr >= 0) lo = max(lo, c0 - c.wr);
  if (c0 >= c.kv_limit || hi < lo) {
    *begin = *end = 0;
    return;
  }
  *begin = static_cast<int>(lo / tile);
  *end = static_cast<int>(hi / tile + 1);
}

// The lean path's mask (no segments, mask array or bias) on one m64nN
// accumulator fragment of rows row0, row0 + 8: -inf outside each row's
// allowed columns, which under lengths, a causal mask and a window are one
// interval [lo, hi). Found once per row, relative to the thread's first
// column col0, so that a score costs an add, an unsigned compare against
// the interval's width and a select; Logits' per-score test of every
// condition is several times that, on the tiles (causal diagonals, ragged
// ends) that take it. With kTransposed the fragment is S^T: a row is a key
// j, its columns queries i (allowed: i >= j causal, j - wr <= i <= j + wl).
template <int kN, bool kTransposed = false>
__device__ __forceinline__ void MaskRowIntervals(float (&s)[kN / 2], const ScoreCtx& c, int64_t row0,
                                                 int64_t col0) {
  int lo[2], width[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = row0 + 8 * h;
    int64_t a = 0, b;  // allowed columns [a, b)
    if constexpr (!kTransposed) {  // r: query i; columns: keys j
      b = c.kv_limit;
      if (c.causal) b = min(b, r + 1);
      if (c.wr >= 0) b = min(b, r + c.wr + 1);
      if (c.wl >= 0) a = max(a, r - c.wl);
      if (r >= c.q_limit) b = a;
    } else {  // r: key j; columns: queries i
      b = c.q_limit;
      if (c.causal) a = max(a, r);
      if (c.wr >= 0) a = max(a, r - c.wr);
      if (c.wl >= 0) b = min(b, r + c.wl + 1);
      if (r >= c.kv_limit) b = a;
    }
    // Relative to col0 and clamped to the fragment's kN columns: 32 bits.
    const int64_t ra = min(max(a - col0, int64_t(0)), int64_t(kN));
    const int64_t rb = min(max(b - col0, ra), int64_t(kN));
    lo[h] = static_cast<int>(ra), width[h] = static_cast<int>(rb - ra);
  }
#pragma unroll
  for (int e = 0; e < kN / 2; ++e) {
    const int h = (e >> 1) & 1, off = 8 * (e >> 2) + (e & 1);
    if (static_cast<unsigned>(off - lo[h]) >= static_cast<unsigned>(width[h])) s[e] = -INFINITY;
  }
}

// Turns one m64nN wgmma accumulator fragment of raw scores q.k into logits in
// log2 units (-inf where masked). Element e of the fragment sits at fragment
// row row0 + 8 * ((e / 2) % 2) and column col0 + 8 * (e / 4) + e % 2 (the
// wgmma accumulator layout; row0/col0 carry the thread's lane offsets). With
// kTransposed the fragment is S^T: rows are keys, columns queries.
// kGeneral adds soft-cap, bias, segment ids and the boolean mask; without it
// (the common case) the code is a multiply and, on boundary tiles, index
// compares -- small enough to stay in the instruction cache, which the fully
// unrolled general path does not. kScaleLean = false leaves the lean path's
// scores unscaled (only masked to -inf): the forward folds the scale into the
// exponent's FFMA instead (which needs scale > 0, see FwdNeedsGeneral).
template <int kN, bool kTransposed, bool kGeneral, bool kScaleLean = true>
__device__ __forceinline__ void Logits(float (&s)[kN / 2], const ScoreCtx& c, int64_t row0,
                                       int64_t col0, bool need_mask) {
  if constexpr (!kGeneral) {
    if constexpr (kScaleLean) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) s[e] *= c.scale_log2;
    }
    if (need_mask) {
      // 32-bit index math (the handlers reject sequences of 2^31 or more):
      // fewer registers in the kernels' tightest loop.
      const int q_limit = static_cast<int>(c.q_limit), kv_limit = static_cast<int>(c.kv_limit);
      const int wl = static_cast<int>(min(c.wl, int64_t(INT32_MAX)));
      const int wr = static_cast<int>(min(c.wr, int64_t(INT32_MAX)));
      const int r0 = static_cast<int>(row0), c0 = static_cast<int>(col0);
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) {
        const int r = r0 + 8 * ((e >> 1) & 1), cc = c0 + 8 * (e >> 2) + (e & 1);
        const int i = kTransposed ? cc : r, j = kTransposed ? r : cc;
        const bool ok = i < q_limit && j < kv_limit && !(c.causal && j > i) &&
                        !(wl >= 0 && i - j > wl) && !(wr >= 0 && j - i > wr);
        if (!ok) s[e] = -INFINITY;
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < kN / 2; ++e) {
      const int64_t r = row0 + 8 * ((e >> 1) & 1), cc = col0 + 8 * (e >> 2) + (e & 1);
      const int64_t i = kTransposed ? cc : r, j = kTransposed ? r : cc;
      float x;
      if (c.plain) {
        x = s[e] * c.scale_log2;
      } else {
        x = s[e] * c.scale;
        if (c.softcap != 0.f) x = c.softcap * tanhf(x * c.inv_softcap);
        if (c.bias && i < c.t && j < c.s) x += c.bias[i * c.s + j];
        x *= kLog2e;
      }
      if (need_mask && !Allowed(c, i, j)) x = -INFINITY;
      s[e] = x;
    }
  }
}

// d logit / d (scale * q.k) at query i, key j: 1, or 1 - tanh^2 under the
// soft-cap. The backward recovers tanh from the probability it already holds
// (logit = log(p) + lse, minus the bias) rather than keeping every logit live
// in registers; where p underflows to 0 the gradient is 0 anyway.
template <bool kGeneral>
__device__ __forceinline__ float SoftcapGrad(const ScoreCtx& c, float p, float lse2, int64_t i,
                                             int64_t j) {
  if (!kGeneral || c.softcap == 0.f || p == 0.f) return 1.f;
  float x = (log2f(p) + lse2) * kLn2;
  if (c.bias && i < c.t && j < c.s) x -= c.bias[i * c.s + j];
  const float th = x * c.inv_softcap;
  return 1.f - th * th;
}

// Transposes a 4x4 matrix held by the four lanes of a quad, lane q holding
// row q in a[0..3]: afterwards lane q holds column q. Two exchange rounds; in
// round m an element whose lane and position differ in bit m moves to the
// partner lane (lane ^ m) and position (position ^ m).
__device__ __forceinline__ void QuadTranspose(uint32_t* a, int q) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    const bool hi = (q & m) != 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b & m) continue;  // pairs (b, b ^ m) with bit m of b clear
      const uint32_t send = hi ? a[b] : a[b ^ m];
      const uint32_t recv = __shfl_xor_sync(0xffffffff, send, m);
      if (hi)
        a[b] = recv;
      else
        a[b ^ m] = recv;
    }
  }
}

}  // namespace attention
}  // namespace jax_dnn
