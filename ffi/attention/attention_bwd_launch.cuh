// Host launcher of the backward kernels for one element type (instantiated per
// type in attention_bwd_<type>.cu).
#pragma once

#include <algorithm>
#include <cstdint>

#include "ffi/attention/attention_bwd.cuh"
#include "ffi/attention/attention_tma.h"
#include "ffi/common/device_info.h"

namespace jax_dnn {
namespace attention {

// The grid's last slices whose tiles a causal backward takes longest first
// (BwdGridTile): ceil(2 SMs / tiles), at most all of them.
inline unsigned CausalTail(const AttentionBwdParams& p, dim3 grid) {
  const uint64_t slices = uint64_t{grid.y} * grid.z;
  if (!p.mask.causal || grid.x * slices > UINT32_MAX) return 0;  // BwdGridTile's 32-bit tail index
  const uint64_t tail = (2 * static_cast<uint64_t>(SmCount()) + grid.x - 1) / grid.x;
  return static_cast<unsigned>(std::min(slices, tail));
}

template <typename Kernel>
cudaError_t Launch(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, const CUtensorMap& a,
                   const CUtensorMap& b, const CUtensorMap& c, const CUtensorMap& d,
                   const AttentionBwdParams& params) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  AttentionBwdParams p = params;
  p.tail_slices = CausalTail(p, grid);
  kernel<<<grid, 384, smem, stream>>>(a, b, c, d, p);
  return cudaGetLastError();
}

// The dK/dV kernel's tiles: kBQ queries (Q, dO) and 128 keys (K, V).
inline bool MakeDkvMaps(const AttentionBwdParams& p, int bq, CUtensorMap* tq, CUtensorMap* tdo,
                        CUtensorMap* tk, CUtensorMap* tv) {
  const AttentionShape& s = p.shape;
  return MakeTensorMap(tq, p.q, s.b, s.t, s.n, s.h, bq) &&
         MakeTensorMap(tdo, p.d_o, s.b, s.t, s.n, s.hv, bq) &&
         MakeTensorMap(tk, p.k, s.b, s.s, s.kh, s.h, 128) &&
         MakeTensorMap(tv, p.v, s.b, s.s, s.kh, s.hv, 128);
}

inline dim3 DkvGrid(const AttentionShape& s) {
  return dim3(static_cast<unsigned>((s.s + 127) / 128), s.kh, s.b);
}

template <typename T, int kD, int kDv, int kBQ, bool kGeneral>
cudaError_t LaunchDkv(const AttentionBwdParams& p, cudaStream_t stream) {
  CUtensorMap tq, tdo, tk, tv;
  if (!MakeDkvMaps(p, kBQ, &tq, &tdo, &tk, &tv)) return cudaErrorInvalidValue;
  const dim3 kv_grid = DkvGrid(p.shape);
  if constexpr (kD + kDv <= 256) {  // both accumulators fit in registers
    return Launch(AttentionDkvKernel<T, kD, kDv, kBQ, true, true, kGeneral>, kv_grid,
                  DkvTiles<kD, kDv, kBQ>::kSmem, stream, tq, tdo, tk, tv, p);
  } else {
    cudaError_t e = Launch(AttentionDkvKernel<T, kD, kDv, kBQ, true, false, kGeneral>, kv_grid,
                           DkvTiles<kD, kDv, kBQ, false, true, true>::kSmem, stream, tq, tdo, tk, tv, p);
    if (e != cudaSuccess) return e;
    // The dV launch loads no V (it needs only P^T), and in that room takes
    // kBQv queries a step: its S^T wgmmas are then twice as wide (the K
    // operand, re-read from shared memory every step, serves twice the
    // work), beside registers for dV, S^T and P^T only.
    constexpr int kBQv = 64;
    if (!MakeDkvMaps(p, kBQv, &tq, &tdo, &tk, &tv)) return cudaErrorInvalidValue;
    return Launch(AttentionDkvKernel<T, kD, kDv, kBQv, false, true, kGeneral>, kv_grid,
                  DkvTiles<kD, kDv, kBQv, false, false>::kSmem, stream, tq, tdo, tk, tv, p);
  }
}

template <typename T, int kD, int kDv, bool kGeneral>
cudaError_t LaunchBwdGeneral(const AttentionBwdParams& p, cudaStream_t stream) {
  const AttentionShape& s = p.shape;
  // StoreFragment writes dQ, dK and dV 16 bytes at a time (XLA's result
  // buffers are aligned far beyond that).
  if (!IsAligned(p.dq, 16) || !IsAligned(p.dk, 16) || !IsAligned(p.dv, 16))
    return cudaErrorMisalignedAddress;
  const int64_t rows = s.b * s.t * s.n;
  {
    const T* o = static_cast<const T*>(p.o);
    const T* d_o = static_cast<const T*>(p.d_o);
    auto blocks = [&](int lanes) { return static_cast<unsigned>((rows * lanes + 255) / 256); };
    if (s.hv % 8 == 0 && IsAligned(o, 16) && IsAligned(d_o, 16)) {
      if (s.hv <= 64)
        AttentionDeltaKernel<T, 8, 8><<<blocks(8), 256, 0, stream>>>(o, d_o, p.delta, rows, s.t, s.n, s.hv);
      else
        AttentionDeltaKernel<T, 16, 8><<<blocks(16), 256, 0, stream>>>(o, d_o, p.delta, rows, s.t, s.n, s.hv);
    } else {
      AttentionDeltaKernel<T, 32, 1><<<blocks(32), 256, 0, stream>>>(o, d_o, p.delta, rows, s.t, s.n, s.hv);
    }
  }
  if (p.dbias != nullptr) {
    cudaError_t e = cudaMemsetAsync(p.dbias, 0, sizeof(float) * s.b * s.n * s.t * s.s, stream);
    if (e != cudaSuccess) return e;
  }
  CUtensorMap tq, tdo, tk, tv;
  // Narrower tiles for head dims past 128 keep shared memory and registers in budget.
  constexpr bool kWide = std::max(kD, kDv) > 128;
  // Query tile of the dK/dV kernel: its S^T and dP^T fragments live beside
  // both fp32 accumulators, so it shrinks as they grow (and for the general
  // logits path, whose index and soft-cap work needs more registers). The
  // lean path at head dims up to 64 takes 128 queries: its S^T / dP^T
  // fragments then have the size they have at head dim 128 with 64 queries
  // (which fit), and each wgmma is twice as wide: 6% faster at S = 16384
  // (H200, B*S = 16384, D = 64, backward 16.25 -> 15.28 ms non-causal).
  // Past head dims 128 + 128 the lean dK launch (dK alone: 128 accumulator
  // registers at head dim 256) also takes 64 queries, so that its S^T and
  // dP^T wgmmas are m64n64 (each read of K and V from shared memory serves
  // twice the queries it did at 32); at 256 / 256 it then keeps one dO
  // buffer (DkvTiles).
  constexpr int kBQ = kD + kDv <= 128 && !kGeneral ? 128
                      : kD + kDv <= 128 || !kGeneral ? 64
                                                     : 32;

  if (p.dq_acc != nullptr) {  // the single pass (see AttentionDkvKernel's kDq)
    if constexpr ((kD == 64 || kD == 128) && kDv == kD && !kGeneral) {
      constexpr int kBQf = DqTileRows(kD);  // the fused dQ's query tile
      cudaError_t e = cudaMemsetAsync(p.dq_acc, 0, sizeof(float) * AttentionDqAccElements(s), stream);
      if (e != cudaSuccess) return e;
      if (!MakeDkvMaps(p, kBQf, &tq, &tdo, &tk, &tv)) return cudaErrorInvalidValue;
      e = Launch(AttentionDkvKernel<T, kD, kDv, kBQf, true, true, kGeneral, true>, DkvGrid(s),
                 DkvTiles<kD, kDv, kBQf, true>::kSmem, stream, tq, tdo, tk, tv, p);
      if (e != cudaSuccess) return e;
      const unsigned tiles = static_cast<unsigned>((s.t + kBQf - 1) / kBQf);
      AttentionDqConvertKernel<T, kD, kBQf><<<dim3(tiles, s.n, s.b), 256, 0, stream>>>(
          p.dq_acc, static_cast<T*>(p.dq), s.t, s.n, s.h);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;  // the handler checks AttentionFusedDqSupported first
    }
  }
  // Key tile of the dQ kernel: its S and dP fragments (kBNq / 2 floats each)
  // live beside the dQ accumulator (kD / 2), so the tile is as wide as the
  // register file allows: 128 keys at head dim 64 (lean logits path only;
  // the general path would spill), 64 up to 128, 32 beyond.
  constexpr int kBNq = kWide ? 32 : (kD <= 64 && kDv <= 64 && !kGeneral) ? 128 : 64;
  if (!MakeTensorMap(&tq, p.q, s.b, s.t, s.n, s.h, 128) ||
      !MakeTensorMap(&tdo, p.d_o, s.b, s.t, s.n, s.hv, 128) ||
      !MakeTensorMap(&tk, p.k, s.b, s.s, s.kh, s.h, kBNq) ||
      !MakeTensorMap(&tv, p.v, s.b, s.s, s.kh, s.hv, kBNq))
    return cudaErrorInvalidValue;
  const dim3 dq_grid(static_cast<unsigned>((s.t + 127) / 128), s.n, s.b);
  cudaError_t e = Launch(AttentionDqKernel<T, kD, kDv, kBNq, kGeneral>, dq_grid, DqTiles<kD, kDv, kBNq>::kSmem,
                         stream, tq, tdo, tk, tv, p);
  if (e != cudaSuccess) return e;

  return LaunchDkv<T, kD, kDv, kBQ, kGeneral>(p, stream);
}

template <typename T, int kD, int kDv>
cudaError_t LaunchBwdDims(const AttentionBwdParams& p, cudaStream_t stream) {
  return NeedsGeneral(OptionsOf(p.mask, p.scale, p.softcap)) ? LaunchBwdGeneral<T, kD, kDv, true>(p, stream)
                                                              : LaunchBwdGeneral<T, kD, kDv, false>(p, stream);
}

template <typename T>
cudaError_t LaunchBwdTyped(const AttentionBwdParams& p, cudaStream_t stream) {
  cudaError_t e = cudaErrorInvalidValue;
  DispatchHeadDims(p.shape.h, p.shape.hv, [&](auto d, auto dv) {
    e = LaunchBwdDims<T, decltype(d)::value, decltype(dv)::value>(p, stream);
  });
  return e;
}

}  // namespace attention
}  // namespace jax_dnn
