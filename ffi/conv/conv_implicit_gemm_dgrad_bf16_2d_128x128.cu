// The implicit-GEMM convolution's data gradient: bfloat16, 2D kernel,
// 128 x 128 CTA tile (conv_implicit_gemm.cuh). One kernel a translation unit.
#include "ffi/conv/conv_implicit_gemm.cuh"
#include "ffi/conv/conv_implicit_gemm.h"

namespace jax_dnn {

cudaError_t ConvIgemmDgradBf16Dims2Tile128x128(const ConvShape& shape, const ConvArgs& args,
                                               int sm_count, cudaStream_t stream,
                                               std::string* declined) {
  return conv_igemm::Run<cutlass::conv::Operator::kDgrad, __nv_bfloat16, 2, 128>(
      shape, args, sm_count, stream, declined);
}

}  // namespace jax_dnn
