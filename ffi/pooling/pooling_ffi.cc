// XLA FFI handlers for max and average pooling (see pooling.h):
// decode -> validate -> launch. Attributes (jax_dnn/_src/pooling.py
// _ffi_params): adaptive, count_include_pad, and one int64 a spatial axis
// (d, h, w) of in_*, out_*, window_*, stride_*, pad_*.
#include <cstdint>
#include <limits>
#include <string>

#include "ffi/common/device_info.h"
#include "ffi/common/ffi_util.h"
#include "ffi/pooling/pooling.h"

namespace jax_dnn {
namespace {

// Reads the geometry attributes into p.
ffi::Error DecodeAttrs(const std::string& op, const ffi::Dictionary& attrs, PoolParams& p) {
  auto flag = [&](const char* name, bool& out) -> bool {
    auto v = attrs.get<bool>(name);
    if (v.has_error()) return false;
    out = *v;
    return true;
  };
  if (!flag("adaptive", p.adaptive) || !flag("count_include_pad", p.count_include_pad))
    return InvalidArgument(op + ": missing attribute adaptive or count_include_pad");
  const char* axes[3] = {"_d", "_h", "_w"};
  struct Field {
    const char* name;
    int64_t* values;
    int64_t minimum;
  } fields[] = {{"in", p.in, 1},         {"out", p.output, 0},  {"window", p.window, 1},
                {"stride", p.stride, 1}, {"pad", p.pad, 0}};
  for (const Field& f : fields) {
    for (int a = 0; a < 3; ++a) {
      auto v = attrs.get<int64_t>(std::string(f.name) + axes[a]);
      if (v.has_error()) return InvalidArgument(op + ": missing attribute " + f.name + axes[a]);
      if (*v < f.minimum)
        return InvalidArgument(op + ": attribute " + f.name + axes[a] + " must be >= " +
                               std::to_string(f.minimum));
      // The kernels' per-axis arithmetic is 32-bit.
      if (*v > std::numeric_limits<int32_t>::max() / 2)
        return InvalidArgument(op + ": attribute " + f.name + axes[a] + " must be < 2^30");
      f.values[a] = *v;
    }
  }
  return ffi::Error::Success();
}

// a is [N, s0, s1, s2, C] for the given spatial sizes; sets n and c.
ffi::Error CheckShape(const std::string& op, const char* name, const ffi::AnyBuffer& a,
                      const int64_t (&spatial)[3], PoolParams& p, bool first) {
  auto dims = a.dimensions();
  if (!ToDType(a.element_type()))
    return InvalidArgument(op + ": " + name + " must be float32, bfloat16 or float16");
  if (dims.size() != 5 || dims[1] != spatial[0] || dims[2] != spatial[1] ||
      dims[3] != spatial[2])
    return InvalidArgument(op + ": " + name + " must be [N, D, H, W, C] with the attributes' "
                           "spatial sizes");
  if (first) {
    p.dtype = *ToDType(a.element_type());
    p.n = dims[0];
    p.c = dims[4];
  } else if (dims[0] != p.n || dims[4] != p.c || *ToDType(a.element_type()) != p.dtype) {
    return InvalidArgument(op + ": " + name + " must match the other operands' N, C and dtype");
  }
  return ffi::Error::Success();
}

ffi::Error MaxPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_max_pool_fwd";
  PoolParams p{};
  p.max = true;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "x", x, p.in, p, true)).failure() ||
      (e = CheckShape(op, "y", *y, p.output, p, false)).failure())
    return e;
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  p.parts = 1;
  return LaunchStatus(LaunchPoolFwd(p, CurrentDeviceProps(), stream), op.c_str());
}

// idx [N, OD, OH, OW, C] uint8 (the argmax offsets, pooling.h), for windows
// of at most kPoolMaxArgmax positions.
ffi::Error CheckIdx(const std::string& op, const ffi::AnyBuffer& idx, const PoolParams& p) {
  auto dims = idx.dimensions();
  if (idx.element_type() != ffi::DataType::U8 || dims.size() != 5 || dims[0] != p.n ||
      dims[1] != p.output[0] || dims[2] != p.output[1] || dims[3] != p.output[2] ||
      dims[4] != p.c)
    return InvalidArgument(op + ": idx must be uint8 [N, OD, OH, OW, C]");
  if (p.window[0] * p.window[1] * p.window[2] > kPoolMaxArgmax)
    return InvalidArgument(op + ": argmax offsets need windows of at most " +
                           std::to_string(kPoolMaxArgmax) + " positions");
  return ffi::Error::Success();
}

ffi::Error MaxPoolIdxFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> idx, ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_max_pool_idx_fwd";
  PoolParams p{};
  p.max = true;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "x", x, p.in, p, true)).failure() ||
      (e = CheckShape(op, "y", *y, p.output, p, false)).failure() ||
      (e = CheckIdx(op, *idx, p)).failure())
    return e;
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  p.idx = idx->untyped_data();
  p.parts = 1;
  return LaunchStatus(LaunchPoolFwd(p, CurrentDeviceProps(), stream), op.c_str());
}

