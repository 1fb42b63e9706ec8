// XLA FFI handlers for activation and bias_act: decode -> validate -> launch.
#include "ffi/activation/activation.h"
#include "ffi/common/ffi_util.h"

namespace jax_dnn {
namespace {

ffi::Error CheckActivation(int64_t a) {
  if (a < 0 || a >= kNumActivations)
    return InvalidArgument("jax_dnn activation: unknown activation id " + std::to_string(a));
  return ffi::Error::Success();
}

// bias is [param_sets, width] with width = x's last dimension and rows % param_sets == 0.
ffi::Error CheckBias(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& bias, int64_t* rows,
                     int64_t* width, int64_t* param_sets) {
  *width = LastDim(x);
  *rows = *width == 0 ? 0 : x.element_count() / *width;
  auto bd = bias.dimensions();
  if (bd.size() != 2 || bd[1] != *width)
    return InvalidArgument("jax_dnn bias_act: bias must be [param_sets, width] with width = x.shape[-1]");
  *param_sets = bd[0];
  if (*param_sets < 1 || *rows % *param_sets != 0)
    return InvalidArgument("jax_dnn bias_act: bias param_sets must divide the rows of x");
  return ffi::Error::Success();
}

ffi::Error ActivationFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                             int64_t activation) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || y->element_type() != x.element_type())
    return InvalidArgument("jax_dnn activation_fwd: x must be float32, bfloat16 or float16");
  if (auto e = CheckActivation(activation); e.failure()) return e;
  ActivationFwdParams p{};
  p.dtype = *dtype;
  p.activation = static_cast<Activation>(activation);
  p.x = x.untyped_data();
  p.y = y->untyped_data();
  p.rows = 1;
  p.width = static_cast<int64_t>(x.element_count());
  p.param_sets = 1;
  return LaunchStatus(LaunchActivationFwd(p, stream), "jax_dnn_activation_fwd");
}

ffi::Error ActivationBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> dx, int64_t activation) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || dy.element_type() != x.element_type() || dx->element_type() != x.element_type())
    return InvalidArgument("jax_dnn activation_bwd: dy and x must share one float dtype");
  if (dy.element_count() != x.element_count())
    return InvalidArgument("jax_dnn activation_bwd: dy and x must have the same size");
  if (auto e = CheckActivation(activation); e.failure()) return e;
  ActivationBwdParams p{};
  p.dtype = *dtype;
  p.activation = static_cast<Activation>(activation);
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.dx = dx->untyped_data();
  p.rows = 1;
  p.width = static_cast<int64_t>(x.element_count());
  p.param_sets = 1;
  return LaunchStatus(LaunchActivationBwd(p, stream), "jax_dnn_activation_bwd");
}

ffi::Error BiasActFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> bias,
                          ffi::Result<ffi::AnyBuffer> y, int64_t activation) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || y->element_type() != x.element_type())
    return InvalidArgument("jax_dnn bias_act_fwd: x must be float32, bfloat16 or float16");
  if (auto e = CheckActivation(activation); e.failure()) return e;
  ActivationFwdParams p{};
  if (auto e = CheckBias(x, bias, &p.rows, &p.width, &p.param_sets); e.failure()) return e;
  p.dtype = *dtype;
  p.activation = static_cast<Activation>(activation);
  p.x = x.untyped_data();
  p.bias = bias.typed_data();
  p.y = y->untyped_data();
  return LaunchStatus(LaunchActivationFwd(p, stream), "jax_dnn_bias_act_fwd");
}

ffi::Error BiasActBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::ResultBuffer<ffi::F32> dbias,
                          ffi::ResultBuffer<ffi::F32> workspace, int64_t activation) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || dy.element_type() != x.element_type() || dx->element_type() != x.element_type())
    return InvalidArgument("jax_dnn bias_act_bwd: dy and x must share one float dtype");
  if (dy.element_count() != x.element_count())
    return InvalidArgument("jax_dnn bias_act_bwd: dy and x must have the same size");
  if (auto e = CheckActivation(activation); e.failure()) return e;
  ActivationBwdParams p{};
  if (auto e = CheckBias(x, bias, &p.rows, &p.width, &p.param_sets); e.failure()) return e;
  auto wd = workspace->dimensions();
  if (wd.size() != 4 || wd[0] != p.param_sets || wd[2] != 1 || wd[3] != p.width || wd[1] < 1)
    return InvalidArgument("jax_dnn bias_act_bwd: workspace must be [param_sets, parts, 1, width]");
  if (dbias->element_count() != bias.element_count())
    return InvalidArgument("jax_dnn bias_act_bwd: dbias must match bias");
  p.dtype = *dtype;
  p.activation = static_cast<Activation>(activation);
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.bias = bias.typed_data();
  p.dx = dx->untyped_data();
  p.dbias = dbias->typed_data();
  p.partials = workspace->typed_data();
  p.parts = wd[1];
  return LaunchStatus(LaunchActivationBwd(p, stream), "jax_dnn_bias_act_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationFwd, ActivationFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Attr<int64_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(ActivationBwd, ActivationBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Attr<int64_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasActFwd, BiasActFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [param_sets, width]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Attr<int64_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BiasActBwd, BiasActBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [param_sets, width]
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias [param_sets, width]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [param_sets, parts, 1, width]
                                  .Attr<int64_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
