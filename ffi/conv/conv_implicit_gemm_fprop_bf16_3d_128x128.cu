// The implicit-GEMM convolution's forward: bfloat16, 3D kernel,
// 128 x 128 CTA tile (conv_implicit_gemm.cuh). One kernel a translation unit.
#include "ffi/conv/conv_implicit_gemm.cuh"
#include "ffi/conv/conv_implicit_gemm.h"

namespace jax_dnn {

cudaError_t ConvIgemmFpropBf16Dims3Tile128x128(const ConvShape& shape, const ConvArgs& args,
                                               int sm_count, cudaStream_t stream,
                                               std::string* declined) {
  return conv_igemm::Run<cutlass::conv::Operator::kFprop, __nv_bfloat16, 3, 128>(
      shape, args, sm_count, stream, declined);
}

}  // namespace jax_dnn
