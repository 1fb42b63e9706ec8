// The pooling kernels' plans: see pooling_plan.h.
#include "ffi/pooling/pooling_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr int kPoolBlockThreads = 256;
// Four 256-thread blocks an SM keep enough 16-byte loads in flight to
// stream HBM (the norms' streamed kernels run at 2 an SM of 512 threads).
constexpr int64_t kPoolGlobalBlocksPerSm = 4;
constexpr int64_t kPoolDefaultSms = 132;
constexpr int64_t kPoolGlobalMinPositions = 8;  // a spatial thread's positions at least

int DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

int PoolChannelVector(int64_t c, DType dtype) {
  const int v = 16 / DTypeBytes(dtype);
  return c % v == 0 ? v : 1;
}

PoolGlobalPlan PoolGlobal(int64_t n, int64_t c, int64_t spatial, DType dtype,
                          const DeviceProps& device) {
  PoolGlobalPlan p{};
  p.vector = PoolChannelVector(c, dtype);
  const int64_t vectors = c / p.vector;
  p.channel_threads = 1;
  while (p.channel_threads < 32 && p.channel_threads < vectors) p.channel_threads *= 2;
  p.spatial_threads = kPoolBlockThreads / p.channel_threads;
  p.strips = (vectors + p.channel_threads - 1) / p.channel_threads;
  const int64_t sms = device.sm_count > 0 ? device.sm_count : kPoolDefaultSms;
  const int64_t columns = std::max<int64_t>(1, n * p.strips);
  const int64_t want = (kPoolGlobalBlocksPerSm * sms + columns - 1) / columns;
  const int64_t most = std::max<int64_t>(
      1, spatial / (kPoolGlobalMinPositions * p.spatial_threads));
  p.parts = std::max<int64_t>(1, std::min(want, most));
  return p;
}

int64_t PoolGlobalParts(int64_t n, int64_t c, int64_t spatial, int64_t outputs, bool adaptive,
                        DType dtype, const DeviceProps& device) {
  if (!adaptive || outputs != 1) return 1;
  return PoolGlobal(n, c, spatial, dtype, device).parts;
}

}  // namespace jax_dnn
