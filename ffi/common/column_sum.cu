// See column_sum.h. A block covers 32 * V columns of one (param_set, sum): each
// thread V adjacent columns (V = 4: 16-byte loads when the width allows), its
// 32 row lanes each summing a fixed, contiguous share of the `parts` partials
// (four accumulators: four loads in flight); then lane 0 adds the 32 lane sums
// in index order. Fixed assignment and order: deterministic. Why (ncu, H200,
// 2 sums x 4096 columns, ~260 parts): one thread per column walking all parts
// took 19 us, latency-bound on 32 blocks; 8 then 32 lanes of scalar loads
// 6.5-9.4 us (15 us at 8192 columns).
#include "ffi/common/column_sum.h"

#include "ffi/common/device.cuh"

namespace jax_dnn {
namespace {

constexpr int kThreadCols = 32;
constexpr int kLanes = 32;

template <int V>
__global__ void __launch_bounds__(kThreadCols* kLanes) ColumnSumKernel(ColumnSumParams p) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreadCols + threadIdx.x) * V;
  const int64_t g = blockIdx.y;
  const int s = blockIdx.z;
  const int lane = threadIdx.y;
  const int64_t share = (p.parts + kLanes - 1) / kLanes;
  const int64_t first = lane * share;
  const int64_t last = first + share < p.parts ? first + share : p.parts;
  float acc[4][V] = {};
  // width % V == 0 for V > 1, so a thread's columns are all in or all out.
  if (col < p.width) {
    const float* src = p.partials + (g * p.parts * p.sums + s) * p.width + col;
    const int64_t step = static_cast<int64_t>(p.sums) * p.width;
    int64_t j = first;
    for (; j + 4 <= last; j += 4) {
      float v[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) LoadVec<float, V>(src + (j + u) * step, v[u]);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[u][i] += v[u][i];
    }
    for (; j < last; ++j) {
      float v[V];
      LoadVec<float, V>(src + j * step, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[0][i] += v[i];
    }
  }
  __shared__ float lanes[kLanes][kThreadCols][V];
#pragma unroll
  for (int i = 0; i < V; ++i) lanes[lane][threadIdx.x][i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
  __syncthreads();
  if (lane == 0 && col < p.width) {
    float* out = (s == 0 ? p.out[0] : p.out[1]) + g * p.width + col;  // not p.out[s]: a stack copy
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float total = lanes[0][threadIdx.x][i];
#pragma unroll
      for (int l = 1; l < kLanes; ++l) total += lanes[l][threadIdx.x][i];
      out[i] = total;
    }
  }
}

}  // namespace

cudaError_t LaunchColumnSum(const ColumnSumParams& p, cudaStream_t stream) {
  if (p.width == 0 || p.param_sets == 0) return cudaSuccess;
  if (p.param_sets > 65535) return cudaErrorInvalidValue;  // gridDim.y limit
  const bool vec = p.width % 4 == 0 && IsAligned(p.partials, 16);
  const int64_t cols = kThreadCols * (vec ? 4 : 1);
  dim3 grid(static_cast<unsigned>((p.width + cols - 1) / cols), static_cast<unsigned>(p.param_sets),
            static_cast<unsigned>(p.sums));
  if (vec) {
    ColumnSumKernel<4><<<grid, dim3(kThreadCols, kLanes), 0, stream>>>(p);
  } else {
    ColumnSumKernel<1><<<grid, dim3(kThreadCols, kLanes), 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace jax_dnn
