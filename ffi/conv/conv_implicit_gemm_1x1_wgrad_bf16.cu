// The 1x1 convolution's weight gradient as a split-K GEMM with a fixed-order
// reduction, bfloat16 (conv_implicit_gemm_1x1.cuh). One kernel a translation unit.
#include "ffi/conv/conv_implicit_gemm.h"
#include "ffi/conv/conv_implicit_gemm_1x1.cuh"

namespace jax_dnn {

cudaError_t ConvGemm1x1WgradBf16(const ConvShape& shape, const ConvArgs& args, int sm_count,
                                 cudaStream_t stream, std::string* declined) {
  return conv_igemm::Run1x1Wgrad<__nv_bfloat16>(shape, args, sm_count, stream, declined);
}

}  // namespace jax_dnn
