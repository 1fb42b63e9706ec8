// The 1x1 convolution (window 1, stride 1, no padding, any rank) as the plain
// GEMM it is, on CUTLASS's sm90 GEMM with the persistent ping-pong schedule:
// two consumer warp groups take turns, so one tile's epilogue overlaps the
// next tile's wgmma. The implicit-GEMM conv kernels have no persistent
// schedule; at a 1x1 layer's short reduction (C = 64: one K tile) their
// epilogue is exposed: 82 TFLOP/s on ResNet-50's 56^2 64->256 1x1 (H200),
// where its 256 MB of traffic at 4.8 TB/s would allow ~250.
//   fprop  y[M, K]  = x[M, C]  . w[K, C]^T   M = N*D*H*W   (B K-major)
//   dgrad  dx[M, C] = dy[M, K] . w[K, C]                   (B MN-major)
//   wgrad  dw[K, C] = dy[M, K]^T . x[M, C]   reduced over M (A, B MN-major)
// Fprop fuses the same epilogue as the implicit GEMM (bias, residual,
// identity/ReLU; conv_implicit_gemm.cuh). Wgrad's output is small (K x C)
// and its reduction long: it splits the reduction (ConvGemm1x1WgradSplits,
// conv_plan.h) on CUTLASS's stream-K scheduler in split-K mode, whose
// deterministic reduction adds the splits' fp32 partial tiles in the
// workspace in split order: bitwise reproducible.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "ffi/conv/conv_implicit_gemm.cuh"
#include "ffi/conv/conv_plan.h"

