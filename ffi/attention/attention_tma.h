// Host side: TMA tensor maps over the [B, seq, heads, head_dim] operands and
// the head-dim dispatch shared by the attention launchers.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ffi/attention/attention_plan.h"

namespace jax_dnn {
namespace attention {

// A 4-D map (head_dim, heads, seq, batch) of a 16-bit [B, seq, heads, dim]
// array with boxes of 64 x 1 x `rows` x 1 in the 128-byte swizzle; elements
// past `dim` or `seq` read as zero. Returns false when the driver refuses.
bool MakeTensorMap(CUtensorMap* map, const void* data, int64_t batch, int64_t seq, int64_t heads,
                   int64_t dim, int rows);

// Calls fn(std::integral_constant D, Dv) for the padded (D, Dv) pair of
// kHeadDims (attention_plan.h) that (h, hv) pad to; returns false for any
// other pair.
template <size_t kIndex = 0, typename Fn>
bool DispatchHeadDims(int64_t h, int64_t hv, Fn&& fn) {
  if constexpr (kIndex == kNumHeadDims) {
    return false;
  } else {
    constexpr HeadDims kDims = kHeadDims[kIndex];
    if (PadDim(h) == kDims.d && PadDim(hv) == kDims.dv) {
      fn(std::integral_constant<int, kDims.d>{}, std::integral_constant<int, kDims.dv>{});
      return true;
    }
    return DispatchHeadDims<kIndex + 1>(h, hv, fn);
  }
}

}  // namespace attention
}  // namespace jax_dnn
