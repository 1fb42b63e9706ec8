// The implicit-GEMM convolution on CUTLASS's sm90 conv (ConvUniversal over
// the collective builders): TMA loads in im2col mode feed a warp-specialized
// wgmma mainloop (one producer warp group, one consumer warp group; CUTLASS's
// sm90 conv has no persistent or split-K schedule), fp32 accumulation, a TMA
// epilogue. Included by one conv_implicit_gemm_*.cu per kernel.
//
// The GEMM each op runs (CUTLASS's conv/detail.hpp), for x [N, D, H, W, C],
// w [K, T, R, S, C], y [N, O, P, Q, K]:
//   fprop  M = N*O*P*Q   N = K   reduced over T*R*S*C   A = x (im2col), B = w
//   dgrad  M = N*D*H*W   N = C   reduced over K*T*R*S   A = dy (im2col), B = w
//   wgrad  M = K         N = T*R*S*C   reduced over N*O*P*Q   A = dy, B = x (im2col)
// Fprop's epilogue is one fused pass over the accumulators:
//   y = max(acc + bias[k] + beta * residual, floor)
// with beta 1 where a residual is given (0: C is never read) and floor -inf
// (no activation) or 0 (ReLU), so one kernel serves both activations. The
// bias is a broadcast row that may be null (then 0).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <string>

// CUTLASS's headers in the order its own conv code includes them (the
// collective builders assume the kernel headers came first).
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "ffi/conv/conv.h"

