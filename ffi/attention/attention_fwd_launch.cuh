// Host launcher of the forward kernel for one element type (instantiated per
// type in attention_fwd_<type>.cu so the two compile in parallel).
#pragma once

#include "ffi/attention/attention_fwd.cuh"
#include "ffi/attention/attention_fwd_combine.cuh"
#include "ffi/attention/attention_tma.h"
#include "ffi/common/device_info.h"

namespace jax_dnn {
namespace attention {

template <typename T, int kD, int kDv, int kBN, bool kGeneral>
cudaError_t LaunchFwdTiles(const AttentionFwdParams& p, cudaStream_t stream) {
  using Tiles = FwdTiles<kD, kDv, kBN>;
  const AttentionShape& s = p.shape;
  CUtensorMap tq, tk, tv;
  if (!MakeTensorMap(&tq, p.q, s.b, s.t, s.n, s.h, Tiles::kBM / 2) ||  // a consumer's half
      !MakeTensorMap(&tk, p.k, s.b, s.s, s.kh, s.h, kBN) ||
      !MakeTensorMap(&tv, p.v, s.b, s.s, s.kh, s.hv, kBN))
    return cudaErrorInvalidValue;
  // A grid of every tile when they fit on the device at once (one CTA an SM:
  // shared memory and registers); otherwise a persistent grid (one CTA an
  // SM): with a split tail (FwdSchedule) on the lean path where every tile
  // has the same keys and the workspace is there, else over pairs of tiles
  // (FwdWorkAt).
  const long long m_tiles = (s.t + Tiles::kBM - 1) / Tiles::kBM, sms = SmCount();
  const long long tiles = m_tiles * s.n * s.b, key_tiles = (s.s + kBN - 1) / kBN;
  if (tiles > INT32_MAX / 2) return cudaErrorInvalidValue;  // the kernel's 32-bit tile indices
  FwdSchedule sched{};
  // The split's fixed costs (a piece's pipeline start, the combine: 9 us at
  // D = 128, 18 at 256) beat what it saves below 32 key tiles a work tile or
  // at Hv = 256 (fwd_trace, H200: 1.5% slower at D = 128, S = 2048 and 0.5%
  // at D = 256, S = 4096; 1.5-3.5% faster at D = 128, S >= 4096 and at
  // D = 64, S = 8192).
  const bool split = !kGeneral && kDv <= 128 && key_tiles >= 32 && tiles > sms && tiles % sms != 0 &&
                     FwdUniformKeys(p.mask) &&
                     p.ws != nullptr && p.ws_elems >= 2 * sms * Tiles::kBM * (kDv + 1) &&
                     (tiles % sms) * key_tiles * sms < INT32_MAX &&  // FwdSplit's 32-bit ranges
                     sms <= kFwdCombineMaxCtas;
  if (split) {
    sched.units = static_cast<int>(tiles);
    sched.rounds = static_cast<int>(tiles / sms);
    sched.split_tiles = static_cast<int>(tiles % sms);
    sched.key_tiles = static_cast<int>(key_tiles);
    sched.ws = p.ws;
  } else {
    sched.pairs = tiles > sms;
    sched.units = static_cast<int>(FwdUnits(m_tiles, s.n, s.b, sched.pairs));
  }
  const unsigned grid = static_cast<unsigned>(sched.units < sms ? sched.units : sms);
  auto launch = [&](auto kernel) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tiles::kSmem);
    if (e != cudaSuccess) return e;
    kernel<<<grid, 384, Tiles::kSmem, stream>>>(tq, tk, tv, p, sched);
    return cudaGetLastError();
  };
  if constexpr (!kGeneral) {
    if (split) {
      cudaError_t e = launch(AttentionFwdKernel<T, kD, kDv, kBN, false, true>);
      if (e != cudaSuccess) return e;
      AttentionFwdCombineKernel<T, kDv>
          <<<dim3(sched.split_tiles, Tiles::kBM / kFwdCombineRows), kFwdCombineRows * kDv / 8, 0, stream>>>(
              p, sched, static_cast<int>(grid));
      return cudaGetLastError();
    }
  }
  return launch(AttentionFwdKernel<T, kD, kDv, kBN, kGeneral, false>);
}

template <typename T, int kD, int kDv>
cudaError_t LaunchFwdDims(const AttentionFwdParams& p, cudaStream_t stream) {
  if constexpr (kD <= 128 && kDv <= 128) {
    if (FwdNeedsGeneral(p.mask, p.softcap, p.scale)) return LaunchFwdTiles<T, kD, kDv, 128, true>(p, stream);
    // 176-key tiles (FwdTiles) only where rows see every key of a long
    // sequence; 128 keys otherwise. With a causal mask or a window, 128 keys
    // match the 128-row tiles and waste less at the diagonal. Without one,
    // an A/B on H200 (2026-11-22, B*S = 16384, non-causal, ratio to cuDNN,
    // 128 -> 176 keys) favoured 128 up to S = 4096 (D = 128: 0.99 -> 0.78 at
    // S = 512, 0.99 -> 0.92 at 2048, 0.97 -> 0.96 at 4096; D = 64: 0.95 ->
    // 0.64 at 512) and 176 beyond (D = 128: 0.95 -> 0.97 at 8192, 0.98 ->
    // 1.00 at 16384; D = 64: 0.92 -> 0.95, 0.95 -> 0.97).
    const bool banded = p.mask.causal || p.mask.window_left >= 0 || p.mask.window_right >= 0;
    return banded || p.shape.s <= 4096 ? LaunchFwdTiles<T, kD, kDv, 128, false>(p, stream)
                                       : LaunchFwdTiles<T, kD, kDv, 176, false>(p, stream);
  } else {
    // 64-key tiles keep Q, two K and two V stages within shared memory.
    return FwdNeedsGeneral(p.mask, p.softcap, p.scale) ? LaunchFwdTiles<T, kD, kDv, 64, true>(p, stream)
                                                       : LaunchFwdTiles<T, kD, kDv, 64, false>(p, stream);
  }
}

template <typename T>
cudaError_t LaunchFwdTyped(const AttentionFwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  DispatchHeadDims(p.shape.h, p.shape.hv, [&](auto d, auto dv) {
    e = LaunchFwdDims<T, decltype(d)::value, decltype(dv)::value>(p, stream);
  });
  return e;
}

}  // namespace attention
}  // namespace jax_dnn
