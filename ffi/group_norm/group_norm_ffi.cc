// XLA FFI handlers for group norm (group_norm.h): decode -> validate -> launch.
#include <string>

#include "ffi/common/ffi_util.h"
#include "ffi/group_norm/group_norm.h"

namespace jax_dnn {
namespace {

struct Shape {
  int64_t n, spatial, channels, groups, param_sets;
};

// x [n, *spatial, channels]; scale, bias [param_sets, channels] with
// param_sets dividing n; groups dividing channels; stats [n, groups, 2].
ffi::Error CheckShapes(const std::string& op, const ffi::AnyBuffer& x,
                       const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>& bias,
                       const ffi::Buffer<ffi::F32>& stats, int64_t groups, int64_t activation,
                       Shape* s) {
  if (!ToDType(x.element_type()))
    return InvalidArgument(op + ": x must be float32, bfloat16 or float16");
  auto xd = x.dimensions();
  if (xd.size() < 2) return InvalidArgument(op + ": x must be [n, *spatial, channels]");
  s->n = xd[0];
  s->channels = xd.back();
  s->spatial = DimProduct(xd, 1, xd.size() - 1);
  s->groups = groups;
  if (s->channels < 1 || groups < 1 || s->channels % groups != 0)
    return InvalidArgument(op + ": groups must divide the channels (x.shape[-1] > 0)");
  auto sd = scale.dimensions();
  if (sd.size() != 2 || sd[1] != s->channels || sd[0] < 1 || s->n % sd[0] != 0)
    return InvalidArgument(op + ": scale must be [param_sets, channels], param_sets dividing n");
  s->param_sets = sd[0];
  auto bd = bias.dimensions();
  if (bd.size() != 2 || bd[0] != sd[0] || bd[1] != sd[1])
    return InvalidArgument(op + ": bias must match scale");
  auto td = stats.dimensions();
  if (td.size() != 3 || td[0] != s->n || td[1] != groups || td[2] != 2)
    return InvalidArgument(op + ": stats must be [n, groups, 2]");
  if (activation < kGroupNormNoActivation || activation > 5)
    return InvalidArgument(op + ": activation must be -1 (none) or an Activation id (0-5)");
  const GroupNormPlan plan = PlanGroupNorm(s->n, s->spatial, s->channels, groups,
                                           *ToDType(x.element_type()), DeviceProps{});
  if (!plan.supported) return InvalidArgument(op + ": the kernels do not take it: " + plan.reason);
  return ffi::Error::Success();
}

// The statistics blocks a sample, from the workspace's second dimension.
ffi::Error CheckSplits(const std::string& op, int64_t splits) {
  if (splits < 1 || splits > 65535)
    return InvalidArgument(op + ": the workspace's splits must be in [1, 65535]");
  return ffi::Error::Success();
}

ffi::Error GroupNormFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::AnyBuffer> y,
                            ffi::ResultBuffer<ffi::F32> stats,
                            ffi::ResultBuffer<ffi::F32> workspace, int64_t groups,
                            float epsilon, int64_t activation) {
  const std::string op = "jax_dnn_group_norm_fwd";
  Shape s{};
  ffi::Error e = CheckShapes(op, x, scale, bias, *stats, groups, activation, &s);
  if (e.failure()) return e;
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return InvalidArgument(op + ": y must match x");
  auto wd = workspace->dimensions();
  if (wd.size() != 4 || wd[0] != s.n || wd[2] != groups || wd[3] != 2)
    return InvalidArgument(op + ": workspace must be [n, splits, groups, 2]");
  if ((e = CheckSplits(op, wd[1])).failure()) return e;
  GroupNormFwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.activation = static_cast<int>(activation);
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.bias = bias.typed_data();
  p.y = y->untyped_data();
  p.stats = stats->typed_data();
  p.partials = workspace->typed_data();
  p.n = s.n;
  p.spatial = s.spatial;
  p.channels = s.channels;
  p.groups = s.groups;
  p.param_sets = s.param_sets;
  p.splits = wd[1];
  p.epsilon = epsilon;
  return LaunchStatus(LaunchGroupNormFwd(p, stream), op.c_str());
}

ffi::Error GroupNormBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                            ffi::Buffer<ffi::F32> stats, ffi::Result<ffi::AnyBuffer> dx,
                            ffi::ResultBuffer<ffi::F32> dscale, ffi::ResultBuffer<ffi::F32> dbias,
                            ffi::ResultBuffer<ffi::F32> partials,
                            ffi::ResultBuffer<ffi::F32> sample_sums,
                            ffi::ResultBuffer<ffi::F32> coefs, int64_t groups, float epsilon,
                            int64_t activation) {
  (void)epsilon;  // the forward's rstd carries it
  const std::string op = "jax_dnn_group_norm_bwd";
  Shape s{};
  ffi::Error e = CheckShapes(op, x, scale, bias, stats, groups, activation, &s);
  if (e.failure()) return e;
  if (dy.element_type() != x.element_type() || dx->element_type() != x.element_type() ||
      dy.element_count() != x.element_count() || dx->element_count() != x.element_count())
    return InvalidArgument(op + ": dy and dx must match x");
  if (dscale->element_count() != scale.element_count() ||
      dbias->element_count() != scale.element_count())
    return InvalidArgument(op + ": dscale and dbias must match scale");
  auto pd = partials->dimensions();
  if (pd.size() != 4 || pd[0] != s.n || pd[2] != 2 || pd[3] != s.channels)
    return InvalidArgument(op + ": workspace partials must be [n, splits, 2, channels]");
  if ((e = CheckSplits(op, pd[1])).failure()) return e;
  if (sample_sums->element_count() != s.n * 2 * s.channels)
    return InvalidArgument(op + ": workspace sample_sums must be [n, 2, channels]");
  if (coefs->element_count() != s.n * groups * 2)
    return InvalidArgument(op + ": workspace coefs must be [n, groups, 2]");
  GroupNormBwdParams p{};
  p.dtype = *ToDType(x.element_type());
  p.activation = static_cast<int>(activation);
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.scale = scale.typed_data();
  p.bias = bias.typed_data();
  p.stats = stats.typed_data();
  p.dx = dx->untyped_data();
  p.dscale = dscale->typed_data();
  p.dbias = dbias->typed_data();
  p.partials = partials->typed_data();
  p.sample_sums = sample_sums->typed_data();
  p.coefs = coefs->typed_data();
  p.n = s.n;
  p.spatial = s.spatial;
  p.channels = s.channels;
  p.groups = s.groups;
  p.param_sets = s.param_sets;
  p.splits = pd[1];
  return LaunchStatus(LaunchGroupNormBwd(p, stream), op.c_str());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormFwd, GroupNormFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [n, *spatial, channels]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, channels]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [param_sets, channels]
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::Buffer<ffi::F32>>()   // stats [n, groups, 2]: mean, rstd
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [n, splits, groups, 2]
                                  .Attr<int64_t>("groups")
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("activation"),  // -1: none
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupNormBwd, GroupNormBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // dy
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [param_sets, channels]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [param_sets, channels]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // stats [n, groups, 2]
                                  .Ret<ffi::AnyBuffer>()          // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dscale [param_sets, channels]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias [param_sets, channels]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [n, splits, 2, channels]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [n, 2, channels]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // workspace [n, groups, 2]
                                  .Attr<int64_t>("groups")
                                  .Attr<float>("epsilon")
                                  .Attr<int64_t>("activation"),  // -1: none
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
