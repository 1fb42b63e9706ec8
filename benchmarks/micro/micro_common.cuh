// Shared harness of the standalone micro-benchmarks in this directory (each
// still builds alone: nvcc -O3 -std=c++17 -arch=sm_90a <file>.cu): error
// check, streaming 16-byte load, bf16 packing, the (count, mean, M2) state of
// the layer-norm variants, the copy kernel the variants are compared against,
// and the event timer (median of `reps` runs of
// `calls` launches).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

__device__ __forceinline__ uint4 LoadNc(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// 8 fp32 -> 8 bf16 in one 16-byte vector.
__device__ __forceinline__ uint4 Pack(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__global__ void Copy(const uint4* __restrict__ x, uint4* __restrict__ y, int64_t n) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = LoadNc(x + i), b = LoadNc(x + i + stride), c = LoadNc(x + i + 2 * stride),
          d = LoadNc(x + i + 3 * stride);
    y[i] = a, y[i + stride] = b, y[i + 2 * stride] = c, y[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) y[i] = LoadNc(x + i);
}

// A row's (count, mean, M2), merged by Chan's rule.
struct MeanM2 {
  float n, mean, m2;
  __device__ static MeanM2 Merge(MeanM2 a, MeanM2 b) {
    const float n = a.n + b.n;
    const float d = b.mean - a.mean;
    const float wb = b.n * __frcp_rn(n);
    return {n, a.mean + d * wb, a.m2 + b.m2 + d * d * a.n * wb};
  }
};

template <typename F>
float TimeMs(F f, int calls = 20, int reps = 7) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    for (int c = 0; c < calls; ++c) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / calls);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
