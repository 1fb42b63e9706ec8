// XLA FFI handlers for layer_norm and rms_norm (one kernel family, see
// layer_norm.h): decode -> validate -> launch.
#include <string>

#include "ffi/common/ffi_util.h"
#include "ffi/layer_norm/layer_norm.h"

namespace jax_dnn {
namespace {

struct Shape {
  int64_t rows, width, param_sets;
};

// x is [..., width]; scale (and each other parameter) is [param_sets, width] with
// param_sets dividing the rows.
ffi::Error CheckShapes(const std::string& op, const ffi::AnyBuffer& x,
                       const ffi::Buffer<ffi::F32>& scale,
                       std::initializer_list<const ffi::Buffer<ffi::F32>*> params, Shape* s) {
  if (!ToDType(x.element_type()))
    return InvalidArgument(op + ": x must be float32, bfloat16 or float16");
  if (x.dimensions().size() == 0) return InvalidArgument(op + ": x must have rank >= 1");
  s->width = LastDim(x);
  s->rows = s->width == 0 ? 0 : x.element_count() / s->width;
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[1] != s->width)
    return InvalidArgument(op + ": scale must be [param_sets, width], width = x.shape[-1]");
  s->param_sets = sd[0];
  if (s->param_sets < 1 || s->rows % s->param_sets != 0)
    return InvalidArgument(op + ": parameter param_sets must divide the rows of x");
  for (const auto* b : params)
    if (b->element_count() != scale.element_count())
      return InvalidArgument(op + ": bias and parameter gradients must match scale");
  return ffi::Error::Success();
}

// Layer norm's stats: [..., 2] fp32 over x's rows.
ffi::Error CheckStats(const std::string& op, const ffi::Buffer<ffi::F32>& stats, const Shape& s) {
  if (stats.element_count() != 2 * s.rows || stats.dimensions().size() == 0 ||
      stats.dimensions().back() != 2)
    return InvalidArgument(op + ": stats must be [..., 2] over the rows of x");
  return ffi::Error::Success();
}

ffi::Error Fwd(cudaStream_t stream, const std::string& op, const ffi::AnyBuffer& x,
               const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>* bias,
               ffi::AnyBuffer& y, ffi::Buffer<ffi::F32>* stats, float epsilon) {
  Shape s{};
  ffi::Error e = bias ? CheckShapes(op, x, scale, {bias}, &s) : CheckShapes(op, x, scale, {}, &s);
  if (e.failure()) return e;
  if (y.element_type() != x.element_type()) return InvalidArgument(op + ": y must have x's dtype");
  if (stats && (e = CheckStats(op, *stats, s)).failure()) return e;
  LayerNormFwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.rms = bias == nullptr;
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.bias = bias ? bias->typed_data() : nullptr;
  p.y = y.untyped_data();
  p.stats = stats ? stats->typed_data() : nullptr;
  p.rows = s.rows;
  p.width = s.width;
  p.param_sets = s.param_sets;
  p.epsilon = epsilon;
  return LaunchStatus(LaunchLayerNormFwd(p, stream), op.c_str());
}

ffi::Error Bwd(cudaStream_t stream, const std::string& op, const ffi::AnyBuffer& dy,
               const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
               const ffi::Buffer<ffi::F32>* stats, ffi::AnyBuffer& dx,
               ffi::Buffer<ffi::F32>& dscale, ffi::Buffer<ffi::F32>* dbias,
               ffi::Buffer<ffi::F32>& workspace, float epsilon) {
  const bool rms = dbias == nullptr;
  Shape s{};
  ffi::Error e = rms ? CheckShapes(op, x, scale, {&dscale}, &s)
                     : CheckShapes(op, x, scale, {&dscale, dbias}, &s);
  if (e.failure()) return e;
  if (stats && (e = CheckStats(op, *stats, s)).failure()) return e;
  if (dy.element_type() != x.element_type() || dx.element_type() != x.element_type() ||
      dy.element_count() != x.element_count())
    return InvalidArgument(op + ": dy and dx must match x");
  auto wd = workspace.dimensions();
  if (wd.size() != 4 || wd[0] != s.param_sets || wd[1] < 1 || wd[2] != (rms ? 1 : 2) ||
      wd[3] != s.width)
    return InvalidArgument(op + ": workspace must be [param_sets, parts, sums, width]");
  LayerNormBwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.rms = rms;
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.stats = stats ? stats->typed_data() : nullptr;
  p.dx = dx.untyped_data();
  p.partials = workspace.typed_data();
  p.dscale = dscale.typed_data();
  p.dbias = rms ? nullptr : dbias->typed_data();
  p.rows = s.rows;
  p.width = s.width;
  p.param_sets = s.param_sets;
  p.parts = wd[1];
  p.epsilon = epsilon;
  return LaunchStatus(LaunchLayerNormBwd(p, stream), op.c_str());
}

ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> stats, float epsilon) {
  return Fwd(stream, "jax_dnn_layer_norm_fwd", x, scale, &bias, *y, &*stats, epsilon);
}

ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> y, float epsilon) {
  return Fwd(stream, "jax_dnn_rms_norm_fwd", x, scale, nullptr, *y, nullptr, epsilon);
}

ffi::Error LayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> stats,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::ResultBuffer<ffi::F32> dscale,
                            ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::ResultBuffer<ffi::F32> workspace, float epsilon) {
  return Bwd(stream, "jax_dnn_layer_norm_bwd", dy, x, scale, &stats, *dx, *dscale, &*dbias,
             *workspace, epsilon);
}

ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::ResultBuffer<ffi::F32> dscale,
                          ffi::ResultBuffer<ffi::F32> workspace, float epsilon) {
  return Bwd(stream, "jax_dnn_rms_norm_bwd", dy, x, scale, nullptr, *dx, *dscale, nullptr,
             *workspace, epsilon);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFwd, LayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [..., width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [param_sets, width]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // stats [..., 2]: mean, rstd
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwd, RmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [..., width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, width]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwd, LayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // stats [..., 2]: mean, rstd
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dscale [param_sets, width]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias [param_sets, width]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [param_sets, parts, 2, width]
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwd, RmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, width]
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dscale [param_sets, width]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [param_sets, parts, 1, width]
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
