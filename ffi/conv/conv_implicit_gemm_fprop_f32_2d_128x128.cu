// The implicit-GEMM convolution's forward: float32 on TF32 tensor cores, 2D kernel,
// 128 x 128 CTA tile (conv_implicit_gemm.cuh). One kernel a translation unit.
#include "ffi/conv/conv_implicit_gemm.cuh"
#include "ffi/conv/conv_implicit_gemm.h"

namespace jax_dnn {

cudaError_t ConvIgemmFpropF32Dims2Tile128x128(const ConvShape& shape, const ConvArgs& args,
                                              int sm_count, cudaStream_t stream,
                                              std::string* declined) {
  return conv_igemm::Run<cutlass::conv::Operator::kFprop, float, 2, 128>(
      shape, args, sm_count, stream, declined);
}

}  // namespace jax_dnn
