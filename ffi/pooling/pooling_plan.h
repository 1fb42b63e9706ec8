// The pooling kernels' plans (pooling_plan.cc): how many channels a thread
// moves at once, and how global average pooling splits its spatial axis.
// Host-only plain C++, built in CPU-only builds too; Python asks them through
// ffi/registrations.cc (jax_dnn/_src/plans.py), the launchers ask the same
// functions.
#pragma once

#include <cstdint>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// Max pooling's argmax indices (pooling.h): one byte an output, the window's
// row-major offset, kPoolNoArgmax where a padded position wins; windows of
// at most kPoolMaxArgmax positions use them (jax_dnn/_src/pooling.py keeps
// x and y as the residuals of larger ones).
constexpr int kPoolNoArgmax = 255;
constexpr int kPoolMaxArgmax = 255;

// Channels a thread loads as one access: a 16-byte vector (8 bf16/fp16, 4
// fp32) where C is a multiple of it, else 1 (XLA's buffers are 16-byte
// aligned, so every row of C channels then starts on a vector).
int PoolChannelVector(int64_t c, DType dtype);

// Global average pooling (an adaptive average pool to output 1 on every
// axis): a block reduces `spatial_threads` rows of `channel_threads` channel
// vectors at a time over its share of the spatial positions; `parts` blocks
// share a (batch, channel strip) and write fp32 partial sums [N, parts, C]
// that a second kernel adds in a fixed order (parts 1: no workspace, the
// block writes y).
struct PoolGlobalPlan {
  int vector;           // channels a load (PoolChannelVector)
  int channel_threads;  // threads across channel vectors (power of 2, <= 32)
  int spatial_threads;  // threads across spatial positions (256 / channel_threads)
  int64_t strips;       // channel strips: ceil(C / vector / channel_threads)
  int64_t parts;        // blocks a (batch, strip)
};

// Splits the spatial positions over blocks until N * strips * parts fills the
// device with kPoolGlobalBlocksPerSm blocks an SM (132-SM H100 with no device
// known), never below 8 positions a spatial thread.
PoolGlobalPlan PoolGlobal(int64_t n, int64_t c, int64_t spatial, DType dtype,
                          const DeviceProps& device);

// Whether a call is global average pooling (every output axis 1, adaptive),
// and its parts (1 otherwise): the size of the forward's workspace.
int64_t PoolGlobalParts(int64_t n, int64_t c, int64_t spatial, int64_t outputs, bool adaptive,
                        DType dtype, const DeviceProps& device);

}  // namespace jax_dnn