ffi::Error MaxPoolIdxBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer idx,
                             ffi::Result<ffi::AnyBuffer> dx, ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_max_pool_idx_bwd";
  PoolParams p{};
  p.max = true;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "dx", *dx, p.in, p, true)).failure() ||
      (e = CheckShape(op, "dy", dy, p.output, p, false)).failure() ||
      (e = CheckIdx(op, idx, p)).failure())
    return e;
  p.dy = dy.untyped_data();
  p.idx = const_cast<void*>(idx.untyped_data());
  p.out = dx->untyped_data();
  p.parts = 1;
  return LaunchStatus(LaunchPoolBwd(p, stream), op.c_str());
}

ffi::Error AvgPoolFwdImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::ResultBuffer<ffi::F32> workspace, ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_avg_pool_fwd";
  PoolParams p{};
  p.max = false;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "x", x, p.in, p, true)).failure() ||
      (e = CheckShape(op, "y", *y, p.output, p, false)).failure())
    return e;
  // The workspace: [N, parts, C] partial sums of global pooling, or a
  // 1-float placeholder (parts 1).
  auto wd = workspace->dimensions();
  p.parts = 1;
  if (wd.size() == 3) {
    if (wd[0] != p.n || wd[2] != p.c || wd[1] < 1)
      return InvalidArgument(op + ": workspace must be [N, parts, C]");
    p.parts = wd[1];
  }
  p.partials = workspace->typed_data();
  p.x = x.untyped_data();
  p.out = y->untyped_data();
  return LaunchStatus(LaunchPoolFwd(p, CurrentDeviceProps(), stream), op.c_str());
}

ffi::Error MaxPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                          ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_max_pool_bwd";
  PoolParams p{};
  p.max = true;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "x", x, p.in, p, true)).failure() ||
      (e = CheckShape(op, "dy", dy, p.output, p, false)).failure() ||
      (e = CheckShape(op, "y", y, p.output, p, false)).failure() ||
      (e = CheckShape(op, "dx", *dx, p.in, p, false)).failure())
    return e;
  p.dy = dy.untyped_data();
  p.x = x.untyped_data();
  p.y = y.untyped_data();
  p.out = dx->untyped_data();
  p.parts = 1;
  return LaunchStatus(LaunchPoolBwd(p, stream), op.c_str());
}

ffi::Error AvgPoolBwdImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Dictionary attrs) {
  const std::string op = "jax_dnn_avg_pool_bwd";
  PoolParams p{};
  p.max = false;
  ffi::Error e = DecodeAttrs(op, attrs, p);
  if (e.failure() || (e = CheckShape(op, "dx", *dx, p.in, p, true)).failure() ||
      (e = CheckShape(op, "dy", dy, p.output, p, false)).failure())
    return e;
  p.dy = dy.untyped_data();
  p.out = dx->untyped_data();
  p.parts = 1;
  return LaunchStatus(LaunchPoolBwd(p, stream), op.c_str());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolFwd, MaxPoolFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, D, H, W, C]
                                  .Ret<ffi::AnyBuffer>()  // y [N, OD, OH, OW, C]
                                  .Attrs(),               // the geometry (file header)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolBwd, MaxPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy [N, OD, OH, OW, C]
                                  .Arg<ffi::AnyBuffer>()  // x [N, D, H, W, C]
                                  .Arg<ffi::AnyBuffer>()  // y [N, OD, OH, OW, C]: the forward's
                                  .Ret<ffi::AnyBuffer>()  // dx [N, D, H, W, C]
                                  .Attrs(),               // the geometry
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolIdxFwd, MaxPoolIdxFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [N, D, H, W, C]
                                  .Ret<ffi::AnyBuffer>()  // y [N, OD, OH, OW, C]
                                  .Ret<ffi::AnyBuffer>()  // idx [N, OD, OH, OW, C] uint8
                                  .Attrs(),               // the geometry
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxPoolIdxBwd, MaxPoolIdxBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy [N, OD, OH, OW, C]
                                  .Arg<ffi::AnyBuffer>()  // idx [N, OD, OH, OW, C] uint8
                                  .Ret<ffi::AnyBuffer>()  // dx [N, D, H, W, C]
                                  .Attrs(),               // the geometry
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolFwd, AvgPoolFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // x [N, D, H, W, C]
                                  .Ret<ffi::AnyBuffer>()         // y [N, OD, OH, OW, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // workspace [N, parts, C] or [1]
                                  .Attrs(),                      // the geometry
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AvgPoolBwd, AvgPoolBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // dy [N, OD, OH, OW, C]
                                  .Ret<ffi::AnyBuffer>()  // dx [N, D, H, W, C]
                                  .Attrs(),               // the geometry
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_dnn
