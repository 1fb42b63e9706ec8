// XLA FFI handlers for softmax / log_softmax: decode -> validate -> launch.
#include "ffi/common/ffi_util.h"
#include "ffi/softmax/softmax.h"

namespace jax_dnn {
namespace {

// Views dims as [outer, n, inner] around `axis`.
ffi::Error SplitAxis(ffi::Span<const int64_t> dims, int64_t axis, int64_t* outer, int64_t* n,
                     int64_t* inner) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  if (axis < 0 || axis >= rank)
    return InvalidArgument("jax_dnn softmax: axis " + std::to_string(axis) +
                           " out of range for rank " + std::to_string(rank));
  *outer = DimProduct(dims, 0, axis);
  *n = dims[axis];
  *inner = DimProduct(dims, axis + 1, rank);
  return ffi::Error::Success();
}

ffi::Error SoftmaxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          int64_t axis, bool log) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || y->element_type() != x.element_type())
    return InvalidArgument("jax_dnn softmax_fwd: x must be float32, bfloat16 or float16");
  SoftmaxFwdParams p{};
  if (auto e = SplitAxis(x.dimensions(), axis, &p.outer, &p.n, &p.inner); e.failure()) return e;
  p.dtype = *dtype;
  p.log = log;
  p.x = x.untyped_data();
  p.y = y->untyped_data();
  return LaunchStatus(LaunchSoftmaxFwd(p, stream), "jax_dnn_softmax_fwd");
}

ffi::Error SoftmaxBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::Result<ffi::AnyBuffer> dx, int64_t axis, bool log) {
  auto dtype = ToDType(x.element_type());
  if (!dtype || dy.element_type() != x.element_type() || dx->element_type() != x.element_type())
    return InvalidArgument("jax_dnn softmax_bwd: x and dy must share one float dtype");
  if (dy.element_count() != x.element_count())
    return InvalidArgument("jax_dnn softmax_bwd: x and dy must have the same shape");
  SoftmaxBwdParams p{};
  if (auto e = SplitAxis(x.dimensions(), axis, &p.outer, &p.n, &p.inner); e.failure()) return e;
  p.dtype = *dtype;
  p.log = log;
  p.x = x.untyped_data();
  p.dy = dy.untyped_data();
  p.dx = dx->untyped_data();
  return LaunchStatus(LaunchSoftmaxBwd(p, stream), "jax_dnn_softmax_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxFwd, SoftmaxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("axis")
                                  .Attr<bool>("log"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoftmaxBwd, SoftmaxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // x (forward input)
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Attr<int64_t>("axis")
                                  .Attr<bool>("log"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
