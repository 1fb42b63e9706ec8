// See column_sum.h. One thread per (group, sum, column): reads `parts` values
// down a column, coalesced across threads. The partials are small (parts is a
// few hundred) and usually still in L2, so this kernel is short.
#include "ffi/common/column_sum.h"

namespace jax_dnn {
namespace {

constexpr int kThreads = 256;

__global__ void ColumnSumKernel(ColumnSumParams p) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t g = blockIdx.y;
  const int s = blockIdx.z;
  if (col >= p.width) return;
  const float* src = p.partials + (g * p.parts * p.sums + s) * p.width + col;
  const int64_t step = static_cast<int64_t>(p.sums) * p.width;
  // Four independent accumulators keep four loads in flight; their fixed
  // combination order keeps the result deterministic.
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 4 <= p.parts; j += 4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] += src[(j + u) * step];
  }
  for (; j < p.parts; ++j) acc[0] += src[j * step];
  p.out[s][g * p.width + col] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace

cudaError_t LaunchColumnSum(const ColumnSumParams& p, cudaStream_t stream) {
  if (p.width == 0 || p.groups == 0) return cudaSuccess;
  if (p.groups > 65535) return cudaErrorInvalidValue;  // gridDim.y limit
  dim3 grid(static_cast<unsigned>((p.width + kThreads - 1) / kThreads),
            static_cast<unsigned>(p.groups), static_cast<unsigned>(p.sums));
  ColumnSumKernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_dnn
