// The convolution's algorithm registry and heuristic (conv_plan.cc). Host-only
// plain C++, built in CPU-only builds too: the handlers (conv_ffi.cc) and
// Python (jax_dnn/_src/plans.py, through ffi/registrations.cc) ask the same
// functions, so a rule is stated once.
//
// Shapes and layouts as in conv.h. An algorithm is a way to run one op; each
// declares, for a problem, whether it takes it (and why not), its workspace and
// whether it is bitwise reproducible. Algorithms:
//   implicit_gemm_128x128, implicit_gemm_128x64: CUTLASS's sm90 implicit GEMM
//     (TMA im2col loads feeding warp-specialized wgmma, conv_implicit_gemm.cuh)
//     with a 128 x 128 or 128 x 64 CTA tile (GEMM M x N; see kConvIgemmKernels
//     for which op, dtype and rank each is built for). Deterministic: every
//     output element is reduced by one CTA in a fixed order.
//   gemm_1x1: a 1x1 convolution (window 1, stride 1, no padding) as a plain
//     GEMM (conv_implicit_gemm_1x1.cuh): fprop and dgrad on CUTLASS's
//     persistent ping-pong schedule, wgrad split over its reduction
//     (ConvGemm1x1WgradSplits) with a fixed-order reduction of the splits.
//     Deterministic.
//   depthwise_direct: the direct depthwise kernels (conv_depthwise.h); its
//     rules and workspace are ConvDepthwiseSupports / ConvDepthwiseWorkspaceBytes.
//     The shared-memory tiled kernel (conv_direct.h) runs what it takes
//     (ConvDepthwiseTiled: fprop, stride-1 dgrad, wgrad of 1D/2D windows 3,
//     5 or 7 wide), the other direct kernels the rest.
//   grouped_direct: grouped convolutions with few channels a group
//     (2 <= C / groups <= kConvGroupedMaxChannels) on the tiled direct kernel:
//     fprop, stride-1 dgrad and wgrad (1D/2D windows); rules and workspace
//     ConvGroupedSupports / ConvGroupedWorkspaceBytes (conv_direct_plan.h).
//     Deterministic (every output summed by one thread in a fixed order;
//     wgrad's per-block partials reduced in a fixed order).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"
#include "ffi/conv/conv.h"