namespace jax_dnn {
namespace conv_igemm {

// The fused activation as a clamp from below with a runtime floor: -inf is
// the identity, 0 is ReLU. A NaN stays NaN (NaN < floor is false), as
// jax.nn.relu's max(x, 0) keeps it.
template <class T>
struct FloorActivation {
  struct Arguments {
    T floor = -INFINITY;
  };
  CUTLASS_HOST_DEVICE T operator()(T const& v, Arguments const& args) const {
    return v < args.floor ? args.floor : v;
  }
};

template <class T, int N>
struct FloorActivation<cutlass::Array<T, N>> {
  using Arguments = typename FloorActivation<T>::Arguments;
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v,
                                                      Arguments const& args) const {
    cutlass::Array<T, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = v[i] < args.floor ? args.floor : v[i];
    return y;
  }
};

template <class T>
struct CutlassElement {
  using type = T;
};
template <>
struct CutlassElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<__half> {
  using type = cutlass::half_t;
};

// One kernel: op, element type (bf16, fp16, or float run as TF32), spatial
// rank of the kernel (2 or 3) and CTA tile N (128 or 64; M is 128). The K
// tile is 128 bytes of channels (64 16-bit, 32 float): one 128-byte swizzle row.
template <cutlass::conv::Operator kOp, class Element, int kDims, int kTileN>
struct ConvIgemm {
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows
  static constexpr int kTileK = 128 / static_cast<int>(sizeof(Element));
  // The K mode is a nested shape for every conv op, and wgrad's N too
  // (CUTLASS's conv3x_emitter.py).
  using TileN = cute::conditional_t<kOp == cutlass::conv::Operator::kWgrad,
                                    cute::Shape<cute::Int<kTileN>>, cute::Int<kTileN>>;
  using Tile = cute::Shape<cute::_128, TileN, cute::Shape<cute::Int<kTileK>>>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using LayoutAct =
      cute::conditional_t<kDims == 2, cutlass::layout::TensorNHWC, cutlass::layout::TensorNDHWC>;
  // The output's layout: activations for fprop/dgrad, the filter for wgrad.
  using LayoutOut = cute::conditional_t<
      kOp != cutlass::conv::Operator::kWgrad, LayoutAct,
      cute::conditional_t<kDims == 2, cutlass::layout::TensorKCSR, cutlass::layout::TensorKCSRT>>;
  using Fusion = cute::conditional_t<
      kOp == cutlass::conv::Operator::kFprop,
      cutlass::epilogue::fusion::LinCombPerColBiasEltAct<FloorActivation, Element, float, Element,
                                                         Element, float>,
      cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutOut, kAlign,
      Element, LayoutOut, kAlign, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kOp, Element, LayoutAct, kAlign,
      Element, LayoutAct, kAlign, float, Tile, Cluster,
      cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;
  using ProblemShape = cutlass::conv::ConvProblemShape<kOp, kDims>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, Mainloop, Epilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};

// CUTLASS's problem for `s` on a kernel of rank kDims: the trailing kDims
// spatial axes of conv.h's (D, H, W) arrays (a rank-1 problem has H = 1).
template <class ProblemShape>
ProblemShape MakeProblem(const ConvShape& s) {
  constexpr int kDims = ProblemShape::RankS;
  typename ProblemShape::TensorExtent act{}, flt{};
  typename ProblemShape::SpatialExtent pad_lo{}, pad_hi{}, stride{}, dilation{};
  act[0] = static_cast<int>(s.n);
  flt[0] = static_cast<int>(s.k);
  for (int i = 0; i < kDims; ++i) {
    const int axis = 3 - kDims + i;
    act[1 + i] = static_cast<int>(s.input[axis]);
    flt[1 + i] = static_cast<int>(s.window[axis]);
    pad_lo[i] = static_cast<int>(s.pad_lo[axis]);
    pad_hi[i] = static_cast<int>(s.pad_hi[axis]);
    stride[i] = static_cast<int>(s.stride[axis]);
    dilation[i] = static_cast<int>(s.dilation[axis]);
  }
  act[kDims + 1] = static_cast<int>(s.c);
  flt[kDims + 1] = static_cast<int>(s.c);
  return ProblemShape(cutlass::conv::Mode::kCrossCorrelation, act, flt, pad_lo, pad_hi, stride,
                      dilation, /*groups=*/1);
}

// The epilogue's stride of the output (C and D) from CUTLASS's packed
// strides: fprop/dgrad activations ((Q, P, [Z,] N), K, 0), reversed from
// [N, [Z,] P, Q, K]; wgrad's filter (K, (1, S, R[, T]), 0), which
// make_cute_packed_stride builds.
template <class Stride, class ProblemShape>
Stride OutputStride(const ProblemShape& problem) {
  if constexpr (ProblemShape::ConvOp == cutlass::conv::Operator::kWgrad) {
    return cutlass::make_cute_packed_stride(Stride{}, problem.shape_C, problem.stride_C,
                                            ProblemShape::ConvOp);
  } else {
    Stride stride{};
    cute::for_each(cute::make_seq<cute::rank<0>(Stride{})>{}, [&](auto i) {
      cute::get<0, i>(stride) = problem.stride_C[ProblemShape::RankT - 2 - i];
    });
    return stride;
  }
}

template <cutlass::conv::Operator kOp, class T, int kDims, int kTileN>
cudaError_t Run(const ConvShape& s, const ConvArgs& a, int sm_count, cudaStream_t stream,
                std::string* declined) {
  using Element = typename CutlassElement<T>::type;
  using K = ConvIgemm<kOp, Element, kDims, kTileN>;
  using Conv = typename K::Conv;
  using StrideC = typename Conv::ConvKernel::StrideC;
  using StrideD = typename Conv::ConvKernel::StrideD;
  const auto problem = MakeProblem<typename K::ProblemShape>(s);
  const StrideC stride_c = OutputStride<StrideC>(problem);
  const StrideD stride_d = OutputStride<StrideD>(problem);

  const Element* ptr_a;
  const Element* ptr_b;
  Element* ptr_d;
  if constexpr (kOp == cutlass::conv::Operator::kFprop) {
    ptr_a = static_cast<const Element*>(a.x);
    ptr_b = static_cast<const Element*>(a.w);
    ptr_d = static_cast<Element*>(a.y);
  } else if constexpr (kOp == cutlass::conv::Operator::kDgrad) {
    ptr_a = static_cast<const Element*>(a.dy);
    ptr_b = static_cast<const Element*>(a.w);
    ptr_d = static_cast<Element*>(a.dx);
  } else {
    ptr_a = static_cast<const Element*>(a.dy);
    ptr_b = static_cast<const Element*>(a.x);
    ptr_d = static_cast<Element*>(a.dw);
  }
  // C is read only where beta != 0 (CUTLASS skips the load at beta == 0); it
  // points at D otherwise so that its TMA descriptor has a valid address.
  const Element* ptr_c = ptr_d;
  if constexpr (kOp == cutlass::conv::Operator::kFprop)
    if (a.residual != nullptr) ptr_c = static_cast<const Element*>(a.residual);

  cutlass::KernelHardwareInfo hw;
  if (cudaGetDevice(&hw.device_id) != cudaSuccess) return cudaGetLastError();
  hw.sm_count = sm_count;
  typename Conv::Arguments args(problem, {ptr_a, ptr_b}, {{}, ptr_c, stride_c, ptr_d, stride_d},
                                hw);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  if constexpr (kOp == cutlass::conv::Operator::kFprop) {
    fusion.beta = a.residual != nullptr ? 1.f : 0.f;
    fusion.bias_ptr = static_cast<const Element*>(a.bias);
    fusion.activation.floor = a.activation == kConvNoActivation ? -INFINITY : 0.f;
  }

  Conv conv;
  cutlass::Status status = conv.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    *declined = std::string("CUTLASS's sm90 conv declines the problem: ") +
                cutlassGetStatusString(status);
    return cudaErrorNotSupported;
  }
  const size_t workspace = Conv::get_workspace_size(args);
  if (workspace > static_cast<size_t>(a.workspace_bytes)) {
    *declined = "the kernel needs " + std::to_string(workspace) +
                " workspace bytes, the call has " + std::to_string(a.workspace_bytes);
    return cudaErrorNotSupported;
  }
  status = conv.initialize(args, a.workspace, stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    *declined = std::string("CUTLASS's conv setup failed: ") + cutlassGetStatusString(status);
    return cudaErrorNotSupported;
  }
  status = conv.run(stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace conv_igemm
}  // namespace jax_dnn
