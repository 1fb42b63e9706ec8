// The activations' plans: see activation_plan.h.
#include "ffi/activation/activation_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr int64_t kBiasActBlocksPerSm = 8;
constexpr int64_t kBiasActBlocksNoDevice = 1024;
constexpr int64_t kMaxGridY = 65535;

}  // namespace

int64_t BiasActBwdParts(int64_t rows, int64_t param_sets, int64_t width, DType dtype,
                        const DeviceProps& device) {
  param_sets = std::max<int64_t>(param_sets, 1);
  // 16-byte vectors where the width is a multiple of one (the launcher also
  // needs aligned buffers, which XLA's are).
  const int64_t vec = 16 / (dtype == DType::kF32 ? 4 : 2);
  const int64_t columns = kBiasActColLanes * (width % vec == 0 ? vec : 1);
  const int64_t col_blocks = std::max<int64_t>(1, (width + columns - 1) / columns);
  const int64_t target =
      device.sm_count > 0 ? kBiasActBlocksPerSm * device.sm_count : kBiasActBlocksNoDevice;
  int64_t parts = (target + param_sets * col_blocks - 1) / (param_sets * col_blocks);
  parts = std::min(parts, kMaxGridY / param_sets);
  parts = std::min(parts, (rows / param_sets + kBiasActRowLanes - 1) / kBiasActRowLanes);
  return std::max<int64_t>(parts, 1);
}

}  // namespace jax_dnn
