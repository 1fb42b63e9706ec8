// Batch norm's plans: see batch_norm_plan.h.
#include "ffi/batch_norm/batch_norm_plan.h"

#include <algorithm>

namespace jax_dnn {
namespace {

constexpr int kBatchNormBlocksPerSm = 8;  // 256-thread blocks: 2048 threads, an SM's maximum
constexpr int kBatchNormWaves = 2;
// No device known: two waves of 8 blocks an SM on a GPU of up to 256 SMs.
constexpr int64_t kBatchNormMinBlocks = 256 * kBatchNormBlocksPerSm * kBatchNormWaves;
constexpr int64_t kBatchNormMinPartRows = 64;
constexpr int64_t kBatchNormWorkspaceFloats = int64_t{1} << 26;  // 256 MiB

}  // namespace

BatchNormTile BatchNormTileFor(int64_t width, DType dtype, bool vectorized, int vector_bytes) {
  const int bytes = dtype == DType::kF32 ? 4 : 2;
  const int per_vector = vector_bytes / bytes;
  const int vec = vectorized && width % per_vector == 0 ? per_vector : 1;
  const int64_t units = std::max<int64_t>(1, width / vec);
  int cols = 1;
  while (cols < 32 && cols < units) cols *= 2;
  return BatchNormTile{vec, cols, kBatchNormThreads / cols, (units + cols - 1) / cols};
}

int64_t BatchNormParts(int64_t rows, int64_t param_sets, int64_t width, DType dtype,
                       const DeviceProps& device) {
  param_sets = std::max<int64_t>(param_sets, 1);
  const BatchNormTile tile = BatchNormTileFor(width, dtype, true);
  const int64_t target = device.sm_count > 0
                             ? int64_t{device.sm_count} * kBatchNormBlocksPerSm * kBatchNormWaves
                             : kBatchNormMinBlocks;
  int64_t parts = (target + param_sets * tile.tiles - 1) / (param_sets * tile.tiles);
  const int64_t set_rows = rows / param_sets;
  parts = std::min(parts, (set_rows + kBatchNormMinPartRows - 1) / kBatchNormMinPartRows);
  parts = std::min(parts, kBatchNormWorkspaceFloats / std::max<int64_t>(1, param_sets * 2 * width));
  parts = std::min<int64_t>(parts, 65535);  // gridDim.y
  return std::max<int64_t>(parts, 1);
}

}  // namespace jax_dnn
