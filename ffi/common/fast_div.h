// Division of a non-negative 64-bit index by a divisor fixed at launch, as a
// multiply-high, an add and a shift (Granlund and Montgomery, "Division by
// invariant integers using multiplication", 1994). A 64-bit `/` on the GPU is
// a subroutine of tens of instructions; the elementwise kernels split every
// 16-byte vector's flat index into (row, column) to find its bias.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dnn {

struct FastDiv {
  uint64_t divisor = 1;
  uint64_t mul = 1;  // floor(2^64 (2^shift - divisor) / divisor) + 1
  uint32_t shift = 0;  // ceil(log2(divisor))

  FastDiv() = default;
  // divisor >= 1.
  __host__ explicit FastDiv(uint64_t d) : divisor(d) {
    while ((uint64_t{1} << shift) < d) ++shift;
    const unsigned __int128 num = (static_cast<unsigned __int128>(1) << 64) *
                                  ((static_cast<unsigned __int128>(1) << shift) - d);
    mul = static_cast<uint64_t>(num / d + 1);
  }

  // n / divisor for 0 <= n < 2^63 (so that the sum below cannot wrap).
  __device__ __forceinline__ uint64_t Div(uint64_t n) const {
    return (__umul64hi(n, mul) + n) >> shift;
  }
};

}  // namespace jax_dnn
