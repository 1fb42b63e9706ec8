// XLA FFI handlers for batch norm's four kernels (batch_norm.h): decode ->
// validate -> launch. An absent residual (and dresidual) is an empty [0]
// buffer.
#include <string>

#include "ffi/batch_norm/batch_norm.h"
#include "ffi/common/ffi_util.h"

namespace jax_dnn {
namespace {

// x is [..., C] with C > 0; a per-channel operand is [G, K, C] (or [G, C]
// for K = 1) with G dividing the rows of x.
ffi::Error CheckShapes(const std::string& op, const ffi::AnyBuffer& x,
                       const ffi::Buffer<ffi::F32>& coefs, int64_t k, BatchNormParams* p) {
  auto dtype = ToDType(x.element_type());
  if (!dtype) return InvalidArgument(op + ": x must be float32, bfloat16 or float16");
  if (x.dimensions().size() == 0) return InvalidArgument(op + ": x must have rank >= 1");
  p->dtype = *dtype;
  p->width = LastDim(x);
  p->rows = p->width == 0 ? 0 : x.element_count() / p->width;
  auto cd = coefs.dimensions();
  const bool shaped = k == 1 ? cd.size() == 2 && cd[1] == p->width
                             : cd.size() == 3 && cd[1] == k && cd[2] == p->width;
  if (!shaped || cd[0] < 1 || p->rows % cd[0] != 0)
    return InvalidArgument(op + ": per-channel operand must be [G, " + std::to_string(k) +
                           ", C] with G dividing the rows of x and C = x.shape[-1]");
  p->param_sets = cd[0];
  p->coefs = coefs.typed_data();
  p->coef_rows = static_cast<int>(k);
  return ffi::Error::Success();
}

ffi::Error CheckLike(const std::string& op, const char* name, const ffi::AnyBuffer& a,
                     const ffi::AnyBuffer& x) {
  if (a.element_type() != x.element_type() || a.element_count() != x.element_count())
    return InvalidArgument(op + ": " + name + " must match x's shape and dtype");
  return ffi::Error::Success();
}

// The residual (or dresidual): x's shape and dtype, or empty.
ffi::Error CheckOptional(const std::string& op, const char* name, const ffi::AnyBuffer& a,
                         const ffi::AnyBuffer& x, const void** ptr) {
  if (a.element_count() == 0) {
    *ptr = nullptr;
    return ffi::Error::Success();
  }
  *ptr = a.untyped_data();
  return CheckLike(op, name, a, x);
}

ffi::Error CheckSums(const std::string& op, const BatchNormParams& p,
                     const ffi::Buffer<ffi::F32>& s0, const ffi::Buffer<ffi::F32>& s1,
                     const ffi::Buffer<ffi::F32>& workspace) {
  const int64_t n = p.param_sets * p.width;
  if (s0.element_count() != n || s1.element_count() != n)
    return InvalidArgument(op + ": the sums must be [G, C]");
  auto wd = workspace.dimensions();
  if (wd.size() != 4 || wd[0] != p.param_sets || wd[1] < 1 || wd[2] != 2 || wd[3] != p.width)
    return InvalidArgument(op + ": workspace must be [G, parts, 2, C]");
  return ffi::Error::Success();
}

ffi::Error StatsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> shift,
                     ffi::ResultBuffer<ffi::F32> s0, ffi::ResultBuffer<ffi::F32> s1,
                     ffi::ResultBuffer<ffi::F32> workspace) {
  const std::string op = "jax_dnn_batch_norm_stats";
  BatchNormParams p{};
  ffi::Error e = CheckShapes(op, x, shift, 1, &p);
  if (e.failure() || (e = CheckSums(op, p, *s0, *s1, *workspace)).failure()) return e;
  p.activation = kBatchNormNoActivation;
  p.x = x.untyped_data();
  p.partials = workspace->typed_data();
  p.sums[0] = s0->typed_data();
  p.sums[1] = s1->typed_data();
  p.parts = workspace->dimensions()[1];
  return LaunchStatus(LaunchBatchNormStats(p, stream), op.c_str());
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> coefs,
                   ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> y, int64_t activation) {
  const std::string op = "jax_dnn_batch_norm_fwd";
  BatchNormParams p{};
  ffi::Error e = CheckShapes(op, x, coefs, 2, &p);
  if (e.failure() || (e = CheckOptional(op, "residual", residual, x, &p.residual)).failure() ||
      (e = CheckLike(op, "y", *y, x)).failure())
    return e;
  p.activation = static_cast<int>(activation);
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  return LaunchStatus(LaunchBatchNormFwd(p, stream), op.c_str());
}

ffi::Error BwdStatsImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::F32> coefs, ffi::AnyBuffer residual,
                        ffi::ResultBuffer<ffi::F32> s0, ffi::ResultBuffer<ffi::F32> s1,
                        ffi::ResultBuffer<ffi::F32> workspace, int64_t activation) {
  const std::string op = "jax_dnn_batch_norm_bwd_stats";
  BatchNormParams p{};
  ffi::Error e = CheckShapes(op, x, coefs, 3, &p);
  if (e.failure() || (e = CheckLike(op, "dy", dy, x)).failure() ||
      (e = CheckOptional(op, "residual", residual, x, &p.residual)).failure() ||
      (e = CheckSums(op, p, *s0, *s1, *workspace)).failure())
    return e;
  p.activation = static_cast<int>(activation);
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.partials = workspace->typed_data();
  p.sums[0] = s0->typed_data();
  p.sums[1] = s1->typed_data();
  p.parts = workspace->dimensions()[1];
  return LaunchStatus(LaunchBatchNormBwdStats(p, stream), op.c_str());
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::F32> coefs, ffi::AnyBuffer residual,
                   ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dresidual,
                   int64_t activation) {
  const std::string op = "jax_dnn_batch_norm_bwd";
  BatchNormParams p{};
  const void* dres = nullptr;
  ffi::Error e = CheckShapes(op, x, coefs, 6, &p);
  if (e.failure() || (e = CheckLike(op, "dy", dy, x)).failure() ||
      (e = CheckOptional(op, "residual", residual, x, &p.residual)).failure() ||
      (e = CheckLike(op, "dx", *dx, x)).failure() ||
      (e = CheckOptional(op, "dresidual", *dresidual, x, &dres)).failure())
    return e;
  if ((p.residual == nullptr) != (dres == nullptr))
    return InvalidArgument(op + ": dresidual must be given exactly when residual is");
  p.activation = static_cast<int>(activation);
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.out = dx->untyped_data();
  p.dresidual = dresidual->untyped_data();
  if (dres == nullptr) p.dresidual = nullptr;
  return LaunchStatus(LaunchBatchNormBwd(p, stream), op.c_str());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormStats, StatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [..., C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // shift [G, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum(x - shift) [G, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum((x - shift)^2) [G, C]
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // workspace [G, parts, 2, C]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [..., C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefs [G, 2, C]: a, b
                                  .Arg<ffi::AnyBuffer>()         // residual like x, or [0]
                                  .Ret<ffi::AnyBuffer>()         // y = act(x a + b + residual)
                                  .Attr<int64_t>("activation"),  // Activation, or -1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwdStats, BwdStatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // dy [..., C]
                                  .Arg<ffi::AnyBuffer>()         // x [..., C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefs [G, 3, C]: a, b, m
                                  .Arg<ffi::AnyBuffer>()         // residual like x, or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum(dz) [G, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum(dz (x - m)) [G, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace [G, parts, 2, C]
                                  .Attr<int64_t>("activation"),  // Activation, or -1
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BatchNormBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // dy [..., C]
                                  .Arg<ffi::AnyBuffer>()         // x [..., C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // coefs [G, 6, C]: a, b, m, k1, k2, k3
                                  .Arg<ffi::AnyBuffer>()         // residual like x, or [0]
                                  .Ret<ffi::AnyBuffer>()         // dx
                                  .Ret<ffi::AnyBuffer>()         // dresidual = dz, or [0]
                                  .Attr<int64_t>("activation"),  // Activation, or -1
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
