// XLA FFI handlers for the convolution (conv.h): forward, data gradient and
// weight gradient. Each decodes its buffers into a ConvShape, checks the call
// against the rules of the algorithm the plan chose (ConvAlgorithmFor, the
// function Python's plan asked), and launches that algorithm's kernel.
//
// Buffers (every spatial rank padded to 3 in Python):
//   x [N, D, H, W, C], w [K, T, R, S, C / groups], y / dy [N, O, P, Q, K];
//   bias [K] or [0] (absent), residual like y or [0] (absent);
//   workspace u8[bytes] as the plan sized it.
#include <string>

#include "ffi/common/device_info.h"
#include "ffi/common/ffi_util.h"
#include "ffi/conv/conv.h"
#include "ffi/conv/conv_depthwise.h"
#include "ffi/conv/conv_direct.h"
#include "ffi/conv/conv_implicit_gemm.h"
#include "ffi/conv/conv_plan.h"

namespace jax_dnn {
namespace {

using Attrs3 = ffi::Span<const int64_t>;

// The attributes every target has.
struct ConvAttrs {
  int64_t algo, groups, rank;
  Attrs3 stride, dilation, pad_lo, pad_hi;
};

std::string Dims(const ffi::AnyBuffer& b) {
  std::string s = "[";
  for (size_t i = 0; i < b.dimensions().size(); ++i)
    s += (i ? ", " : "") + std::to_string(b.dimensions()[i]);
  return s + "]";
}

bool Is5d(const ffi::AnyBuffer& b) { return b.dimensions().size() == 5; }

// A shape from the activations x ([N, D, H, W, C]), the filter-shaped
// buffer ([K, T, R, S, C / groups]) and the output-shaped one ([N, O, P, Q, K]),
// or why they do not fit one another and the attributes.
ffi::Error DecodeShape(const std::string& op, const ConvAttrs& a, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& w, const ffi::AnyBuffer& y, ConvShape* s) {
  if (a.stride.size() != 3 || a.dilation.size() != 3 || a.pad_lo.size() != 3 ||
      a.pad_hi.size() != 3)
    return InvalidArgument(op + ": stride, dilation, pad_lo and pad_hi must have 3 entries");
  if (!Is5d(x) || !Is5d(w) || !Is5d(y))
    return InvalidArgument(op + ": x, w and y must be 5-D (x " + Dims(x) + ", w " + Dims(w) +
                           ", y " + Dims(y) + ")");
  if (!ToDType(x.element_type()))
    return InvalidArgument(op + ": the dtype must be float32, bfloat16 or float16");
  if (w.element_type() != x.element_type() || y.element_type() != x.element_type())
    return InvalidArgument(op + ": x, w and y must have one dtype");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  s->n = xd[0];
  s->c = xd[4];
  s->k = wd[0];
  s->groups = a.groups;
  s->rank = static_cast<int>(a.rank);
  for (int i = 0; i < 3; ++i) {
    s->input[i] = xd[1 + i];
    s->window[i] = wd[1 + i];
    s->output[i] = yd[1 + i];
    s->stride[i] = a.stride[i];
    s->dilation[i] = a.dilation[i];
    s->pad_lo[i] = a.pad_lo[i];
    s->pad_hi[i] = a.pad_hi[i];
  }
  if (a.groups < 1 || wd[4] * a.groups != s->c)
    return InvalidArgument(op + ": w " + Dims(w) + " must have C / groups = " +
                           std::to_string(s->c) + " / " + std::to_string(a.groups) +
                           " input channels (x " + Dims(x) + ")");
  if (yd[0] != s->n || yd[4] != s->k)
    return InvalidArgument(op + ": y " + Dims(y) + " must be [N, O, P, Q, K] for x " + Dims(x) +
                           " and w " + Dims(w));
  return ffi::Error::Success();
}

// Checks the call against algorithm a.algo's rules for `problem` and runs it.
ffi::Error Launch(cudaStream_t stream, const std::string& op, const ConvAttrs& a,
                  const ConvProblem& problem, ConvArgs& args, ffi::AnyBuffer& workspace) {
  const DeviceProps device = CurrentDeviceProps();
  const ConvAlgorithm algorithm = ConvAlgorithmFor(static_cast<int>(a.algo), problem, device);
  if (!algorithm.supported)
    return InvalidArgument(op + ": algorithm " + algorithm.name + " (" + std::to_string(a.algo) +
                           ") does not take this call: " + algorithm.reason);
  const int64_t workspace_bytes = static_cast<int64_t>(workspace.size_bytes());
  // gemm_1x1's wgrad fits its splits to the workspace it gets (one split
  // needs none), so a plan made for another device still runs.
  const bool adapts = algorithm.id == kConvGemm1x1 && problem.op == ConvOp::kWgrad;
  if (!adapts && workspace_bytes < algorithm.workspace_bytes)
    return InvalidArgument(op + ": the workspace has " + std::to_string(workspace_bytes) +
                           " bytes, " + algorithm.name + " needs " +
                           std::to_string(algorithm.workspace_bytes));
  args.dtype = problem.dtype;
  args.workspace = workspace_bytes > 0 ? workspace.untyped_data() : nullptr;
  args.workspace_bytes = workspace_bytes;
  if (algorithm.id == kConvDepthwiseDirect)
    return LaunchStatus(LaunchConvDepthwise(problem.op, problem.shape, args, stream), op.c_str());
  if (algorithm.id == kConvGroupedDirect)
    return LaunchStatus(LaunchConvDirectTiled(problem.op, problem.shape, args, stream), op.c_str());
  std::string declined;
  const cudaError_t status = LaunchConvImplicitGemm(problem.op, algorithm.id, problem.shape, args,
                                                    SmCount(), stream, &declined);
  if (!declined.empty()) return InvalidArgument(op + ": " + declined);
  return LaunchStatus(status, op.c_str());
}

ffi::Error ConvFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> workspace, int64_t algo, int64_t activation,
                       int64_t groups, int64_t rank, Attrs3 stride, Attrs3 dilation,
                       Attrs3 pad_lo, Attrs3 pad_hi) {
  const std::string op = "jax_dnn_conv_fwd";
  const ConvAttrs a{algo, groups, rank, stride, dilation, pad_lo, pad_hi};
  ConvProblem p;
  p.op = ConvOp::kFprop;
  if (ffi::Error e = DecodeShape(op, a, x, w, *y, &p.shape); e.failure()) return e;
  p.dtype = *ToDType(x.element_type());
  p.activation = static_cast<int>(activation);
  p.bias = bias.element_count() > 0;
  p.residual = residual.element_count() > 0;
  if (activation < kConvNoActivation || activation > 5)
    return InvalidArgument(op + ": activation must be -1 (none) or a bias_act id 0-5");
  if (p.bias && (bias.dimensions().size() != 1 || bias.dimensions()[0] != p.shape.k ||
                 bias.element_type() != x.element_type()))
    return InvalidArgument(op + ": bias " + Dims(bias) + " must be [K] = [" +
                           std::to_string(p.shape.k) + "] of x's dtype, or [0]");
  if (p.residual && (residual.element_count() != y->element_count() || !Is5d(residual) ||
                     residual.element_type() != x.element_type()))
    return InvalidArgument(op + ": residual " + Dims(residual) + " must match y " + Dims(*y) +
                           ", or be [0]");
  ConvArgs args;
  args.activation = p.activation;
  args.x = x.untyped_data();
  args.w = w.untyped_data();
  args.bias = p.bias ? bias.untyped_data() : nullptr;
  args.residual = p.residual ? residual.untyped_data() : nullptr;
  args.y = y->untyped_data();
  return Launch(stream, op, a, p, args, *workspace);
}

ffi::Error ConvDgradImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> workspace,
                         int64_t algo, int64_t groups, int64_t rank, Attrs3 stride,
                         Attrs3 dilation, Attrs3 pad_lo, Attrs3 pad_hi) {
  const std::string op = "jax_dnn_conv_dgrad";
  const ConvAttrs a{algo, groups, rank, stride, dilation, pad_lo, pad_hi};
  ConvProblem p;
  p.op = ConvOp::kDgrad;
  if (ffi::Error e = DecodeShape(op, a, *dx, w, dy, &p.shape); e.failure()) return e;
  p.dtype = *ToDType(dy.element_type());
  ConvArgs args;
  args.dy = dy.untyped_data();
  args.w = w.untyped_data();
  args.dx = dx->untyped_data();
  return Launch(stream, op, a, p, args, *workspace);
}

