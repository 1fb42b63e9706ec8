// XLA FFI handlers for layer_norm and rms_norm (one kernel family, see
// layer_norm.h): decode -> validate -> launch.
#include <optional>

#include "ffi/common/ffi_util.h"
#include "ffi/layer_norm/layer_norm.h"

namespace jax_dnn {
namespace {

struct Shape {
  int64_t rows, width, groups;
};

// x is [..., width]; scale is [groups, width] with groups dividing the rows;
// each per-row statistic has `rows` elements.
ffi::Error CheckShapes(const char* op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
                       std::initializer_list<const ffi::Buffer<ffi::F32>*> params,
                       std::initializer_list<int64_t> stat_sizes, Shape* s) {
  if (!ToDType(x.element_type()))
    return InvalidArgument(std::string(op) + ": x must be float32, bfloat16 or float16");
  if (x.dimensions().size() == 0) return InvalidArgument(std::string(op) + ": x must have rank >= 1");
  s->width = LastDim(x);
  s->rows = s->width == 0 ? 0 : x.element_count() / s->width;
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[1] != s->width)
    return InvalidArgument(std::string(op) + ": scale must be [groups, width], width = x.shape[-1]");
  s->groups = sd[0];
  if (s->groups < 1 || s->rows % s->groups != 0)
    return InvalidArgument(std::string(op) + ": parameter groups must divide the rows of x");
  for (const auto* b : params)
    if (b->element_count() != scale.element_count())
      return InvalidArgument(std::string(op) + ": bias must match scale");
  for (int64_t n : stat_sizes)
    if (n != s->rows)
      return InvalidArgument(std::string(op) + ": mean/rstd must have one element per row");
  return ffi::Error::Success();
}

ffi::Error Fwd(cudaStream_t stream, const char* op, const ffi::AnyBuffer& x,
               const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>* bias,
               ffi::AnyBuffer& y, ffi::Buffer<ffi::F32>* mean, ffi::Buffer<ffi::F32>& rstd,
               float epsilon) {
  Shape s{};
  if (bias) {
    if (auto e = CheckShapes(op, x, scale, {bias}, {mean->element_count(), rstd.element_count()}, &s);
        e.failure())
      return e;
  } else if (auto e = CheckShapes(op, x, scale, {}, {rstd.element_count()}, &s); e.failure()) {
    return e;
  }
  if (y.element_type() != x.element_type())
    return InvalidArgument(std::string(op) + ": y must have x's dtype");
  LayerNormFwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.rms = bias == nullptr;
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.bias = bias ? bias->typed_data() : nullptr;
  p.y = y.untyped_data();
  p.mean = mean ? mean->typed_data() : nullptr;
  p.rstd = rstd.typed_data();
  p.rows = s.rows;
  p.width = s.width;
  p.groups = s.groups;
  p.epsilon = epsilon;
  return LaunchStatus(LaunchLayerNormFwd(p, stream), op);
}

ffi::Error Bwd(cudaStream_t stream, const char* op, const ffi::AnyBuffer& dy,
               const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& scale,
               const ffi::Buffer<ffi::F32>* mean, const ffi::Buffer<ffi::F32>& rstd,
               ffi::AnyBuffer& dx, ffi::Buffer<ffi::F32>& dscale, ffi::Buffer<ffi::F32>* dbias,
               ffi::Buffer<ffi::F32>& workspace) {
  const bool rms = mean == nullptr;
  Shape s{};
  ffi::Error e = rms ? CheckShapes(op, x, scale, {&dscale}, {rstd.element_count()}, &s)
                     : CheckShapes(op, x, scale, {&dscale, dbias},
                                   {mean->element_count(), rstd.element_count()}, &s);
  if (e.failure()) return e;
  if (dy.element_type() != x.element_type() || dx.element_type() != x.element_type() ||
      dy.element_count() != x.element_count())
    return InvalidArgument(std::string(op) + ": dy and dx must match x");
  auto wd = workspace.dimensions();
  if (wd.size() != 4 || wd[0] != s.groups || wd[1] < 1 || wd[2] != (rms ? 1 : 2) ||
      wd[3] != s.width)
    return InvalidArgument(std::string(op) + ": workspace must be [groups, parts, sums, width]");
  LayerNormBwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.rms = rms;
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.mean = rms ? nullptr : mean->typed_data();
  p.rstd = rstd.typed_data();
  p.dx = dx.untyped_data();
  p.partials = workspace.typed_data();
  p.dscale = dscale.typed_data();
  p.dbias = rms ? nullptr : dbias->typed_data();
  p.rows = s.rows;
  p.width = s.width;
  p.groups = s.groups;
  p.parts = wd[1];
  return LaunchStatus(LaunchLayerNormBwd(p, stream), op);
}

ffi::Error LayerNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> mean, ffi::ResultBuffer<ffi::F32> rstd,
                            float epsilon) {
  return Fwd(stream, "jax_dnn_layer_norm_fwd", x, scale, &bias, *y, &*mean, *rstd, epsilon);
}

ffi::Error RmsNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> y, ffi::ResultBuffer<ffi::F32> rstd,
                          float epsilon) {
  return Fwd(stream, "jax_dnn_rms_norm_fwd", x, scale, nullptr, *y, nullptr, *rstd, epsilon);
}

ffi::Error LayerNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> mean,
                            ffi::Buffer<ffi::F32> rstd, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::ResultBuffer<ffi::F32> dscale, ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::ResultBuffer<ffi::F32> workspace) {
  return Bwd(stream, "jax_dnn_layer_norm_bwd", dy, x, scale, &mean, rstd, *dx, *dscale, &*dbias,
             *workspace);
}

ffi::Error RmsNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> rstd,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::ResultBuffer<ffi::F32> dscale,
                          ffi::ResultBuffer<ffi::F32> workspace) {
  return Bwd(stream, "jax_dnn_rms_norm_bwd", dy, x, scale, nullptr, rstd, *dx, *dscale, nullptr,
             *workspace);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormFwd, LayerNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [..., width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [groups, width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [groups, width]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // mean [...]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // rstd [...]
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwd, RmsNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [..., width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [groups, width]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // rstd [...]
                                  .Attr<float>("epsilon"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerNormBwd, LayerNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [groups, width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rstd
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dscale [groups, width]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias [groups, width]
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // workspace [groups, parts, 2, width]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwd, RmsNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [groups, width]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rstd
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dscale [groups, width]
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // workspace [groups, parts, 1, width]
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
