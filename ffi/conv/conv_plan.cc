// The convolution's algorithm registry and heuristic: see conv_plan.h.
#include "ffi/conv/conv_plan.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "ffi/conv/conv_depthwise_plan.h"
#include "ffi/conv/conv_direct_plan.h"

namespace jax_dnn {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// SMs assumed where no device is known: an H100 SXM's (H200: also 132).
constexpr int kAssumedSmCount = 132;

const char* OpName(ConvOp op) {
  switch (op) {
    case ConvOp::kFprop:
      return "fprop";
    case ConvOp::kDgrad:
      return "dgrad";
    case ConvOp::kWgrad:
    default:
      return "wgrad";
  }
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
    default:
      return "float32";
  }
}

// Where the heuristic takes the direct kernels outside the deterministic
// mode (DirectByDefault): depthwise fprop and dgrad of windows of 49 taps or
// more (7x7), stride and dilation 1, 16-bit types, C a multiple of 8 and no
// multiplier (the tiled kernel's vector path). There they ran 1.21-1.26x
// XLA's (cuDNN's) speed on ConvNeXt's 7x7 layers (H200, bf16,
// benchmarks/probes/conv_direct_check.py). Elsewhere XLA runs depthwise and grouped
// convolutions unless deterministic: 3x3 depthwise ran 0.66-0.73x,
// grouped_direct 0.49-0.73x and the direct wgrads 0.26-0.66x.
bool DirectByDefault(int id, const ConvProblem& p) {
  const ConvShape& s = p.shape;
  if (id != kConvDepthwiseDirect || p.op == ConvOp::kWgrad || p.dtype == DType::kF32) return false;
  if (s.k != s.c || s.c % 8 != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (s.stride[i] != 1 || s.dilation[i] != 1) return false;
  return s.window[0] * s.window[1] * s.window[2] >= 49;
}

const char* AlgorithmName(int id) {
  switch (id) {
    case kConvImplicitGemm128x128:
      return "implicit_gemm_128x128";
    case kConvImplicitGemm128x64:
      return "implicit_gemm_128x64";
    case kConvDepthwiseDirect:
      return "depthwise_direct";
    case kConvGemm1x1:
      return "gemm_1x1";
    case kConvGroupedDirect:
      return "grouped_direct";
    default:
      return "unknown";
  }
}

constexpr int kAlgorithmIds[] = {kConvImplicitGemm128x128, kConvImplicitGemm128x64,
                                 kConvGemm1x1, kConvDepthwiseDirect, kConvGroupedDirect};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string Axes(const int64_t (&v)[3]) {
  return "(" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", " + std::to_string(v[2]) +
         ")";
}

bool IgemmBuilt(ConvOp op, DType dtype, int dims, int algorithm) {
  for (const ConvIgemmKernel& k : kConvIgemmKernels)
    if (k.op == op && k.dtype == dtype && (k.dims == 0 || k.dims == dims) &&
        k.algorithm == algorithm)
      return true;
  return false;
}

// What CUTLASS's sm90 implicit-GEMM conv takes (its collective's
// can_implement, sm90_implicit_gemm_gmma_ss_warpspecialized.hpp, restated for
// our layouts), plus what our instantiations fix: which op/dtype/rank/tile is
// built, the fused activations, dgrad's unit stride (a strided dgrad runs as
// stride-1 forward convolutions, one per phase: jax_dnn/_src/conv/phases.py). The handler also runs
// CUTLASS's own can_implement before each launch.
std::string IgemmUnsupported(int algorithm, const ConvProblem& p) {
#ifdef JAX_DNN_CONV_IGEMM_NOT_BUILT
  return "the implicit-GEMM kernels are not built (no CUTLASS headers at build time)";
#endif
  const ConvShape& s = p.shape;
  const int dims = ConvKernelDims(s.rank);
  if (!IgemmBuilt(p.op, p.dtype, dims, algorithm)) {
    std::string why = std::string("no ") + AlgorithmName(algorithm) + " kernel is built for " +
                      OpName(p.op) + " " + DTypeName(p.dtype) +
                      (algorithm == kConvGemm1x1 ? "" : " " + std::to_string(dims) + "D");
    if (p.dtype == DType::kF32 && p.op != ConvOp::kFprop)
      why += " (TF32 wgmma reads operands K-major: float32 has fprop only)";
    return why;
  }
  if (s.groups != 1) return "the implicit-GEMM kernels take groups == 1 (CUTLASS's sm90 conv)";
  // TMA moves 16-byte aligned rows: channel counts a multiple of 16 bytes.
  const int64_t align = p.dtype == DType::kF32 ? 4 : 8;
  if (s.c % align != 0 || s.k % align != 0)
    return "input and output channels must be multiples of " + std::to_string(align) + " for " +
           DTypeName(p.dtype) + " (16-byte TMA rows); got C = " + std::to_string(s.c) +
           ", K = " + std::to_string(s.k);
  if (p.op == ConvOp::kFprop && p.activation != kConvNoActivation && p.activation != 0)
    return "the implicit-GEMM epilogue fuses no activation or relu only; activation id " +
           std::to_string(p.activation) + " runs after the convolution";
  if (algorithm == kConvGemm1x1) {
    for (int i = 0; i < 3; ++i)
      if (s.window[i] != 1 || s.stride[i] != 1 || s.pad_lo[i] != 0 || s.pad_hi[i] != 0)
        return "gemm_1x1 takes window 1, stride 1 and no padding";
    if (s.c > kInt32Max || s.k > kInt32Max ||
        s.input[0] * s.input[1] * s.input[2] > kInt32Max / s.n)
      return "the GEMM's rows (batch x pixels) pass 2^31 - 1";
    return "";
  }
  if (p.op == ConvOp::kDgrad) {
    for (int i = 0; i < 3; ++i)
      if (s.stride[i] != 1)
        return "strided dgrad: CUTLASS's sm90 implicit GEMM has no strided dgrad kernel (it runs "
               "as stride-1 forward convolutions, one a phase, where a forward algorithm takes "
               "each: jax_dnn/_src/conv/phases.py)";
  } else {
    // The im2col TMA's traversal stride (elementStrides) is at most 8.
    for (int i = 0; i < 3; ++i)
      if (s.stride[i] > 8) return "strides past 8 (the im2col TMA's traversal stride limit)";
  }
  // TMA im2col limits (2D / 3D kernels): padding at most 256 / 16, the box
  // corners signed 8 / 5 bit, filter offsets (R - 1) * dilation below 255 / 31.
  const int64_t pad_limit = dims == 2 ? 256 : 16;
  const int64_t corner_limit = int64_t{1} << (16 / dims - 1);
  const int64_t offset_limit = (int64_t{1} << (16 / dims)) - 1;
  for (int i = 3 - dims; i < 3; ++i) {
    const int64_t reach = (s.window[i] - 1) * s.dilation[i];
    if (s.pad_lo[i] > pad_limit || s.pad_hi[i] > pad_limit)
      return "padding past " + std::to_string(pad_limit) + " (the im2col TMA's limit in " +
             std::to_string(dims) + "D)";
    if (reach >= offset_limit)
      return "(window - 1) * dilation = " + std::to_string(reach) + " reaches the im2col TMA's " +
             "filter offset limit " + std::to_string(offset_limit) + " in " +
             std::to_string(dims) + "D";
    int64_t lower = -s.pad_lo[i], upper = s.pad_hi[i] - reach;
    if (p.op == ConvOp::kDgrad) {
      lower = s.pad_lo[i] - reach;
      upper = lower + s.input[i] - s.output[i];
    }
    if (lower < -corner_limit || lower > corner_limit - 1 || upper < -corner_limit ||
        upper > corner_limit - 1)
      return "padding and window reach past the im2col TMA's box corner range [" +
             std::to_string(-corner_limit) + ", " + std::to_string(corner_limit - 1) + "] in " +
             std::to_string(dims) + "D";
  }
  // CUTLASS's problem shape holds extents in int, its GEMM M (fprop, dgrad) or
  // reduction (wgrad) in int32.
  for (int64_t e : {s.n, s.c, s.k})
    if (e > kInt32Max) return "an extent past 2^31 - 1";
  for (int i = 0; i < 3; ++i)
    if (s.input[i] > kInt32Max || s.output[i] > kInt32Max) return "an extent past 2^31 - 1";
  const int64_t pixels = p.op == ConvOp::kDgrad ? s.input[0] * s.input[1] * s.input[2]
                                                : s.output[0] * s.output[1] * s.output[2];
  if (pixels > kInt32Max / s.n)
    return "the implicit GEMM's rows (batch x pixels) pass 2^31 - 1";
  return "";
}

int64_t WgradPixels(const ConvShape& s) { return s.n * s.input[0] * s.input[1] * s.input[2]; }

// gemm_1x1 wgrad's output tiles (K x C at 128 x 128).
int64_t Gemm1x1WgradTiles(const ConvShape& s) { return CeilDiv(s.k, 128) * CeilDiv(s.c, 128); }

// wgrad's GEMM output tiles (M = K, N = T*R*S*C) at 128 x 128.
int64_t WgradTiles(const ConvShape& s) {
  const int64_t trsc = s.window[0] * s.window[1] * s.window[2] * (s.c / s.groups);
  return CeilDiv(s.k, 128) * CeilDiv(trsc, 128);
}

ConvAlgorithm Answer(int id, const ConvProblem& p, const DeviceProps& device) {
  ConvAlgorithm a;
  a.id = id;
  a.name = AlgorithmName(id);
  const std::string shape_error = ConvShapeError(p.shape);
  if (!shape_error.empty()) {
    a.reason = shape_error;
    return a;
  }
  switch (id) {
    case kConvImplicitGemm128x128:
    case kConvImplicitGemm128x64:
    case kConvGemm1x1:
      a.reason = IgemmUnsupported(id, p);
      a.workspace_bytes = 0;
      if (id == kConvGemm1x1 && p.op == ConvOp::kWgrad && a.reason.empty())
        a.workspace_bytes = ConvGemm1x1WgradWorkspaceBytes(
            p.shape, ConvGemm1x1WgradSplits(p.shape, device));
      a.deterministic = true;
      break;
    case kConvDepthwiseDirect: {
      std::string why;
      if (!ConvDepthwiseSupports(p.op, p.shape, p.dtype, &why))
        a.reason = why.empty() ? "the depthwise kernel does not take this problem" : why;
      a.workspace_bytes = ConvDepthwiseWorkspaceBytes(p.op, p.shape, p.dtype, device.sm_count);
      if (a.workspace_bytes < 0) a.workspace_bytes = 0;
      // Its gradients reduce through the workspace in a fixed order.
      a.deterministic = true;
      break;
    }
    case kConvGroupedDirect: {
      std::string why;
      if (!ConvGroupedSupports(p.op, p.shape, p.dtype, &why))
        a.reason = why.empty() ? "grouped_direct does not take this problem" : why;
      a.workspace_bytes = ConvGroupedWorkspaceBytes(p.op, p.shape, p.dtype, device.sm_count);
      // Each output summed by one thread in a fixed order; wgrad's parts
      // reduced in a fixed order.
      a.deterministic = true;
      break;
    }
    default:
      a.reason = "no convolution algorithm has id " + std::to_string(id);
      return a;
  }
  a.supported = a.reason.empty();
  return a;
}

}  // namespace

