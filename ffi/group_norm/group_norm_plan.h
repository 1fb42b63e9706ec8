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
// threads_y = kGroupNormBlockThreads / threads_x (at least 1): 256-thread
// blocks, so that 2-3 blocks share an SM (the kernels use 80-128 registers a
// thread: a 512-thread block had an SM to itself, idle while it drained;
// 16 x 128^2 x 128 bf16 forward ran 0.80x XLA at 512 threads, 1.00x at 256,
// H200).
constexpr int kGroupNormMaxThreadsX = 512;
constexpr int kGroupNormBlockThreads = 256;

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
  // Samples a chunk: the launchers run the statistics and the elementwise
  // pass over one chunk, then the next. The plan takes the whole batch: chunks
  // of 24 MiB (so that the second read of x came from L2) ran 0.57-0.96x XLA
  // forward+backward against 0.72-1.26x for the whole batch (H200, bf16, the
  // benchmark's shapes): each chunk's three launches cost more than L2 saved.
  int64_t chunk_samples = 1;
};

// x [n, spatial, channels] of `dtype`, `groups` dividing channels.
//
// splits: the statistics kernels aim at kGroupNormBlocksPerSm blocks an SM
// (rounded down, so that they all run at once) over the samples (N * G may be far fewer than the SMs: (8,
// 64^2, 320) has 8 samples), and 132 SMs where no device is known (device.sm_count 0); a
// block takes at least kGroupNormMinRowSteps steps of threads_y positions,
// so that its partial sums (2 x C floats the backward) stay a small
// fraction of the bytes it reads.
GroupNormPlan PlanGroupNorm(int64_t n, int64_t spatial, int64_t channels, int64_t groups,
                            DType dtype, const DeviceProps& device);

}  // namespace jax_dnn
