// Group norm's plan (group_norm_plan.cc): whether the kernels take a problem,
// the block shape and how many blocks split each sample's statistics.
// Host-only plain C++, built in CPU-only builds too; Python asks it through
// ffi/registrations.cc (jax_dnn/_src/plans.py) to size the workspaces, and
// the launchers (group_norm.cu) ask it for the launch.
#pragma once

#include <cstdint>
#include <string>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// Every kernel's block is threads_x x threads_y: thread (tx, ty) holds the
// `vec` channels [tx * vec, (tx + 1) * vec) of a position (vec: 16 bytes of
// x where C is a multiple of them, else one element), so a block row
// covers the C channels of one position and the block threads_y positions.
// threads_x = C / vec is at most kGroupNormMaxThreadsX: the statistics
// kernels keep one fp32 partial per element of a block step in shared memory
// (2 x threads x vec floats, 32 KiB at 512 threads x 16 bytes of bf16).
constexpr int kGroupNormMaxThreadsX = 512;
constexpr int kGroupNormBlockThreads = 512;

struct GroupNormPlan {
  bool supported = false;
  // Whether the kernels run the problem by default; where not (instance
  // norm: kGroupNormInstanceByDefault), XLA runs the reference unless
  // jax_dnn.config deterministic asks for the kernels.
  bool by_default = false;
  std::string reason;  // why not, where unsupported or not the default
  int vec = 1;
  int threads_x = 1;
  int threads_y = 1;
  // Blocks a sample of the statistics kernels (forward statistics, the
  // backward's reductions): each sums positions [k * rows, (k + 1) * rows) of
  // its sample, rows = ceil(spatial / splits), into its slice of the
  // workspace; the partial sums are added in a fixed order (deterministic).
  int64_t splits = 1;
  // Positions a block of the elementwise kernels (the forward's apply, dx).
  int64_t apply_rows = 1;
  // Samples a chunk: the kernels run the statistics and the elementwise pass
  // over one chunk, then the next, so that the elementwise pass finds the
  // chunk's x (and dy) in L2: kGroupNormChunkBytes of inputs at most (half
  // of an H100's or H200's 50 MiB L2; the outputs stream past it), at least
  // one sample.
  int64_t chunk_samples = 1;
};

// x [n, spatial, channels] of `dtype`, `groups` dividing channels.
//
// splits: the statistics kernels aim at kGroupNormBlocksPerSm blocks an SM
// over the samples of a chunk (N * G may be far fewer than the SMs: (8,
// 64^2, 320) has 8 samples), and 132 SMs where no device is known (device.sm_count 0); a
// block takes at least kGroupNormMinRowSteps steps of threads_y positions,
// so that its partial sums (2 x C floats the backward) stay a small
// fraction of the bytes it reads.
GroupNormPlan PlanGroupNorm(int64_t n, int64_t spatial, int64_t channels, int64_t groups,
                            DType dtype, const DeviceProps& device);

}  // namespace jax_dnn
