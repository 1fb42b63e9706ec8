// Host launcher of the forward kernel for one element type (instantiated per
// type in attention_fwd_<type>.cu so the two compile in parallel).
#pragma once

#include "ffi/attention/attention_fwd.cuh"
#include "ffi/attention/attention_tma.h"

namespace jax_dnn {
namespace attention {

template <typename T, int kD, int kDv>
cudaError_t LaunchFwdDims(const AttentionFwdParams& p, cudaStream_t stream) {
  // 128-key tiles while Q, two K and two V stages fit in shared memory.
  constexpr int kBN = (kD <= 128 && kDv <= 128) ? 128 : 64;
  using Tiles = FwdTiles<kD, kDv, kBN>;
  const AttentionShape& s = p.shape;
  CUtensorMap tq, tk, tv;
  if (!MakeTensorMap(&tq, p.q, s.b, s.t, s.n, s.h, Tiles::kBM) ||
      !MakeTensorMap(&tk, p.k, s.b, s.s, s.kh, s.h, kBN) ||
      !MakeTensorMap(&tv, p.v, s.b, s.s, s.kh, s.hv, kBN))
    return cudaErrorInvalidValue;
  auto kernel = NeedsGeneral(p.mask, p.softcap) ? AttentionFwdKernel<T, kD, kDv, kBN, true>
                                                : AttentionFwdKernel<T, kD, kDv, kBN, false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tiles::kSmem);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((s.t + Tiles::kBM - 1) / Tiles::kBM), s.n, s.b);
  kernel<<<grid, 384, Tiles::kSmem, stream>>>(tq, tk, tv, p);
  return cudaGetLastError();
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
