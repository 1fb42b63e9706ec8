// The 1x1 convolution's data gradient as a persistent ping-pong GEMM, bfloat16
// (conv_implicit_gemm_1x1.cuh). One kernel a translation unit.
#include "ffi/conv/conv_implicit_gemm.h"
#include "ffi/conv/conv_implicit_gemm_1x1.cuh"

namespace jax_dnn {

cudaError_t ConvGemm1x1DgradBf16(const ConvShape& shape, const ConvArgs& args, int sm_count,
                                 cudaStream_t stream, std::string* declined) {
  return conv_igemm::Run1x1<cutlass::conv::Operator::kDgrad, __nv_bfloat16>(shape, args, sm_count,
                                                                         stream, declined);
}

}  // namespace jax_dnn