int64_t ConvGemm1x1WgradSplits(const ConvShape& s, const DeviceProps& device) {
  const int64_t sms = device.sm_count > 0 ? device.sm_count : kAssumedSmCount;
  const int64_t tiles = Gemm1x1WgradTiles(s);
  const int64_t k_tiles = CeilDiv(WgradPixels(s), 64);
  const int64_t splits = std::min<int64_t>({CeilDiv(sms, tiles), k_tiles / 8, 32});
  return std::max<int64_t>(splits, 1);
}

int64_t ConvGemm1x1WgradWorkspaceBytes(const ConvShape& s, int64_t splits) {
  if (splits <= 1) return 0;
  constexpr int64_t kTileBytes = 128 * 128 * 4;    // fp32 partial accumulators
  constexpr int64_t kBarrierBytes = 2 * 4;          // an int32 a consumer warp group
  constexpr int64_t kAlign = 1024;                  // past CUTLASS's L2-line rounding
  const int64_t tiles = Gemm1x1WgradTiles(s);
  return CeilDiv(tiles * kTileBytes, kAlign) * kAlign +
         CeilDiv(tiles * kBarrierBytes, kAlign) * kAlign;
}

std::string ConvShapeError(const ConvShape& s) {
  if (s.rank < 1 || s.rank > 3) return "the spatial rank must be 1, 2 or 3";
  if (s.n < 1 || s.c < 1 || s.k < 1) return "empty problem (batch or channels 0)";
  if (s.groups < 1 || s.c % s.groups != 0 || s.k % s.groups != 0)
    return "groups (" + std::to_string(s.groups) + ") must divide the input channels (" +
           std::to_string(s.c) + ") and output channels (" + std::to_string(s.k) + ")";
  for (int i = 0; i < 3; ++i) {
    if (i < 3 - s.rank) {
      if (s.input[i] != 1 || s.window[i] != 1 || s.output[i] != 1 || s.stride[i] != 1 ||
          s.dilation[i] != 1 || s.pad_lo[i] != 0 || s.pad_hi[i] != 0)
        return "axes in front of a rank-" + std::to_string(s.rank) +
               " problem must have extent 1, stride 1, dilation 1 and no padding";
      continue;
    }
    if (s.input[i] < 1 || s.window[i] < 1 || s.output[i] < 1)
      return "empty problem (a spatial extent is 0)";
    if (s.stride[i] < 1 || s.dilation[i] < 1) return "strides and dilations must be >= 1";
    if (s.pad_lo[i] < 0 || s.pad_hi[i] < 0) return "padding must be non-negative";
    const int64_t span = s.input[i] + s.pad_lo[i] + s.pad_hi[i] - (s.window[i] - 1) * s.dilation[i];
    if (span < 1 || (span - 1) / s.stride[i] + 1 != s.output[i])
      return "output extents " + Axes(s.output) + " do not follow from input " + Axes(s.input) +
             ", window " + Axes(s.window) + ", stride " + Axes(s.stride) + ", dilation " +
             Axes(s.dilation) + " and padding " + Axes(s.pad_lo) + " / " + Axes(s.pad_hi);
  }
  return "";
}

