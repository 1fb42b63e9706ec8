// The norms' plans: see layer_norm_plan.h.
#include "ffi/layer_norm/layer_norm_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr int64_t kNormBwdMinParts = 320;
constexpr int64_t kNormBwdPartsPerSm = 2;
constexpr int64_t kNormBwdWorkspaceFloats = int64_t{1} << 26;  // 256 MiB

}  // namespace

int64_t LayerNormBwdParts(int64_t rows, int64_t param_sets, int64_t width, bool rms,
                          const DeviceProps& device) {
  param_sets = std::max<int64_t>(param_sets, 1);
  const int64_t sums = rms ? 1 : 2;
  const int64_t target = std::max(kNormBwdMinParts, kNormBwdPartsPerSm * device.sm_count);
  int64_t parts = (target + param_sets - 1) / param_sets;
  parts = std::min(parts, kNormBwdWorkspaceFloats / std::max<int64_t>(1, param_sets * sums * width));
  parts = std::min(parts, rows / param_sets);
  return std::max<int64_t>(parts, 1);
}

}  // namespace jax_dnn
