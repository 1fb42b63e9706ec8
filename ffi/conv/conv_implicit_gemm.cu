// The implicit-GEMM convolution's launcher: finds the kernel built for a
// call's op, dtype, rank and tile (kConvIgemmKernels, conv_plan.h) and runs it.
// Built without the kernels where CMake found no CUTLASS headers
// (JAX_DNN_CONV_IGEMM_NOT_BUILT; the plans then decline every call).
#include <string>

#include "ffi/conv/conv_implicit_gemm.h"
#include "ffi/conv/conv_plan.h"

namespace jax_dnn {

#ifndef JAX_DNN_CONV_IGEMM_NOT_BUILT
namespace {

struct IgemmEntry {
  ConvIgemmKernel kernel;
  ConvIgemmLaunch launch;
};

// One entry a kernel of kConvIgemmKernels, in its order.
constexpr IgemmEntry kIgemmEntries[] = {
    {kConvIgemmKernels[0], ConvIgemmFpropBf16Dims2Tile128x128},
    {kConvIgemmKernels[1], ConvIgemmFpropBf16Dims2Tile128x64},
    {kConvIgemmKernels[2], ConvIgemmFpropF16Dims2Tile128x128},
    {kConvIgemmKernels[3], ConvIgemmFpropF16Dims2Tile128x64},
    {kConvIgemmKernels[4], ConvIgemmFpropBf16Dims3Tile128x128},
    {kConvIgemmKernels[5], ConvIgemmFpropF32Dims2Tile128x128},
    {kConvIgemmKernels[6], ConvIgemmDgradBf16Dims2Tile128x128},
    {kConvIgemmKernels[7], ConvIgemmDgradBf16Dims2Tile128x64},
    {kConvIgemmKernels[8], ConvIgemmDgradF16Dims2Tile128x128},
    {kConvIgemmKernels[9], ConvIgemmDgradF16Dims2Tile128x64},
    {kConvIgemmKernels[10], ConvIgemmDgradBf16Dims3Tile128x128},
    {kConvIgemmKernels[11], ConvIgemmWgradBf16Dims2Tile128x128},
    {kConvIgemmKernels[12], ConvIgemmWgradF16Dims2Tile128x128},
    {kConvIgemmKernels[13], ConvIgemmWgradBf16Dims3Tile128x128},
    {kConvIgemmKernels[14], ConvGemm1x1FpropBf16},
    {kConvIgemmKernels[15], ConvGemm1x1DgradBf16},
    {kConvIgemmKernels[16], ConvGemm1x1WgradBf16},
};
static_assert(sizeof(kIgemmEntries) / sizeof(kIgemmEntries[0]) ==
                  sizeof(kConvIgemmKernels) / sizeof(kConvIgemmKernels[0]),
              "one launcher a built kernel");

}  // namespace

cudaError_t LaunchConvImplicitGemm(ConvOp op, int algorithm, const ConvShape& shape,
                                   const ConvArgs& args, int sm_count, cudaStream_t stream,
                                   std::string* declined) {
  const int dims = ConvKernelDims(shape.rank);
  for (const IgemmEntry& e : kIgemmEntries) {
    const ConvIgemmKernel& k = e.kernel;
    if (k.op == op && k.dtype == args.dtype && (k.dims == 0 || k.dims == dims) &&
        k.algorithm == algorithm)
      return e.launch(shape, args, sm_count, stream, declined);
  }
  *declined = "no implicit-GEMM kernel is built for this op, dtype, rank and tile";
  return cudaErrorNotSupported;
}

#else

cudaError_t LaunchConvImplicitGemm(ConvOp, int, const ConvShape&, const ConvArgs&, int,
                                   cudaStream_t, std::string* declined) {
  *declined = "the implicit-GEMM kernels are not built (no CUTLASS headers at build time)";
  return cudaErrorNotSupported;
}

#endif  // JAX_DNN_CONV_IGEMM_NOT_BUILT

}  // namespace jax_dnn
