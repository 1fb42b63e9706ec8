// The implicit-GEMM convolution kernels (CUTLASS's sm90 conv: TMA im2col
// loads feeding warp-specialized wgmma; conv_implicit_gemm.cuh), one per
// entry of kConvIgemmKernels (conv_plan.h), each in its own translation unit
// conv_implicit_gemm_<op>_<dtype>_<dims>d_<tile>.cu so that a parallel build
// compiles them side by side. No XLA types here.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ffi/conv/conv.h"

namespace jax_dnn {

// Runs `op` on `shape` with implicit-GEMM algorithm `algorithm`
// (kConvImplicitGemm128x128, kConvImplicitGemm128x64 or kConvGemm1x1) on `stream`, with the
// pointers of `args` that `op` uses (conv.h) and `args.workspace`. `sm_count`
// is the device's (CUTLASS's KernelHardwareInfo). The caller checked the
// plan's rules (ConvAlgorithmFor). Returns cudaErrorNotSupported with the
// reason in *declined where no kernel is built for the call or CUTLASS's
// can_implement declines it; another error where a launch failed.
cudaError_t LaunchConvImplicitGemm(ConvOp op, int algorithm, const ConvShape& shape,
                                   const ConvArgs& args, int sm_count, cudaStream_t stream,
                                   std::string* declined);

// The kernels, by op, dtype, kernel rank and CTA tile (M x N); the 1x1 GEMMs.
using ConvIgemmLaunch = cudaError_t (*)(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                        std::string*);
cudaError_t ConvIgemmFpropBf16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvIgemmFpropBf16Dims2Tile128x64(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmFpropF16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmFpropF16Dims2Tile128x64(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                             std::string*);
cudaError_t ConvIgemmFpropBf16Dims3Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvIgemmFpropF32Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmDgradBf16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvIgemmDgradBf16Dims2Tile128x64(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmDgradF16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmDgradF16Dims2Tile128x64(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                             std::string*);
cudaError_t ConvIgemmDgradBf16Dims3Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvIgemmWgradBf16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvIgemmWgradF16Dims2Tile128x128(const ConvShape&, const ConvArgs&, int,
                                              cudaStream_t, std::string*);
cudaError_t ConvIgemmWgradBf16Dims3Tile128x128(const ConvShape&, const ConvArgs&, int,
                                               cudaStream_t, std::string*);
cudaError_t ConvGemm1x1FpropBf16(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                 std::string*);
cudaError_t ConvGemm1x1DgradBf16(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                 std::string*);
cudaError_t ConvGemm1x1WgradBf16(const ConvShape&, const ConvArgs&, int, cudaStream_t,
                                 std::string*);

}  // namespace jax_dnn
