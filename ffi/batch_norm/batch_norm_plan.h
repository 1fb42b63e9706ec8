// Batch norm's plans (batch_norm_plan.cc): how a kernel tiles [rows, C] and
// into how many row parts it splits each parameter set, which sizes the
// reductions' workspace. Host-only plain C++, built in CPU-only builds too;
// Python asks it through ffi/registrations.cc (jax_dnn/_src/plans.py), the
// launchers (batch_norm_*.cu) ask the same functions.
#pragma once

#include <cstdint>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// A block of kBatchNormThreads threads covers `cols` threads of `vec`
// adjacent channels each (vectors of vector_bytes where C allows, else
// single elements) by `lanes` rows; the grid covers `tiles` channel tiles
// of cols * vec channels.
constexpr int kBatchNormThreads = 256;

struct BatchNormTile {
  int vec;        // channels a thread (vector_bytes / element bytes; 1 where C is no multiple)
  int cols;       // threads across the tile's channels (a power of two, <= 32)
  int lanes;      // row lanes: kBatchNormThreads / cols
  int64_t tiles;  // channel tiles
};

// The tile for C channels of `dtype`. `vectorized`: whether the buffers
// allow vector access (C a multiple of the vector and aligned pointers).
BatchNormTile BatchNormTileFor(int64_t width, DType dtype, bool vectorized, int vector_bytes = 16);

// Row parts of each parameter set: the grid is (tiles, parts, param_sets).
// Enough blocks for kBatchNormWaves waves of kBatchNormBlocksPerSm blocks
// an SM (at least kBatchNormMinBlocks with no device known), parts of at
// least kBatchNormMinPartRows rows each, so that a block's loads amortize
// its per-channel setup and its partial sums stay a few percent of the bytes
// read. The reductions' workspace is [param_sets, parts, 2, width] fp32
// (summed by ffi/common/column_sum.cu in a fixed order); at most 256 MiB,
// and at most 65535 parts (the grid's y dimension).
int64_t BatchNormParts(int64_t rows, int64_t param_sets, int64_t width, DType dtype,
                       const DeviceProps& device);

}  // namespace jax_dnn
