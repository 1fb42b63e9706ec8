// Host side: TMA tensor maps over the [B, seq, heads, head_dim] operands and
// the head-dim dispatch shared by the attention launchers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"

namespace jax_dnn {
namespace attention {

// A 4-D map (head_dim, heads, seq, batch) of a 16-bit [B, seq, heads, dim]
// array with boxes of 64 x 1 x `rows` x 1 in the 128-byte swizzle; elements
// past `dim` or `seq` read as zero. Returns false when the driver refuses.
bool MakeTensorMap(CUtensorMap* map, const void* data, int64_t batch, int64_t seq, int64_t heads,
                   int64_t dim, int rows);

// Head dims padded to the kernels' 64-column slabs.
inline int PadDim(int64_t h) { return static_cast<int>((h + 63) / 64 * 64); }

// Calls fn(std::integral_constant D, Dv) for the padded (D, Dv) pairs the
// kernels are built for; returns false for any other pair.
template <typename Fn>
bool DispatchHeadDims(int64_t h, int64_t hv, Fn&& fn) {
  const int d = PadDim(h), dv = PadDim(hv);
#define JAX_DNN_HEAD_DIMS(D, DV)                                                          \
  if (d == D && dv == DV) {                                                               \
    fn(std::integral_constant<int, D>{}, std::integral_constant<int, DV>{});              \
    return true;                                                                          \
  }
  JAX_DNN_HEAD_DIMS(64, 64)
  JAX_DNN_HEAD_DIMS(128, 128)
  JAX_DNN_HEAD_DIMS(192, 192)
  JAX_DNN_HEAD_DIMS(256, 256)
  JAX_DNN_HEAD_DIMS(192, 128)  // MLA-style
#undef JAX_DNN_HEAD_DIMS
  return false;
}

}  // namespace attention
}  // namespace jax_dnn