ffi::Error ConvWgradImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                         ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> workspace,
                         int64_t algo, int64_t groups, int64_t rank, Attrs3 stride,
                         Attrs3 dilation, Attrs3 pad_lo, Attrs3 pad_hi) {
  const std::string op = "jax_dnn_conv_wgrad";
  const ConvAttrs a{algo, groups, rank, stride, dilation, pad_lo, pad_hi};
  ConvProblem p;
  p.op = ConvOp::kWgrad;
  if (ffi::Error e = DecodeShape(op, a, x, *dw, dy, &p.shape); e.failure()) return e;
  p.dtype = *ToDType(x.element_type());
  ConvArgs args;
  args.x = x.untyped_data();
  args.dy = dy.untyped_data();
  args.dw = dw->untyped_data();
  return Launch(stream, op, a, p, args, *workspace);
}

}  // namespace

// The attributes' order in each Bind() chain is the handler's parameter order;
// Python passes them by name.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvFwd, ConvFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, D, H, W, C]
                                  .Arg<ffi::AnyBuffer>()  // w [K, T, R, S, C / groups]
                                  .Arg<ffi::AnyBuffer>()  // bias [K], or [0]: none
                                  .Arg<ffi::AnyBuffer>()  // residual [N, O, P, Q, K], or [0]
                                  .Ret<ffi::AnyBuffer>()  // y [N, O, P, Q, K]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[bytes]
                                  .Attr<int64_t>("algo")
                                  .Attr<int64_t>("activation")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("rank")
                                  .Attr<Attrs3>("stride")
                                  .Attr<Attrs3>("dilation")
                                  .Attr<Attrs3>("pad_lo")
                                  .Attr<Attrs3>("pad_hi"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvDgrad, ConvDgradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy [N, O, P, Q, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, T, R, S, C / groups]
                                  .Ret<ffi::AnyBuffer>()  // dx [N, D, H, W, C]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[bytes]
                                  .Attr<int64_t>("algo")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("rank")
                                  .Attr<Attrs3>("stride")
                                  .Attr<Attrs3>("dilation")
                                  .Attr<Attrs3>("pad_lo")
                                  .Attr<Attrs3>("pad_hi"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(ConvWgrad, ConvWgradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, D, H, W, C]
                                  .Arg<ffi::AnyBuffer>()  // dy [N, O, P, Q, K]
                                  .Ret<ffi::AnyBuffer>()  // dw [K, T, R, S, C / groups]
                                  .Ret<ffi::AnyBuffer>()  // workspace u8[bytes]
                                  .Attr<int64_t>("algo")
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("rank")
                                  .Attr<Attrs3>("stride")
                                  .Attr<Attrs3>("dilation")
                                  .Attr<Attrs3>("pad_lo")
                                  .Attr<Attrs3>("pad_hi"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