namespace jax_dnn {

// Algorithm ids: the FFI attribute `algo`. Stable numbers (a benchmark cache
// on disk stores them); new algorithms take new ids.
enum ConvAlgorithmId : int {
  kConvNoAlgorithm = -1,
  kConvImplicitGemm128x128 = 0,
  kConvImplicitGemm128x64 = 1,
  kConvDepthwiseDirect = 2,
  kConvGemm1x1 = 3,
  kConvGroupedDirect = 4,
};

// One built implicit-GEMM kernel (one CUDA translation unit each,
// conv_implicit_gemm_<op>_<dtype>_<dims>d_<tile>.cu, or
// conv_implicit_gemm_1x1_<op>_<dtype>.cu). `dims` is the kernel's spatial
// rank: 2 serves rank 1 and 2 problems (1D as H = 1), 3 serves rank 3, 0
// (gemm_1x1) every rank.
// float32 runs on TF32 tensor cores with a 32-deep K tile; TF32 wgmma reads
// both operands K-major, which only fprop's are (dgrad reads the filter and
// wgrad both operands MN-major), so float32 has fprop alone.
struct ConvIgemmKernel {
  ConvOp op;
  DType dtype;
  int dims;
  int algorithm;  // kConvImplicitGemm128x128, kConvImplicitGemm128x64 or kConvGemm1x1
};

// Seventeen kernels keep the CUDA build within CI's limits (each takes 30-60 s
// to compile): bf16 and fp16 2D first, then bf16 3D, then TF32 2D fprop, and
// the bf16 1x1 GEMM (ResNet's bottlenecks are two-thirds 1x1). The 128 x 64
// tile where it measured faster: GEMM N = 64 (fprop's K, dgrad's C), 229 vs
// 161 TFLOP/s at 56^2 3x3 C = K = 64 (H200).
inline constexpr ConvIgemmKernel kConvIgemmKernels[] = {
    {ConvOp::kFprop, DType::kBF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kFprop, DType::kBF16, 2, kConvImplicitGemm128x64},
    {ConvOp::kFprop, DType::kF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kFprop, DType::kF16, 2, kConvImplicitGemm128x64},
    {ConvOp::kFprop, DType::kBF16, 3, kConvImplicitGemm128x128},
    {ConvOp::kFprop, DType::kF32, 2, kConvImplicitGemm128x128},
    {ConvOp::kDgrad, DType::kBF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kDgrad, DType::kBF16, 2, kConvImplicitGemm128x64},
    {ConvOp::kDgrad, DType::kF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kDgrad, DType::kF16, 2, kConvImplicitGemm128x64},
    {ConvOp::kDgrad, DType::kBF16, 3, kConvImplicitGemm128x128},
    {ConvOp::kWgrad, DType::kBF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kWgrad, DType::kF16, 2, kConvImplicitGemm128x128},
    {ConvOp::kWgrad, DType::kBF16, 3, kConvImplicitGemm128x128},
    {ConvOp::kFprop, DType::kBF16, 0, kConvGemm1x1},
    {ConvOp::kDgrad, DType::kBF16, 0, kConvGemm1x1},
    {ConvOp::kWgrad, DType::kBF16, 0, kConvGemm1x1},
};

// gemm_1x1's wgrad (dw[K, C] = dy^T . x, reduced over M = N*D*H*W pixels)
// splits its reduction so that its 128 x 128 output tiles times the splits
// fill the device's SMs (132 assumed where no device is known), each split
// at least 8 K tiles (512 pixels) long, at most 32 splits.
int64_t ConvGemm1x1WgradSplits(const ConvShape& shape, const DeviceProps& device);
// Its workspace for `splits`: CUTLASS's split-K reduction keeps an fp32
// 128 x 128 tile and a barrier word a warp group for every output tile
// (0 bytes for one split). An upper bound of CUTLASS's own figure (its
// allocations round to the L2 line); the launcher checks the exact one.
int64_t ConvGemm1x1WgradWorkspaceBytes(const ConvShape& shape, int64_t splits);

// The kernel spatial rank a problem of caller rank `rank` runs on.
constexpr int ConvKernelDims(int rank) { return rank == 3 ? 3 : 2; }

// One problem as the plans see it: the op, its element type, its shape and,
// for fprop, the fused epilogue it asks for.
struct ConvProblem {
  ConvOp op = ConvOp::kFprop;
  DType dtype = DType::kBF16;
  ConvShape shape;
  int activation = kConvNoActivation;  // fprop: bias_act's id, -1 none
  bool bias = false;
  bool residual = false;
};

// One algorithm's answer for one problem.
struct ConvAlgorithm {
  int id = kConvNoAlgorithm;
  std::string name;
  bool supported = false;
  std::string reason;  // why not (one line), empty when supported
  int64_t workspace_bytes = 0;
  bool deterministic = false;
};

// Why `shape` is not a well-formed problem of rank shape.rank (a sentence), or
// the empty string: positive extents, channels divisible by groups, output
// extents as the convolution's formula gives them
// (O = (D + pad_lo + pad_hi - (T - 1) * dilation - 1) / stride + 1), extent-1
// unused leading axes, non-negative padding.
std::string ConvShapeError(const ConvShape& shape);

// Every registered algorithm for the problem's op, each saying whether it takes
// the problem (on `device`) and why not.
std::vector<ConvAlgorithm> ConvAlgorithms(const ConvProblem& problem, const DeviceProps& device);

// Algorithm `id`'s answer for the problem (unsupported with a reason for an
// unknown id): what the handler checks a call against.
ConvAlgorithm ConvAlgorithmFor(int id, const ConvProblem& problem, const DeviceProps& device);

// The heuristic's choice, instantly:
//   - depthwise_direct where it takes the problem (groups == C > 1), and
//     grouped_direct likewise, when deterministic or where the switch
//     kConvDirectByDefault (conv_plan.cc) is on; else declined (XLA runs them);
//   - gemm_1x1 where it takes the problem (fprop, dgrad and wgrad);
//   - fprop and dgrad: implicit_gemm_128x64 where the GEMM's N (fprop's K,
//     dgrad's C) is at most 64 and it is built, else implicit_gemm_128x128;
//   - wgrad otherwise: implicit_gemm_128x128 only where its GEMM (M = K, N = T*R*S*C,
//     reduced over N*O*P*Q) has at least as many 128 x 128 output tiles as
//     the device has SMs (132 assumed where no device is known). CUTLASS's
//     sm90 conv has no split-K: each CTA reduces the whole N*O*P*Q, so with
//     fewer tiles than SMs the kernel reaches at most tiles / SMs of the
//     device's rate (a ResNet-50 3x3 64->64 wgrad has 1 x 5 tiles: 5 CTAs on
//     132 SMs, each reducing 0.4M products an output), far below XLA's. Under
//     `deterministic` the rule is waived: it is the bitwise-reproducible choice.
// `deterministic` restricts the choice to deterministic algorithms. When none
// takes the problem: supported = false, id = -1, and the reason lists why.
ConvAlgorithm ConvPlan(const ConvProblem& problem, bool deterministic, const DeviceProps& device);

}  // namespace jax_dnn