namespace jax_dnn {
namespace conv_igemm {

template <cutlass::conv::Operator kOp, class Element>
struct Conv1x1Gemm {
  static_assert(kOp != cutlass::conv::Operator::kWgrad, "fprop and dgrad only");
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;
  // w [K, C]: fprop reads it as B (N = K, reduced C) K-major, dgrad as B
  // (N = C, reduced K) N-major.
  using LayoutB = cute::conditional_t<kOp == cutlass::conv::Operator::kFprop,
                                      cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  using Fusion = cute::conditional_t<
      kOp == cutlass::conv::Operator::kFprop,
      cutlass::epilogue::fusion::LinCombPerColBiasEltAct<FloorActivation, Element, float, Element,
                                                         Element, float>,
      cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD, kAlign,
      Element, LayoutD, kAlign, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Wgrad: the cooperative schedule (both consumer warp groups on one tile),
// which the stream-K scheduler takes.
template <class Element>
struct Conv1x1WgradGemm {
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  // dy [M, K] as A (M = K, reduced pixels) M-major; x [M, C] as B (N = C) N-major.
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutD, kAlign,
      Element, LayoutD, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float, Element, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element,
      LayoutB, kAlign, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Checks, sets up and launches a CUTLASS GEMM (the 1x1 kernels' common tail).
template <class G>
cudaError_t LaunchGemm(G& gemm, const typename G::Arguments& args, const ConvArgs& a,
                       cudaStream_t stream, std::string* declined) {
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) {
    *declined = std::string("CUTLASS's sm90 GEMM declines the 1x1 problem: ") +
                cutlassGetStatusString(status);
    return cudaErrorNotSupported;
  }
  const size_t workspace = G::get_workspace_size(args);
  if (workspace > static_cast<size_t>(a.workspace_bytes)) {
    *declined = "the kernel needs " + std::to_string(workspace) +
                " workspace bytes, the call has " + std::to_string(a.workspace_bytes);
    return cudaErrorNotSupported;
  }
  status = gemm.initialize(args, a.workspace, stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    *declined = std::string("CUTLASS's GEMM setup failed: ") + cutlassGetStatusString(status);
    return cudaErrorNotSupported;
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t Run1x1Wgrad(const ConvShape& s, const ConvArgs& a, int sm_count, cudaStream_t stream,
                        std::string* declined) {
  using Element = typename CutlassElement<T>::type;
  using G = typename Conv1x1WgradGemm<Element>::Gemm;
  using Kernel = typename G::GemmKernel;
  const int m = static_cast<int>(s.k);
  const int n = static_cast<int>(s.c);
  const int k = static_cast<int>(s.n * s.input[0] * s.input[1] * s.input[2]);
  const auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{},
                                                         cute::make_shape(m, k, 1));
  const auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{},
                                                         cute::make_shape(n, k, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                                         cute::make_shape(m, n, 1));
  Element* ptr_d = static_cast<Element*>(a.dw);
  cutlass::KernelHardwareInfo hw;
  if (cudaGetDevice(&hw.device_id) != cudaSuccess) return cudaGetLastError();
  hw.sm_count = sm_count;
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {m, n, k, 1},
                             {static_cast<const Element*>(a.dy), stride_a,
                              static_cast<const Element*>(a.x), stride_b},
                             {{}, ptr_d, stride_d, ptr_d, stride_d},
                             hw};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  // The plan sized the workspace for the splits on the device it planned
  // for; where the call's is smaller (another device), one pass needs none.
  DeviceProps device;
  device.sm_count = sm_count;
  int splits = static_cast<int>(ConvGemm1x1WgradSplits(s, device));
  if (a.workspace_bytes < ConvGemm1x1WgradWorkspaceBytes(s, splits)) splits = 1;
  using Scheduler = typename Kernel::TileScheduler;
  args.scheduler.splits = splits;
  args.scheduler.decomposition_mode = Scheduler::DecompositionMode::SplitK;
  args.scheduler.reduction_mode = Scheduler::ReductionMode::Deterministic;
  G gemm;
  return LaunchGemm(gemm, args, a, stream, declined);
}

template <cutlass::conv::Operator kOp, class T>
cudaError_t Run1x1(const ConvShape& s, const ConvArgs& a, int sm_count, cudaStream_t stream,
                   std::string* declined) {
  using Element = typename CutlassElement<T>::type;
  using G = typename Conv1x1Gemm<kOp, Element>::Gemm;
  using Kernel = typename G::GemmKernel;
  constexpr bool kFprop = kOp == cutlass::conv::Operator::kFprop;
  const int m = static_cast<int>(s.n * s.input[0] * s.input[1] * s.input[2]);
  const int n = static_cast<int>(kFprop ? s.k : s.c);
  const int k = static_cast<int>(kFprop ? s.c : s.k);
  const auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{},
                                                         cute::make_shape(m, k, 1));
  const auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{},
                                                         cute::make_shape(n, k, 1));
  const auto stride_c = cutlass::make_cute_packed_stride(typename Kernel::StrideC{},
                                                         cute::make_shape(m, n, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                                         cute::make_shape(m, n, 1));
  const Element* ptr_a = static_cast<const Element*>(kFprop ? a.x : a.dy);
  const Element* ptr_b = static_cast<const Element*>(a.w);
  Element* ptr_d = static_cast<Element*>(kFprop ? a.y : a.dx);
  // C is read only where beta != 0; it points at D otherwise (a valid TMA address).
  const Element* ptr_c = ptr_d;
  if (kFprop && a.residual != nullptr) ptr_c = static_cast<const Element*>(a.residual);

  cutlass::KernelHardwareInfo hw;
  if (cudaGetDevice(&hw.device_id) != cudaSuccess) return cudaGetLastError();
  hw.sm_count = sm_count;
  typename G::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {m, n, k, 1},
                             {ptr_a, stride_a, ptr_b, stride_b},
                             {{}, ptr_c, stride_c, ptr_d, stride_d},
                             hw};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.f;
  fusion.beta = 0.f;
  if constexpr (kFprop) {
    fusion.beta = a.residual != nullptr ? 1.f : 0.f;
    fusion.bias_ptr = static_cast<const Element*>(a.bias);
    fusion.activation.floor = a.activation == kConvNoActivation ? -INFINITY : 0.f;
  }

  G gemm;
  return LaunchGemm(gemm, args, a, stream, declined);
}

}  // namespace conv_igemm
}  // namespace jax_dnn
