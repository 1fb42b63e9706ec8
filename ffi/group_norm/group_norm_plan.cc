// Group norm's plan: see group_norm_plan.h.
#include "ffi/group_norm/group_norm_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr int64_t kGroupNormBlocksPerSm = 2;
constexpr int64_t kGroupNormDefaultSms = 132;
constexpr int64_t kGroupNormMinRowSteps = 4;
// Row steps a block of the elementwise kernels: enough loads in flight a
// thread, blocks enough for every SM at the SD shapes (8 x 64^2 x 320 bf16:
// 6 positions a step, 24 a block, 1366 blocks).
constexpr int64_t kGroupNormApplySteps = 4;

// Instance norm (one channel a group, C > 1) on the kernels ran 0.73x
// (forward) and 0.74x (backward) Flax's XLA computation at (32, 64^2, 256)
// bf16 on an H200. XLA runs it by default; the kernels stay reachable
// (deterministic: their reductions are in a fixed order).
constexpr bool kGroupNormInstanceByDefault = false;

int DTypeBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

GroupNormPlan PlanGroupNorm(int64_t n, int64_t spatial, int64_t channels, int64_t groups,
                            DType dtype, const DeviceProps& device) {
  GroupNormPlan plan;
  if (n < 0 || spatial < 0 || channels < 1 || groups < 1 || channels % groups != 0) {
    plan.reason = "channels must be > 0 and divisible by groups";
    return plan;
  }
  const int bytes = DTypeBytes(dtype);
  // 16-byte vectors, or one element where C is no multiple of them (two
  // variants instead of every width halve the kernels' instantiations).
  const int vec = channels % (16 / bytes) == 0 ? 16 / bytes : 1;
  plan.vec = vec;
  const int64_t threads_x = channels / vec;
  if (threads_x > kGroupNormMaxThreadsX) {
    plan.reason = "more than " + std::to_string(kGroupNormMaxThreadsX) +
                  " vectors of channels a position";
    return plan;
  }
  plan.supported = true;
  plan.by_default = kGroupNormInstanceByDefault || groups != channels || channels == 1;
  if (!plan.by_default)
    plan.reason = "instance norm (one channel a group): XLA's computation is the default "
                  "(the kernels ran 0.73-0.74x it); deterministic takes the kernels";
  plan.threads_x = static_cast<int>(threads_x);
  plan.threads_y = static_cast<int>(std::max<int64_t>(1, kGroupNormBlockThreads / threads_x));
  const int64_t steps = (spatial + plan.threads_y - 1) / plan.threads_y;
  const int64_t sms = device.sm_count > 0 ? device.sm_count : kGroupNormDefaultSms;
  const int64_t target = kGroupNormBlocksPerSm * sms;
  plan.chunk_samples = std::max<int64_t>(n, 1);
  int64_t splits = target / plan.chunk_samples;
  splits = std::min(splits, std::max<int64_t>(1, steps / kGroupNormMinRowSteps));
  plan.splits = std::max<int64_t>(splits, 1);
  plan.apply_rows = kGroupNormApplySteps * plan.threads_y;
  return plan;
}

}  // namespace jax_dnn