std::vector<ConvAlgorithm> ConvAlgorithms(const ConvProblem& problem, const DeviceProps& device) {
  std::vector<ConvAlgorithm> all;
  for (int id : kAlgorithmIds) all.push_back(Answer(id, problem, device));
  return all;
}

ConvAlgorithm ConvAlgorithmFor(int id, const ConvProblem& problem, const DeviceProps& device) {
  for (int known : kAlgorithmIds)
    if (known == id) return Answer(id, problem, device);
  ConvAlgorithm a;
  a.id = id;
  a.name = AlgorithmName(id);
  a.reason = "no convolution algorithm has id " + std::to_string(id);
  return a;
}

ConvAlgorithm ConvPlan(const ConvProblem& problem, bool deterministic, const DeviceProps& device) {
  const std::vector<ConvAlgorithm> all = ConvAlgorithms(problem, device);
  auto usable = [&](int id) -> const ConvAlgorithm* {
    for (const ConvAlgorithm& a : all)
      if (a.id == id && a.supported && (a.deterministic || !deterministic)) return &a;
    return nullptr;
  };
  const ConvShape& s = problem.shape;
  // Why the heuristic passed over a supported algorithm (wgrad's tile rule).
  std::string declined;
  // The direct kernels (depthwise_direct, grouped_direct) run by default
  // only where DirectByDefault says; otherwise in the deterministic
  // mode, and XLA runs depthwise and grouped convolutions.
  for (int id : {kConvDepthwiseDirect, kConvGroupedDirect}) {
    if (const ConvAlgorithm* a = usable(id)) {
      if (deterministic || DirectByDefault(id, problem)) return *a;
      declined = std::string("the direct kernels are not the default here (DirectByDefault: "
                             "depthwise 7x7 and larger, stride 1, 16-bit, fprop and dgrad): XLA "
                             "runs this ") +
                 (id == kConvDepthwiseDirect ? "depthwise" : "grouped") +
                 " convolution unless deterministic";
    }
  }
  if (const ConvAlgorithm* a = usable(kConvGemm1x1)) return *a;
  if (problem.op == ConvOp::kWgrad) {
    if (const ConvAlgorithm* a = usable(kConvImplicitGemm128x128)) {
      const int sms = device.sm_count > 0 ? device.sm_count : kAssumedSmCount;
      const int64_t tiles = WgradTiles(s);
      if (deterministic || tiles >= sms) return *a;
      declined = "wgrad's " + std::to_string(tiles) + " output tiles would busy " +
                 std::to_string(tiles) + " of " + std::to_string(sms) +
                 " SMs (no split-K: it takes a tile an SM or more, unless deterministic)";
    }
  } else {
    const int64_t gemm_n = problem.op == ConvOp::kFprop ? s.k : s.c;
    const int first = gemm_n <= 64 ? kConvImplicitGemm128x64 : kConvImplicitGemm128x128;
    const int second = first == kConvImplicitGemm128x64 ? kConvImplicitGemm128x128
                                                         : kConvImplicitGemm128x64;
    if (const ConvAlgorithm* a = usable(first)) return *a;
    if (const ConvAlgorithm* a = usable(second)) return *a;
  }
  ConvAlgorithm none;
  none.id = kConvNoAlgorithm;
  none.name = "none";
  for (const ConvAlgorithm& a : all) {
    const std::string why =
        !a.supported ? a.reason : !declined.empty() ? declined : "not deterministic";
    none.reason += (none.reason.empty() ? "" : "; ") + a.name + ": " + why;
  }
  return none;
}

}  // namespace jax_dnn
